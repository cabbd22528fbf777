"""Resident memory of ``from_pretrained`` on a stand-in in the released storage format (FP8 dense Linears, packed FP4
experts, FP8 Engram table, E8M0 scales): native loading (FP8 / FP4 kept as stored, weight-only on the CPU) against
dequantized loading (``FineGrainedFP8Config(dequantize=True)``, bf16), with our own bf16 checkpoint as a baseline
(no conversion at all).

The stand-in is a ~260M-parameter text model whose routed experts are most of the weights, as in the release (64
experts of 4 layers, vocabulary 4000; Engram tables kept in FP8 as stored, ``engram_table_dtype="fp8"``, in every
case). Each case runs in a fresh process with glibc's mmap threshold pinned at 64 KiB (``MALLOC_MMAP_THRESHOLD_``:
every large tensor is its own mapping, returned to the system when freed), the peak resident set (``VmHWM``) reset
through ``/proc/self/clear_refs`` once torch and the package are imported. Reported, as rises over that point (MiB):

- ``peak``: VmHWM over the load;
- ``after``: VmRSS once loaded. transformers memory-maps the safetensors shards and keeps tensors it did not convert
  as views of the maps, so the maps stay open, and every checkpoint page the loader read (the FP4 experts' too,
  although they were copied into the fused tensors) is still counted: clean file pages, which the kernel reclaims
  under memory pressure;
- ``held``: VmRSS once those pages are paged out (``madvise(MADV_PAGEOUT)`` over the checkpoint's maps, which the
  kernel honours for pages no other process maps): what the loaded model really holds, the base of the goals;
- ``fwd``: VmRSS after one no-grad forward of 1 x 64 tokens (the weight pages the forward reads come back), and
  ``fwd peak``: VmHWM over that forward (the weight-only path dequantizes a Linear per call and an expert when
  tokens reach it).

Goals: native ``held`` ≤ 0.35 x dequantized ``held``, and ≤ 1.15 x the checkpoint's bytes. Linux 5.4+ only.

Then, on ``--device`` (cpu by default, or cuda), both loads again in this process (``device_map=DEVICE``) and the
same 2 x 64 tokens through each: max |Δ logit| of native against dequantized, the positions whose greedy token
(argmax) agrees, which modules computed (transformers' ``FP8Linear`` / ``FP8Experts`` kernels, or our weight-only
modules where those cannot run) and, on CUDA, ``torch.cuda.max_memory_allocated`` over each load and its forward.
On CUDA the resident-memory table is skipped (it measures host memory).

With ``--processes N``: instead, LoRA's loading on N processes (gloo on the CPU, NCCL one GPU each with
``--device cuda``), every process holding the stand-in sharded with FSDP2 (``training.fsdp.shard_model``), LoRA on
the README's targets, two ways in one run: **whole** (each process ``from_pretrained``, then ``shard_model``: today's
way) and **sharded** (the model built on the meta device, sharded, then each process reading only its shards:
``load_sharded_weights``, as ``examples/lora_released.py`` loads). Per process: load seconds and the peak rise of its
proportional set size (PSS, ``/proc/self/smaps_rollup``, sampled every 10 ms: a page the processes share is split
among them) over its PSS before loading, against its shards of the stored weights plus its share of the Engram
tables (memory-mapped in both); then one LoRA training step (AdamW, 1 x 256 tokens) on the model so loaded. On CUDA
also ``torch.cuda.max_memory_allocated`` over the load and over the step (from torch 2.12 FSDP2 shards the packed
FP4 experts; before, ``shard_model`` keeps them whole on each process, which one process does anyway).

    python benchmarks/loading.py [--device cpu|cuda] [--workdir DIR] [--shard-mb 100] [--threads 2] [--processes N]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

STAND_IN = dict(
    vocab_size=4000,
    hidden_size=768,
    moe_intermediate_size=384,
    num_hidden_layers=4,
    num_attention_heads=8,
    head_dim=128,
    qk_rope_head_dim=64,
    q_lora_rank=256,
    o_lora_rank=256,
    o_groups=4,
    n_routed_experts=64,
    num_experts_per_tok=4,
    sliding_window=128,
    compress_ratios=[0, 2, 2, 1],
    kv_source_layer_ids=[1, 3],
    index_source_layer_ids=[1, 3],
    index_n_heads=4,
    index_head_dim=64,
    index_topk=64,
    candidate_source_layer_id=-1,
    engram_layer_ids=[1],
    engram_num_embeddings=[40216],
    engram_max_ngram_size=3,
    engram_vocab_size=5000,
    engram_n_heads=4,
    engram_head_dim=64,
    engram_compressed_vocab_size=2000,
    engram_table_dtype="fp8",
    num_nextn_predict_layers=0,
)
CASES = {
    "native": "released, native (FP8/FP4 kept, weight-only)",
    "dequantized": "released, dequantized to bf16",
    "bf16": "our bf16 checkpoint (baseline, no conversion)",
}


def _status(field: str) -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith(field + ":"))


def _page_out_checkpoint(folder: str) -> None:
    """Ask the kernel to reclaim this process's resident pages of ``folder``'s safetensors maps (clean file pages:
    a later read maps them in again)."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    madv_pageout = 21
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split()
            if (
                len(fields) >= 6
                and fields[5].startswith(str(Path(folder).resolve()))
                and fields[5].endswith(".safetensors")
            ):
                start, end = (int(address, 16) for address in fields[0].split("-"))
                if libc.madvise(start, end - start, madv_pageout) != 0:
                    raise OSError(ctypes.get_errno(), "madvise(MADV_PAGEOUT) failed")


def measure(folder: str, case: str) -> dict:
    """Runs in the child process: load once, then one forward; memory rises over the point after the imports."""
    import gc

    import torch
    from transformers import FineGrainedFP8Config

    import modeling_dsv41  # noqa: F401
    from modeling_dsv41 import DeepseekV41ForCausalLM

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    kwargs = {"quantization_config": FineGrainedFP8Config(dequantize=True)} if case == "dequantized" else {}
    gc.collect()
    with open("/proc/self/clear_refs", "w") as clear:
        clear.write("5")  # VmHWM := VmRSS
    before = _status("VmRSS")
    start = time.perf_counter()
    model = DeepseekV41ForCausalLM.from_pretrained(folder, dtype=torch.bfloat16, **kwargs)
    seconds = time.perf_counter() - start
    peak = _status("VmHWM") - before
    gc.collect()
    after = _status("VmRSS") - before
    _page_out_checkpoint(folder)
    held = _status("VmRSS") - before

    ids = torch.randint(3, STAND_IN["vocab_size"] - 1, (1, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        with open("/proc/self/clear_refs", "w") as clear:
            clear.write("5")
        resident = _status("VmRSS")
        model(ids, use_cache=False, logits_to_keep=1)
        forward_peak = _status("VmHWM") - resident
    gc.collect()
    return {
        "seconds": seconds,
        "model_bytes": sum(t.numel() * t.element_size() for t in model.state_dict().values()),
        "peak": peak,
        "after": after,
        "held": held,
        "forward": _status("VmRSS") - before,
        "forward_peak": forward_peak,
    }


def native_against_dequantized(folder: str, device: str, ids) -> dict:
    """Load the released ``folder`` natively and dequantized (bf16) on ``device``, one after the other, and run
    ``ids`` through each: max |Δ logit|, positions whose argmax agrees, the quantized module kinds of the native
    model and, on CUDA, each case's allocation (after the load, and the peak over load and forward)."""
    import gc
    from collections import Counter

    import torch
    from transformers import FineGrainedFP8Config
    from transformers.integrations.finegrained_fp8 import FP8Experts, FP8Linear

    import modeling_dsv41  # noqa: F401
    from modeling_dsv41 import DeepseekV41ForCausalLM

    cuda = torch.device(device).type == "cuda"
    logits, result = {}, {"memory": {}}
    for case, kwargs in (
        ("native", {}),
        ("dequantized", {"quantization_config": FineGrainedFP8Config(dequantize=True)}),
    ):
        if cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
        model = DeepseekV41ForCausalLM.from_pretrained(folder, dtype=torch.bfloat16, device_map=device, **kwargs)
        held = torch.cuda.memory_allocated(device) if cuda else None
        with torch.no_grad():
            logits[case] = model(ids.to(device), use_cache=False).logits.float().cpu()
        if cuda:
            result["memory"][case] = {"held": held, "peak": torch.cuda.max_memory_allocated(device)}
        if case == "native":
            result["modules"] = dict(
                Counter(type(m).__name__ for m in model.modules() if isinstance(m, (FP8Linear, FP8Experts)))
            )
        del model
        gc.collect()
    native, dequantized = logits["native"], logits["dequantized"]
    result["max_abs_logit_diff"] = (native - dequantized).abs().max().item()
    result["argmax_equal"] = int((native.argmax(-1) == dequantized.argmax(-1)).sum())
    result["positions"] = native.shape[0] * native.shape[1]
    return result


def print_device_comparison(folder: Path, device: str) -> None:
    import torch

    ids = torch.randint(3, STAND_IN["vocab_size"] - 1, (2, 64), generator=torch.Generator().manual_seed(1))
    r = native_against_dequantized(str(folder), device, ids)
    where = f"CUDA ({torch.cuda.get_device_name(device)})" if torch.device(device).type == "cuda" else "CPU"
    print(
        f"\nnative vs dequantized on {where}, 2 x 64 tokens, bf16: max |Δ logit| {r['max_abs_logit_diff']:.4g}, "
        f"greedy argmax equal at {r['argmax_equal']}/{r['positions']} positions"
    )
    print(
        "native model's quantized modules: "
        + ", ".join(f"{n} {k}" for k, n in sorted(r["modules"].items()))
        + " (FP8Linear / FP8Experts: transformers' kernels; WeightOnly*: dequantized in the forward)"
    )
    for case, memory in r["memory"].items():
        print(
            f"{case:12s} allocated after load {memory['held'] / 2**20:8.0f} MiB, "
            f"max_memory_allocated (load + forward) {memory['peak'] / 2**20:8.0f} MiB"
        )
    if r["memory"]:
        print(
            f"native / dequantized max_memory_allocated: "
            f"{r['memory']['native']['peak'] / r['memory']['dequantized']['peak']:.2f}"
        )


def write_checkpoints(workdir: Path, shard_bytes: int) -> dict[str, Path]:
    import torch
    from tokenizers import Tokenizer, models

    import modeling_dsv41  # noqa: F401
    from configuration import DeepseekV41Config
    from modeling_dsv41 import DeepseekV41ForCausalLM
    from modeling_dsv41.released.writing import save_released_checkpoint

    torch.manual_seed(0)
    model = DeepseekV41ForCausalLM(DeepseekV41Config(text_config={**STAND_IN, "engram_table_dtype": "float"}))
    model = model.to(torch.bfloat16)
    # any tokenizer compressing to engram_compressed_vocab_size ids: one key per pair of tokens
    vocab = {f"{'t' if i % 2 == 0 else 'T'}{i // 2}": i for i in range(STAND_IN["vocab_size"])}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    model.model.engram_hasher.load_tokenizer(tokenizer)
    folders = {"released": workdir / "released", "bf16": workdir / "bf16"}
    save_released_checkpoint(model, folders["released"], max_shard_bytes=shard_bytes)
    tokenizer.save(str(folders["released"] / "tokenizer.json"))
    config = json.loads((folders["released"] / "config.json").read_text())
    config["text_config"]["engram_table_dtype"] = "fp8"  # keep the tables as stored in every case
    (folders["released"] / "config.json").write_text(json.dumps(config, indent=2))
    model.save_pretrained(folders["bf16"], max_shard_size=shard_bytes)
    return folders


def _child(folder: Path, case: str, threads: int) -> dict:
    code = (
        "import json, sys; sys.path.insert(0, sys.argv[1]); from benchmarks.loading import measure; "
        "print('RESULT' + json.dumps(measure(sys.argv[2], sys.argv[3])))"
    )
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MALLOC_MMAP_THRESHOLD_="65536")
    argv = [sys.executable, "-c", code, str(REPO), str(folder), case]
    out = subprocess.run(argv, env=env, check=True, capture_output=True, text=True).stdout
    return json.loads(next(line for line in out.splitlines() if line.startswith("RESULT"))[len("RESULT") :])


def resident_memory_table(folders: dict[str, Path], stored: int, threads: int) -> None:
    """Each case in a fresh process: the resident-memory figures of the module docstring, and the goals."""
    mib = 2**20
    print(
        f"{'case (MiB)':46s} {'load s':>7s} {'model':>6s} {'peak':>6s} {'after':>6s} {'held':>6s} "
        f"{'/stored':>7s} {'fwd':>6s} {'fwd peak':>8s}"
    )
    results = {}
    for case, name in CASES.items():
        r = results[case] = _child(folders["bf16" if case == "bf16" else "released"], case, threads)
        print(
            f"{name:46s} {r['seconds']:7.2f} {r['model_bytes'] / mib:6.0f} {r['peak'] / mib:6.0f} "
            f"{r['after'] / mib:6.0f} {r['held'] / mib:6.0f} {r['held'] / stored:7.2f} {r['forward'] / mib:6.0f} "
            f"{r['forward_peak'] / mib:8.0f}"
        )
    native, dequantized = results["native"], results["dequantized"]
    print(
        f"native / dequantized: held {native['held'] / dequantized['held']:.2f} (goal <= 0.35), peak "
        f"{native['peak'] / dequantized['peak']:.2f}, after one forward "
        f"{native['forward'] / dequantized['forward']:.2f}; "
        f"native held / stored bytes {native['held'] / stored:.2f} (goal <= 1.15)"
    )


def _pss() -> int:
    with open("/proc/self/smaps_rollup") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("Pss:"))


def _load_for_lora(rank: int, world: int, port: int, folder: str, device: str, results) -> None:
    """One process of ``--processes``: both loads, one after the other, each measured from its own baseline."""
    import gc
    import threading

    import torch
    import torch.distributed as dist
    from peft import LoraConfig, get_peft_model

    import modeling_dsv41  # noqa: F401
    from configuration import DeepseekV41Config
    from modeling_dsv41 import DeepseekV41ForCausalLM
    from modeling_dsv41.released.loading import empty_native_model
    from modeling_dsv41.training.fsdp import load_sharded_weights, shard_model

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    target = torch.device(f"cuda:{rank}") if device == "cuda" else torch.device("cpu")
    if device == "cuda":
        torch.cuda.set_device(target)
    dist.init_process_group("nccl" if device == "cuda" else "gloo", rank=rank, world_size=world)
    config = DeepseekV41Config.from_pretrained(folder)
    lora = LoraConfig(
        r=16,
        target_modules=[
            "attn.wq_a",
            "attn.wq_b",
            "attn.wkv",
            "attn.wo_b",
            "shared_experts.w1",
            "shared_experts.w2",
            "shared_experts.w3",
        ],
        target_parameters=["experts.gate_up_proj", "experts.down_proj"],
    )

    def whole():
        model = DeepseekV41ForCausalLM.from_pretrained(
            folder, config=config, engram_tables="mmap", device_map=None if device == "cpu" else str(target)
        )
        return shard_model(get_peft_model(model, lora))

    def sharded():
        model = get_peft_model(empty_native_model(DeepseekV41ForCausalLM, folder, config=config, device=target), lora)
        shard_model(model)
        load_sharded_weights(model, folder, device=target)
        return model

    def step(model) -> None:
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
        ids = torch.randint(3, config.text_config.vocab_size, (1, 256), generator=torch.Generator().manual_seed(rank))
        ids = ids.to(target)
        model.train()(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    def device_peak() -> float:
        return torch.cuda.max_memory_allocated(target) if device == "cuda" else float("nan")

    for name, load in (("sharded", sharded), ("whole", whole)):
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(target)
        dist.barrier()
        baseline, peak, stop = _pss(), [0], threading.Event()

        def sample():
            while not stop.wait(0.01):
                peak[0] = max(peak[0], _pss())

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        start = time.perf_counter()
        model = load()
        seconds = time.perf_counter() - start
        stop.set()
        sampler.join()
        peak[0] = max(peak[0], _pss())
        loaded = device_peak()
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats(target)
        start = time.perf_counter()
        step(model)
        step_seconds = time.perf_counter() - start
        results.put((name, rank, seconds, peak[0] - baseline, _pss() - baseline, loaded, device_peak(), step_seconds))
        del model
    dist.barrier()
    dist.destroy_process_group()


def loading_on_processes(folder: Path, processes: int, device: str) -> None:
    """``--processes``: the per-process table of the module docstring."""
    import socket

    import torch
    import torch.multiprocessing as mp

    weights, tables = _stored_bytes(folder)
    share = (weights + tables) / processes
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    context = mp.get_context("spawn")
    results = context.SimpleQueue()
    env = dict(os.environ)
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"  # freed tensors go back to the system (see above)
    try:
        mp.start_processes(
            _load_for_lora,
            args=(processes, port, str(folder), device, results),
            nprocs=processes,
            start_method="spawn",
        )
    finally:
        os.environ.clear()
        os.environ.update(env)
    rows = sorted(results.get() for _ in range(2 * processes))
    mib = 2**20
    print(
        f"LoRA loading on {processes} processes ({device}): stored {weights / mib:.1f} MiB + Engram tables "
        f"{tables / mib:.1f} MiB; per process, shards + Engram share: {share / mib:.1f} MiB"
    )
    print(
        f"{'load':8s} {'rank':>4s} {'seconds':>8s} {'peak PSS rise MiB':>18s} {'x share':>8s} {'held after MiB':>15s} "
        f"{'device load MiB':>16s} {'device step MiB':>16s} {'step s':>7s}"
    )
    for name, rank, seconds, peak, after, loaded, stepped, step_seconds in rows:
        print(
            f"{name:8s} {rank:4d} {seconds:8.2f} {peak / mib:18.1f} {peak / share:8.2f} {after / mib:15.1f} "
            f"{loaded / mib:16.1f} {stepped / mib:16.1f} {step_seconds:7.2f}"
        )
    print(f"torch {torch.__version__}; device MiB: torch.cuda.max_memory_allocated over the load, then over the step")


def _stored_bytes(folder: Path) -> tuple[int, int]:
    """(bytes of the stored tensors but the Engram tables, bytes of the tables), from the safetensors headers."""
    from modeling_dsv41.safetensors_files import safetensors_header

    sizes = [0, 0]
    for path in folder.glob("*.safetensors"):
        _, header = safetensors_header(path)
        for key, entry in header.items():
            if key != "__metadata__":
                start, stop = entry["data_offsets"]
                sizes[".engram.embed." in key] += stop - start
    return sizes[0], sizes[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--shard-mb", type=int, default=100)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--device", default="cpu", help="where the native vs dequantized logits check runs (cpu, cuda)"
    )
    parser.add_argument(
        "--processes",
        type=int,
        default=0,
        help="LoRA's loading on this many processes instead, sharded against whole (see above)",
    )
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        workdir = args.workdir or Path(tmp)
        folders = {"released": workdir / "released", "bf16": workdir / "bf16"}
        if not all(folder.is_dir() for folder in folders.values()):
            folders = write_checkpoints(workdir, args.shard_mb * 2**20)
        stored = sum(f.stat().st_size for f in folders["released"].glob("*.safetensors"))
        mib = 2**20
        print(
            f"released checkpoint: {stored / mib:.0f} MiB in "
            f"{len(list(folders['released'].glob('*.safetensors')))} shards of <= {args.shard_mb} MiB"
        )
        if args.processes:
            loading_on_processes(folders["released"], args.processes, args.device)
            return
        if args.device == "cpu":
            resident_memory_table(folders, stored, args.threads)
        print_device_comparison(folders["released"], args.device)


if __name__ == "__main__":
    main()
