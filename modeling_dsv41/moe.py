"""DeepSeek-V4.1 mixture of experts: a biased top-k router with a second bias for image tokens, clamped
SwiGLU routed experts stored fused as transformers' experts are (``gate_up_proj`` [E, 2·I, D], ``down_proj``
[E, D, I], dispatched by ``config._experts_implementation``), and one shared expert every token goes through."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn
from transformers.integrations.moe import use_experts_implementation

from .numerics import reference_numerics_active
from .recompute import recomputed
from .upstream import _grouped_mm


class DeepseekV41Gate(nn.Module):
    """Router. ``bias`` (text) or ``bias_vl`` (image-span tokens) steers which experts are *chosen*; the routing
    weights come from the unbiased scores, renormalized over the chosen ones and scaled by ``route_scale``.

    Both biases are fp32 buffers (saved with the model): the aux-loss-free balancing rule moves them, never a
    gradient or an optimizer (see :mod:`~modeling_dsv41.training.router_balancing`).
    """

    def __init__(self, config, use_vision_bias: bool, num_experts: int | None = None, top_k: int | None = None):
        super().__init__()
        num_experts = num_experts or config.n_routed_experts
        self.top_k = top_k or config.num_experts_per_tok
        self.scoring_func = config.scoring_func
        self.gate_temp = config.gate_temp
        self.norm_topk_prob = config.norm_topk_prob
        self.route_scale = config.routed_scaling_factor
        self.weight = nn.Parameter(torch.empty(num_experts, config.hidden_size))
        self.register_buffer("bias", torch.zeros(num_experts, dtype=torch.float32))
        if use_vision_bias:
            self.register_buffer("bias_vl", torch.zeros(num_experts, dtype=torch.float32))
        else:
            self.bias_vl = None

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """Router logits [N, E] in fp32, before the scoring function."""
        logits = F.linear(x.float(), self.weight.float())
        return logits if self.gate_temp == 1 else logits / self.gate_temp  # (x / 1 is x: one op less)

    def scores(self, logits: torch.Tensor) -> torch.Tensor:
        """Unbiased expert affinities [N, E] in fp32 from the logits."""
        if self.scoring_func == "softmax":
            return logits.softmax(dim=-1)
        if self.scoring_func == "sigmoid":
            return logits.sigmoid()
        return F.softplus(logits).sqrt()

    def forward(
        self, x: torch.Tensor, image_mask: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [N, D], image_mask [N] bool → (router logits [N, E] fp32, weights [N, k] fp32, expert indices [N, k]).
        The logits come first, as transformers' routers return them (``output_router_logits`` records them)."""
        logits = self.logits(x)
        scores = self.scores(logits)
        bias = self.bias.float()
        if image_mask is not None and self.bias_vl is not None:
            bias = torch.where(image_mask.unsqueeze(-1), self.bias_vl.float(), bias)
        indices = (scores + bias).topk(self.top_k, dim=-1).indices
        weights = scores.gather(1, indices)
        if self.norm_topk_prob and self.top_k > 1:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)  # not norm_eps: matches training
        return logits, weights * self.route_scale, indices


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """``silu(gate) * up`` in fp32 with the training clamps: up to ±limit, gate above at limit (none if limit <= 0).

    ``up`` is clamped in its own dtype where ±limit are numbers of it (bf16's 10, say): the clamp's result is then
    the same number either way, and the product promotes it to fp32 exactly, without a copy of its own."""
    gate = gate.float()
    if limit > 0:
        up = up.clamp(-limit, limit) if _is_exactly(limit, up.dtype) else up.float().clamp(-limit, limit)
        gate = gate.clamp(max=limit)
    return F.silu(gate) * up


def _is_exactly(value: float, dtype: torch.dtype) -> bool:
    """Whether ``value``'s significand fits ``dtype``'s (a conservative test of being one of its numbers), in plain
    Python, which ``torch.compile`` folds."""
    bits = _SIGNIFICAND_BITS.get(dtype)
    return bits is not None and (math.frexp(value)[0] * 2**bits).is_integer()


_SIGNIFICAND_BITS = {torch.bfloat16: 8, torch.float16: 11, torch.float32: 24, torch.float64: 53}


def swiglu_hidden(
    gate: torch.Tensor, up: torch.Tensor, limit: float, dtype: torch.dtype, weight: torch.Tensor | None = None
) -> torch.Tensor:
    """The experts' hidden activation in ``dtype``: :func:`clamped_swiglu` (fp32), times the routing ``weight``
    [N, 1] where given, rounded once. Recomputed in the backward (:func:`~.recompute.recomputed`): it keeps the
    projections gate and up [N, I], not the fp32 copies, clamps and products of every routed slot."""

    def region(gate: torch.Tensor, up: torch.Tensor, weight: torch.Tensor | None) -> torch.Tensor:
        hidden = clamped_swiglu(gate, up, limit)
        return (hidden if weight is None else weight * hidden).to(dtype)

    return recomputed(region, gate, up, weight)


class DeepseekV41Expert(nn.Module):
    """The shared expert: a SwiGLU FFN (``w1`` gate, ``w3`` up, ``w2`` down) with the routed experts' clamps."""

    def __init__(self, hidden_size: int, intermediate_size: int, swiglu_limit: float):
        super().__init__()
        self.w1 = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.w2 = nn.Linear(intermediate_size, hidden_size, bias=False)
        self.w3 = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.swiglu_limit = swiglu_limit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(swiglu_hidden(self.w1(x), self.w3(x), self.swiglu_limit, x.dtype))


@use_experts_implementation
class DeepseekV41Experts(nn.Module):
    """The routed experts as two fused tensors, in the layout of transformers' MoE experts: ``gate_up_proj``
    [E, 2·I, D] (each expert's ``w1`` rows, then its ``w3`` rows) and ``down_proj`` [E, D, I] (its ``w2``).
    The released per-expert ``w1``/``w2``/``w3`` are merged on load and split again on save (see
    :mod:`~modeling_dsv41.released.conversions`).

    ``experts_implementation="eager"`` (this ``forward``, the default) is the reference's computation: the routing
    weight scales the clamped SwiGLU activation before ``w2`` and the experts' outputs are summed in fp32 in expert
    order. ``"batched_mm"`` and ``"grouped_mm"`` run transformers' kernels with the same clamps
    (:meth:`_apply_gate`), scale after ``w2`` and return the model dtype, so they agree with eager to rounding.
    """

    def __init__(self, config, num_experts: int | None = None):
        super().__init__()
        self.num_experts = num_experts or config.n_routed_experts
        self.hidden_dim = config.hidden_size
        self.intermediate_dim = config.moe_intermediate_size
        self.swiglu_limit = config.swiglu_limit
        self.gate_up_proj = nn.Parameter(torch.empty(self.num_experts, 2 * self.intermediate_dim, self.hidden_dim))
        self.down_proj = nn.Parameter(torch.empty(self.num_experts, self.hidden_dim, self.intermediate_dim))

    def expert_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``gate_up_proj`` [E, 2·I, D] and ``down_proj`` [E, D, I]: the one place the eager and compiled paths read
        the routed experts' weights, once per forward (a PEFT parametrization computes them)."""
        return self.gate_up_proj, self.down_proj

    def _apply_gate(self, gate_up_out: torch.Tensor) -> torch.Tensor:
        """[S, 2·I] gate and up projections → clamped SwiGLU [S, I] (batched_mm / grouped_mm)."""
        gate, up = gate_up_out.chunk(2, dim=-1)
        return swiglu_hidden(gate, up, self.swiglu_limit, gate_up_out.dtype)

    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        """hidden_states [N, D], top_k_index / top_k_weights [N, k] → fp32 [N, D].

        Few routed slots (N·k ≤ E, decoding): :meth:`_forward_per_slot`. Otherwise, where
        :func:`uses_grouped_kernels`, all experts' grouped products over the slots sorted by expert
        (:func:`grouped_experts_forward`, fixed shapes); else only experts with tokens run
        (:func:`routed_experts_forward`, one host sync reading how many each got)."""
        if top_k_index.numel() <= self.num_experts:
            return self._forward_per_slot(hidden_states, top_k_index, top_k_weights)
        gate_up_proj, down_proj = self.expert_weights()
        if uses_grouped_kernels(gate_up_proj):
            return grouped_experts_forward(
                hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj, self.swiglu_limit
            )
        # one unbind, whose backward stacks every expert's gradient once (indexing per expert would build a
        # zero-padded [E, ...] gradient per expert)
        gate_ups, downs = gate_up_proj.unbind(0), down_proj.unbind(0)
        return routed_experts_forward(
            hidden_states,
            top_k_index,
            top_k_weights,
            self.num_experts,
            self.swiglu_limit,
            lambda expert: (gate_ups[expert], downs[expert]),
        )

    def _forward_per_slot(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        """:func:`per_slot_experts_forward` on the chosen experts' weights, gathered."""
        gate_up_proj, down_proj = self.expert_weights()
        return per_slot_experts_forward(
            hidden_states,
            top_k_index,
            top_k_weights,
            self.swiglu_limit,
            gate_up_proj.shape[0],
            lambda experts: (gate_up_proj.index_select(0, experts), down_proj.index_select(0, experts)),
        )


def per_slot_experts_forward(
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    swiglu_limit: float,
    num_held: int,
    slot_weights: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
) -> torch.Tensor:
    """The routed experts slot by slot, each slot's expert weights gathered (``slot_weights(experts [N·k])`` →
    gate_up [N·k, 2·I, D] and down [N·k, D, I] in the compute dtype): a fixed number of batched ops with no host sync
    (one graph under ``torch.compile``), and, with no more slots than experts, no more weight read than the
    per-expert loop. On the CPU each token's experts are summed in ascending order, as the loop does (the reference's
    bits); elsewhere in one reduction, in slot order. ``num_held``: the experts held (expert parallelism's off-rank
    slots, id = that count and weight 0, read the last one held and add 0). Returns fp32 [N, D]."""
    num_tokens, top_k = top_k_index.shape
    in_loop_order = hidden_states.device.type == "cpu"
    experts, weights = top_k_index, top_k_weights
    if in_loop_order:
        order = top_k_index.argsort(dim=1)
        experts, weights = experts.gather(1, order), weights.gather(1, order)
    gate_up_weights, down_weights = slot_weights(experts.flatten().clamp(max=num_held - 1))
    x = hidden_states.repeat_interleave(top_k, dim=0).unsqueeze(-1)  # [N·k, D, 1]
    gate_up = torch.bmm(gate_up_weights, x).squeeze(-1)  # [N·k, 2·I] (I/tp under TP)
    gate, up = gate_up.chunk(2, dim=-1)
    hidden = swiglu_hidden(gate, up, swiglu_limit, x.dtype, weights.reshape(-1, 1)).unsqueeze(-1)
    out = torch.bmm(down_weights, hidden).view(num_tokens, top_k, -1)
    if not in_loop_order:
        return out.sum(dim=1, dtype=torch.float32)
    total = out[:, 0].float()
    for slot in range(1, top_k):  # fixed order: the fp32 sum is the loop's, 0 + e_first + e_second + …
        total = total + out[:, slot]  # promoted to fp32 inside the add
    return total


class ProjectedWeight(Protocol):
    """An expert weight [out, in] that is applied rather than materialized (the natively loaded FP4 experts:
    dequantized inside the product and again in its backward, LoRA deltas added to the output)."""

    shape: torch.Size

    def linear(self, x: torch.Tensor, rows: slice) -> torch.Tensor:
        """``x @ W[rows].T``: x [N, in] → [N, len(rows)]."""
        ...


ExpertWeight = torch.Tensor | ProjectedWeight


def _project(x: torch.Tensor, weight: ExpertWeight, rows: slice) -> torch.Tensor:
    if isinstance(weight, torch.Tensor):
        return F.linear(x, weight[rows])
    return weight.linear(x, rows)


def uses_grouped_kernels(weight: torch.Tensor) -> bool:
    """Whether the routed experts of ``weight`` run as grouped products (:func:`grouped_experts_forward`): under
    ``torch.compile``, and eagerly in bf16 on an accelerator outside reference numerics, where the per-expert loop's
    host sync and its E small products cost more than one grouped kernel. On the CPU the loop, which runs only the
    experts with tokens and sums them in the reference's order, is as fast."""
    if torch.compiler.is_compiling():
        return True
    return weight.device.type != "cpu" and weight.dtype == torch.bfloat16 and not reference_numerics_active()


def routed_experts_forward(
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    num_experts: int,
    swiglu_limit: float,
    expert_weights: Callable[[int], tuple[ExpertWeight, ExpertWeight]],
) -> torch.Tensor:
    """The reference's routed experts (the eager implementation), shared by the plain and the natively quantized
    experts. ``expert_weights(e)`` gives expert ``e``'s ``gate_up`` [2·I, D] and ``down`` [D, I] in the compute dtype,
    as tensors or as :class:`ProjectedWeight` (a frozen quantized weight applied without being kept); it is called
    only for experts with tokens, in expert order. Returns fp32 [N, D]; one host sync reads how many tokens each
    expert got.

    The slots are gathered once, grouped by expert: the input gradient is then one scatter-add in that order (a token
    sums its experts' gradients in ascending expert order), as under expert parallelism, where the same gathered
    slots travel to the ranks holding their experts (:mod:`~modeling_dsv41.training.expert_parallel`)."""
    num_tokens, top_k = top_k_index.shape
    expert_ids = top_k_index.flatten()
    order = expert_ids.argsort(stable=True)  # slots grouped by expert, tokens ascending within each
    counts = torch.bincount(expert_ids, minlength=num_experts).tolist()
    # expert parallelism routes other ranks' slots to id `num_experts` (local count), weight 0: sorted last, skipped
    counts = counts[:num_experts]
    slot_tokens = order[: sum(counts)] // top_k
    # index_select: its backward is a plain index_add, far cheaper than advanced indexing's scatter
    inputs = hidden_states.index_select(0, slot_tokens).split(counts)
    tokens, weights = slot_tokens.split(counts), top_k_weights.flatten()[order[: sum(counts)]].split(counts)
    out = hidden_states.new_zeros(num_tokens, hidden_states.shape[-1], dtype=torch.float32)
    groups = zip(tokens, weights, inputs)
    for expert, (token, weight, x) in enumerate(groups):  # fixed order: the fp32 sum is reproducible
        if token.numel() == 0:
            continue
        gate_up, down = expert_weights(expert)
        inter = gate_up.shape[0] // 2  # this rank's I/tp under tensor parallelism (`packed_colwise`)
        gate, up = _project(x, gate_up, slice(0, inter)), _project(x, gate_up, slice(inter, None))
        hidden = swiglu_hidden(gate, up, swiglu_limit, x.dtype, weight.unsqueeze(-1))
        add_rows(out, token, _project(hidden, down, slice(None)).float())
    return out


def grouped_experts_forward(
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    swiglu_limit: float,
) -> torch.Tensor:
    """:func:`routed_experts_forward`'s computation in fixed shapes, for ``torch.compile``: the N·k slots sorted by
    expert, each expert's rows delimited by offsets (counts by a scatter into [E], not a data-dependent
    ``bincount``), both projections as grouped products (transformers' ``_grouped_mm``: torch's kernel where it
    compiles, a custom op otherwise), the routing weight applied before ``w2`` and each token's experts added in
    ascending expert order in fp32, as the eager loop does. Returns fp32 [N, D]; agrees with it to GEMM rounding.
    """
    num_tokens, top_k = top_k_index.shape
    num_experts = gate_up_proj.shape[0]
    expert_ids = top_k_index.flatten()
    order = expert_ids.argsort(stable=True)  # slots grouped by expert, tokens ascending within each
    sorted_ids = expert_ids.index_select(0, order)
    # expert parallelism's off-rank slots (id = local count, weight 0) sort last, past the last offset
    counts = sorted_ids.new_zeros(num_experts + 1).scatter_add_(0, sorted_ids, torch.ones_like(sorted_ids))
    offsets = counts[:num_experts].cumsum(0).to(torch.int32)
    valid = (sorted_ids < num_experts).unsqueeze(-1)
    slot_tokens = order // top_k
    x = hidden_states.index_select(0, slot_tokens).masked_fill(~valid, 0)
    gate_up = _grouped_mm(x, gate_up_proj.transpose(-2, -1), offsets)  # [N·k, 2·I]
    gate, up = gate_up.chunk(2, dim=-1)
    # the grouped products leave the rows past the last offset undefined: masked, so that no gradient comes of them
    weights = top_k_weights.flatten().index_select(0, order).unsqueeze(-1).masked_fill(~valid, 0)
    hidden = swiglu_hidden(gate, up, swiglu_limit, x.dtype, weights)
    out = _grouped_mm(hidden, down_proj.transpose(-2, -1), offsets).float().masked_fill(~valid, 0)
    return out.new_zeros(num_tokens, out.shape[-1]).index_add(0, slot_tokens, out)


def add_rows(out: torch.Tensor, index: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
    """``out.index_add_(0, index, source)`` (in place) whose backward keeps only ``index``: autograd's own keeps
    ``source`` too, for its shape, and in the experts' loop that is every routed slot's fp32 output [n, D]."""
    return _AddRows.apply(out, index, source)


class _AddRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, out, index, source):
        ctx.save_for_backward(index)
        ctx.mark_dirty(out)
        return out.index_add_(0, index, source)

    @staticmethod
    def backward(ctx, grad):
        (index,) = ctx.saved_tensors
        return grad, None, grad.index_select(0, index)


class DeepseekV41MoE(nn.Module):
    """Routed ``experts`` (:class:`DeepseekV41Experts`) plus ``shared_experts``. ``num_experts`` / ``top_k`` default
    to the config's (the DSpark draft blocks have their own)."""

    def __init__(self, config, use_vision_bias: bool, num_experts: int | None = None, top_k: int | None = None):
        super().__init__()
        self.n_routed_experts = num_experts or config.n_routed_experts
        self.gate = DeepseekV41Gate(config, use_vision_bias, self.n_routed_experts, top_k)
        self.experts = DeepseekV41Experts(config, self.n_routed_experts)
        self.shared_experts = DeepseekV41Expert(config.hidden_size, config.moe_intermediate_size, config.swiglu_limit)
        self.last_expert_indices: torch.Tensor | None = None  # [B, S, k], read by the bias-balancing rule

    def forward(self, x: torch.Tensor, image_mask: torch.Tensor | None = None) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        _, weights, indices = self.gate(x, None if image_mask is None else image_mask.reshape(-1))
        self.last_expert_indices = indices.detach().view(*shape[:-1], -1)
        out = self.experts(x, indices, weights).float() + self.shared_experts(x)  # the shared output promoted
        return out.to(x.dtype).view(shape)
