"""The optimizer kinds of :class:`~.mixed.MixedOptimizer` and their default hyperparameters (shared by the optimizer
and the name-based policy that assigns them)."""

from __future__ import annotations

from typing import Any

from .muon import V4_NS_COEFFICIENTS

KINDS = ("muon", "muon_headwise", "sinkhorn", "adamw")

_MUON_DEFAULTS: dict[str, Any] = {
    "weight_decay": 0.1,
    "momentum": 0.95,
    "nesterov": True,
    "ns_coefficients": V4_NS_COEFFICIENTS,
    "update_rms": 0.18,
}
# Per-kind defaults, applied to a group before the optimizer-wide ``lr``. ``num_heads`` has no default.
KIND_DEFAULTS: dict[str, dict[str, Any]] = {
    "muon": dict(_MUON_DEFAULTS),
    "muon_headwise": {**_MUON_DEFAULTS, "split_sizes": None},
    "sinkhorn": {
        "weight_decay": 0.0,
        "momentum": 0.95,
        "nesterov": True,
        "sinkhorn_iters": 11,
        "row_mask_tau": 1e-3,
        "update_rms": 0.18,
    },
    "adamw": {"weight_decay": 0.01, "betas": (0.9, 0.999), "eps": 1e-8},  # torch.optim.AdamW's defaults
}

__all__ = ["KINDS", "KIND_DEFAULTS"]
