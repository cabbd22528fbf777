"""Load time and peak memory of ``from_pretrained`` on a sharded checkpoint in the released storage format (FP8 dense
Linears, packed FP4 experts, FP8 Engram table, E8M0 scales) against the size of the dequantized model.

A ~200M-parameter text-only stand-in is written twice: in the released format and in our own bf16 format (the
baseline: no conversion at all). Each load runs in a fresh process that reports wall time, the final model's bytes,
peak RSS (VmHWM, which counts the memory-mapped checkpoint pages the process touched) and the peak of anonymous
memory (RssAnon, sampled every 2 ms: what loading really allocates).

    python benchmarks/loading.py [--workdir DIR] [--shard-mb 100]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

STAND_IN = dict(
    vocab_size=32000, hidden_size=1024, moe_intermediate_size=512, num_hidden_layers=4, num_attention_heads=8,
    head_dim=128, qk_rope_head_dim=64, q_lora_rank=256, o_lora_rank=256, o_groups=4, n_routed_experts=24,
    num_experts_per_tok=4, sliding_window=128, compress_ratios=[0, 2, 2, 1], kv_source_layer_ids=[1, 3],
    index_source_layer_ids=[1, 3], index_n_heads=4, index_head_dim=64, index_topk=64, candidate_source_layer_id=-1,
    engram_layer_ids=[1], engram_num_embeddings=[160316], engram_max_ngram_size=3, engram_vocab_size=20000,
    engram_n_heads=4, engram_head_dim=64, engram_compressed_vocab_size=16000, num_nextn_predict_layers=0,
)


def _status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def measure_load(folder: str, dtype: str, prefetch: bool = False) -> dict:
    """Runs in the child process: load once, report time and memory. ``prefetch`` keeps transformers' thread pool
    that materializes every tensor ahead of conversion (what from_pretrained turns off for the released format)."""
    import contextlib

    import modeling_dsv41  # noqa: F401
    from modeling_dsv41 import DeepseekV41ForCausalLM, checkpoint_loading

    if prefetch:
        checkpoint_loading.sequential_loading = contextlib.nullcontext

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    peak_anon, stop = [_status("RssAnon")], threading.Event()

    def sample():
        while not stop.is_set():
            peak_anon[0] = max(peak_anon[0], _status("RssAnon"))
            time.sleep(0.002)

    before_anon, before_rss = _status("RssAnon"), _status("VmRSS")
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    start = time.perf_counter()
    model = DeepseekV41ForCausalLM.from_pretrained(folder, dtype=getattr(torch, dtype))
    seconds = time.perf_counter() - start
    stop.set()
    sampler.join()
    model_bytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    return {
        "seconds": seconds,
        "model_bytes": model_bytes,
        "parameters": sum(p.numel() for p in model.parameters()),
        "peak_rss_bytes": _status("VmHWM") - before_rss,
        "peak_anon_bytes": max(peak_anon[0], _status("RssAnon")) - before_anon,
    }


def write_checkpoints(workdir: Path, shard_bytes: int) -> dict[str, Path]:
    import modeling_dsv41  # noqa: F401
    from configuration import DeepseekV41Config
    from modeling_dsv41 import DeepseekV41ForCausalLM
    from modeling_dsv41.hub.checkpoint_loading import save_released_checkpoint
    from tokenizers import Tokenizer, models

    torch.manual_seed(0)
    model = DeepseekV41ForCausalLM(DeepseekV41Config(text_config=STAND_IN)).to(torch.bfloat16)
    # any tokenizer compressing to engram_compressed_vocab_size ids: one key per pair of tokens
    vocab = {f"{'t' if i % 2 == 0 else 'T'}{i // 2}": i for i in range(STAND_IN["vocab_size"])}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    model.model.engram_hasher.load_tokenizer(tokenizer)
    folders = {"released": workdir / "released", "bf16": workdir / "bf16"}
    save_released_checkpoint(model, folders["released"], max_shard_bytes=shard_bytes)
    tokenizer.save(str(folders["released"] / "tokenizer.json"))
    model.save_pretrained(folders["bf16"], max_shard_size=shard_bytes)
    return folders


def _child(folder: Path, dtype: str, prefetch: bool, env: dict) -> dict:
    code = (
        "import json, sys; sys.path.insert(0, sys.argv[1]); from benchmarks.loading import measure_load; "
        "print('RESULT' + json.dumps(measure_load(sys.argv[2], sys.argv[3], sys.argv[4] == '1')))"
    )
    argv = [sys.executable, "-c", code, str(REPO), str(folder), dtype, str(int(prefetch))]
    out = subprocess.run(argv, env=env, check=True, capture_output=True, text=True).stdout
    return json.loads(next(line for line in out.splitlines() if line.startswith("RESULT"))[len("RESULT"):])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--shard-mb", type=int, default=100)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        workdir = args.workdir or Path(tmp)
        folders = {"released": workdir / "released", "bf16": workdir / "bf16"}
        if not all(folder.is_dir() for folder in folders.values()):
            folders = write_checkpoints(workdir, args.shard_mb * 2**20)
        env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
        runs = [
            ("released FP8/FP4 -> bf16", folders["released"], "bfloat16", False),
            ("released FP8/FP4 -> fp32", folders["released"], "float32", False),
            ("released -> bf16, transformers' prefetch", folders["released"], "bfloat16", True),
            ("released -> fp32, transformers' prefetch", folders["released"], "float32", True),
            ("our bf16 checkpoint -> bf16 (baseline)", folders["bf16"], "bfloat16", False),
        ]
        size = {name: sum(f.stat().st_size for f in folder.glob("*.safetensors")) for name, folder in folders.items()}
        print(f"checkpoint bytes: released {size['released'] / 2**20:.0f} MiB, bf16 {size['bf16'] / 2**20:.0f} MiB "
              f"({len(list(folders['released'].glob('*.safetensors')))} released shards of <= {args.shard_mb} MiB)")
        print(f"{'run':42s} {'params':>8s} {'load s':>7s} {'model MiB':>9s} {'peak RSS':>9s} {'ratio':>6s} "
              f"{'peak anon':>9s} {'ratio':>6s}")
        for name, folder, dtype, prefetch in runs:
            r = _child(folder, dtype, prefetch, env)
            mib = 2**20
            print(f"{name:42s} {r['parameters'] / 1e6:7.0f}M {r['seconds']:7.2f} {r['model_bytes'] / mib:9.0f} "
                  f"{r['peak_rss_bytes'] / mib:9.0f} {r['peak_rss_bytes'] / r['model_bytes']:6.2f} "
                  f"{r['peak_anon_bytes'] / mib:9.0f} {r['peak_anon_bytes'] / r['model_bytes']:6.2f}")


if __name__ == "__main__":
    main()
