"""Cached decoding (DeepseekV41Cache) vs recomputing the whole prefix for every new token.

Tiny preset (6 layers, width 64, window 16, ratio-2 and ratio-1 compressed layers, index_topk 8, Engram), fp32,
batch 1, ``torch.set_num_threads`` as on CI (2 by default). For each context length N it reports, from one run:

- cached decode: median time of one ``model(next_token, cache=cache)`` step after an N-token prefill;
- recompute: median time of one full forward over N tokens (what each new token costs without a cache);
- the speed-up of the first over the second, and the cache's size at N;

and finally how much the per-token decode time grows from the shortest to the longest context. By design a
decode step costs the window (fixed) plus work over the compressed rows (∝ N / ratio: the indexer scores all of
them, attention reads only index_topk), so it should grow far slower than N.

Usage: ``python benchmarks/generate.py [--contexts 256 2048] [--steps 32] [--reps 3] [--threads 2] [--device cpu]``
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import modeling_dsv41  # noqa: F401  (registers the Auto classes)
from configuration import DeepseekV41Config
from modeling_dsv41 import DeepseekV41ForCausalLM


def build(device: str) -> DeepseekV41ForCausalLM:
    torch.manual_seed(0)
    config = DeepseekV41Config.from_preset("tiny")
    model = DeepseekV41ForCausalLM(config).eval().to(device)
    # a stand-in for the tokenizer's compressed map (the fixture's stub tokenizer has id // 2)
    model.model.engram_hasher.token_map.copy_(torch.arange(config.text_config.vocab_size, device=device) // 2)
    return model


def synchronized(device: str) -> float:
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return time.perf_counter()


@torch.no_grad()
def measure(
    model: DeepseekV41ForCausalLM, contexts: list[int], steps: int, reps: int, device: str
) -> dict[int, dict[str, float]]:
    """Decode steps and full forwards of all contexts, interleaved round-robin so that machine noise (a shared
    CPU) lands on every context alike instead of on whichever ran during a slow spell."""
    ids, caches = {}, {}
    for context in contexts:
        ids[context] = torch.randint(
            3, 500, (1, context + steps), generator=torch.Generator().manual_seed(context)
        ).to(device)
        caches[context] = model(ids[context][:, :context], use_cache=True, logits_to_keep=1).cache
    decode = {context: [] for context in contexts}
    for t in range(steps):
        for context in contexts:
            start = synchronized(device)
            model(ids[context][:, context + t : context + t + 1], cache=caches[context])
            decode[context].append(synchronized(device) - start)
    full = {context: [] for context in contexts}
    for _ in range(reps):
        for context in contexts:
            start = synchronized(device)
            model(ids[context][:, :context], use_cache=False, logits_to_keep=1)
            full[context].append(synchronized(device) - start)
    return {
        context: {
            "decode_s": statistics.median(decode[context][1:] or decode[context]),
            "full_s": statistics.median(full[context]),
            "cache_kib": sum(caches[context].nbytes().values()) / 1024,
        }
        for context in contexts
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[256, 2048])
    parser.add_argument("--steps", type=int, default=32, help="cached decode steps timed per context")
    parser.add_argument("--reps", type=int, default=3, help="full forwards timed per context")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = build(args.device)
    measure(model, [32], 4, 1, args.device)  # warm-up

    print(f"tiny preset, fp32, batch 1, {args.device}, {args.threads} threads")
    print(f"{'context':>8} {'cached tok/s':>13} {'recompute tok/s':>16} {'speed-up':>9} {'cache KiB':>10}")
    results = measure(model, args.contexts, args.steps, args.reps, args.device)
    for context, r in results.items():
        print(
            f"{context:>8} {1 / r['decode_s']:>13.1f} {1 / r['full_s']:>16.2f} "
            f"{r['full_s'] / r['decode_s']:>8.1f}× {r['cache_kib']:>10.1f}"
        )
    short, long = min(args.contexts), max(args.contexts)
    growth = results[long]["decode_s"] / results[short]["decode_s"]
    print(f"per-token decode time at {long} vs {short}: {growth:.2f}× (context ×{long / short:.0f})")


if __name__ == "__main__":
    main()
