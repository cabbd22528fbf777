"""Single-pass manifold-constrained hyper-connections (mHC) over ``hc_mult`` residual copies.

Each sub-block derives (pre, post, comb) from its own input stream. ``post`` and ``comb`` expand the
sub-block's output back into the copies; ``pre`` is handed to the *next* sub-block, which uses it to
collapse the copies into its input (one-hot on copy 0 before the first layer).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import once_differentiable

from .numerics import backward_in_forward_numerics, reference_numerics_active
from .recompute import recomputed


def sinkhorn_split(
    mixes: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, hc_mult: int, iters: int, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Split projected mixes [..., (2+hc)·hc] into pre [..., hc], post [..., hc] and a doubly-stochastic comb [..., hc,
    hc]."""
    hc = hc_mult
    sizes = [hc, hc, hc * hc]
    (pre, post, comb), (pre_base, post_base, comb_base) = mixes.split(sizes, dim=-1), base.float().split(sizes)
    pre_scale, post_scale, comb_scale = scale.float().unbind()  # (split and unbind: one op each in the backward)
    pre = torch.sigmoid(pre * pre_scale + pre_base) + eps
    post = 2 * torch.sigmoid(post * post_scale + post_base)
    comb = comb * comb_scale + comb_base
    # Sinkhorn on [hc, hc, tokens]: the row and column sums become adds of contiguous token vectors (3-4x faster on
    # CPU than reducing a trailing dim of 4) and add in the same order, so the result is bit-identical.
    lead = comb.shape[:-1]
    comb = _Sinkhorn.apply(comb.reshape(-1, hc, hc).permute(1, 2, 0).contiguous(), iters, eps)
    return pre, post, comb.permute(2, 0, 1).reshape(*lead, hc, hc)


def _sinkhorn_dims(iters: int) -> list[int]:
    """The dim each normalisation sums over after the softmax: columns (0), then rows and columns ``iters - 1``
    times."""
    return [0] + [1, 0] * (iters - 1)


class _Sinkhorn(torch.autograd.Function):
    """Softmax over rows then Sinkhorn's alternate normalisations of comb logits [hc, hc, N], as the reference: a
    step is ``x / (x.sum(dim) + eps)``. The backward keeps the softmax and each step's normaliser [hc, 1, N] or
    [1, hc, N] (not the iterates: each is one division of the previous, replayed exactly), and takes a step's
    gradient in four ops, ``(g - Σ_dim g·y) / d``, where autograd of the division takes about twice as many."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
        comb = torch.exp(logits - logits.amax(dim=1, keepdim=True))
        softmax = comb / comb.sum(dim=1, keepdim=True)
        comb, normalisers = softmax + eps, []
        for dim in _sinkhorn_dims(iters):
            normalisers.append(comb.sum(dim=dim, keepdim=True) + eps)
            comb = comb / normalisers[-1]
        ctx.save_for_backward(softmax, *normalisers)
        ctx.eps, ctx.reference_numerics = eps, reference_numerics_active()
        return comb

    @staticmethod
    @once_differentiable
    @backward_in_forward_numerics
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        softmax, *normalisers = ctx.saved_tensors
        iterates, comb = [], softmax + ctx.eps
        for normaliser in normalisers:
            comb = comb / normaliser
            iterates.append(comb)
        dims = _sinkhorn_dims(len(normalisers) // 2 + 1)
        for dim, iterate, normaliser in zip(reversed(dims), reversed(iterates), reversed(normalisers)):
            grad = (grad - (grad * iterate).sum(dim=dim, keepdim=True)) / normaliser
        # the softmax's: shift-invariant, so the max subtracted before the exp gets none
        return softmax * (grad - (grad * softmax).sum(dim=1, keepdim=True)), None, None


class DeepseekV41HyperConnection(nn.Module):
    """mHC's arithmetic over the copies: a sub-block's mixes from its input, the collapse and the expand. It holds no
    parameters: each sub-block's are its block's (:class:`DeepseekV41HyperConnectedBlock`)."""

    def __init__(self, hc_mult: int, sinkhorn_iters: int, hc_eps: float, norm_eps: float):
        super().__init__()
        self.hc_mult, self.sinkhorn_iters, self.hc_eps, self.norm_eps = hc_mult, sinkhorn_iters, hc_eps, norm_eps

    def mixes(
        self, x: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [B,S,hc,D] → (pre [B,S,hc], post [B,S,hc], comb [B,S,hc,hc]), all fp32. The projection is recomputed in
        the backward (:func:`~.recompute.recomputed`), which keeps x (collapse and expand keep it anyway) rather
        than its fp32 copy; Sinkhorn keeps its normalisers (:class:`_Sinkhorn`)."""
        mixes = recomputed(self._project, x, fn)
        return sinkhorn_split(mixes, scale, base, self.hc_mult, self.sinkhorn_iters, self.hc_eps)

    def _project(self, x: torch.Tensor, fn: torch.Tensor) -> torch.Tensor:
        """x [B,S,hc,D] → the mixes [B,S,(2+hc)·hc] (fp32): one RMS statistic per token over all copies."""
        flat = x.flatten(2).float()
        rstd = torch.rsqrt(flat.square().mean(-1, keepdim=True) + self.norm_eps)
        return F.linear(flat, fn.float()) * rstd

    @staticmethod
    def collapse(x: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
        """[B,S,hc,D] × [B,S,hc] → [B,S,D]: the sub-block input."""
        return _Collapse.apply(x, pre)

    @staticmethod
    def expand(out: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
        """post·out + combᵀ·residual → [B,S,hc,D]: copy j gets Σ_i comb[i, j]·residual_i."""
        return _Expand.apply(out, residual, post, comb)


# The forwards below are the reference's arithmetic (fp32 broadcast products summed over the copies, so the bits
# match it); their backwards are small matmuls over the copies, in the numerics the forward ran in. Autograd of the
# broadcast products would form [B,S,hc,hc,D] products and reduce them again: on CPU most of mHC's backward, for the
# same values up to fp32 rounding of the sums' order.


class _Collapse(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, pre)
        ctx.reference_numerics = reference_numerics_active()
        return (pre.unsqueeze(-1) * x).sum(dim=2).to(x.dtype)  # x promoted to fp32 inside the product

    @staticmethod
    @once_differentiable
    @backward_in_forward_numerics
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        x, pre = ctx.saved_tensors
        grad = grad.float().unsqueeze(-2)  # [B,S,1,D]
        grad_x = (pre.unsqueeze(-1) * grad).to(x.dtype) if ctx.needs_input_grad[0] else None
        grad_pre = (x.float() @ grad.transpose(-1, -2)).squeeze(-1) if ctx.needs_input_grad[1] else None
        return grad_x, grad_pre


class _Expand(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx, out: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor
    ) -> torch.Tensor:
        ctx.save_for_backward(out, residual, post, comb)
        ctx.reference_numerics = reference_numerics_active()
        mixed = (comb.unsqueeze(-1) * residual.unsqueeze(-2)).sum(dim=2)
        return (post.unsqueeze(-1) * out.unsqueeze(-2) + mixed).to(out.dtype)

    @staticmethod
    @once_differentiable
    @backward_in_forward_numerics
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        out, residual, post, comb = ctx.saved_tensors
        grad = grad.float()  # [B,S,hc,D]
        needs = ctx.needs_input_grad
        grad_out = (post.unsqueeze(-2) @ grad).squeeze(-2).to(out.dtype) if needs[0] else None
        grad_residual = (comb @ grad).to(residual.dtype) if needs[1] else None
        grad_post = (grad @ out.float().unsqueeze(-1)).squeeze(-1) if needs[2] else None
        grad_comb = residual.float() @ grad.transpose(-1, -2) if needs[3] else None
        return grad_out, grad_residual, grad_post, grad_comb


def identity_pre_mix(x: torch.Tensor, hc_mult: int) -> torch.Tensor:
    """The collapse weights before layer 0: all weight on copy 0. x: [B,S,hc,D] → [B,S,hc] fp32."""
    pre = x.new_zeros(x.shape[0], x.shape[1], hc_mult, dtype=torch.float32)
    pre[..., 0] = 1.0
    return pre


class DeepseekV41HyperConnectedBlock(nn.Module):
    """A block of two sub-layers, attention then FFN, each under single-pass mHC: it reads the copies [B,S,hc,D]
    collapsed with the ``pre`` of the sub-layer before it and normed (``attn_norm``, ``ffn_norm``), and its output
    [B,S,D] is expanded back into them with its own ``post`` and ``comb``; its own ``pre`` collapses the copies for
    the next sub-layer. The base of every decoder layer and DSpark draft block, which define ``attn``, ``ffn`` and the
    norms.

    The block owns both sub-layers' mHC parameters, fp32, under the checkpoint's names
    ``hc_{attn,ffn}_{fn,base,scale}`` (``layers.{i}.hc_attn_fn``, ``mtp.{k}.hc_ffn_scale``): fn [(2+hc)·hc, hc·D], base
    [(2+hc)·hc], scale [3].
    """

    def __init__(self, config):
        super().__init__()
        hc, dim = config.hc_mult, config.hidden_size
        mix = (2 + hc) * hc
        self.hc = DeepseekV41HyperConnection(hc, config.hc_sinkhorn_iters, config.hc_eps, config.rms_norm_eps)
        # registered fn, fn, base, base, scale, scale (the optimizer's order)
        fp32 = torch.float32
        self.hc_attn_fn = nn.Parameter(torch.empty(mix, hc * dim, dtype=fp32))
        self.hc_ffn_fn = nn.Parameter(torch.empty(mix, hc * dim, dtype=fp32))
        self.hc_attn_base = nn.Parameter(torch.zeros(mix, dtype=fp32))
        self.hc_ffn_base = nn.Parameter(torch.zeros(mix, dtype=fp32))
        self.hc_attn_scale = nn.Parameter(torch.ones(3, dtype=fp32))
        self.hc_ffn_scale = nn.Parameter(torch.ones(3, dtype=fp32))

    def hc_parameters(self) -> tuple[tuple[nn.Parameter, nn.Parameter, nn.Parameter], ...]:
        """Each sub-layer's mHC parameters (fn, scale, base): the attention's, then the FFN's."""
        return (
            (self.hc_attn_fn, self.hc_attn_scale, self.hc_attn_base),
            (self.hc_ffn_fn, self.hc_ffn_scale, self.hc_ffn_base),
        )

    def hyper_connected(
        self,
        x: torch.Tensor,
        pre_mix: torch.Tensor,
        attention: Callable[[torch.Tensor], tuple[torch.Tensor, Any]],
        ffn: Callable[[torch.Tensor], torch.Tensor],
    ) -> tuple[torch.Tensor, torch.Tensor, Any]:
        """The two sub-layers on the copies x [B,S,hc,D], the first collapsing them with ``pre_mix`` [B,S,hc] →
        (the copies, the FFN's ``pre`` for the next block, what else ``attention`` returned). ``attention`` takes
        its normed input [B,S,D] and returns (its output [B,S,D], anything else); ``ffn`` returns its output."""
        (attn_fn, attn_scale, attn_base), (ffn_fn, ffn_scale, ffn_base) = self.hc_parameters()
        attn_pre, post, comb = self.hc.mixes(x, attn_fn, attn_scale, attn_base)
        out, extra = attention(self.attn_norm(self.hc.collapse(x, pre_mix)))
        x = self.hc.expand(out, x, post, comb)
        ffn_pre, post, comb = self.hc.mixes(x, ffn_fn, ffn_scale, ffn_base)
        out = ffn(self.ffn_norm(self.hc.collapse(x, attn_pre)))
        return self.hc.expand(out, x, post, comb), ffn_pre, extra
