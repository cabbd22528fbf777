"""Will a full fine-tune fit? Per-device memory of training every weight of DeepSeek-V4.1 with the mixed optimizer
on the expert-parallel mesh (:mod:`~.expert_parallel`: routed experts split by expert over ``ep`` ranks and
FSDP2-sharded over the other ``world / ep``, everything else FSDP2 over all ranks), with gradient checkpointing,
planned on the meta device. Backs ``dsv41 inspect --train full --devices NODESxGPUSxSIZE``.

What trains: every weight but the indexer (no gradient through its top-k), the DSpark draft head (the Trainer freezes
it while the backbone trains) and the Engram tables, which stay frozen in host memory, memory-mapped from the bf16
checkpoint (one page cache per node), the model gathering the rows it reads (FSDP2 would all-gather a whole
table, about 100 B parameters, at every forward of its layer).

Two precisions (:data:`PRECISIONS`): ``"fp32 master"``, the Trainer under accelerate's ``mixed_precision: bf16``
(fp32 weights, gradients and optimizer state, bf16 compute and gradient reduction; the mHC ``hc_*`` and attention
sinks replicated in fp32, see :mod:`~.fsdp`), and ``"bf16"``, the model loaded in bf16 without mixed precision
(weights, gradients and :class:`~..optim.MixedOptimizer` state in bf16, the fp32-kept modules fp32), as NeMo's
recipe keeps AdamW's moments in bf16. The optimizer state is one momentum buffer per Muon, head-wise Muon and
Sinkhorn tensor and two moments per AdamW tensor, in the weights' dtype.

Every rank holds (bytes per device): 1/world of the weights, gradients and optimizer state; the largest decoder
layer's non-expert weights gathered, with the next one prefetched; its ``E/ep`` local experts gathered over
``ep_shard``, with the next layer's; during a layer's backward its unsharded gradients and the reduce-scatter buffers
(EP group first: one more copy, see :class:`~.expert_parallel.EPGroupFirstReduceScatter`); the root's weights
(embedding, LM head: gathered through the step); the checkpointed layer inputs, the recomputed layer's saved
tensors (:func:`~.planning.layer_saved_bytes_per_token`), the all-to-all buffers of its routed slots, the logits with
their loss, and :data:`~.planning.RESERVE_BYTES`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from torch import nn

from ..optim import assign_kinds
from ..optim.policy import FROZEN
from ..placement import is_engram_table_tensor
from .fsdp import _kept_fp32, _split_fp32
from .planning import (
    RESERVE_BYTES,
    PerDeviceTotal,
    _fsdp_units,
    all_to_all_bytes,
    checkpointed_input_bytes_per_token,
    layer_saved_bytes_per_token,
)

PRECISIONS = ("fp32 master", "bf16")
_EXPERTS = re.compile(r"(^|\.)layers\.\d+\.ffn\.experts\.")
_DRAFT_HEAD = re.compile(r"(^|\.)mtp\.")
_LAYER = re.compile(r"(^|\.)layers\.\d+$")


@dataclass
class FullTrainingPlan(PerDeviceTotal):
    """Per-device bytes of a full fine-tuning step on ``nodes × gpus_per_node`` devices (see the module docstring)."""

    nodes: int
    gpus_per_node: int
    capacity: int
    ep_size: int
    precision: str
    seq_len: int
    batch_size: int
    trainable_parameters: int = 0
    terms: dict[str, float] = field(default_factory=dict)
    host_bytes: dict[str, float] = field(default_factory=dict)
    largest_layer: str = ""

    @property
    def world(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def ep_shard(self) -> int:
        return self.world // self.ep_size


def _trains(name: str, kinds: dict[str, str]) -> bool:
    return kinds[name] != FROZEN and not _DRAFT_HEAD.search(name) and not is_engram_table_tensor(name)


def _state_buffers(kind: str) -> int:
    return 2 if kind == "adamw" else 1  # AdamW's two moments, one momentum buffer for the other kinds


@dataclass
class ModelTotals:
    """What a plan needs from the model, summed once per precision (bytes unless said otherwise)."""

    trainable_parameters: int = 0
    weights: float = 0.0
    grads: float = 0.0
    state: float = 0.0
    replicated: float = 0.0
    root: float = 0.0
    tables: float = 0.0
    # decoder layer → [non-expert weights gathered, all its experts gathered, non-expert gradient buffers,
    # all its experts' gradient buffers]
    layers: dict[str, list[float]] = field(default_factory=dict)


def model_totals(model: nn.Module, precision: str) -> ModelTotals:
    """``model``'s sums a full-training plan needs in ``precision`` (one of :data:`PRECISIONS`): computed once and
    passed to :func:`plan_full_training` for every mesh tried."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    master = precision == "fp32 master"
    kinds = assign_kinds(model)
    kept = {id(p) for p in _kept_fp32(model)}
    replicated = {id(p) for p in _split_fp32(model)[1]} if master else set()
    unit_names = sorted(_fsdp_units(model), key=len, reverse=True)
    totals = ModelTotals()
    for name, p in model.named_parameters():
        n = p.numel()
        if is_engram_table_tensor(name):
            totals.tables += n * 2  # bf16, memory-mapped from the converted checkpoint
            continue
        trains = _trains(name, kinds)
        compute = 4 if id(p) in kept else 2  # bytes per element as the forward reads them (gathered)
        # held as: fp32 masters, or the loaded dtype (fp32-kept modules fp32); frozen weights as loaded
        own = n * (4 if master and trains else p.element_size())
        totals.trainable_parameters += n if trains else 0
        if id(p) in replicated:  # whole on every rank, with its gradient and state if it trains
            totals.replicated += own * (2 + _state_buffers(kinds[name])) if trains else own
            continue
        totals.weights += own
        if trains:
            totals.grads += own
            totals.state += own * _state_buffers(kinds[name])
        unit = next((u for u in unit_names if name.startswith(f"{u}.")), None)
        if unit is None:  # the root unit: gathered from the forward to the end of the backward
            totals.root += n * compute
        elif _LAYER.search(unit) and not _DRAFT_HEAD.search(unit):  # a backbone decoder layer
            entry = totals.layers.setdefault(unit, [0.0, 0.0, 0.0, 0.0])
            if _EXPERTS.search(name):
                entry[1] += n * compute
                entry[3] += n * (2 + 2)  # bf16 gradient + its reduce-scatter input
            elif trains:
                entry[0] += n * compute
                entry[2] += n * (2 + 2 + 2)  # bf16 gradient, reduce-scatter input, its EP-group-first copy
            else:
                entry[0] += n * compute
    return totals


def plan_full_training(
    model: nn.Module,
    nodes: int,
    gpus_per_node: int,
    capacity: int,
    ep_size: int,
    precision: str = "fp32 master",
    seq_len: int = 4096,
    batch_size: int = 1,
    totals: ModelTotals | None = None,
) -> FullTrainingPlan:
    """Plan full fine-tuning of ``model`` (the causal LM on the meta device, in bf16 with its fp32-kept modules
    fp32) on ``nodes`` nodes of ``gpus_per_node`` devices of ``capacity`` bytes, experts split over ``ep_size``
    ranks, micro-batches of ``batch_size`` × ``seq_len`` tokens per device."""
    config = model.config.get_text_config()
    plan = FullTrainingPlan(nodes, gpus_per_node, capacity, ep_size, precision, seq_len, batch_size)
    world = plan.world
    if world % ep_size or config.n_routed_experts % ep_size:
        raise ValueError(
            f"ep_size={ep_size} must divide the {world} devices and the {config.n_routed_experts} experts"
        )
    totals = totals or model_totals(model, precision)
    plan.trainable_parameters = totals.trainable_parameters
    layer_cost = {name: (b[0], b[1] / ep_size, b[2] + b[3] / ep_size) for name, b in totals.layers.items()}
    plan.largest_layer, (gathered, experts, gradients) = max(layer_cost.items(), key=lambda item: sum(item[1]))
    tokens = seq_len * batch_size
    layers = range(config.num_hidden_layers)
    plan.terms["weights (1/world)"] = totals.weights / world
    plan.terms["gradients (1/world)"] = totals.grads / world
    plan.terms["optimizer state (1/world)"] = totals.state / world
    if totals.replicated:
        plan.terms["mHC + sinks (replicated, fp32)"] = totals.replicated
    plan.terms["gathered layer (one + prefetch)"] = 2 * gathered
    plan.terms[f"gathered experts ({config.n_routed_experts // ep_size} per layer, one + prefetch)"] = 2 * experts
    plan.terms["a layer's gradients being reduced"] = gradients
    plan.terms["root weights (gathered all step)"] = totals.root
    plan.terms["checkpointed layer inputs"] = checkpointed_input_bytes_per_token(config) * tokens * len(layers)
    plan.terms["recomputed layer"] = max(layer_saved_bytes_per_token(config, i, seq_len) for i in layers) * tokens
    plan.terms["all-to-all buffers (routed slots)"] = all_to_all_bytes(config, tokens)
    plan.terms["logits + loss"] = 3 * tokens * config.vocab_size * 4
    plan.terms["reserve"] = RESERVE_BYTES
    plan.host_bytes["Engram tables (bf16, memory-mapped, per node)"] = totals.tables
    return plan


def ep_sizes(model: nn.Module, world: int) -> list[int]:
    """The expert-parallel sizes a world of ``world`` devices can take: divisors of the world and the expert count."""
    experts = model.config.get_text_config().n_routed_experts
    return [size for size in range(1, world + 1) if world % size == 0 and experts % size == 0]


def smallest_fit(
    model: nn.Module,
    gpus_per_node: int,
    capacity: int,
    precision: str,
    seq_len: int = 4096,
    batch_size: int = 1,
    max_nodes: int = 256,
) -> FullTrainingPlan | None:
    """The plan on the fewest nodes that fits, and on those nodes the smallest EP size that fits (the fewest ranks
    each all-to-all spans); None if even ``max_nodes`` nodes are not enough."""
    totals = model_totals(model, precision)
    for nodes in range(1, max_nodes + 1):
        for ep in ep_sizes(model, nodes * gpus_per_node):
            plan = plan_full_training(
                model, nodes, gpus_per_node, capacity, ep, precision, seq_len, batch_size, totals
            )
            if plan.fits:
                return plan
    return None


def default_ep_size(model: nn.Module, nodes: int, gpus_per_node: int) -> int:
    """One node's devices when they divide the experts (the all-to-all stays on the node's links), else the largest
    size that does."""
    sizes = [size for size in ep_sizes(model, nodes * gpus_per_node) if size <= gpus_per_node]
    return max(sizes) if sizes else 1


__all__ = [
    "PRECISIONS",
    "FullTrainingPlan",
    "ModelTotals",
    "default_ep_size",
    "ep_sizes",
    "model_totals",
    "plan_full_training",
    "smallest_fit",
]
