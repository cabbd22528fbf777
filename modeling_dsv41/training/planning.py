"""Will a LoRA fine-tune fit? Per-device memory of training adapters on a natively loaded DeepSeek-V4.1 (FP8 Linears,
FP4 experts, frozen) sharded with FSDP2 the way :func:`~.fsdp.shard_model` shards it, planned on the meta device.
Backs ``dsv41 inspect --devices 8x80GiB --train lora``.

Every rank holds (bytes per device):

* **frozen shards**: 1/N of every frozen weight at its natively loaded size (released storage: FP8 + E8M0 scales,
  packed FP4 + scales; the DSpark head too), the Engram tables excepted: they stay in host memory, read row by row;
* **gathered units**: FSDP2 all-gathers one unit (a decoder layer, ``_no_split_modules``) for its forward and again
  for its backward, while the next one is prefetched: twice the largest unit; the root's own weights (embedding, LM
  head, final norms) stay gathered from the forward to the end of the backward;
* **adapters**: LoRA weights, their gradients and two AdamW moments, all fp32 (PEFT keeps adapters in fp32; the
  Trainer puts them in the AdamW group), sharded 1/N;
* **activations at the step's peak** (:mod:`.activation_memory`, within 10% of measured steps): the checkpointed
  layers' inputs (each decoder layer keeps only its input until its backward) and the larger of the loss (the fp32
  logits, their log-softmax and its gradient) and the worst layer's backward (the layer's forward run again, what it
  saves for its backward and its largest transient);
* **reserve**: CUDA context, NCCL buffers and allocator slack, a fixed :data:`RESERVE_BYTES`.

With ``ep_size`` above 1 (``shard_model(..., expert_parallel_size=ep_size)``, the launch's
``--expert_parallel_size``; :mod:`.expert_parallel`) the routed experts are split by expert over ``ep_size`` ranks
and FSDP2-sharded over the others: the frozen shards are still 1/N of everything, but a unit in use gathers only
its layer's ``E/ep`` local experts with the rest of the layer (the adapters' factors stay in the layer's unit, whole
once gathered), and the routed slots travel by all-to-all (:func:`all_to_all_bytes`).

With ``offload=True`` (``shard_model(..., offload_policy=CPUOffloadPolicy())``) the frozen shards and the adapters'
optimizer state live in host memory instead; with ``offload_activations=True`` (``shard_model(...,
offload_activations=True)``, :mod:`.offload`) the checkpointed inputs do. :func:`longest_sequence` finds the longest
micro-batch sequence that fits.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from torch import nn

from ..placement import is_engram_table_tensor, native_held_bytes, released_storage_bytes
from .activation_memory import activation_peak, attended_slots

RESERVE_BYTES = 3 * 2**30
# the README's LoRA targets: attention Linears and shared experts (target_modules), routed experts (target_parameters)
LORA_LINEARS = re.compile(r"(^|\.)layers\.\d+\.(attn\.(wq_a|wq_b|wkv|wo_b)|ffn\.shared_experts\.w[123])$")
LORA_EXPERTS = re.compile(r"(^|\.)layers\.\d+\.ffn\.experts$")
_ROUTED_EXPERT_WEIGHT = re.compile(r"(^|\.)ffn\.experts\.")
_ADAPTER_BYTES_PER_PARAMETER = 4 * 4  # fp32 weight, gradient and two AdamW moments


def layer_saved_bytes_per_token(config, layer_id: int, seq_len: int) -> float:
    """Bytes per token that one decoder layer's forward saves for its backward (bf16 activations, fp32 where the model
    computes in fp32), term by term as the eager attention path saved them (the routed experts' inputs are saved
    whether or not they carry adapters: the input gradient flows through them). The full fine-tuning planner's
    (:mod:`.full_planning`): an upper bound now that the sparse attention's backward recomputes its keys and
    probabilities; the LoRA plan uses :mod:`.activation_memory`, the model measured against the new code."""
    d, hc, heads, hd = config.hidden_size, config.hc_mult, config.num_attention_heads, config.head_dim
    spec = config.layer_plan[layer_id]
    ratio = spec.compress_ratio
    k = attended_slots(config, ratio, seq_len)
    top_k, inter = config.num_experts_per_tok, config.moe_intermediate_size
    routed = top_k + config.n_shared_experts
    terms = {
        # sink attention: fp32 keys of every attended slot and the fp32 query, then per slot block the scores,
        # masks and probabilities ([H, K] fp32, about five of them) and the fp32 accumulator
        "attention keys": (k + heads) * hd * 4,
        "attention scores": 5 * heads * k * 4 + heads * hd * 4,
        # q_a, q (before and after rope), kv, the attention output and the grouped output projection
        "attention projections": (2 * config.q_lora_rank + 3 * heads * hd + 3 * hd) * 2
        + heads * hd * 4
        + config.o_groups * config.o_lora_rank * 2,
        # mHC: the flattened stream in fp32 for both sub-blocks' mixes, the collapse inputs, Sinkhorn's iterations
        "mHC": hc * d * (2 * 4 + 2 * 2) + 2 * (config.hc_sinkhorn_iters + 4) * hc * hc * 4 * 2,
        "norms": 6 * d * 4,
        # SwiGLU in fp32 (five [I] tensors per routed and shared slot), the routed slots' inputs and outputs
        "MoE": 5 * routed * inter * 4 + top_k * (d * 4 + d * 2 + 2 * inter * 2) + config.n_routed_experts * 4 * 2,
    }
    if ratio:
        terms["compressor"] = 3 * d * 4 // max(ratio, 1) + 2 * hd * 4
        terms["indexer"] = config.index_n_heads * config.index_head_dim * 2 // 2
    if spec.has_engram:
        rows = (config.engram_max_ngram_size - 1) * config.engram_n_heads * config.engram_head_dim
        terms["Engram"] = rows * (4 + 2) + hc * d * 4 * 5
    return float(sum(terms.values()))


def checkpointed_input_bytes_per_token(config) -> float:
    """What one decoder layer keeps until its backward under gradient checkpointing: its input stream [hc, D] in
    bf16 and its pre-mix [hc] in fp32 (the compressed context it is handed is a fraction of a token's worth)."""
    return config.hc_mult * config.hidden_size * 2 + config.hc_mult * 4 + config.head_dim * 2


class PerDeviceTotal:
    """For a plan's ``terms`` (bytes per device) and ``capacity``: their sum, and whether it fits."""

    terms: dict[str, float]
    capacity: int

    @property
    def per_device(self) -> float:
        return sum(self.terms.values())

    @property
    def fits(self) -> bool:
        return self.per_device <= self.capacity


@dataclass
class LoraTrainingPlan(PerDeviceTotal):
    """Per-device bytes of a LoRA step under FSDP2 on ``num_devices`` ranks (see the module docstring)."""

    num_devices: int
    capacity: int
    seq_len: int
    batch_size: int
    rank: int
    offload: bool
    offload_activations: bool = False
    ep_size: int = 1
    adapter_parameters: int = 0
    peak_moment: str = ""
    other_moment: tuple[str, float] = ("", 0.0)
    terms: dict[str, float] = field(default_factory=dict)
    largest_unit: str = ""
    host_bytes: dict[str, float] = field(default_factory=dict)
    checkpoint_bytes: float = 0.0  # the released checkpoint on disk
    largest_read: float = 0.0  # the largest stored tensor: what a process holds beyond its shards while loading
    save_bytes: float = 0.0  # one training checkpoint: the adapter and its AdamW moments (fp32)


def _fsdp_units(model: nn.Module) -> dict[str, nn.Module]:
    """The units :func:`~.fsdp.shard_model` shards (``_no_split_modules`` instances), by name."""
    classes = set(model._no_split_modules)
    return {name: module for name, module in model.named_modules() if type(module).__name__ in classes}


def _runs_in_training(unit: nn.Module) -> bool:
    """Whether the backbone's training forward runs (so gathers) the unit: not the DSpark draft blocks."""
    return type(unit).__name__ != "DeepseekV41DSparkBlock"


def _frozen_bytes(module: nn.Module, prefix: str = "", experts: bool | None = None) -> float:
    """Natively loaded bytes of ``module``'s weights, the Engram tables left out (they stay in host memory); only
    the routed experts' (``experts=True``) or all but theirs (``experts=False``)."""
    return sum(
        native_held_bytes(f"{prefix}{name}", p)
        for name, p in module.named_parameters()
        if not is_engram_table_tensor(f"{prefix}{name}")
        and (experts is None or bool(_ROUTED_EXPERT_WEIGHT.search(f"{prefix}{name}")) == experts)
    )


def all_to_all_bytes(config, tokens: int) -> int:
    """Bytes of expert parallelism's all-to-all buffers for ``tokens`` tokens: each routed slot's hidden vector sent
    and received in bf16, its fp32 output sent back and received."""
    return tokens * config.num_experts_per_tok * config.hidden_size * (2 + 2 + 4 + 4)


def lora_parameters(model: nn.Module, rank: int) -> int:
    """LoRA weights PEFT builds for :data:`LORA_LINEARS` (``r·(in + out)`` each) and :data:`LORA_EXPERTS` (per expert,
    ``r·(in + out)`` for ``gate_up_proj`` and ``down_proj``)."""
    total = 0
    for name, module in model.named_modules():
        if LORA_LINEARS.search(name):
            total += rank * (module.in_features + module.out_features)
        elif LORA_EXPERTS.search(name):
            for param in (module.gate_up_proj, module.down_proj):
                experts, out_features, in_features = param.shape
                total += experts * rank * (in_features + out_features)
    return total


def plan_lora_training(
    model: nn.Module,
    devices: dict[int, int],
    seq_len: int = 4096,
    batch_size: int = 1,
    rank: int = 16,
    offload: bool = False,
    offload_activations: bool = False,
    ep_size: int = 1,
) -> LoraTrainingPlan:
    """Plan LoRA training of ``model`` (the causal LM, meta or not, in bf16) on ``devices`` (index → bytes, one rank
    each), micro-batches of ``batch_size`` × ``seq_len`` tokens per rank, adapters of rank ``rank``, the routed
    experts split over ``ep_size`` ranks (1: FSDP2 alone)."""
    config = model.config.get_text_config()
    n = len(devices)
    if ep_size < 1 or n % ep_size or config.n_routed_experts % ep_size:
        raise ValueError(f"ep_size={ep_size} must divide the {n} devices and the {config.n_routed_experts} experts")
    plan = LoraTrainingPlan(n, min(devices.values()), seq_len, batch_size, rank, offload, offload_activations, ep_size)
    units = _fsdp_units(model)
    # frozen bytes of each unit: (all but its routed experts, its routed experts)
    frozen_split = {
        name: (_frozen_bytes(unit, f"{name}.", experts=False), _frozen_bytes(unit, f"{name}.", experts=True))
        for name, unit in units.items()
    }
    # a unit in use gathers its frozen weights (of the routed experts, its E/ep local ones) and fp32 adapters, and
    # (backward) its adapters' unsharded gradients
    sizes = {
        name: (rest + experts / ep_size, lora_parameters(units[name], rank))
        for name, (rest, experts) in frozen_split.items()
    }
    total = _frozen_bytes(model)
    running = {name: size for name, size in sizes.items() if _runs_in_training(units[name])}
    plan.largest_unit, (frozen, adapted) = max(running.items(), key=lambda item: item[1][0] + 8 * item[1][1])
    plan.adapter_parameters = lora_parameters(model, rank)
    tables = sum(native_held_bytes(name, p) for name, p in model.named_parameters() if is_engram_table_tensor(name))
    plan.host_bytes["Engram tables"] = tables
    stored = [released_storage_bytes(name, p) for name, p in model.named_parameters()]
    plan.checkpoint_bytes = sum(stored)
    plan.largest_read = max(  # a rank reads its rows of a tensor; of the experts, one of its experts at a time
        released_storage_bytes(name, p) / (p.shape[0] if p.dim() == 3 else n)
        for name, p in model.named_parameters()
        if not is_engram_table_tensor(name)
    )
    plan.save_bytes = plan.adapter_parameters * 3 * 4
    adapter_state = plan.adapter_parameters * _ADAPTER_BYTES_PER_PARAMETER
    if offload:
        plan.host_bytes["frozen shards and adapter state (all ranks)"] = total + adapter_state
    else:
        plan.terms["frozen shards"] = total / n
        plan.terms["adapters + grads + AdamW"] = adapter_state / n
    plan.terms["gathered units (one + prefetch)"] = 2 * (frozen + 4 * adapted) + 4 * adapted
    plan.terms["root weights (gathered all step)"] = total - sum(sum(split) for split in frozen_split.values())
    peak = activation_peak(config, seq_len, batch_size, rank, offload_activations)
    plan.peak_moment, plan.other_moment = peak.moment, peak.other
    plan.terms["checkpointed layer inputs"] = peak.terms["checkpointed layer inputs"]
    plan.terms["recomputed layer"] = peak.terms.get("recomputed layer", 0.0)
    plan.terms["logits + loss"] = peak.terms.get("logits + loss", 0.0)
    if ep_size > 1:
        plan.terms["all-to-all buffers (routed slots)"] = all_to_all_bytes(config, seq_len * batch_size)
    if offload_activations:
        plan.host_bytes["checkpointed layer inputs (this rank)"] = peak.host_bytes
    plan.terms["reserve"] = RESERVE_BYTES
    return plan


def longest_sequence(
    model: nn.Module,
    devices: dict[int, int],
    batch_size: int = 1,
    rank: int = 16,
    offload: bool = False,
    offload_activations: bool = False,
    step: int = 1024,
    ep_size: int = 1,
) -> int:
    """The longest sequence per device (a multiple of ``step`` tokens, at most the model's
    ``max_position_embeddings``) whose :func:`plan_lora_training` fits; 0 if not even ``step`` tokens do."""

    def fits(seq_len: int) -> bool:
        return plan_lora_training(
            model, devices, seq_len, batch_size, rank, offload, offload_activations, ep_size
        ).fits

    limit = model.config.get_text_config().max_position_embeddings // step
    low, high = 0, 1  # low fits (or is 0), high is the next multiple to try
    while high <= limit and fits(high * step):
        low, high = high, 2 * high
    high = min(high, limit + 1)
    while high - low > 1:  # fits(low * step), not fits(high * step)
        middle = (low + high) // 2
        low, high = (middle, high) if fits(middle * step) else (low, middle)
    return low * step


__all__ = [
    "LORA_EXPERTS",
    "LORA_LINEARS",
    "RESERVE_BYTES",
    "LoraTrainingPlan",
    "PerDeviceTotal",
    "all_to_all_bytes",
    "checkpointed_input_bytes_per_token",
    "layer_saved_bytes_per_token",
    "longest_sequence",
    "lora_parameters",
    "plan_lora_training",
]
