"""Peak memory of one forward pass against sequence length: chunked queries vs the whole sequence at once.

What is measured: the rise of the process's peak resident set (``VmHWM``, reset through ``/proc/self/clear_refs``)
over one no-grad forward at batch 1, each in a fresh subprocess with glibc's mmap threshold pinned at 64 KiB, so
that every large torch CPU tensor is its own mapping, returned to the system when freed, and the peak is that of
the live tensors (the interpreter, torch and the model are resident before the reset and not counted). Linux only.

Configurations, both in the same run:

- ``chunked``: the config's ``query_chunk_size`` (the indexer's scores, top-k and attention per query chunk);
- ``whole sequence`` (baseline): ``query_chunk_size`` = S, as before chunking: the indexer's [S, heads, S / ratio]
  scores exist at once, so memory grows quadratically.

Model: a 3-layer text model at width 64 (window 16; layers 1-2 ratio 4, layer 1 KV, index and candidate source,
layer 2 an indexer inside its candidates; 2 index heads of 32, index_topk 64), fp32, no Engram. The target is
peak(16384) ≤ 4.5 × peak(4096) for the chunked pass (4× is linear).

Usage: ``python benchmarks/memory.py [--seqs 4096 16384] [--chunk 1024] [--no-baseline]``
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def memory_config(chunk: int | None = None):
    """The benchmark's small text model; ``chunk`` sets ``query_chunk_size`` (None: the config's default)."""
    from configuration import DeepseekV41Config

    text = {
        "vocab_size": 512, "hidden_size": 64, "moe_intermediate_size": 32, "num_hidden_layers": 3,
        "num_attention_heads": 4, "head_dim": 64, "qk_rope_head_dim": 16, "q_lora_rank": 32, "o_groups": 2,
        "o_lora_rank": 32, "n_routed_experts": 4, "num_experts_per_tok": 2, "sliding_window": 16,
        "compress_ratios": [0, 4, 4], "kv_source_layer_ids": [1], "index_source_layer_ids": [1, 2],
        "index_n_heads": 2, "index_head_dim": 32, "index_topk": 64, "candidate_source_layer_id": 1,
        "candidate_topk_blocks": 32, "candidate_block_size": 4, "engram_layer_ids": [], "engram_num_embeddings": [],
        "num_nextn_predict_layers": 0,
        "compress_rope_scaling": {"rope_type": "yarn", "factor": 4, "beta_fast": 32, "beta_slow": 1,
                                  "original_max_position_embeddings": 32},
    }
    if chunk is not None:
        text["query_chunk_size"] = chunk
    return DeepseekV41Config(text_config=text, vision_config=None)


def peak_rss_bytes() -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmHWM:"))


def current_rss_bytes() -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmRSS:"))


def measure_in_this_process(seq: int, chunk: int) -> int:
    """Bytes the peak RSS rises by over one forward of ``seq`` tokens (after a short warm-up forward)."""
    import torch

    from modeling_dsv41 import DeepseekV41ForCausalLM

    torch.manual_seed(0)
    torch.set_num_threads(int(os.environ.get("DSV41_THREADS", "2")))
    model = DeepseekV41ForCausalLM(memory_config(chunk)).eval()
    ids = torch.randint(3, 500, (1, seq), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model(ids[:, :256], use_cache=False, logits_to_keep=1)  # warm-up: lazy inits, thread pools
        with open("/proc/self/clear_refs", "w") as clear:
            clear.write("5")  # reset VmHWM to the current RSS
        before = current_rss_bytes()
        model(ids, use_cache=False, logits_to_keep=1)
    return peak_rss_bytes() - before


def peak_forward_bytes(seq: int, chunk: int) -> int:
    """:func:`measure_in_this_process` in a fresh interpreter, so no earlier allocation is already resident."""
    env = os.environ | {"MALLOC_MMAP_THRESHOLD_": "65536", "PYTHONPATH": str(REPO)}
    code = f"from benchmarks.memory import measure_in_this_process as m; print(m({seq}, {chunk}))"
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, check=True)
    return int(done.stdout.split()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqs", type=int, nargs=2, default=[4096, 16384], metavar=("SHORT", "LONG"))
    parser.add_argument("--chunk", type=int, default=memory_config().text_config.query_chunk_size)
    parser.add_argument("--no-baseline", action="store_true", help="skip the whole-sequence baseline")
    args = parser.parse_args()
    short, long = args.seqs
    runs = {f"chunked (query_chunk_size {args.chunk})": lambda s: args.chunk}
    if not args.no_baseline:
        runs["whole sequence (query_chunk_size = S), baseline"] = lambda s: s
    print("peak RSS rise over one forward, batch 1, fp32, CPU (fresh process each)")
    print(f"{'configuration':<50}{f'S={short} MiB':>14}{f'S={long} MiB':>14}{'ratio':>8}")
    results = {}
    for name, chunk_of in runs.items():
        peaks = [peak_forward_bytes(seq, chunk_of(seq)) for seq in (short, long)]
        results[name] = peaks
        print(f"{name:<50}{peaks[0] / 2**20:>14.1f}{peaks[1] / 2**20:>14.1f}{peaks[1] / peaks[0]:>7.2f}×")
    print(f"target: ratio ≤ 4.5× (sequence ×{long / short:.0f}); " + json.dumps({k: v for k, v in results.items()}))


if __name__ == "__main__":
    main()
