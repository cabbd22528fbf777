"""Sinkhorn-balanced update direction (DeepSeek-V4.1, SPEC §6).

It replaces Adam's second moment for huge tables (Engram, token embedding, LM head): instead of a
per-element variance estimate, the momentum matrix is balanced by alternating row and column ℓ2
normalizations, so only one momentum buffer is stored per table.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

NORM_FLOOR = 1e-30  # keeps an all-zero column (no live row touches it) at zero instead of NaN


def sinkhorn_balance(update: Tensor, iters: int = 11, row_mask_tau: float = 1e-3) -> tuple[Tensor, Tensor]:
    """Balance the rows and columns of ``update [m, n]``; returns ``(live_rows [L], direction [L, n])``.

    Rows whose ℓ2 norm is ``≤ row_mask_tau · mean(row norms)`` are masked out: an embedding row that no
    token touched has a ~0 update, and normalizing it would blow noise up to full size. Only the ``L``
    live rows are returned (the caller leaves the others exactly unchanged; with an all-zero update no row
    is live). The live rows are normalized ``iters`` times, rows first and rows last (so ``iters`` is odd),
    then multiplied by ``√n``: every returned row has RMS exactly 1 and the columns are balanced.
    Computed in float32.
    """
    if update.ndim != 2:
        raise ValueError(f"the Sinkhorn-balanced update needs a matrix [rows, cols], got {tuple(update.shape)}")
    if iters < 1 or iters % 2 == 0:
        raise ValueError(f"sinkhorn_iters must be odd (rows first and last), got {iters}")
    update = update.float()
    row_norms = torch.linalg.vector_norm(update, dim=1)
    live_rows = torch.nonzero(row_norms > row_mask_tau * row_norms.mean()).squeeze(1)
    direction = update.index_select(0, live_rows)
    for step in range(iters):
        dim = 1 if step % 2 == 0 else 0  # even steps: ℓ2 over each row; odd steps: over each column
        direction.div_(torch.linalg.vector_norm(direction, dim=dim, keepdim=True).clamp_min(NORM_FLOOR))
    return live_rows, direction.mul_(math.sqrt(update.shape[1]))
