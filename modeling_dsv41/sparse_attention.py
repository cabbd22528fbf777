"""Sparse sink attention: each query attends over its own list of *slots* (rows of a K=V tensor, -1 for none), with a
per-head sink logit in the softmax denominator, as the reference's sparse attention kernel computes it.

:func:`sink_attention` reduces the slots in the reference kernel's blocks of 64, so that the float rounding, and with
it the logits, follow the reference's; inference outside reference numerics takes as many as fit a memory bound
(:func:`slots_per_step`: a decode step's query all at once), for fewer ops. Its backward recomputes the blocks from
each row's log-sum-exp (:func:`sink_attention_backward`). :func:`sink_attention_probs` and
:func:`attention_from_probs` are the same attention through its explicit map (``output_attentions``).
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from .numerics import backward_in_forward_numerics, reference_numerics_active

# Slots per step of the reference kernel's online softmax (its tile of gathered K=V rows).
SPARSE_ATTENTION_BLOCK = 64
# In inference, outside reference numerics, a step takes as many slots as keep its gathered fp32 keys and logits
# within this many bytes (at least the kernel's 64): each step is some twenty ops, and a decode step's query takes
# all its slots in one.
SPARSE_ATTENTION_STEP_BYTES = 64 * 2**20


def slots_per_step(q: torch.Tensor) -> int:
    """Slots per step of an online softmax that keeps nothing for a backward (inference: decoding, eval), for queries
    q [B, S, H, D]: as many as :data:`SPARSE_ATTENTION_STEP_BYTES` allows, at least :data:`SPARSE_ATTENTION_BLOCK`.
    Training, reference numerics (the reference kernel's rounding points) and ``torch.compile`` (which fuses the
    steps' ops, and would otherwise recompile for each sequence length) take the kernel's 64."""
    if reference_numerics_active() or torch.compiler.is_compiling():
        return SPARSE_ATTENTION_BLOCK
    bsz, seq_len, n_heads, dim = q.shape
    return max(SPARSE_ATTENTION_BLOCK, SPARSE_ATTENTION_STEP_BYTES // (4 * bsz * seq_len * (dim + 2 * n_heads)))


def gather_slots(kv: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """The K=V rows [B, S, k, D] that ``slots`` [B, S, k] pick from kv [B, N, D]; an empty slot (-1) reads row 0,
    for the caller to mask.

    An ``index_select`` on the flattened rows rather than advanced indexing: its backward is an ``index_add_``
    (atomic adds on GPU) instead of the deterministic ``index_put_`` that advanced indexing's backward sorts
    its indices for, which dominated a GPU training step. The forward is the same copy of the same rows.
    """
    bsz, n_rows, dim = kv.shape
    offsets = torch.arange(0, bsz * n_rows, n_rows, device=slots.device).view(-1, 1, 1)
    flat = (slots.clamp_min(0) + offsets).flatten()
    return kv.reshape(bsz * n_rows, dim).index_select(0, flat).view(*slots.shape, dim)


def sink_attention(
    q: torch.Tensor, kv: torch.Tensor, slots: torch.Tensor, sink: torch.Tensor, scale: float
) -> torch.Tensor:
    """Softmax attention of every head over the K=V rows its query's ``slots`` pick, with a per-head sink logit in
    the denominator: :func:`sink_attention_forward`'s output, differentiated by recomputation.

    q [B,S,H,D], kv [B,N,D], slots [B,S,K] (rows of kv, -1 = empty), sink [H] → [B,S,H,D]. For the backward it keeps
    q, kv, the slots, the sink, the output and each row's log-sum-exp, not the gathered keys or the probabilities:
    :func:`sink_attention_backward` recomputes them block by block, as sparse attention kernels do. Without a
    gradient to track it is the forward alone, in fewer steps (:func:`slots_per_step`).
    """
    if torch.is_grad_enabled() and (q.requires_grad or kv.requires_grad or sink.requires_grad):
        return _SinkAttention.apply(q, kv, slots, sink, scale)
    return _online_softmax(q, kv, slots, sink, scale, slots_per_step(q))[0]


def sink_attention_forward(
    q: torch.Tensor,
    kv: torch.Tensor,
    slots: torch.Tensor,
    sink: torch.Tensor,
    scale: float,
    step: int = SPARSE_ATTENTION_BLOCK,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The output of :func:`sink_attention` [B,S,H,D] and each row's log-sum-exp [B,S,H] (fp32, over its slots'
    logits and its sink).

    As in the reference kernel, an online softmax runs over blocks of ``step`` slots (the kernel's 64; wider in
    inference, :func:`slots_per_step`): probabilities are taken against the running maximum and rounded to the
    activation dtype before the PV product, while the denominator and the accumulator stay fp32. A query with no slot
    to attend to gets zeros. Written in differentiable ops, so autograd of it is the plain backward that keeps every
    block's keys and probabilities.
    """
    out, peak, denom = _online_softmax(q, kv, slots, sink, scale, step)
    return out, peak + torch.log(denom)


def _online_softmax(
    q: torch.Tensor, kv: torch.Tensor, slots: torch.Tensor, sink: torch.Tensor, scale: float, step: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`sink_attention_forward`'s output [B,S,H,D] with the final running maximum and denominator [B,S,H]."""
    qf, kvf = q.float(), kv.float()
    peak, denom, acc = _online_softmax_first(qf, kvf, slots[..., :step], scale, q.dtype)
    for start in range(step, slots.shape[-1], step):
        block = slots[..., start : start + step]
        peak, denom, acc = _online_softmax_step(qf, kvf, block, scale, peak, denom, acc, q.dtype)
    denom = denom + torch.exp(sink - peak)  # a bf16 sink promoted to fp32 inside the subtraction
    return (acc / denom.unsqueeze(-1)).to(q.dtype), peak, denom


def _online_softmax_first(
    qf: torch.Tensor, kvf: torch.Tensor, block: torch.Tensor, scale: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`_online_softmax_step` from the empty state (maximum -1e30, zero sums), in the ops that do not change
    its result: the rescale of the empty sums is exp(-1e30 - peak) = 0. The maximum stays finite (-1e30) over a
    block of empty slots, so that their probabilities are exp(-inf) = 0 as later blocks' are."""
    keys, scores = _block_scores(qf, kvf, block, scale)
    peak = scores.amax(dim=-1).clamp_min(-1e30)
    probs = torch.exp(scores - peak.unsqueeze(-1))
    acc = torch.einsum("bshk,bskd->bshd", probs.to(dtype).float(), keys)
    return peak, probs.sum(dim=-1), acc


def _online_softmax_step(
    qf: torch.Tensor,
    kvf: torch.Tensor,
    block: torch.Tensor,
    scale: float,
    peak: torch.Tensor,
    denom: torch.Tensor,
    acc: torch.Tensor,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One block of the online softmax: the running maximum, denominator and accumulator after it (a function of its
    own, so that a block's keys are freed before the next block gathers its own)."""
    keys, scores = _block_scores(qf, kvf, block, scale)
    new_peak = torch.maximum(peak, scores.amax(dim=-1))
    rescale = torch.exp(peak - new_peak)
    probs = torch.exp(scores - new_peak.unsqueeze(-1))
    denom = denom * rescale + probs.sum(dim=-1)
    acc = acc * rescale.unsqueeze(-1) + torch.einsum("bshk,bskd->bshd", probs.to(dtype).float(), keys)
    return new_peak, denom, acc


def _block_scores(
    qf: torch.Tensor, kvf: torch.Tensor, block: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """One block's keys [B,S,k,D] (fp32; an empty slot's are row 0's) and scaled logits [B,S,H,k] (-inf on empty
    slots). An empty slot's probability is exactly 0, so its (finite) keys add nothing forward or backward."""
    keys = gather_slots(kvf, block)
    scores = torch.einsum("bshd,bskd->bshk", qf, keys) * scale
    return keys, scores.masked_fill((block < 0).unsqueeze(2), -torch.inf)


def sink_attention_backward(
    grad: torch.Tensor,
    q: torch.Tensor,
    kv: torch.Tensor,
    slots: torch.Tensor,
    sink: torch.Tensor,
    scale: float,
    out: torch.Tensor,
    lse: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients (q [B,S,H,D], kv [B,N,D], sink [H]) of :func:`sink_attention` given the output's ``grad``, from what
    its forward kept: each block's keys and logits are recomputed as the forward computed them, its probabilities
    from the row's log-sum-exp, p = exp(logit - lse). With δ = Σ_d grad·out per row (the sink's value is zero),
    d logit = p·(grad·key - δ), the sink gets -Σ p_sink·δ, and each slot's key and value gradients (one row of kv
    for both) are added back onto the row it picked."""
    bsz, n_rows, dim = kv.shape
    n_heads = q.shape[2]
    kvf = kv.float()
    qg = torch.cat([q.float(), grad.float()], dim=2)  # [B, S, 2H, D]: a slot's key and value gradients, one product
    delta = (qg[:, :, n_heads:] * out.float()).sum(dim=-1)  # [B, S, H]
    grad_q = torch.zeros_like(qg[:, :, :n_heads])
    grad_kv = kvf.new_zeros(bsz * n_rows, dim)
    offsets = torch.arange(0, bsz * n_rows, n_rows, device=slots.device).view(-1, 1, 1)
    for start in range(0, slots.shape[-1], SPARSE_ATTENTION_BLOCK):
        block = slots[..., start : start + SPARSE_ATTENTION_BLOCK]
        _block_backward(qg, kvf, (block.clamp_min(0) + offsets).flatten(), block, lse, delta, scale, grad_q, grad_kv)
    grad_sink = -(torch.exp(sink.float() - lse) * delta).sum(dim=(0, 1))
    return grad_q.to(q.dtype), grad_kv.view(bsz, n_rows, dim).to(kv.dtype), grad_sink.to(sink.dtype)


def _block_backward(
    qg: torch.Tensor,
    kvf: torch.Tensor,
    rows: torch.Tensor,
    block: torch.Tensor,
    lse: torch.Tensor,
    delta: torch.Tensor,
    scale: float,
    grad_q: torch.Tensor,
    grad_kv: torch.Tensor,
) -> None:
    """One block's share of :func:`sink_attention_backward`, added into ``grad_q`` [B,S,H,D] and ``grad_kv``
    [B·N, D] (fp32) at the flattened ``rows`` its slots picked."""
    n_heads = grad_q.shape[2]
    keys, scores = _block_scores(qg[:, :, :n_heads], kvf, block, scale)
    probs = torch.exp(scores - lse.unsqueeze(-1))  # [B, S, H, k], 0 on empty slots
    grad_scores = probs * (torch.einsum("bshd,bskd->bshk", qg[:, :, n_heads:], keys) - delta.unsqueeze(-1)) * scale
    grad_q.add_(torch.einsum("bshk,bskd->bshd", grad_scores, keys))
    grad_keys = torch.einsum("bshk,bshd->bskd", torch.cat([grad_scores, probs], dim=2), qg)
    grad_kv.index_add_(0, rows, grad_keys.flatten(0, 2))


class _SinkAttention(torch.autograd.Function):
    """:func:`sink_attention_forward` whose backward recomputes the blocks (:func:`sink_attention_backward`)."""

    @staticmethod
    def forward(ctx, q, kv, slots, sink, scale):
        out, lse = sink_attention_forward(q, kv, slots, sink, scale)
        ctx.save_for_backward(q, kv, slots, sink, out, lse)
        ctx.scale, ctx.reference_numerics = scale, reference_numerics_active()
        return out

    @staticmethod
    @once_differentiable
    @backward_in_forward_numerics
    def backward(ctx, grad):
        q, kv, slots, sink, out, lse = ctx.saved_tensors
        grad_q, grad_kv, grad_sink = sink_attention_backward(grad, q, kv, slots, sink, ctx.scale, out, lse)
        return grad_q, grad_kv, None, grad_sink, None


def sink_attention_probs(
    q: torch.Tensor, kv: torch.Tensor, slots: torch.Tensor, sink: torch.Tensor, scale: float
) -> torch.Tensor:
    """The attention map of :func:`sink_attention`: each head's probability on each of its query's slots
    [B, H, S, K] (same arguments), in the activation dtype. An empty slot gets 0; a row sums to less than one,
    the rest going to the sink."""
    keys = gather_slots(kv.float(), slots)
    logits = torch.einsum("bshd,bskd->bhsk", q.float(), keys) * scale
    logits = logits.masked_fill((slots < 0).unsqueeze(1), -torch.inf)
    sinks = sink.float().view(1, -1, 1, 1).expand(*logits.shape[:-1], 1)
    return torch.cat([logits, sinks], dim=-1).softmax(dim=-1)[..., :-1].to(q.dtype)


def attention_from_probs(probs: torch.Tensor, kv: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """:func:`sink_attention`'s output [B, S, H, D] from its attention map probs [B, H, S, K]
    (:func:`sink_attention_probs`), as transformers' eager attention computes it, so that the map lies on the
    gradient path. It agrees with the fused online softmax to rounding (that one rounds per block of slots, as the
    reference kernel)."""
    return torch.einsum("bhsk,bskd->bshd", probs.float(), gather_slots(kv.float(), slots)).to(kv.dtype)
