"""What predicts GPU time, counted on the CPU: aten ops, bytes moved by non-matmul ops and host syncs of one training
step (forward + backward) and one decode step, ours against transformers' ``DeepseekV4ForCausalLM`` at the same sizes.

On a GPU an eager step costs a kernel launch per aten op, its memory traffic in the ops that are not matrix
products (elementwise ops, reductions, gathers, copies: bandwidth-bound) and a stall at every host sync (a value
read back: ``.item()``, ``.tolist()``, ``nonzero``, a data-dependent shape). Both models run on the ``meta`` device,
which has shapes but no data, so that nothing is computed (the ~510M ``medium`` size at 4 × 2048 tokens takes
seconds) and every branch taken is the one for a device that is not the CPU. A ``TorchDispatchMode`` sees each op
after autograd and composite decompositions (``F.linear`` is its transpose view and an ``mm``) and counts:

- ops: every op but views (which launch nothing) and the read-backs counted below;
- non-matmul bytes: the bytes each of those ops reads and writes (its tensor inputs and outputs; a gather reads the
  rows it outputs, not its whole source), matrix products (``mm``, ``bmm``, ``addmm``, grouped ``mm``, attention
  kernels) left out;
- host syncs: the ops that read a value back, by where they were called from. On the meta device there is no value:
  the mode answers them with zeros (an empty ``nonzero``) so that the step goes on, and says so.

Sizes (``--size``, from benchmarks/forward.py): ``medium`` (default; issue 15's ~510M configuration, no Engram) or
``tiny``. Training: ``--batch`` × ``--seq`` tokens (4 × 2048), loss on the inputs, bf16. Decode: one token at
batch 1 after a ``--context``-token prefill (1024), each model with its own dynamic cache. Both models are cast as
``from_pretrained(dtype=torch.bfloat16)`` leaves them: bf16, with the modules each keeps in fp32.

Usage: ``python benchmarks/op_counts.py [--size medium|tiny] [--batch 4] [--seq 2048] [--context 1024]``
"""

from __future__ import annotations

import argparse
import sys
import traceback
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from transformers.utils import logging as hf_logging

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling forward.py, however this script is run
from forward import SIZES, as_loaded, build_ours, build_transformers_v4  # noqa: E402

aten = torch.ops.aten
MATMULS = frozenset(
    {
        aten.mm,
        aten.bmm,
        aten.addmm,
        aten.baddbmm,
        aten.addbmm,
        aten.dot,
        aten._grouped_mm,
        aten._scaled_dot_product_efficient_attention,
        aten._scaled_dot_product_flash_attention,
        aten._scaled_dot_product_cudnn_attention,
        aten._scaled_dot_product_flash_attention_for_cpu,
        aten._efficient_attention_backward,
        aten._scaled_dot_product_efficient_attention_backward,
        aten._scaled_dot_product_flash_attention_backward,
        aten._scaled_dot_product_flash_attention_for_cpu_backward,
    }
)
GATHERS = frozenset({aten.index_select, aten.embedding, aten.gather, aten.index})
# ops that read values back to the host; a repeat_interleave without output_size reads its total
READ_BACKS = frozenset(
    {
        aten._local_scalar_dense,
        aten.nonzero,
        aten.masked_select,
        aten._unique2,
        aten.unique_consecutive,
        aten.unique_dim,
        aten.bincount,
        aten.equal,
        aten.is_nonzero,
    }
)
OURS_ROOT = str(Path(__file__).resolve().parent.parent)


def _caller() -> str:
    """The innermost frame outside torch, this file and Python's libraries: where a read-back was asked for."""
    for frame in reversed(traceback.extract_stack()):
        path = frame.filename
        if path != __file__ and "/torch/" not in path and ("site-packages" in path or path.startswith(OURS_ROOT)):
            short = path.split("site-packages/")[-1].replace(OURS_ROOT + "/", "")
            return f"{short}:{frame.lineno}"
    return "?"


def _nbytes(tensors) -> int:
    """Bytes of the tensors, a broadcast (expanded) one counted as the memory it reads, not its numel."""
    return sum(
        min(t.numel() * t.element_size(), t.untyped_storage().nbytes()) for t in tensors if isinstance(t, torch.Tensor)
    )


def _moved_bytes(func, args: tuple, kwargs: dict, out) -> int:
    """Bytes an op reads and writes: its tensor inputs and outputs; a gather reads only the rows it outputs."""
    written = _nbytes(tree_flatten(out)[0])
    if func.overloadpacket in GATHERS:
        indices = [
            t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor) and not t.is_floating_point()
        ]
        return 2 * written + _nbytes(indices)
    return _nbytes(tree_flatten((args, kwargs))[0]) + written


def _is_read_back(func, kwargs: dict) -> bool:
    return func.overloadpacket in READ_BACKS or (
        func is aten.repeat_interleave.Tensor and kwargs.get("output_size") is None
    )


def _stand_in(func, args: tuple):
    """A value-free answer to a read-back on the meta device, so that the step runs on to be counted."""
    if func.overloadpacket is aten._local_scalar_dense:
        return False if args[0].dtype == torch.bool else 0
    if func.overloadpacket is aten.nonzero:
        return torch.empty(0, args[0].ndim, dtype=torch.long, device=args[0].device)
    raise NotImplementedError(f"{func} reads values back and has no stand-in here")


@dataclass
class StepCount:
    ops: int = 0
    non_matmul_bytes: int = 0
    syncs: Counter = field(default_factory=Counter)  # call site -> read-backs
    ops_by_name: Counter = field(default_factory=Counter)
    bytes_by_name: Counter = field(default_factory=Counter)


class StepCounter(TorchDispatchMode):
    """Counts the ops, the non-matmul bytes and the host syncs dispatched while active (see the module docstring)."""

    def __init__(self):
        super().__init__()
        self.count = StepCount()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _is_read_back(func, kwargs):
            self.count.syncs[f"{func.overloadpacket.__name__} at {_caller()}"] += 1
            if args[0].is_meta:
                return _stand_in(func, args)
            return func(*args, **kwargs)
        out = func(*args, **kwargs)
        if not func.is_view:
            name = func.overloadpacket.__name__
            self.count.ops += 1
            self.count.ops_by_name[name] += 1
            if func.overloadpacket not in MATMULS:
                moved = _moved_bytes(func, args, kwargs, out)
                self.count.non_matmul_bytes += moved
                self.count.bytes_by_name[name] += moved
        return out


def training_step_count(model: nn.Module, batch: int, seq: int) -> StepCount:
    """One forward + backward with the loss on the inputs (an attention mask of ones, as a collator gives)."""
    ids = torch.zeros(batch, seq, dtype=torch.long, device="meta")
    model.train()
    with StepCounter() as counter:
        loss = model(input_ids=ids, attention_mask=torch.ones_like(ids), labels=ids).loss
        loss.backward()
    return counter.count


@torch.no_grad()
def decode_step_count(model: nn.Module, context: int) -> StepCount:
    """One cached step at batch 1 after a ``context``-token prefill and a first step."""
    model.eval()
    ids = torch.zeros(1, context + 2, dtype=torch.long, device="meta")
    mask = torch.ones_like(ids)
    with StepCounter():  # the prefill and a first step: read-backs answered, not counted
        cache = model(input_ids=ids[:, :context], attention_mask=mask[:, :context], use_cache=True).cache
        model(input_ids=ids[:, context : context + 1], attention_mask=mask[:, : context + 1], cache=cache)
    with StepCounter() as counter:
        model(input_ids=ids[:, context + 1 :], attention_mask=mask, cache=cache)
    return counter.count


def build_on_meta(size: str) -> dict[str, nn.Module]:
    """Ours and transformers' V4 at ``size`` in bf16 (their fp32 modules kept, as loaded) on the meta device (the V4
    built from ours, as forward.py)."""
    torch.manual_seed(0)
    ours = build_ours(engram=size == "tiny", size=size)
    theirs = build_transformers_v4(ours, use_cache=True)
    return {
        "ours": as_loaded(ours, "meta", torch.bfloat16),
        "transformers V4": as_loaded(theirs, "meta", torch.bfloat16),
    }


def report(counts: dict[str, StepCount], title: str, top: int) -> None:
    ours, v4 = counts["ours"], counts["transformers V4"]
    print(f"\n## {title}")
    print(f"{'':<16} {'aten ops':>9} {'non-matmul MiB':>15} {'host syncs':>11}")
    for name, count in counts.items():
        print(f"{name:<16} {count.ops:>9,} {count.non_matmul_bytes / 2**20:>15,.1f} {sum(count.syncs.values()):>11}")
    print(f"{'ours ÷ V4':<16} {ours.ops / v4.ops:>8.2f}× {ours.non_matmul_bytes / v4.non_matmul_bytes:>14.2f}×")
    for name, count in counts.items():
        for site, n in count.syncs.most_common():
            print(f"  {name} syncs: {n} × {site}")
    for name, count in counts.items():
        ops = ", ".join(f"{op} {n}" for op, n in count.ops_by_name.most_common(top))
        moved = ", ".join(f"{op} {n / 2**20:,.0f}" for op, n in count.bytes_by_name.most_common(top))
        print(f"  {name}, most frequent ops: {ops}\n  {name}, most MiB moved: {moved}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="medium")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--top", type=int, default=8, help="ops listed per model, by count and by bytes moved")
    args = parser.parse_args()
    hf_logging.set_verbosity_error()  # V4's YaRN check warns about the small original_max_position_embeddings
    models = build_on_meta(args.size)
    print(f"size {args.size}, bf16 on the meta device, torch {torch.__version__}")
    report(
        {name: training_step_count(m, args.batch, args.seq) for name, m in models.items()},
        f"training step: forward + backward, {args.batch} × {args.seq} tokens",
        args.top,
    )
    report(
        {name: decode_step_count(m, args.context) for name, m in models.items()},
        f"decode step: batch 1, one token after {args.context}",
        args.top,
    )


if __name__ == "__main__":
    main()
