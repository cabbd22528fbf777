"""The optimizer kinds of :class:`~.mixed.MixedOptimizer`, one :class:`OptimizerKind` object each.

A kind holds everything kind-specific: its group hyperparameters and their defaults, the checks of a group and of
its parameters, the per-parameter state and the update rule (:mod:`.updates`). The optimizer and the name-based
policy (:mod:`.policy`) read them from here.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import torch
from torch import Tensor

from .distributed import DEEPSPEED_HINT, Replicate, Shard, is_flat_partition, sharded_dims
from .muon import V4_NS_COEFFICIENTS, head_blocks
from .updates import State, adamw_step, muon_step, sinkhorn_step


@dataclass(frozen=True, eq=False)
class OptimizerKind:
    """One algorithm of :class:`~.mixed.MixedOptimizer`: what its param groups hold, its state and its update."""

    name: str
    defaults: Mapping[str, Any]  # applied to a group before the optimizer-wide ``lr``
    check: Callable[[dict[str, Any]], None]  # raises on a bad group (after the defaults); normalizes values in place
    step: Callable[[State, dict[str, Any], list[Tensor]], None]  # the update of the parameters that have gradients
    buffers: tuple[str, ...]  # per-parameter state tensors, zeros like the parameter
    counts_steps: bool = False  # a float32 ``step`` tensor per parameter, first in its state
    required: tuple[str, ...] = ()  # group keys without a default
    # Run on every parameter before each step (DeepSpeed ZeRO-1/2 swap in flat partitions after __init__).
    check_param: Callable[[str, Tensor], None] | None = None
    keys: frozenset[str] = field(init=False)  # the group keys this kind takes besides params, names, kind, lr

    def __post_init__(self) -> None:
        object.__setattr__(self, "defaults", MappingProxyType(dict(self.defaults)))
        object.__setattr__(self, "keys", frozenset((*self.defaults, *self.required)))

    def init_state(self, p: Tensor) -> dict[str, Tensor]:
        """Zero state, equal to none: all tensors, so ``torch.load(weights_only=True)`` reads a saved one."""
        state = {"step": torch.tensor(0.0, dtype=torch.float32)} if self.counts_steps else {}
        state.update({key: torch.zeros_like(p, memory_format=torch.preserve_format) for key in self.buffers})
        return state

    def state_bytes(self, numel: int, element_size: int) -> int:
        """Bytes of state for one tensor (buffers in the param dtype, the step counter in fp32)."""
        return len(self.buffers) * numel * element_size + (4 if self.counts_steps else 0)


def _check_common(group: dict[str, Any], complex_ok: bool = False) -> None:
    if group["lr"] < 0:
        raise ValueError(f"lr must be >= 0, got {group['lr']}")
    if group["weight_decay"] < 0:
        raise ValueError(f"weight_decay must be >= 0, got {group['weight_decay']}")
    for p in group["params"]:
        if torch.is_complex(p) and not complex_ok:
            raise ValueError(f"{group['kind']} does not support complex parameters")


def _check_momentum(group: dict[str, Any]) -> None:
    if not 0 <= group["momentum"] < 1:
        raise ValueError(f"momentum must be in [0, 1), got {group['momentum']}")
    if group["update_rms"] <= 0:
        raise ValueError(f"update_rms must be > 0, got {group['update_rms']}")


def _check_muon(group: dict[str, Any]) -> None:
    _check_common(group)
    _check_momentum(group)
    coefficients = tuple(tuple(float(c) for c in abc) for abc in group["ns_coefficients"])
    if not coefficients or any(len(abc) != 3 for abc in coefficients):
        raise ValueError("ns_coefficients must be a non-empty sequence of (a, b, c), one per Newton–Schulz step")
    group["ns_coefficients"] = coefficients
    if group["kind"] == "muon_headwise":
        group["num_heads"] = _as_int_or_tuple(group["num_heads"])
        if group["split_sizes"] is not None:
            group["split_sizes"] = tuple(int(s) for s in group["split_sizes"])
    for p in group["params"]:
        _check_matrices(group["kind"], p)
        if group["kind"] == "muon_headwise":
            head_blocks(p.shape[-2], group["num_heads"], group["split_sizes"])  # raises on a bad layout
            if p.ndim - 2 in sharded_dims(p) and not all(type(pl) in (Shard, Replicate) for pl in p.placements):
                raise ValueError(f"head-wise Muon needs rows sharded with Shard or Replicate, got {p.placements}")


def _check_sinkhorn(group: dict[str, Any]) -> None:
    _check_common(group)
    _check_momentum(group)
    if group["weight_decay"] != 0:
        raise ValueError("sinkhorn groups take no weight decay (masked rows must stay exactly unchanged)")
    if group["sinkhorn_iters"] < 1 or group["sinkhorn_iters"] % 2 == 0:
        raise ValueError(f"sinkhorn_iters must be odd (rows first and last), got {group['sinkhorn_iters']}")
    if group["row_mask_tau"] < 0:
        raise ValueError(f"row_mask_tau must be >= 0, got {group['row_mask_tau']}")
    for p in group["params"]:
        _check_table(group["kind"], p)


def _check_adamw(group: dict[str, Any]) -> None:
    _check_common(group, complex_ok=True)
    beta1, beta2 = group["betas"]
    if not (0 <= beta1 < 1 and 0 <= beta2 < 1):
        raise ValueError(f"betas must be in [0, 1), got {group['betas']}")
    if group["eps"] < 0:
        raise ValueError(f"eps must be >= 0, got {group['eps']}")
    group["betas"] = (beta1, beta2)


def _refuse_flat(kind: str, p: Tensor) -> None:
    if is_flat_partition(p) or p.ndim == 1:
        raise ValueError(f"{kind} needs matrices, got a flat tensor of shape {tuple(p.shape)}. {DEEPSPEED_HINT}")


def _check_matrices(kind: str, p: Tensor) -> None:
    """Muon kinds need matrices or batches of them ``[..., rows, cols]``; flat partitions are refused."""
    _refuse_flat(kind, p)
    if p.ndim < 2:
        raise ValueError(f"{kind} needs matrices (or batches of them), got shape {tuple(p.shape)}")


def _check_table(kind: str, p: Tensor) -> None:
    """Sinkhorn needs 2-D tables ``[rows, cols]``; flat partitions are refused."""
    _refuse_flat(kind, p)
    if p.ndim != 2:
        raise ValueError(f"{kind} needs 2-D parameters [rows, cols], got shape {tuple(p.shape)}")


def _as_int_or_tuple(value: int | Sequence[int]) -> int | tuple[int, ...]:
    return int(value) if isinstance(value, int) else tuple(int(v) for v in value)


_MUON_DEFAULTS: dict[str, Any] = {
    "weight_decay": 0.1,
    "momentum": 0.95,
    "nesterov": True,
    "ns_coefficients": V4_NS_COEFFICIENTS,
    "update_rms": 0.18,
}
_MOMENTUM = ("momentum_buffer",)

MUON = OptimizerKind("muon", _MUON_DEFAULTS, _check_muon, muon_step, _MOMENTUM, check_param=_check_matrices)
MUON_HEADWISE = OptimizerKind(
    "muon_headwise",
    {**_MUON_DEFAULTS, "split_sizes": None},
    _check_muon,
    muon_step,
    _MOMENTUM,
    required=("num_heads",),
    check_param=_check_matrices,
)
SINKHORN = OptimizerKind(
    "sinkhorn",
    {
        "weight_decay": 0.0,
        "momentum": 0.95,
        "nesterov": True,
        "sinkhorn_iters": 11,
        "row_mask_tau": 1e-3,
        "update_rms": 0.18,
    },
    _check_sinkhorn,
    sinkhorn_step,
    _MOMENTUM,
    check_param=_check_table,
)
ADAMW = OptimizerKind(
    "adamw",
    {"weight_decay": 0.01, "betas": (0.9, 0.999), "eps": 1e-8},  # torch.optim.AdamW's defaults
    _check_adamw,
    adamw_step,
    ("exp_avg", "exp_avg_sq"),
    counts_steps=True,
)

OPTIMIZER_KINDS: Mapping[str, OptimizerKind] = MappingProxyType(
    {kind.name: kind for kind in (MUON, MUON_HEADWISE, SINKHORN, ADAMW)}
)
KINDS = tuple(OPTIMIZER_KINDS)
# Per-kind defaults, applied to a group before the optimizer-wide ``lr``. ``num_heads`` has no default.
KIND_DEFAULTS: dict[str, dict[str, Any]] = {name: dict(kind.defaults) for name, kind in OPTIMIZER_KINDS.items()}

__all__ = ["ADAMW", "KINDS", "KIND_DEFAULTS", "MUON", "MUON_HEADWISE", "OPTIMIZER_KINDS", "SINKHORN", "OptimizerKind"]
