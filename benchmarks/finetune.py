"""One LoRA fine-tuning step on the released-format stand-in of benchmarks/loading.py: the model loaded natively (FP8
Linears and FP4 experts kept as stored, frozen) against the baseline, the same folder loaded dequantized to bf16
(``FineGrainedFP8Config(dequantize=True)``).

Both get the same LoRA adapters (r 16 on the FP8 Linears: attention ``wq_a``, ``wq_b``, ``wkv``, ``wo_b`` and the
shared experts, and on the routed experts through PEFT ``target_parameters``; the factors drawn once, both nonzero,
kept in fp32) and the same batch; each case runs in a fresh
process. Reported, native ÷ dequantized:

- peak memory of a step (forward, backward, AdamW on the adapters) with the model loaded: on CPU the rise of the
  process's peak resident set (``VmHWM``, reset through ``/proc/self/clear_refs`` once the checkpoint's file pages
  are paged out, as in benchmarks/loading.py: glibc's mmap threshold pinned at 64 KiB, every large tensor its own
  mapping) over the resident set before the load, i.e. weights + step; on CUDA ``torch.cuda.max_memory_allocated``
  over the step (weights included). Goal ≤ 0.45;
- the step time (median of ``--steps`` steps after one warm-up step);
- max |Δ| between the two cases' adapter gradients at the first step (and that relative to the largest gradient).

``--no-experts`` leaves the routed experts without adapters.

    python benchmarks/finetune.py [--device cpu|cuda] [--seq 128] [--batch 1] [--steps 3] [--threads 2]
        [--gradient-checkpointing] [--no-experts] [--workdir DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.loading import STAND_IN, _page_out_checkpoint, _status, write_checkpoints  # noqa: E402

CASES = {"native": "native (FP8/FP4 kept, frozen)", "dequantized": "dequantized to bf16 (baseline)"}
LINEAR_TARGETS = [
    "attn.wq_a",
    "attn.wq_b",
    "attn.wkv",
    "attn.wo_b",
    "shared_experts.w1",
    "shared_experts.w2",
    "shared_experts.w3",
]
EXPERT_TARGETS = ["experts.gate_up_proj", "experts.down_proj"]


def lora_model(folder: str, case: str, device: str, experts: bool, factors: Path, gradient_checkpointing: bool):
    """The ``case`` load of ``folder`` on ``device`` with the adapters; the factors are read from ``factors`` if it
    exists (written by the first case otherwise), so both cases start from the same adapters."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import FineGrainedFP8Config

    import modeling_dsv41  # noqa: F401
    from modeling_dsv41 import DeepseekV41ForCausalLM

    kwargs = {"quantization_config": FineGrainedFP8Config(dequantize=True)} if case == "dequantized" else {}
    base = DeepseekV41ForCausalLM.from_pretrained(folder, dtype=torch.bfloat16, device_map=device, **kwargs)
    if gradient_checkpointing:
        base.activation_checkpointing_enable()
    torch.manual_seed(0)
    config = LoraConfig(
        r=16,
        lora_alpha=32,
        target_modules=LINEAR_TARGETS,
        init_lora_weights=False,
        target_parameters=EXPERT_TARGETS if experts else [],
    )
    model = get_peft_model(base, config).train()
    adapters = {n: p for n, p in model.named_parameters() if p.requires_grad}
    with torch.no_grad():
        for param in adapters.values():  # fp32 factors in both cases (PEFT draws them in the base's float dtype)
            param.data = param.data.float()
        if factors.exists():
            for name, value in torch.load(factors).items():
                adapters[name].copy_(value)
        else:
            torch.save({n: p.detach().cpu() for n, p in adapters.items()}, factors)
    return model, adapters


def measure(
    folder: str,
    case: str,
    device: str,
    seq: int,
    batch: int,
    steps: int,
    experts: bool,
    gradient_checkpointing: bool,
    workdir: str,
) -> dict:
    """Runs in the child process: load, attach the adapters, one warm-up step (its gradients saved), ``steps``
    timed steps; the memory figures of the module docstring."""
    import gc

    import peft  # noqa: F401  imported before the memory baseline, as everything the step needs
    import torch
    import transformers  # noqa: F401

    import modeling_dsv41  # noqa: F401

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    cuda = torch.device(device).type == "cuda"
    gc.collect()
    before = torch.cuda.memory_allocated(device) if cuda else _status("VmRSS")
    model, adapters = lora_model(folder, case, device, experts, Path(workdir) / "factors.pt", gradient_checkpointing)
    optimizer = torch.optim.AdamW(adapters.values(), lr=1e-4)
    ids = torch.randint(3, STAND_IN["vocab_size"] - 1, (batch, seq), generator=torch.Generator().manual_seed(0))
    ids = ids.to(device)
    gc.collect()
    if cuda:
        held = torch.cuda.memory_allocated(device) - before
        torch.cuda.reset_peak_memory_stats(device)
    else:
        _page_out_checkpoint(folder)
        held = _status("VmRSS") - before
        with open("/proc/self/clear_refs", "w") as clear:
            clear.write("5")  # VmHWM := VmRSS

    def step() -> None:
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)  # zeroed in place: the gradient buffers stay, as in training

    model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    torch.save({n: p.grad.detach().float().cpu() for n, p in adapters.items()}, Path(workdir) / f"grads_{case}.pt")
    optimizer.step()
    optimizer.zero_grad(set_to_none=False)
    seconds = []
    for _ in range(steps):
        if cuda:
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        step()
        if cuda:
            torch.cuda.synchronize(device)
        seconds.append(time.perf_counter() - start)
    peak = torch.cuda.max_memory_allocated(device) - before if cuda else _status("VmHWM") - before
    return {
        "held": held,
        "peak": peak,
        "step_s": statistics.median(seconds),
        "adapter_params": sum(p.numel() for p in adapters.values()),
    }


def _child(folder: Path, case: str, args, workdir: Path) -> dict:
    code = (
        "import json, sys; sys.path.insert(0, sys.argv[1]); from benchmarks.finetune import measure; "
        "print('RESULT' + json.dumps(measure(*sys.argv[2:5], *map(int, sys.argv[5:8]), sys.argv[8] == '1', "
        "sys.argv[9] == '1', sys.argv[10])))"
    )
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), MALLOC_MMAP_THRESHOLD_="65536")
    argv = [
        sys.executable,
        "-c",
        code,
        str(REPO),
        str(folder),
        case,
        args.device,
        str(args.seq),
        str(args.batch),
        str(args.steps),
        str(int(args.experts)),
        str(int(args.gradient_checkpointing)),
        str(workdir),
    ]
    result = subprocess.run(argv, env=env, capture_output=True, text=True)
    if result.returncode != 0:
        sys.exit(f"the {case} case failed:\n{result.stderr[-3000:]}")
    return json.loads(next(line for line in result.stdout.splitlines() if line.startswith("RESULT"))[len("RESULT") :])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--steps", type=int, default=3, help="timed steps after one warm-up step")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--gradient-checkpointing", action="store_true")
    parser.add_argument(
        "--experts",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="adapters on the routed experts too (default: %(default)s)",
    )
    parser.add_argument("--shard-mb", type=int, default=100)
    parser.add_argument("--workdir", type=Path, default=None)
    args = parser.parse_args()
    import torch

    with tempfile.TemporaryDirectory() as tmp:
        workdir = args.workdir or Path(tmp)
        folder = workdir / "released"
        if not folder.is_dir():
            write_checkpoints(workdir, args.shard_mb * 2**20)
        (workdir / "factors.pt").unlink(missing_ok=True)
        where = f"CUDA ({torch.cuda.get_device_name(args.device)})" if args.device.startswith("cuda") else "CPU"
        print(
            f"one LoRA step on the released-format stand-in, {where}, batch {args.batch} x {args.seq} tokens, "
            f"gradient checkpointing {'on' if args.gradient_checkpointing else 'off'}, "
            f"{args.threads} threads; memory: "
            f"{'max_memory_allocated' if where != 'CPU' else 'VmHWM rise over the process before the load'}"
        )
        results = {case: _child(folder, case, args, workdir) for case in CASES}
        mib = 2**20
        print(f"{'case':34s} {'held MiB':>9s} {'step peak MiB':>14s} {'step s':>8s}")
        for case, name in CASES.items():
            r = results[case]
            print(f"{name:34s} {r['held'] / mib:9.0f} {r['peak'] / mib:14.0f} {r['step_s']:8.3f}")
        grads = {case: torch.load(workdir / f"grads_{case}.pt") for case in CASES}
        delta = max((grads["native"][n] - g).abs().max().item() for n, g in grads["dequantized"].items())
        scale = max(g.abs().max().item() for g in grads["dequantized"].values())
        native, dequantized = results["native"], results["dequantized"]
        print(
            f"native / dequantized (baseline): step peak memory {native['peak'] / dequantized['peak']:.2f} "
            f"(goal <= 0.45), held {native['held'] / dequantized['held']:.2f}, "
            f"step time {native['step_s'] / dequantized['step_s']:.2f}"
        )
        print(
            f"adapter gradients ({native['adapter_params']} parameters), native vs dequantized: max |Δ| "
            f"{delta:.3g} (max |g| {scale:.3g}, relative {delta / scale:.2g})"
        )


if __name__ == "__main__":
    main()
