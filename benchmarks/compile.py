"""Eager vs ``torch.compile``: a training step (forward+backward, gradient checkpointing on) with every decoder layer
compiled as one graph (``modeling_dsv41.training.compilation.compile_blocks``, what ``torch_compile=True`` in the
Trainer does), and a static-cache decode step with ``torch.compile(model.forward, fullgraph=True)``.

For each ``--sizes`` (``tiny``, ``medium``: benchmarks/forward.py's configurations; ``--medium-layers`` keeps the
first layers of the medium one, since compiling its 8 layer kinds takes minutes per kind on one CPU thread) it
reports, from one run:

- the whole model's training forward (with labels) under ``torch._dynamo.explain``: graphs and graph breaks, what
  compiling the model as a whole gives (the per-block compile is ``fullgraph=True``: no break, or an error);
- per-block compile: graphs compiled (dynamo frames), compile time (the first compiled step's time minus an eager
  step's), and the compiled ÷ eager median step time, from ``--reps`` rounds of one eager step and one compiled step
  after compiling (the same model, the eager one under ``torch.compiler.set_stance("force_eager")``), so that both
  see the same load of a shared machine;
- ops per step: the aten ops an eager step dispatches, and the kernels a compiled step runs by torch.profiler
  (inductor's fused kernels and the aten ops left outside them);
- the same for one decode step after a ``--context``-token prefill (batch 1, static cache), and the largest
  difference of the compiled logits from the eager ones.

Times are process CPU time (``time.process_time``) on ``--threads`` threads (1 by default), inductor compiling in
process (``compile_threads = 1``), the median of ``--reps`` steps after two warm-up steps. The training rows also
give the kernel's share of each step (``sys s``: mostly page faults: every step's gradients are fresh memory, which
glibc maps from the kernel and returns to it, 4 KiB page by 4 KiB page) and the ratio of the user time alone. PyTorch's
``THP_MEM_ALLOC_ENABLE=1`` (set before the script starts) maps large tensors in 2 MiB pages instead; the header says
whether it was set. ``--device cuda`` runs
the same on a GPU (wall-clock time, synchronized; benchmarks/gpu.sh), ``--dtype`` sets the model dtype.

``--profile N`` prints torch.profiler's N ops with the most self time of an eager and a compiled training step, and
the floating-point operations and time of each one's matrix products.

Usage: ``python benchmarks/compile.py [--sizes tiny medium] [--batch 1] [--seq 128] [--context 256] [--reps 5]
[--profile N]``
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch._dynamo.testing import CompileCounterWithBackend
from transformers.utils import logging as hf_logging

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling benchmarks, however this script is run
from forward import build_ours, make_inputs  # noqa: E402
from generate import OpCounter, decode_inputs  # noqa: E402

from modeling_dsv41.training.compilation import compile_blocks  # noqa: E402


def clock(device: str) -> float:
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        return time.perf_counter()
    return time.process_time()


def kernel_time(device: str) -> float:
    """The process's system CPU time (CPU runs; 0 on a GPU, where steps are timed by the wall clock)."""
    return 0.0 if device.startswith("cuda") else resource.getrusage(resource.RUSAGE_SELF).ru_stime


def timed(step: Callable[[], object], reps: int, device: str) -> tuple[float, float, list[float]]:
    """(first call's seconds, median of ``reps`` calls after a second warm-up call, all the timed calls)."""
    start = clock(device)
    step()
    first = clock(device) - start
    step()
    times = []
    for _ in range(reps):
        start = clock(device)
        step()
        times.append(clock(device) - start)
    return first, statistics.median(times), times


def kernels(step: Callable[[], object]) -> int:
    """Kernels one call of ``step`` runs, by torch.profiler: inductor's fused kernels and the top-level aten ops,
    allocations and views excluded."""
    from torch.profiler import ProfilerActivity, profile

    skip = (
        "aten::empty",
        "aten::empty_strided",
        "aten::as_strided",
        "aten::view",
        "aten::reshape",
        "aten::alias",
        "aten::_reshape_alias",
        "aten::resize_",
        "aten::detach",
        "aten::lift_fresh",
        "aten::zeros",
    )
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    count = 0
    for event in prof.events():
        parent = event.cpu_parent
        fused = "cpp_fused" in event.name or "triton_" in event.name
        top_level = event.name.startswith("aten::") and (parent is None or not parent.name.startswith("aten::"))
        count += fused or (top_level and event.name not in skip)
    return count


def top_ops(step: Callable[[], object], rows: int) -> str:
    """torch.profiler's table of the ``rows`` ops of one call of ``step`` with the most self time, by input shape,
    and what its matrix products (mm, bmm, addmm, baddbmm) add up to: floating-point operations and self time."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], record_shapes=True, with_flops=True) as prof:
        step()
    averages = prof.key_averages(group_by_input_shape=True)
    products = [e for e in prof.events() if e.name in ("aten::mm", "aten::bmm", "aten::addmm", "aten::baddbmm")]
    flops, seconds = sum(e.flops or 0 for e in products), sum(e.self_cpu_time_total for e in products) / 1e6
    total = sum(e.self_cpu_time_total for e in averages) / 1e6
    table = averages.table(sort_by="self_cpu_time_total", row_limit=rows, max_name_column_width=40)
    return f"{table}\nmatrix products: {flops / 1e9:.1f} GFLOP in {seconds:.2f} s of the profiled step's {total:.2f} s"


def aten_ops(step: Callable[[], object]) -> int:
    with OpCounter() as counter:
        step()
    return counter.total - counter.views


def training(args: argparse.Namespace, size: str) -> dict[str, float]:
    layers = {"num_hidden_layers": args.medium_layers} if size == "medium" and args.medium_layers else {}
    model = build_ours(engram=size == "tiny", size=size, emulate_quantization=False, **layers)
    model = model.to(args.device, getattr(torch, args.dtype)).train()
    model.activation_checkpointing_enable()
    inputs = {k: v.to(args.device) for k, v in make_inputs(model, args.batch, args.seq, image=False).items()}

    def step() -> None:
        model.zero_grad(set_to_none=True)
        model(**inputs, labels=inputs["input_ids"]).loss.backward()

    torch._dynamo.reset()
    # as compile_blocks does: the routers' record of their choices is not written again by the checkpoint's recompute
    with torch._dynamo.config.patch(skip_fwd_side_effects_in_bwd_under_checkpoint=True):
        explained = torch._dynamo.explain(lambda: model(**inputs, labels=inputs["input_ids"]).loss)()
    row = {"whole-model graphs": explained.graph_count, "whole-model breaks": explained.graph_break_count}
    row["eager ops"] = aten_ops(step)
    _, eager, _ = timed(step, 1, args.device)
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("inductor")
    compile_blocks(model, backend=counter)
    first, _, _ = timed(step, 1, args.device)
    (eager, eager_sys), (compiled, compiled_sys) = alternated(step, args.reps, args.device)
    if args.profile:
        for stance in ("force_eager", "default"):
            with torch.compiler.set_stance(stance):
                print(f"\n{size}, {'eager' if stance == 'force_eager' else 'compiled'} step: top ops by self time")
                print(top_ops(step, args.profile))
    row |= {
        "compiled graphs": counter.frame_count,
        "compile s": first - eager,
        "eager s": eager,
        "compiled s": compiled,
        "ratio": compiled / eager,
        "eager sys s": eager_sys,
        "compiled sys s": compiled_sys,
        "user-time ratio": (compiled - compiled_sys) / (eager - eager_sys),
        "compiled kernels": kernels(step),
    }
    return row


def alternated(step: Callable[[], object], reps: int, device: str) -> tuple[tuple[float, float], tuple[float, float]]:
    """(median time, median kernel time) of the eager and of the compiled steps, from ``reps`` rounds of one eager
    step (the compiled blocks' original forwards, ``torch.compiler.set_stance("force_eager")``) and one compiled step:
    both see the same load of a shared machine."""
    times = {"force_eager": [], "default": []}
    for _ in range(reps):
        for stance, measured in times.items():
            with torch.compiler.set_stance(stance):
                start, start_sys = clock(device), kernel_time(device)
                step()
                measured.append((clock(device) - start, kernel_time(device) - start_sys))
    return tuple(
        (statistics.median(t for t, _ in measured), statistics.median(s for _, s in measured))
        for measured in (times["force_eager"], times["default"])
    )


@torch.no_grad()
def decoding(args: argparse.Namespace, size: str) -> dict[str, float]:
    model = build_ours(engram=size == "tiny", size=size).to(args.device, getattr(torch, args.dtype)).eval()
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(model.forward, fullgraph=True, backend=counter)
    row, logits = {}, {}
    for name, forward in (("eager", model.forward), ("compiled", compiled)):
        cache, tokens = decode_inputs(model, args.context, True, args.device, args.reps + 4)
        calls = iter(tokens)
        logits[name] = []

        def step() -> None:
            logits[name].append(forward(input_ids=next(calls), cache=cache).logits.float())

        first, median, _ = timed(step, args.reps, args.device)
        row[f"{name} s"] = median
        if name == "compiled":
            row["compile s"] = first - row["eager s"]
        row[f"{name} {'ops' if name == 'eager' else 'kernels'}"] = (aten_ops if name == "eager" else kernels)(step)
    row |= {"compiled graphs": counter.frame_count, "ratio": row["compiled s"] / row["eager s"]}
    row["max |logit diff|"] = max((a - b).abs().max().item() for a, b in zip(logits["eager"], logits["compiled"]))
    return row


def show(title: str, rows: dict[str, dict[str, float]]) -> None:
    print(f"\n{title}")
    keys = list(next(iter(rows.values())))
    print("| size | " + " | ".join(keys) + " |")
    print("|" + "---|" * (len(keys) + 1))
    for size, row in rows.items():
        cells = [f"{v:.3g}" if isinstance(v, float) else str(v) for v in row.values()]
        print(f"| {size} | " + " | ".join(cells) + " |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", nargs="+", choices=["tiny", "medium"], default=["tiny", "medium"])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--medium-layers", type=int, default=0, help="keep the medium model's first N layers")
    parser.add_argument("--skip", nargs="*", default=[], choices=["train", "decode"])
    parser.add_argument(
        "--profile", type=int, default=0, help="print the N ops of a training step with most self time"
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    import torch._inductor.config as inductor_config

    inductor_config.compile_threads = 1  # compile in this process, so that process time counts it
    hf_logging.set_verbosity_error()
    print(
        f"torch {torch.__version__}, {args.device}, {args.dtype}, {args.threads} thread(s), batch {args.batch}, "
        f"train seq {args.seq}, decode context {args.context}, reps {args.reps}, "
        f"THP_MEM_ALLOC_ENABLE={os.environ.get('THP_MEM_ALLOC_ENABLE', 'unset')}"
        + (f", medium: first {args.medium_layers} layers" if args.medium_layers else "")
    )
    if "train" not in args.skip:
        show(
            "Training step (forward+backward, gradient checkpointing), per-block compile vs eager",
            {size: training(args, size) for size in args.sizes},
        )
    if "decode" not in args.skip:
        show(
            "Decode step (static cache), torch.compile(model.forward, fullgraph=True) vs eager",
            {size: decoding(args, size) for size in args.sizes},
        )


if __name__ == "__main__":
    main()
