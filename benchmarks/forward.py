"""Benchmark our DeepseekV41ForCausalLM against transformers' DeepseekV4ForCausalLM, and show where our time goes.

Both models are built at the same width, depth and expert count, on ``--device`` (cpu or cuda) in ``--dtype``,
with ``torch.set_num_threads`` as on CI (2 by default). ``--size``:

- ``tiny`` (default): our ``tiny`` preset: 6 layers, width 64, 4 heads of 64, 4 routed experts top-2 + 1 shared,
  mHC ×4, window 16, vocab 512;
- ``medium``: issue 15's GPU configuration, about 510M parameters: width 1024, 8 layers, 16 heads of 128,
  32 experts top-6 (intermediate 512), window 128, index_topk 512, vocab 24576, no Engram.

From one run it reports:

- forward (eval, no_grad) and forward+backward (train, loss on the inputs) time and tokens/s of each model and
  ours ÷ transformers' time. The models are timed round-robin after a warm-up and each figure is the median
  of the repeats, so a busy machine slows both alike;
- our forward time split by component (attention incl. compressor/indexer, MoE, mHC mixes/collapse/expand,
  RMSNorms, Engram incl. hashing, vision incl. aligner, the rest) and transformers' split for comparison;
- a torch.profiler table of our top ops over one forward+backward;
- the cost of reference numerics (``config.reference_numerics``): our bf16 forward with the mode on ÷ off, in time
  and in peak resident memory added by the forward (Linux's VmHWM, reset before each measured call).

``--compile`` times the same forward+backward, then forward, with each model's decoder layers compiled (ours by
:func:`~modeling_dsv41.training.compilation.compile_blocks`, one graph per layer; transformers' V4 by
``layer.compile()``, graph breaks allowed: it declares ``_can_compile_fullgraph = False``) instead of the breakdown,
profile and reference-numerics sections: each model's compiled ÷ eager time, and ours ÷ V4 compiled.

The two are not the same architecture, so the ratio is a cost comparison, not a parity check. Differences
that matter for time: transformers' V4 has compressed layers of ratio 4 with a compressor and an indexer in
every one, ours has V4.1's ratios 2 and 1 with shared KV/index sources; V4 has no Engram and no vision, so
our default run keeps Engram (pass ``--no-engram`` to drop it) and sends text only (``--image`` adds one
image per row to the breakdown, ours only).

Usage: ``python benchmarks/forward.py [--size tiny|medium] [--device cpu|cuda] [--dtype float32|bfloat16]
[--batch 2] [--seq 256] [--reps 7] [--threads 2] [--no-engram] [--image] [--compile]``
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import re
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from torch import nn
from transformers import DeepseekV4Config, DeepseekV4ForCausalLM
from transformers.utils import logging as hf_logging

import modeling_dsv41  # noqa: F401  (registers the Auto classes)
from configuration import DeepseekV41Config
from modeling_dsv41 import DeepseekV41ForCausalLM
from modeling_dsv41.training.compilation import compile_blocks

# one image whose ViT grid is 9×13 patches → a 3×5 LM token grid: start + 3 × (5 image + newline) + end
IMAGE_VIT_GRID = (9, 13)
IMAGE_SPAN_TYPES = [0] + ([1] * 5 + [2]) * 3 + [3]

NO_ENGRAM = {"engram_layer_ids": [], "engram_num_embeddings": []}
# text_config overrides of the tiny preset (its small ViT stays: it is only run with --image)
SIZES = {
    "tiny": {},
    "medium": NO_ENGRAM
    | {
        "vocab_size": 24576,
        "hidden_size": 1024,
        "num_hidden_layers": 8,
        "num_attention_heads": 16,
        "head_dim": 128,
        "qk_rope_head_dim": 64,
        "q_lora_rank": 512,
        "o_groups": 4,
        "o_lora_rank": 512,
        "moe_intermediate_size": 512,
        "n_routed_experts": 32,
        "num_experts_per_tok": 6,
        "sliding_window": 128,
        "compress_ratios": [0, 2, 2, 2, 1, 1, 1, 0],
        "kv_source_layer_ids": [1, 4],
        "index_source_layer_ids": [1, 4, 6],
        "index_n_heads": 16,
        "index_head_dim": 64,
        "index_topk": 512,
        "candidate_source_layer_id": 4,
        "candidate_topk_blocks": 256,
        "candidate_block_size": 8,
        "compress_rope_scaling": {
            "rope_type": "yarn",
            "factor": 4,
            "beta_fast": 32,
            "beta_slow": 1,
            "original_max_position_embeddings": 4096,
        },
    },
}


def build_ours(engram: bool, size: str = "tiny", **text_overrides) -> DeepseekV41ForCausalLM:
    """Ours at ``size``; ``text_overrides`` change further text_config fields (e.g. ``query_chunk_size``)."""
    overrides = SIZES[size] | ({} if engram else NO_ENGRAM) | text_overrides
    config = DeepseekV41Config.from_preset("tiny")
    if overrides:
        config = DeepseekV41Config.from_preset("tiny", text_config=config.text_config.to_dict() | overrides)
    model = DeepseekV41ForCausalLM(config)
    if model.model.engram_hasher is not None:
        # a stand-in for the tokenizer's compressed map (the fixture's stub tokenizer has id // 2)
        model.model.engram_hasher.token_map.copy_(torch.arange(config.text_config.vocab_size) // 2)
    return model


def build_transformers_v4(ours: DeepseekV41ForCausalLM, use_cache: bool = False) -> DeepseekV4ForCausalLM:
    """transformers' V4 at our width, depth, heads and experts; compressed layers become its CSA (ratio 4)."""
    t = ours.config.text_config
    config = DeepseekV4Config(
        vocab_size=t.vocab_size,
        hidden_size=t.hidden_size,
        moe_intermediate_size=t.moe_intermediate_size,
        num_hidden_layers=t.num_hidden_layers,
        num_attention_heads=t.num_attention_heads,
        num_key_value_heads=1,
        head_dim=t.head_dim,
        partial_rotary_factor=t.qk_rope_head_dim / t.head_dim,
        q_lora_rank=t.q_lora_rank,
        o_groups=t.o_groups,
        o_lora_rank=t.o_lora_rank,
        n_routed_experts=t.n_routed_experts,
        n_shared_experts=1,
        num_experts_per_tok=t.num_experts_per_tok,
        scoring_func=t.scoring_func,
        routed_scaling_factor=t.routed_scaling_factor,
        swiglu_limit=t.swiglu_limit,
        sliding_window=t.sliding_window,
        index_n_heads=t.index_n_heads,
        index_head_dim=t.index_head_dim,
        index_topk=t.index_topk,
        hc_mult=t.hc_mult,
        hc_sinkhorn_iters=t.hc_sinkhorn_iters,
        hc_eps=t.hc_eps,
        layer_types=["compressed_sparse_attention" if r else "sliding_attention" for r in t.compress_ratios],
        mlp_layer_types=["moe"] * t.num_hidden_layers,  # no hash routing: ours has none either
        rope_theta=t.rope_theta,
        compress_rope_theta=t.compress_rope_theta,
        rope_parameters=dict(t.compress_rope_scaling),
        num_nextn_predict_layers=0,
        pad_token_id=t.pad_token_id,
        use_cache=use_cache,
    )
    return DeepseekV4ForCausalLM(config)


def as_loaded(model: nn.Module, device: torch.device | str, dtype: torch.dtype) -> nn.Module:
    """``model`` on ``device`` in ``dtype`` as ``from_pretrained(dtype=...)`` leaves it: the modules a model keeps in
    fp32 (``_keep_in_fp32_modules_strict``: ours mHC, sinks, router biases, LM head...; V4's likewise) stay fp32."""
    model.to(device, dtype)
    keep = getattr(model, "_keep_in_fp32_modules_strict", None)
    if keep and dtype in (torch.float16, torch.bfloat16):
        pattern = re.compile(r"(?:^|\.)(?:" + "|".join(map(re.escape, keep)) + r")(?:\.|$)")
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
            if pattern.search(name) and tensor.is_floating_point():
                tensor.data = tensor.data.float()
    return model


def make_inputs(model: DeepseekV41ForCausalLM, batch: int, seq: int, image: bool, seed: int = 0) -> dict:
    generator = torch.Generator().manual_seed(seed)
    vocab = model.config.text_config.vocab_size
    input_ids = torch.randint(0, vocab - 16, (batch, seq), generator=generator)  # clear of special ids
    inputs = {"input_ids": input_ids}
    if image:
        vision = model.config.vision_config
        types = torch.full((batch, seq), -1)
        start = 20
        types[:, start : start + len(IMAGE_SPAN_TYPES)] = torch.tensor(IMAGE_SPAN_TYPES)
        input_ids[types >= 0] = model.config.image_token_id
        patches = IMAGE_VIT_GRID[0] * IMAGE_VIT_GRID[1] * batch
        p = vision.patch_size
        inputs |= {
            "pixel_values": torch.randn(patches, vision.num_channels, p, p, generator=generator),
            "image_grid_hw": torch.tensor([IMAGE_VIT_GRID] * batch),
            "image_token_types": types,
        }
    return inputs


def forward_only(model: nn.Module, inputs: dict) -> None:
    model.eval()
    with torch.no_grad():
        model(**inputs)


def forward_backward(model: nn.Module, inputs: dict) -> None:
    model.train()
    model.zero_grad(set_to_none=True)
    model(**inputs, labels=inputs["input_ids"]).loss.backward()


def device_clock(device: torch.device) -> Callable[[], float]:
    """``time.perf_counter`` after the device's queued work is done (CUDA runs asynchronously)."""
    if device.type != "cuda":
        return time.perf_counter

    def clock() -> float:
        torch.cuda.synchronize(device)
        return time.perf_counter()

    return clock


def median_times(
    models: dict[str, nn.Module],
    inputs: dict[str, dict],
    step: Callable,
    warmup: int,
    reps: int,
    clock: Callable[[], float] = time.perf_counter,
) -> dict[str, float]:
    """Median seconds per ``step`` for each model, timed round-robin so machine noise hits all alike."""
    for _ in range(warmup):
        for name, model in models.items():
            step(model, inputs[name])
    samples: dict[str, list[float]] = defaultdict(list)
    for _ in range(reps):
        for name, model in models.items():
            start = clock()
            step(model, inputs[name])
            samples[name].append(clock() - start)
    return {name: statistics.median(s) for name, s in samples.items()}


@contextlib.contextmanager
def timed_calls(
    targets: dict[str, list[tuple[object, str]]], clock: Callable[[], float] = time.perf_counter
) -> Iterator[dict[str, float]]:
    """Wrap each ``getattr(obj, attr)`` so its wall time adds to its component's total (targets must not nest)."""
    totals: dict[str, float] = defaultdict(float)
    patched = []

    def wrap(component: str, fn: Callable) -> Callable:
        @functools.wraps(fn)
        def timed(*args, **kwargs):
            start = clock()
            try:
                return fn(*args, **kwargs)
            finally:
                totals[component] += clock() - start

        return timed

    for component, calls in targets.items():
        for obj, attr in calls:
            patched.append((obj, attr, vars(obj).get(attr)))
            setattr(obj, attr, wrap(component, getattr(obj, attr)))
    try:
        yield totals
    finally:
        for obj, attr, own in reversed(patched):
            if own is None:
                delattr(obj, attr)  # back to the class's method
            else:
                setattr(obj, attr, own)


def peak_rss_added(step: Callable[[], None]) -> int:
    """Bytes of resident memory the process peaks at during ``step`` above where it started (Linux only: resets
    the high-water mark through /proc/self/clear_refs, then reads VmHWM)."""

    def status_kib(field: str) -> int:
        with open("/proc/self/status") as status:
            return next(int(line.split()[1]) for line in status if line.startswith(field + ":"))

    before = status_kib("VmRSS")
    with open("/proc/self/clear_refs", "w") as handle:
        handle.write("5")
    step()
    return (status_kib("VmHWM") - before) * 1024


def numerics_peak_in_this_process(reference: bool, size: str, engram: bool, batch: int, seq: int) -> int:
    """Peak RSS added by one bf16 CPU forward of ours, reference numerics ``reference``, after a warm-up."""
    torch.manual_seed(0)
    torch.set_num_threads(2)
    model = build_ours(engram, size).to(torch.bfloat16).eval()
    model.config.reference_numerics = reference
    inputs = make_inputs(model, batch, seq, image=False) | {"use_cache": False}
    forward_only(model, inputs)
    return peak_rss_added(lambda: forward_only(model, inputs))


def numerics_peak_bytes(reference: bool, size: str, engram: bool, batch: int, seq: int) -> int:
    """:func:`numerics_peak_in_this_process` in a fresh interpreter with glibc's mmap threshold at 64 KiB, so that
    every large tensor is its own mapping, returned when freed: the peak is that of live tensors, not of what an
    earlier measurement left in the heap."""
    repo = Path(__file__).resolve().parents[1]
    env = os.environ | {"MALLOC_MMAP_THRESHOLD_": "65536", "PYTHONPATH": str(repo)}
    code = (
        f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); from forward import "
        f"numerics_peak_in_this_process as m; print(m({reference}, {size!r}, {engram}, {batch}, {seq}))"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=repo, env=env, capture_output=True, text=True, check=True)
    return int(done.stdout.split()[-1])


def reference_numerics_cost(model: DeepseekV41ForCausalLM, inputs: dict, args: argparse.Namespace) -> None:
    """Forward time and peak memory of ``model`` in bf16 with reference numerics on ÷ off.

    Time: round-robin medians on ``model`` itself. Memory: on CUDA, torch's peak allocation; on CPU, the peak RSS
    rise in a fresh process per mode (median of 3), since an in-process high-water mark sees heap reuse."""
    model = model.to(torch.bfloat16).eval()
    inputs = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in inputs.items() if torch.is_tensor(v)}
    inputs["use_cache"] = False
    modes = {"off": False, "on": True}

    def forward(mode: str) -> None:
        model.config.reference_numerics = modes[mode]
        forward_only(model, inputs)

    times = median_times(
        {m: m for m in modes}, {m: None for m in modes}, lambda m, _: forward(m), args.warmup, args.reps
    )
    device = next(model.parameters()).device
    if device.type == "cuda":
        peaks = {}
        for mode in modes:
            forward(mode)
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            base = torch.cuda.memory_allocated(device)
            forward(mode)
            peaks[mode] = torch.cuda.max_memory_allocated(device) - base
        where = "CUDA peak allocation"
    else:
        peaks = {
            mode: statistics.median(
                numerics_peak_bytes(on, args.size, not args.no_engram, args.batch, args.seq) for _ in range(3)
            )
            for mode, on in modes.items()
        }
        where = "peak RSS rise, fresh process per mode, median of 3"
    model.config.reference_numerics = False
    print("\n## Reference numerics (bf16 forward): on ÷ off")
    print(f"time: {times['on'] * 1e3:.1f} ms ÷ {times['off'] * 1e3:.1f} ms = {times['on'] / times['off']:.2f}×")
    print(
        f"peak memory added by the forward ({where}): {peaks['on'] / 2**20:.1f} MiB ÷ "
        f"{peaks['off'] / 2**20:.1f} MiB = {peaks['on'] / max(peaks['off'], 1):.2f}×"
    )


def our_components(model: DeepseekV41ForCausalLM) -> dict[str, list[tuple[object, str]]]:
    targets: dict[str, list[tuple[object, str]]] = defaultdict(list)
    for layer in model.model.layers:
        targets["attention (+compressor, indexer)"].append((layer.attn, "forward"))
        targets["MoE (gate, experts, shared)"].append((layer.ffn, "forward"))
        targets["mHC (mixes+Sinkhorn, collapse, expand)"] += [(layer.hc, a) for a in ("mixes", "collapse", "expand")]
        targets["RMSNorm (attn_norm, ffn_norm)"] += [(layer.attn_norm, "forward"), (layer.ffn_norm, "forward")]
        if layer.engram is not None:
            targets["Engram (hashing, block)"].append((layer.engram, "forward"))
    if model.model.engram_hasher is not None:
        targets["Engram (hashing, block)"].append((model.model.engram_hasher, "forward"))
    if model.config.has_vision:
        targets["vision (ViT, aligner)"] += [(model.model.vision, "forward"), (model.model.aligner, "forward")]
    return targets


def v4_components(model: DeepseekV4ForCausalLM) -> dict[str, list[tuple[object, str]]]:
    targets: dict[str, list[tuple[object, str]]] = defaultdict(list)
    for layer in model.model.layers:
        targets["attention (+compressor, indexer)"].append((layer.self_attn, "forward"))
        targets["MoE (gate, experts, shared)"].append((layer.mlp, "forward"))
        targets["mHC (mixes+Sinkhorn, collapse; expand inline)"] += [
            (layer.attn_hc, "forward"),
            (layer.ffn_hc, "forward"),
        ]
        targets["RMSNorm (attn_norm, ffn_norm)"] += [
            (layer.input_layernorm, "forward"),
            (layer.post_attention_layernorm, "forward"),
        ]
    return targets


REST = "rest (embed, rotary, hash/pad prep, final norm, head)"


def component_times(
    model: nn.Module, inputs: dict, targets: dict, reps: int, clock: Callable[[], float] = time.perf_counter
) -> tuple[dict[str, float], float]:
    """Median forward seconds per component, of the rest and of the whole forward (eval mode, no_grad)."""
    samples: dict[str, list[float]] = defaultdict(list)
    totals = []
    forward_only(model, inputs)  # warm-up
    for _ in range(reps):
        with timed_calls(targets, clock) as spent:
            start = clock()
            forward_only(model, inputs)
            totals.append(clock() - start)
        for component in targets:
            samples[component].append(spent[component])
        samples[REST].append(totals[-1] - sum(spent.values()))
    return {c: statistics.median(s) for c, s in samples.items()}, statistics.median(totals)


def print_components(label: str, parts: dict[str, float], total: float) -> None:
    print(f"\n## Where the forward goes: {label} (median, eval, no_grad)")
    print(f"{'component':<56}{'ms':>9}{'share':>8}")
    for component, seconds in sorted(parts.items(), key=lambda kv: (kv[0] == REST, -kv[1])):
        print(f"{component:<56}{seconds * 1e3:>9.1f}{seconds / total:>8.1%}")
    print(f"{'total':<56}{total * 1e3:>9.1f}")


def compile_layers(model: nn.Module) -> None:
    """Compile ``model``'s decoder layers in place (lazily: each compiles at its first call)."""
    if isinstance(model, DeepseekV41ForCausalLM):
        compile_blocks(model)
    else:
        for layer in model.model.layers:
            layer.compile()


def print_times(models: dict[str, nn.Module], results: dict[str, dict[str, float]], tokens: int) -> None:
    print(f"\n{'model':<38}{'fwd ms':>10}{'fwd tok/s':>11}{'fwd+bwd ms':>12}{'fwd+bwd tok/s':>15}")
    for name in models:
        fwd, both = results["forward"][name], results["forward+backward"][name]
        print(f"{name:<38}{fwd * 1e3:>10.1f}{tokens / fwd:>11,.0f}{both * 1e3:>12.1f}{tokens / both:>15,.0f}")
    ours_name, theirs_name = models
    for kind, times in results.items():
        print(f"{kind}: ours ÷ transformers V4 (time) = {times[ours_name] / times[theirs_name]:.2f}×")


def compiled_times(
    models: dict[str, nn.Module],
    inputs: dict[str, dict],
    eager: dict[str, dict[str, float]],
    args: argparse.Namespace,
    clock: Callable[[], float],
) -> None:
    """The forward+backward, then the forward, again with the decoder layers compiled: times, compiled ÷ eager, ours ÷
    V4. Each row is printed as soon as it is measured (compiling takes minutes on a GPU: a run stopped by its time
    limit keeps what it printed), the training graphs first. The first call of each compiles; its time is reported."""
    for model in models.values():
        compile_layers(model)
    tokens = args.batch * args.seq
    ours_name, theirs_name = models
    for kind, step in (("forward+backward", forward_backward), ("forward", forward_only)):
        print(
            f"\n## {kind}, decoder layers compiled\n{'model':<38}{'compile s':>10}{'ms':>10}{'tok/s':>10}"
            f"{'compiled ÷ eager':>18}"
        )
        times = {}
        for name, model in models.items():
            start = clock()
            step(model, inputs[name])
            compile_s = clock() - start
            times[name] = median_times({name: model}, inputs, step, args.warmup, args.reps, clock)[name]
            print(
                f"{name:<38}{compile_s:>10.1f}{times[name] * 1e3:>10.1f}{tokens / times[name]:>10,.0f}"
                f"{times[name] / eager[kind][name]:>17.2f}×",
                flush=True,
            )
        print(f"{kind}, compiled: ours ÷ transformers V4 (time) = {times[ours_name] / times[theirs_name]:.2f}×")


def to_device(inputs: dict, device: torch.device, dtype: torch.dtype) -> dict:
    """Inputs on ``device``; floating ones (pixels) in the models' ``dtype``."""
    return {k: v.to(device, dtype) if v.is_floating_point() else v.to(device) for k, v in inputs.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="tiny")
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2, help="torch.set_num_threads; CI uses 2")
    parser.add_argument(
        "--no-engram", action="store_true", help="drop Engram from ours (V4 has none; medium has none)"
    )
    parser.add_argument("--image", action="store_true", help="one image per row in our breakdown (ours only)")
    parser.add_argument("--profile-rows", type=int, default=20)
    parser.add_argument("--compile", action="store_true", help="time both models again with their layers compiled")
    args = parser.parse_args()

    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    clock = device_clock(device)
    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    hf_logging.set_verbosity_error()  # V4's YaRN check warns about the tiny original_max_position_embeddings
    ours = build_ours(engram=not args.no_engram, size=args.size)
    theirs = build_transformers_v4(ours)
    ours, theirs = as_loaded(ours, device, dtype), as_loaded(theirs, device, dtype)
    text_inputs = to_device(make_inputs(ours, args.batch, args.seq, image=False), device, dtype)
    models = {"ours (DeepseekV41ForCausalLM)": ours, "transformers DeepseekV4ForCausalLM": theirs}
    no_cache = text_inputs | {"use_cache": False}  # full-sequence forwards: neither model builds a decode cache
    inputs = {"ours (DeepseekV41ForCausalLM)": no_cache, "transformers DeepseekV4ForCausalLM": no_cache}
    n_params = {name: sum(p.numel() for p in m.parameters()) for name, m in models.items()}

    where = (
        f"CUDA ({torch.cuda.get_device_name(device)})"
        if device.type == "cuda"
        else (f"CPU, torch.set_num_threads({torch.get_num_threads()})")
    )
    print(
        f"# Forward benchmark, size {args.size}: batch {args.batch} × {args.seq} tokens, {args.dtype}, {where}, "
        f"torch {torch.__version__}; median of {args.reps} round-robin repeats after {args.warmup} warm-up; "
        f"ours with Engram: {ours.model.engram_hasher is not None}"
    )
    results = {
        "forward": median_times(models, inputs, forward_only, args.warmup, args.reps, clock),
        "forward+backward": median_times(models, inputs, forward_backward, args.warmup, args.reps, clock),
    }
    ours_name, theirs_name = models
    print("parameters: " + ", ".join(f"{name} {n:,}" for name, n in n_params.items()))
    print_times(models, results, args.batch * args.seq)
    if args.compile:
        compiled_times(models, inputs, results, args, clock)
        return

    our_inputs = to_device(make_inputs(ours, args.batch, args.seq, image=args.image), device, dtype) | {
        "use_cache": False
    }
    parts, total = component_times(ours, our_inputs, our_components(ours), args.reps, clock)
    print_components("ours" + (" (one image per row)" if args.image else ""), parts, total)
    parts, total = component_times(theirs, inputs[theirs_name], v4_components(theirs), args.reps, clock)
    print_components("transformers V4", parts, total)

    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    forward_backward(ours, our_inputs)
    with torch.profiler.profile(activities=activities) as prof:
        forward_backward(ours, our_inputs)
        clock()
    sort_by = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    print(f"\n## Our top ops over one forward+backward (torch.profiler, {sort_by})")
    print(prof.key_averages().table(sort_by=sort_by, row_limit=args.profile_rows))

    reference_numerics_cost(ours, no_cache, args)


if __name__ == "__main__":
    main()
