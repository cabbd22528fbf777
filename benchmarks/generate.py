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

Then the ops of one decode step (batch 1, after a prefill of the shortest context): the aten ops it dispatches
(counted by a ``TorchDispatchMode``, after autograd and composite decompositions, so ``F.linear`` counts as its
transpose view and its ``mm``), in all and without views (which move no data), for our dynamic
(:class:`DeepseekV41Cache`) and static (:class:`DeepseekV41StaticCache`) caches. ``--baseline-src DIR`` counts the
same for the dynamic cache of another checkout (e.g. ``git archive main | tar -x -C /tmp/base``), in a subprocess
of this run, and prints ours ÷ that baseline.

``--compile`` also compiles the static-cache decode step (``torch.compile(model.forward, fullgraph=True,
mode=--compile-mode)``; the default ``reduce-overhead`` captures it as a CUDA graph on a GPU; on CPU use
``--compile-mode default``) and reports its time per token against the same step in eager mode, and the kernels
it runs per step (torch.profiler: inductor's fused kernels plus the aten ops the graph still calls, allocations
and views excluded) against the eager step's non-view ops.

``--greedy-only`` runs the greedy generate comparison alone (e.g. a second run at ``--batch 16``);
``--compile-only`` the compiled decode step alone (at the shortest context: a GPU run spends its time compiling).

Usage: ``python benchmarks/generate.py [--size tiny|medium] [--device cpu|cuda] [--dtype float32|bfloat16]
[--contexts 256 2048] [--steps 32] [--reps 3] [--batch 1] [--threads 2] [--baseline-src DIR]
[--compile] [--compile-mode reduce-overhead|default|max-autotune] [--greedy-only | --compile-only]``
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import LogitsProcessor, LogitsProcessorList
from transformers.utils import logging as hf_logging

from modeling_dsv41 import DeepseekV41ForCausalLM

try:  # absent from a --baseline-src checkout older than the static cache
    from modeling_dsv41.generation.cache import DeepseekV41StaticCache
except ImportError:
    DeepseekV41StaticCache = None

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling forward.py, however this script is run
from forward import SIZES, as_loaded, build_ours, build_transformers_v4  # noqa: E402


def build(size: str, device: str, dtype: torch.dtype) -> tuple[DeepseekV41ForCausalLM, nn.Module]:
    """Ours (with Engram at the tiny size, as before) and transformers' V4 at the same sizes, with a cache."""
    torch.manual_seed(0)
    ours = build_ours(engram=size == "tiny", size=size)
    theirs = build_transformers_v4(ours, use_cache=True)
    return as_loaded(ours.eval(), device, dtype), as_loaded(theirs.eval(), device, dtype)


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
) -> dict[str, float | None]:
    """Seconds per decoded token (per row) of each model's ``generate``: the median interval between consecutive
    tokens' logits (the prefill, before the first, excluded), over ``reps`` calls timed round-robin. None for a
    model that runs out of CUDA memory."""
    vocab = min(m.config.get_text_config().vocab_size for m in models.values())
    ids = torch.randint(3, vocab - 16, (batch, context), generator=torch.Generator().manual_seed(context)).to(device)

    def step_intervals(model: nn.Module, new_tokens: int) -> list[float]:
        clock = StepClock(device)
        model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=0,
            logits_processor=LogitsProcessorList([clock]),
        )
        return [b - a for a, b in zip(clock.times, clock.times[1:])]

    out_of_memory = set()

    def intervals_unless_out_of_memory(name: str, new_tokens: int) -> list[float]:
        if name in out_of_memory:
            return []
        try:
            return step_intervals(models[name], new_tokens)
        except torch.cuda.OutOfMemoryError:
            out_of_memory.add(name)
            torch.cuda.empty_cache()
            return []

    for name in models:
        intervals_unless_out_of_memory(name, 2)  # warm-up
    intervals: dict[str, list[float]] = {name: [] for name in models}
    for _ in range(reps):
        for name in models:
            intervals[name] += intervals_unless_out_of_memory(name, steps + 1)
    return {name: None if name in out_of_memory else statistics.median(times) for name, times in intervals.items()}


class OpCounter(TorchDispatchMode):
    """Counts the aten ops dispatched while active, and which of them are views."""

    def __init__(self):
        super().__init__()
        self.ops: Counter[str] = Counter()
        self.views = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func.overloadpacket)] += 1
        self.views += func.is_view
        return func(*args, **(kwargs or {}))

    @property
    def total(self) -> int:
        return sum(self.ops.values())


def decode_inputs(model: nn.Module, context: int, static: bool, device: str, steps: int = 1):
    """A cache holding a ``context``-token prefill plus one decode step, and the ids of ``steps`` more tokens."""
    ids = torch.randint(3, 500, (1, context + 1 + steps), generator=torch.Generator().manual_seed(context)).to(device)
    cache = DeepseekV41StaticCache(model.config, max_cache_len=context + 1 + steps) if static else None
    cache = model(ids[:, :context], cache=cache, use_cache=True, logits_to_keep=1).cache
    model(ids[:, context : context + 1], cache=cache)  # the first step after a prefill is no different, but warm up
    return cache, [ids[:, context + 1 + t : context + 2 + t] for t in range(steps)]


@torch.no_grad()
def decode_op_count(model: nn.Module, context: int, static: bool, device: str) -> dict[str, int]:
    """aten ops of one decode step: in all, and without views."""
    cache, (token,) = decode_inputs(model, context, static, device)
    with OpCounter() as counter:
        model(token, cache=cache)
    return {"total": counter.total, "compute": counter.total - counter.views}


def baseline_op_count(src: str, args: argparse.Namespace) -> dict[str, int]:
    """:func:`decode_op_count` of the dynamic cache of the checkout at ``src``, run with its modules in a
    subprocess."""
    command = [
        sys.executable,
        __file__,
        "--size",
        args.size,
        "--dtype",
        args.dtype,
        "--device",
        args.device,
        "--threads",
        str(args.threads),
        "--contexts",
        str(min(args.contexts)),
        "--op-count-only",
    ]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def kernel_count(step, token: torch.Tensor, cache) -> int:
    """Kernels one call of ``step`` runs, by torch.profiler: inductor's fused kernels and top-level aten ops,
    allocations and views excluded (the counterpart of :func:`decode_op_count`'s non-view count)."""
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
    )
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step(input_ids=token, cache=cache)
    count = 0
    for event in prof.events():
        name = event.name
        fused = "cpp_fused" in name or "triton_" in name
        top_level_aten = name.startswith("aten::") and (
            event.cpu_parent is None or not event.cpu_parent.name.startswith("aten::")
        )
        count += fused or (top_level_aten and name not in skip)
    return count


@torch.no_grad()
def compiled_decode(model: nn.Module, context: int, steps: int, mode: str, device: str) -> dict[str, float]:
    """Seconds per static-cache decode step, eager and compiled (after the compilation), and the compiled
    step's kernels."""
    import torch._inductor.config as inductor_config

    inductor_config.cpp.enable_kernel_profile = True  # name each fused CPU kernel in the profiler
    compiled = torch.compile(model.forward, fullgraph=True, mode=mode)
    seconds = {}
    for name, step in (("eager", model.forward), ("compiled", compiled)):
        cache, tokens = decode_inputs(model, context, True, device, steps + 2)
        step(input_ids=tokens[0], cache=cache)  # compiles (the compiled step), warms up
        step(input_ids=tokens[1], cache=cache)
        times = []
        for token in tokens[2:]:
            start = synchronized(device)
            step(input_ids=token, cache=cache)
            times.append(synchronized(device) - start)
        seconds[name] = statistics.median(times)
    cache, tokens = decode_inputs(model, context, True, device, 2)
    compiled(input_ids=tokens[0], cache=cache)
    seconds["kernels"] = kernel_count(compiled, tokens[1], cache)
    return seconds


def cached_against_recompute(model: DeepseekV41ForCausalLM, args: argparse.Namespace) -> None:
    measure(model, [32], 4, 1, args.device)  # warm-up
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


def print_compiled_decode(model: nn.Module, context: int, eager_ops: int, args: argparse.Namespace) -> None:
    print(f"\n## compiled static decode step (torch.compile fullgraph, mode {args.compile_mode!r}, context {context})")
    result = compiled_decode(model, context, args.steps, args.compile_mode, args.device)
    print(
        f"eager {1 / result['eager']:.1f} tok/s, compiled {1 / result['compiled']:.1f} tok/s "
        f"(compiled ÷ eager time {result['compiled'] / result['eager']:.2f}×)"
    )
    print(
        f"kernels per step: compiled {result['kernels']}, eager non-view ops {eager_ops} "
        f"({result['kernels'] / eager_ops:.2f}×)"
    )


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
    parser.add_argument("--baseline-src", help="a checkout whose dynamic-cache decode step ops are the baseline")
    parser.add_argument("--compile", action="store_true", help="also time and count the compiled static decode step")
    parser.add_argument(
        "--compile-mode", default="reduce-overhead", help="torch.compile mode (CUDA graphs by default)"
    )
    parser.add_argument("--greedy-only", action="store_true", help="only the greedy generate comparison (at --batch)")
    parser.add_argument("--compile-only", action="store_true", help="only the compiled decode step vs eager")
    parser.add_argument("--op-count-only", action="store_true", help=argparse.SUPPRESS)  # --baseline-src's subprocess
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    hf_logging.set_verbosity_error()  # V4's YaRN check warns about the small original_max_position_embeddings
    if args.op_count_only:
        torch.manual_seed(0)
        model = (
            build_ours(engram=args.size == "tiny", size=args.size).eval().to(args.device, getattr(torch, args.dtype))
        )
        print(json.dumps(decode_op_count(model, min(args.contexts), False, args.device)))
        return
    model, theirs = build(args.size, args.device, getattr(torch, args.dtype))
    print(f"size {args.size}, {args.dtype}, {args.device}, {args.threads} threads, torch {torch.__version__}")
    if args.compile_only:
        context = min(args.contexts)
        print_compiled_decode(model, context, decode_op_count(model, context, True, args.device)["compute"], args)
        return
    if not args.greedy_only:
        cached_against_recompute(model, args)

    models = {"ours": model, "transformers V4": theirs}
    print(f"\n## greedy generate, batch {args.batch}, {args.steps} decoded tokens: tokens/s per row")
    print(f"{'context':>8} {'ours tok/s':>11} {'V4 tok/s':>10} {'ours ÷ V4 (time)':>17}")
    for context in args.contexts:
        seconds = greedy_decode_seconds(models, context, args.batch, args.steps, args.reps, args.device)
        ours, v4 = seconds["ours"], seconds["transformers V4"]
        cells = [f"{1 / s:.1f}" if s else "out of memory" for s in (ours, v4)]
        ratio = f"{ours / v4:.2f}×" if ours and v4 else "—"
        print(f"{context:>8} {cells[0]:>11} {cells[1]:>10} {ratio:>17}")
    if args.greedy_only:
        return

    context = min(args.contexts)
    print(f"\n## aten ops of one decode step (batch 1, context {context})")
    counts = {
        "ours, dynamic cache": decode_op_count(model, context, False, args.device),
        "ours, static cache": decode_op_count(model, context, True, args.device),
    }
    if args.baseline_src:
        counts[f"baseline: {args.baseline_src}, dynamic cache"] = baseline = baseline_op_count(args.baseline_src, args)
    print(
        f"{'':<44} {'all ops':>8} {'non-view':>9}" + (f" {'÷ baseline (non-view)':>22}" if args.baseline_src else "")
    )
    for name, count in counts.items():
        ratio = f" {count['compute'] / baseline['compute']:>21.2f}×" if args.baseline_src else ""
        print(f"{name:<44} {count['total']:>8} {count['compute']:>9}{ratio}")

    if args.compile:
        print_compiled_decode(model, context, counts["ours, static cache"]["compute"], args)


if __name__ == "__main__":
    main()
