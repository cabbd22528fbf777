"""Cached decoding (DeepseekV41Cache) vs recomputing the whole prefix, and greedy decoding vs transformers' V4.

``--size tiny`` (default: the tiny preset, 6 layers, width 64, window 16, ratio-2 and ratio-1 compressed layers,
index_topk 8, Engram) or ``medium`` (issue 15's ~510M configuration, no Engram; see benchmarks/forward.py), on
``--device`` (cpu or cuda) in ``--dtype``, ``torch.set_num_threads`` as on CI (2 by default). For each context
length N it reports, from one run:

- cached decode: median time of one ``model(next_token, cache=cache)`` step after an N-token prefill (batch 1);
- recompute: median time of one full forward over N tokens (what each new token costs without a cache);
- the speed-up of the first over the second, and the cache's size at N;
- greedy decoding through ``generate`` at ``--batch`` rows, ours and transformers' ``DeepseekV4ForCausalLM``
  built at the same sizes (each with its own cache): decode tokens/s per row, from the median interval between
  consecutive tokens of ``--steps`` + 1 (the prefill excluded) over round-robin repeats, and ours ÷ V4 in time
  per token;

and how much the per-token decode time grows from the shortest to the longest context. By design a decode step
costs the window (fixed) plus work over the compressed rows (∝ N / ratio: the indexer scores all of them,
attention reads only index_topk), so it should grow far slower than N.

Usage: ``python benchmarks/generate.py [--size tiny|medium] [--device cpu|cuda] [--dtype float32|bfloat16]
[--contexts 256 2048] [--steps 32] [--reps 3] [--batch 1] [--threads 2]``
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn
from transformers import LogitsProcessor, LogitsProcessorList
from transformers.utils import logging as hf_logging

from modeling_dsv41 import DeepseekV41ForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling forward.py, however this script is run
from forward import SIZES, build_ours, build_transformers_v4  # noqa: E402


def build(size: str, device: str, dtype: torch.dtype) -> tuple[DeepseekV41ForCausalLM, nn.Module]:
    """Ours (with Engram at the tiny size, as before) and transformers' V4 at the same sizes, with a cache."""
    torch.manual_seed(0)
    ours = build_ours(engram=size == "tiny", size=size)
    theirs = build_transformers_v4(ours, use_cache=True)
    return ours.eval().to(device, dtype), theirs.eval().to(device, dtype)


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


class StepClock(LogitsProcessor):
    """Records the (device-synchronized) time each generated token's logits arrive; leaves them unchanged."""

    def __init__(self, device: str):
        self.device, self.times = device, []

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        self.times.append(synchronized(self.device))
        return scores


@torch.no_grad()
def greedy_decode_seconds(
    models: dict[str, nn.Module], context: int, batch: int, steps: int, reps: int, device: str
) -> dict[str, float]:
    """Seconds per decoded token (per row) of each model's ``generate``: the median interval between consecutive
    tokens' logits (the prefill, before the first, excluded), over ``reps`` calls timed round-robin."""
    vocab = min(m.config.get_text_config().vocab_size for m in models.values())
    ids = torch.randint(3, vocab - 16, (batch, context), generator=torch.Generator().manual_seed(context)).to(device)

    def step_intervals(model: nn.Module, new_tokens: int) -> list[float]:
        clock = StepClock(device)
        model.generate(
            input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
            do_sample=False, pad_token_id=0, logits_processor=LogitsProcessorList([clock]),
        )
        return [b - a for a, b in zip(clock.times, clock.times[1:])]

    for model in models.values():
        step_intervals(model, 2)  # warm-up
    intervals: dict[str, list[float]] = {name: [] for name in models}
    for _ in range(reps):
        for name, model in models.items():
            intervals[name] += step_intervals(model, steps + 1)
    return {name: statistics.median(times) for name, times in intervals.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="tiny")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--batch", type=int, default=1, help="rows of the greedy generate comparison")
    parser.add_argument("--contexts", type=int, nargs="+", default=[256, 2048])
    parser.add_argument("--steps", type=int, default=32, help="cached decode steps timed per context")
    parser.add_argument("--reps", type=int, default=3, help="full forwards timed per context")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    hf_logging.set_verbosity_error()  # V4's YaRN check warns about the small original_max_position_embeddings
    model, theirs = build(args.size, args.device, getattr(torch, args.dtype))
    measure(model, [32], 4, 1, args.device)  # warm-up

    print(f"size {args.size}, {args.dtype}, {args.device}, {args.threads} threads, torch {torch.__version__}")
    print("\n## ours: cached decode step vs recomputing the prefix (batch 1)")
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

    models = {"ours": model, "transformers V4": theirs}
    print(f"\n## greedy generate, batch {args.batch}, {args.steps} decoded tokens: tokens/s per row")
    print(f"{'context':>8} {'ours tok/s':>11} {'V4 tok/s':>10} {'ours ÷ V4 (time)':>17}")
    for context in args.contexts:
        seconds = greedy_decode_seconds(models, context, args.batch, args.steps, args.reps, args.device)
        print(f"{context:>8} {1 / seconds['ours']:>11.1f} {1 / seconds['transformers V4']:>10.1f} "
              f"{seconds['ours'] / seconds['transformers V4']:>16.2f}×")


if __name__ == "__main__":
    main()
