"""Peak memory of one forward pass against sequence length: chunked queries vs the whole sequence at once.

What is measured, over one no-grad forward at batch 1 (``use_cache=False``, logits of the last token only):

- ``--device cpu`` (default): the rise of the process's peak resident set (``VmHWM``, reset through
  ``/proc/self/clear_refs``), each forward in a fresh subprocess with glibc's mmap threshold pinned at 64 KiB, so
  that every large torch CPU tensor is its own mapping, returned to the system when freed, and the peak is that of
  the live tensors (the interpreter, torch and the model are resident before the reset and not counted). Linux only.
- ``--device cuda``: the rise of ``torch.cuda.max_memory_allocated`` over the memory allocated before the forward
  (the weights), in this process after a short warm-up forward, and the whole peak (weights included) against the
  device's memory. A configuration that runs out of memory is reported as such.

Configurations, both in the same run:

- ``chunked``: the config's ``query_chunk_size`` (the indexer's scores, top-k and attention per query chunk);
- ``whole sequence`` (baseline): ``query_chunk_size`` = S, as before chunking: the indexer's [S, heads, S / ratio]
  scores exist at once, so memory grows quadratically. Skipped above ``--baseline-max-seq`` (it measured 51.8 GiB
  at S=32768 for the medium model on an H200, so 4× that at 65536).

``--size``:

- ``small`` (default): a 3-layer text model at width 64 (window 16; layers 1-2 ratio 4, layer 1 KV, index and
  candidate source, layer 2 an indexer inside its candidates; 2 index heads of 32, index_topk 64), no Engram;
- ``medium``: issue 15's ~505M configuration (benchmarks/forward.py's ``SIZES["medium"]``, no Engram), for the GPU.

The target is peak(16384) ≤ 4.5 × peak(4096) for the chunked pass (4× is linear) on CPU; on one H200, the medium
model's S=131072 forward fits.

Usage: ``python benchmarks/memory.py [--size small|medium] [--device cpu|cuda] [--dtype float32|bfloat16]
[--seqs 4096 16384] [--chunk 1024] [--no-baseline] [--baseline-max-seq 32768]``

``--train``: a training step instead (bf16, every parameter trainable, gradient checkpointing on), at two sequence
lengths (``--seqs``, default 1024 2048 on CPU), with the sparse attention's recomputing backward against the baseline
in the same run, autograd of the same forward (``sink_attention_forward``: it keeps every block's fp32 keys and
probabilities). The model is benchmarks/loading.py's released-format stand-in (4 layers, width 768, 8 heads of 128,
64 experts; built in bf16 here, not loaded natively). Per case:

- ``attention saved``: the bytes every sparse-attention call of one forward keeps for its backward
  (``saved_tensors_hooks``, each storage once), per decoder layer. Goal: recomputing ≤ 0.2 × autograd;
- ``layer peak`` / ``layer time``: one decoder layer's forward and backward (its inputs captured from the model, the
  gradient of its outputs ones), the peak of the tensor bytes allocated inside it that are alive at once (on CPU a
  ``TorchDispatchMode`` counting storages as they are made and freed: the allocator's own slack is not counted; on
  CUDA ``torch.cuda.max_memory_allocated`` over the step) and its time;
- ``step peak`` / ``step time``: the same for the whole model's step (forward, loss, backward).

Times are medians of ``--reps`` runs after a warm-up: on CPU this process's CPU time with one thread (the machine is
shared: wall clock is not), on CUDA the wall clock between synchronizations. Goal: step time ≤ 1.15 × autograd's.
On CUDA the step is also run with the checkpointed inputs offloaded to host memory (``offload_checkpointed_inputs``).

``python benchmarks/memory.py --train [--device cpu|cuda] [--seqs 1024 2048] [--reps 3] [--threads 1]``
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import statistics
import subprocess
import sys
import time
import weakref
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def memory_config(chunk: int | None = None):
    """The ``small`` text model; ``chunk`` sets ``query_chunk_size`` (None: the config's default)."""
    from configuration import DeepseekV41Config

    text = {
        "vocab_size": 512,
        "hidden_size": 64,
        "moe_intermediate_size": 32,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "head_dim": 64,
        "qk_rope_head_dim": 16,
        "q_lora_rank": 32,
        "o_groups": 2,
        "o_lora_rank": 32,
        "n_routed_experts": 4,
        "num_experts_per_tok": 2,
        "sliding_window": 16,
        "compress_ratios": [0, 4, 4],
        "kv_source_layer_ids": [1],
        "index_source_layer_ids": [1, 2],
        "index_n_heads": 2,
        "index_head_dim": 32,
        "index_topk": 64,
        "candidate_source_layer_id": 1,
        "candidate_topk_blocks": 32,
        "candidate_block_size": 4,
        "engram_layer_ids": [],
        "engram_num_embeddings": [],
        "num_nextn_predict_layers": 0,
        "compress_rope_scaling": {
            "rope_type": "yarn",
            "factor": 4,
            "beta_fast": 32,
            "beta_slow": 1,
            "original_max_position_embeddings": 32,
        },
    }
    if chunk is not None:
        text["query_chunk_size"] = chunk
    return DeepseekV41Config(text_config=text, vision_config=None)


def build_model(size: str, chunk: int | None = None):
    """The ``small`` or ``medium`` model (random weights, seed 0) with ``query_chunk_size`` = ``chunk`` (None: the
    config's default), in eval mode."""
    from modeling_dsv41 import DeepseekV41ForCausalLM

    torch.manual_seed(0)
    if size == "small":
        return DeepseekV41ForCausalLM(memory_config(chunk)).eval()
    sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling forward.py, however this runs
    from forward import build_ours

    return build_ours(engram=False, size=size, **({} if chunk is None else {"query_chunk_size": chunk})).eval()


def default_chunk(size: str) -> int:
    if size == "small":
        return memory_config().text_config.query_chunk_size
    from configuration import DeepseekV41TextConfig

    return DeepseekV41TextConfig().query_chunk_size  # forward.py's medium size keeps the default


def forward_once(model, seq: int) -> None:
    """One no-grad forward of ``seq`` tokens at batch 1 (the part both measurements share)."""
    device = next(model.parameters()).device
    ids = torch.randint(3, 500, (1, seq), generator=torch.Generator().manual_seed(0)).to(device)
    with torch.no_grad():
        model(ids, use_cache=False, logits_to_keep=1)


def peak_rss_bytes() -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmHWM:"))


def current_rss_bytes() -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmRSS:"))


def measure_in_this_process(seq: int, chunk: int, size: str = "small", dtype: str = "float32") -> int:
    """Bytes the peak RSS rises by over one forward of ``seq`` tokens (after a short warm-up forward)."""
    torch.set_num_threads(int(os.environ.get("DSV41_THREADS", "2")))
    model = build_model(size, chunk).to(getattr(torch, dtype))
    forward_once(model, 256)  # warm-up: lazy inits, thread pools
    with open("/proc/self/clear_refs", "w") as clear:
        clear.write("5")  # reset VmHWM to the current RSS
    before = current_rss_bytes()
    forward_once(model, seq)
    return peak_rss_bytes() - before


def peak_forward_bytes(seq: int, chunk: int, size: str = "small", dtype: str = "float32") -> int:
    """:func:`measure_in_this_process` in a fresh interpreter, so no earlier allocation is already resident."""
    env = os.environ | {"MALLOC_MMAP_THRESHOLD_": "65536", "PYTHONPATH": str(REPO)}
    code = f"from benchmarks.memory import measure_in_this_process as m; print(m({seq}, {chunk}, {size!r}, {dtype!r}))"
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, check=True)
    return int(done.stdout.split()[-1])


def cuda_peak_bytes(model, seq: int) -> tuple[int, int] | None:
    """(rise of ``torch.cuda.max_memory_allocated`` over the allocation before the forward, the whole peak) over one
    forward of ``seq`` tokens of ``model`` (on a CUDA device, warmed up); None if it ran out of memory."""
    device = next(model.parameters()).device
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    try:
        forward_once(model, seq)
        torch.cuda.synchronize(device)
    except torch.cuda.OutOfMemoryError:
        return None
    finally:
        torch.cuda.empty_cache()
    peak = torch.cuda.max_memory_allocated(device)
    return peak - before, peak


def cuda_runs(size: str, dtype: str, device: str, runs: dict, seqs: list[int]) -> dict[str, list]:
    """:func:`cuda_peak_bytes` of each run's model (built once per run: ``query_chunk_size`` is read at
    construction) at each of ``seqs`` (None where the run skips that length)."""
    results = {}
    for name, chunk_of in runs.items():
        peaks, model = [], None
        for seq in seqs:
            chunk = chunk_of(seq)
            if chunk is None:
                peaks.append(None)
                continue
            if model is None or model.config.text_config.query_chunk_size != chunk:
                del model
                model = build_model(size, chunk).to(device, getattr(torch, dtype))
                forward_once(model, 256)  # warm-up: cuBLAS workspaces, lazy inits
            peaks.append(cuda_peak_bytes(model, seq) or "out of memory")
        results[name] = peaks
        del model
    return results


class LiveTensorBytes(TorchDispatchMode):
    """Bytes of the tensor storages made inside the mode (any device) that are alive: now (``live``) and at most
    (``peak``). A storage counts from the op that makes it (not a view of, nor an op writing into, a tensor it is
    given) until it is freed."""

    def __init__(self) -> None:
        super().__init__()
        self.live = self.peak = 0
        self._storages: dict[int, weakref.ref] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        given = {
            t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)
        }
        for tensor in tree_flatten(out)[0]:
            if not isinstance(tensor, torch.Tensor):
                continue
            storage = tensor.untyped_storage()
            pointer = storage.data_ptr()
            if pointer and pointer not in given and pointer not in self._storages:
                size = storage.nbytes()
                self.live += size
                self.peak = max(self.peak, self.live)
                self._storages[pointer] = weakref.ref(storage, functools.partial(self._freed, pointer, size))
        return out

    def _freed(self, pointer: int, size: int, _ref) -> None:
        self.live -= size
        self._storages.pop(pointer, None)


def autograd_sink_attention(q, kv, slots, sink, scale):
    """The baseline: autograd of the sparse attention's forward, which keeps every block's keys and probabilities."""
    from modeling_dsv41.sparse_attention import sink_attention_forward

    return sink_attention_forward(q, kv, slots, sink, scale)[0]


def training_stand_in(device: str):
    """benchmarks/loading.py's released-format stand-in in bf16 (seed 0), in training mode, gradient checkpointing
    on."""
    from benchmarks.loading import STAND_IN
    from configuration import DeepseekV41Config
    from modeling_dsv41 import DeepseekV41ForCausalLM

    torch.manual_seed(0)
    text = {**STAND_IN, "engram_table_dtype": "float", "emulate_quantization": False}
    model = DeepseekV41ForCausalLM(DeepseekV41Config(text_config=text, vision_config=None))
    model = model.to(device, torch.bfloat16).train()
    model.activation_checkpointing_enable()
    return model


def _clock(device: str):
    if device == "cpu":
        return time.process_time

    def wall() -> float:
        torch.cuda.synchronize(device)
        return time.perf_counter()

    return wall


def _measure(run, device: str, reps: int) -> tuple[int, float]:
    """(peak bytes, median seconds) of ``run()``: the peak from one more run, tracked."""
    clock = _clock(device)
    run()  # warm-up
    seconds = []
    for _ in range(reps):
        start = clock()
        run()
        seconds.append(clock() - start)
    if device == "cpu":
        with LiveTensorBytes() as tracker:
            run()
        peak = tracker.peak
    else:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        run()
        peak = torch.cuda.max_memory_allocated(device) - before
    return peak, statistics.median(seconds)


def attention_saved_per_layer(model, ids) -> float:
    """Bytes the sparse-attention calls of one forward keep for their backward, per decoder layer."""
    from modeling_dsv41 import attention

    storages: dict[int, int] = {}
    original = attention.sink_attention

    def counted(*args):
        def pack(tensor):
            storages[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            return original(*args)

    attention.sink_attention = counted
    try:
        with _checkpointing(model, False):  # the layers' own saved tensors, not only their inputs
            model(ids, labels=ids).loss.backward()
    finally:
        attention.sink_attention = original
    model.zero_grad(set_to_none=True)
    return sum(storages.values()) / model.config.text_config.num_hidden_layers


@contextlib.contextmanager
def _checkpointing(model, enabled: bool):
    """The decoder layers checkpointed (or not) inside, as they were after."""
    layers = model.model.layers
    before = [layer.gradient_checkpointing for layer in layers]
    for layer in layers:
        layer.gradient_checkpointing = enabled
    try:
        yield
    finally:
        for layer, flag in zip(layers, before):
            layer.gradient_checkpointing = flag


def layer_step(model, ids, layer_id: int = 1):
    """A function running decoder layer ``layer_id``'s forward and backward on the inputs it gets in ``model``."""
    layer = model.model.layers[layer_id]
    captured = {}
    handle = layer.register_forward_pre_hook(lambda m, a, k: captured.update(args=a, kwargs=k), with_kwargs=True)
    with torch.no_grad():
        model(ids)
    handle.remove()
    args = [
        a.detach().requires_grad_(a.is_floating_point()) if isinstance(a, torch.Tensor) else a
        for a in captured["args"]
    ]
    hidden, pre = args[:2]
    upstream = (torch.ones_like(hidden), torch.ones_like(pre))

    def run() -> None:
        with _checkpointing(model, False):
            out = layer(*args, **captured["kwargs"])
        torch.autograd.backward(out[:2], upstream)

    return run


def train_runs(device: str, seqs: list[int], reps: int) -> dict[str, dict[int, dict[str, float]]]:
    """Every measurement of the ``--train`` docstring, for each attention (recomputing, autograd) and length."""
    from modeling_dsv41 import attention
    from modeling_dsv41.training.offload import offload_checkpointed_inputs

    model = training_stand_in(device)
    vocab = model.config.text_config.vocab_size
    results: dict[str, dict[int, dict[str, float]]] = {"recomputing": {}, "autograd": {}}
    recomputing = attention.sink_attention
    for name, function in (("recomputing", recomputing), ("autograd", autograd_sink_attention)):
        attention.sink_attention = function
        try:
            for seq in seqs:
                ids = torch.randint(3, vocab, (1, seq), generator=torch.Generator().manual_seed(0)).to(device)

                def step() -> None:
                    model(ids, labels=ids).loss.backward()

                row = {"attention saved": attention_saved_per_layer(model, ids)}
                row["layer peak"], row["layer time"] = _measure(layer_step(model, ids), device, reps)
                row["step peak"], row["step time"] = _measure(step, device, reps)
                results[name][seq] = row
                print(f"{name}, S={seq}: " + ", ".join(f"{key} {value:.4g}" for key, value in row.items()), flush=True)
                model.zero_grad(set_to_none=True)
        finally:
            attention.sink_attention = recomputing
    if device != "cpu":  # on the CPU the checkpointed inputs already live in host memory
        offload_checkpointed_inputs(model)
        for seq in seqs:
            ids = torch.randint(3, vocab, (1, seq), generator=torch.Generator().manual_seed(0)).to(device)
            peak, seconds = _measure(lambda: model(ids, labels=ids).loss.backward(), device, reps)
            results["recomputing"][seq].update({"offloaded step peak": peak, "offloaded step time": seconds})
    return results


def print_train_report(results: dict, seqs: list[int], device: str, threads: int) -> None:
    where = f"CPU, {threads} thread(s), process CPU time" if device == "cpu" else torch.cuda.get_device_name(device)
    print(
        f"training step of the released-format stand-in (bf16, gradient checkpointing), {where}; "
        "recomputing sparse-attention backward vs autograd of its forward (baseline), same run"
    )
    header = f"{'':<28}" + "".join(f"{f'S={seq}: autograd':>18}{'recomputing':>13}{'ratio':>8}" for seq in seqs)
    print(header)
    rows = ("attention saved", "layer peak", "layer time", "step peak", "step time")
    for row in rows:
        cells = []
        for seq in seqs:
            old, new = results["autograd"][seq][row], results["recomputing"][seq][row]
            show = (lambda v: f"{v:.3f} s") if row.endswith("time") else (lambda v: f"{v / 2**20:.1f} MiB")
            cells.append(f"{show(old):>18}{show(new):>13}{new / old:>7.2f}×")
        print(f"{row:<28}" + "".join(cells))
    if "offloaded step peak" in results["recomputing"][seqs[0]]:
        for seq in seqs:
            r = results["recomputing"][seq]
            print(
                f"S={seq}, recomputing, checkpointed inputs offloaded: step peak "
                f"{r['offloaded step peak'] / 2**20:.1f} MiB ({r['offloaded step peak'] / r['step peak']:.2f}× "
                f"resident), step time {r['offloaded step time']:.3f} s "
                f"({r['offloaded step time'] / r['step time']:.2f}×)"
            )
    saved = max(results["recomputing"][s]["attention saved"] / results["autograd"][s]["attention saved"] for s in seqs)
    step = max(results["recomputing"][s]["step time"] / results["autograd"][s]["step time"] for s in seqs)
    print(f"goals: attention saved ≤ 0.2× (worst {saved:.2f}×), step time ≤ 1.15× (worst {step:.2f}×)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=["small", "medium"], default="small")
    parser.add_argument("--device", default="cpu", help="cpu (peak RSS, fresh process each) or cuda[:N]")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--seqs", type=int, nargs=2, default=[4096, 16384], metavar=("SHORT", "LONG"))
    parser.add_argument(
        "--chunk", type=int, default=None, help="query_chunk_size of the chunked run (default: the config's)"
    )
    parser.add_argument("--no-baseline", action="store_true", help="skip the whole-sequence baseline")
    parser.add_argument(
        "--baseline-max-seq",
        type=int,
        default=32768,
        help="skip the whole-sequence baseline above this S (its memory is quadratic)",
    )
    parser.add_argument(
        "--train",
        action="store_true",
        help="a training step: recomputing sparse-attention backward vs autograd (see the docstring)",
    )
    parser.add_argument("--reps", type=int, default=3, help="with --train: timed runs per case (median)")
    parser.add_argument("--threads", type=int, default=1, help="with --train on CPU: torch threads")
    args = parser.parse_args()
    if args.train:
        seqs = args.seqs if "--seqs" in sys.argv else [1024, 2048]
        torch.set_num_threads(args.threads)
        print_train_report(train_runs(args.device, seqs, args.reps), seqs, args.device, args.threads)
        return
    chunk = args.chunk or default_chunk(args.size)
    short, long = args.seqs
    runs = {f"chunked (query_chunk_size {chunk})": lambda s: chunk}
    if not args.no_baseline:
        runs["whole sequence (query_chunk_size = S), baseline"] = lambda s: s if s <= args.baseline_max_seq else None
        for seq in args.seqs:
            if seq > args.baseline_max_seq:
                print(
                    f"note: whole-sequence baseline skipped at S={seq} (> --baseline-max-seq {args.baseline_max_seq}: "
                    "its indexer scores alone would not fit)"
                )
    if args.device == "cpu":
        print(f"peak RSS rise over one forward, batch 1, {args.size}, {args.dtype}, CPU (fresh process each)")
        results = {
            name: [
                None if chunk_of(seq) is None else peak_forward_bytes(seq, chunk_of(seq), args.size, args.dtype)
                for seq in (short, long)
            ]
            for name, chunk_of in runs.items()
        }
    else:
        total = torch.cuda.get_device_properties(args.device).total_memory
        print(
            f"peak CUDA allocation (torch.cuda.max_memory_allocated) over one forward, batch 1, {args.size}, "
            f"{args.dtype}, {torch.cuda.get_device_name(args.device)} ({total / 2**30:.1f} GiB), torch "
            f"{torch.__version__}"
        )
        results = cuda_runs(args.size, args.dtype, args.device, runs, [short, long])
        for name, peaks in results.items():
            for seq, peak in zip((short, long), peaks):
                if isinstance(peak, tuple):
                    print(
                        f"  {name}, S={seq}: whole peak (weights + forward) {peak[1] / 2**30:.2f} GiB "
                        f"= {peak[1] / total:.1%} of the device"
                    )
        results = {name: [p[0] if isinstance(p, tuple) else p for p in peaks] for name, peaks in results.items()}
    print(f"{'configuration':<50}{f'S={short} MiB':>16}{f'S={long} MiB':>16}{'ratio':>8}")
    for name, peaks in results.items():
        cells = [f"{p / 2**20:>16.1f}" if isinstance(p, int) else f"{p or 'skipped':>16}" for p in peaks]
        ratio = f"{peaks[1] / peaks[0]:>7.2f}×" if all(isinstance(p, int) for p in peaks) else f"{'—':>8}"
        print(f"{name:<50}{cells[0]}{cells[1]}{ratio}")
    print(
        f"target: ratio ≤ {1.125 * long / short:.1f}× (sequence ×{long / short:.0f}: linear, +12.5%); "
        + json.dumps(results)
    )


if __name__ == "__main__":
    main()
