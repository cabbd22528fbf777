"""Muon's orthogonalization: a batched Newton–Schulz iteration and the head-wise block layout.

Conventions follow ``torch.optim.Muon`` (torch/optim/_muon.py) so that a plain Muon group can be checked
against it: the iteration runs in bfloat16 on the Frobenius-normalized update, on the transpose when a
matrix has more rows than columns. What differs is that every function here takes a *batch* of matrices
``[..., rows, cols]``: MoE experts, attention heads and same-shape matrices of different layers are
orthogonalized in one batched call, each matrix on its own (never across the batch).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

NSCoefficients = Sequence[tuple[float, float, float]]

# Keller Jordan's quintic (also torch.optim.Muon's default); 5 steps of it is torch's default iteration.
QUINTIC_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
TORCH_MUON_NS_COEFFICIENTS: tuple[tuple[float, float, float], ...] = (QUINTIC_COEFFICIENTS,) * 5
# DeepSeek-V4 hybrid schedule: 8 fast quintic steps drive singular values near 1, then 2 steps of the
# cubic-convergent (2, -1.5, 0.5) polish them onto 1.
V4_NS_COEFFICIENTS: tuple[tuple[float, float, float], ...] = (QUINTIC_COEFFICIENTS,) * 8 + ((2.0, -1.5, 0.5),) * 2

NS_EPS = 1e-7  # floor of the Frobenius norm, as torch.optim.Muon


def zeropower_via_newton_schulz(update: Tensor, ns_coefficients: NSCoefficients, eps: float = NS_EPS) -> Tensor:
    """Approximately replace every matrix ``U S Vᵀ`` of ``update [..., m, n]`` by ``U Vᵀ``; returns bfloat16.

    One step per ``(a, b, c)``: ``X ← a·X + (b·A + c·A²)·X`` with ``A = X·Xᵀ``. bfloat16 like torch.optim.Muon
    and Keller Jordan's reference: the iteration only needs singular values pushed into ~[0.7, 1.2], and
    bf16 halves the memory traffic of the largest step of the optimizer.
    """
    if update.ndim < 2:
        raise ValueError(f"Newton–Schulz needs matrices [..., rows, cols], got shape {tuple(update.shape)}")
    *lead, rows, cols = update.shape
    x = update.reshape(-1, rows, cols).to(torch.bfloat16)
    transposed = rows > cols
    if transposed:  # iterate on the short side: the Gram matrix is [min, min]
        x = x.mT
    x = x / x.norm(dim=(-2, -1), keepdim=True).clamp_min(eps)  # spectral norm ≤ Frobenius norm ≤ 1
    for a, b, c in ns_coefficients:
        gram = torch.bmm(x, x.mT)
        poly = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.baddbmm(x, poly, x, beta=a)
    if transposed:
        x = x.mT
    return x.reshape(*lead, rows, cols)


def update_scale(rows: int, cols: int, update_rms: float) -> float:
    """Factor that gives an orthogonalized ``rows × cols`` block the RMS ``update_rms``.

    Its ``min(rows, cols)`` singular values are ~1, so its RMS is ``1/√max(rows, cols)``;
    ``update_rms = 0.2`` is torch.optim.Muon's ``adjust_lr_fn="match_rms_adamw"``.
    """
    return update_rms * math.sqrt(max(rows, cols))


def head_blocks(
    rows: int, num_heads: int | Sequence[int] = 1, split_sizes: Sequence[int] | None = None
) -> tuple[tuple[int, int, int], ...]:
    """Cut the rows of a weight ``[rows, cols]`` into ``(start, size, heads)`` segments for head-wise Muon.

    ``split_sizes`` are the row counts of the projections fused into one weight (default: one segment);
    ``num_heads`` is one head count for every segment or one per segment. Each segment is orthogonalized as
    ``heads`` matrices ``[size / heads, cols]``; 1 head means the whole segment (e.g. the V of a fused QKV).
    """
    sizes = tuple(split_sizes) if split_sizes is not None else (rows,)
    heads = (num_heads,) * len(sizes) if isinstance(num_heads, int) else tuple(num_heads)
    if len(heads) != len(sizes):
        raise ValueError(f"num_heads {heads} must give one head count per split ({len(sizes)} splits)")
    if sum(sizes) != rows:
        raise ValueError(f"split_sizes {sizes} sum to {sum(sizes)}, but the weight has {rows} rows")
    blocks, start = [], 0
    for size, n in zip(sizes, heads):
        if n < 1 or size % n:
            raise ValueError(f"a split of {size} rows cannot be cut into {n} heads")
        blocks.append((start, size, n))
        start += size
    return tuple(blocks)
