"""DeepSeek-V4.1's optimizer: Muon, head-wise Muon, Sinkhorn-balanced and AdamW in one ``torch.optim.Optimizer``."""

from .kinds import KIND_DEFAULTS, KINDS
from .mixed import MixedOptimizer
from .muon import (
    TORCH_MUON_NS_COEFFICIENTS,
    V4_NS_COEFFICIENTS,
    head_blocks,
    update_scale,
    zeropower_via_newton_schulz,
)
from .policy import (
    DEFAULT_RULES,
    AssignmentTable,
    KindSummary,
    assign_kinds,
    assignment_table,
    build_param_groups,
    canonical_name,
    freeze_default_parameters,
    state_bytes,
)
from .sinkhorn import sinkhorn_balance

__all__ = [
    "DEFAULT_RULES",
    "KINDS",
    "KIND_DEFAULTS",
    "TORCH_MUON_NS_COEFFICIENTS",
    "V4_NS_COEFFICIENTS",
    "AssignmentTable",
    "KindSummary",
    "MixedOptimizer",
    "assign_kinds",
    "assignment_table",
    "build_param_groups",
    "canonical_name",
    "freeze_default_parameters",
    "head_blocks",
    "sinkhorn_balance",
    "state_bytes",
    "update_scale",
    "zeropower_via_newton_schulz",
]
