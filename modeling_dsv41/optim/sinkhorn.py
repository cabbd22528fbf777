"""Sinkhorn-balanced update direction (DeepSeek-V4.1, docs/design.md §6).

It replaces Adam's second moment for huge tables (Engram, token embedding, LM head): instead of a
per-element variance estimate, the momentum matrix is balanced by alternating row and column ℓ2
normalizations, so only one momentum buffer is stored per table.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor

# Outside this range of the largest row norm, squares of the entries may underflow or overflow float32:
# rescale first (the algorithm is invariant to a scalar factor), so that a tiny gradient still gets a
# full-size update rather than none, and a huge one no NaN.
_SAFE_ROW_NORMS = (2.0**-50, 2.0**50)
_FLOAT32_TINY = torch.finfo(torch.float32).tiny


def sinkhorn_balance(
    update: Tensor, iters: int = 11, row_mask_tau: float = 1e-3, row_groups: Sequence[dist.ProcessGroup] = ()
) -> tuple[Tensor, Tensor]:
    """Balance the rows and columns of ``update [m, n]``; returns ``(live_rows [L], direction [L, n])``.

    Rows whose ℓ2 norm is ``≤ row_mask_tau · mean(row norms)`` are masked out: an embedding row that no
    token touched has a ~0 update, and normalizing it would blow noise up to full size. Only the ``L``
    live rows are returned (the caller leaves the others exactly unchanged; with an all-zero update no row
    is live). The live rows get ``iters`` alternating ℓ2 normalizations, rows first and rows last (so
    ``iters`` is odd), then a factor ``√n``: every returned row has RMS 1 and the columns are balanced.

    Written as Sinkhorn scalings ``diag(r)·X·diag(c)`` of the squared entries, so each normalization is one
    matrix-vector product (a column-wise norm is many times slower than a row-wise one on CPU). Float32;
    needs two ``[L, n]`` temporaries.

    ``row_groups``: when ``update`` is this rank's block of rows of a row-sharded matrix, the process groups
    across which the rows are split. Row scalings stay local; the statistics over rows (the largest row norm,
    the mean row norm, the column sums of every column normalization) are all-reduced over them, so every
    rank gets its rows of the unsharded result. ``live_rows`` then index the local rows. The sums are taken in
    fp64 and rounded once: under :func:`~modeling_dsv41.numerics.reference_numerics` (which computes one process's
    sums in fp64) a sharded table gets the same bits as a whole one, however its rows are split.
    """
    if update.ndim != 2:
        raise ValueError(f"the Sinkhorn-balanced update needs a matrix [rows, cols], got {tuple(update.shape)}")
    if iters < 1 or iters % 2 == 0:
        raise ValueError(f"sinkhorn_iters must be odd (rows first and last), got {iters}")
    update = update.float()
    row_norms = torch.linalg.vector_norm(update, dim=1)
    if not _SAFE_ROW_NORMS[0] < _all_reduce(_amax(row_norms), dist.ReduceOp.MAX, row_groups) < _SAFE_ROW_NORMS[1]:
        update = update / _all_reduce(_amax(update.abs()), dist.ReduceOp.MAX, row_groups).clamp_min(_FLOAT32_TINY)
        row_norms = torch.linalg.vector_norm(update, dim=1)
    if row_groups:  # mean over all rows
        count = row_norms.new_tensor(float(len(row_norms)), dtype=torch.float64)
        total, rows = _all_reduce(torch.stack([row_norms.double().sum(), count]), None, row_groups).float()
    else:
        total, rows = row_norms.sum(), float(len(row_norms))
    live_rows = torch.nonzero(row_norms > row_mask_tau * (total / rows)).squeeze(1)

    direction = update.index_select(0, live_rows).div_(row_norms[live_rows, None])  # normalization 1: rows
    squares = direction.square()  # [L, n]
    wide = squares.double() if row_groups else None  # the column sums' partial products, in fp64
    row_scale = torch.ones(len(live_rows), device=update.device)
    col_scale = torch.ones(update.shape[1], device=update.device)
    for step in range(1, iters):
        if step % 2:  # columns: c_j = 1 / ‖(r_i x_ij)_i‖
            if row_groups:
                sums = _all_reduce(row_scale.square().double() @ wide, None, row_groups).float()
            else:
                sums = row_scale.square() @ squares
            col_scale = _inverse_sqrt(sums)
        else:  # rows: r_i = 1 / ‖(x_ij c_j)_j‖
            row_scale = _inverse_sqrt(squares @ col_scale.square())
    del squares, wide
    direction.mul_(row_scale.mul_(math.sqrt(update.shape[1]))[:, None]).mul_(col_scale)
    return live_rows, direction


def _amax(values: Tensor) -> Tensor:
    """Largest entry, 0 for an empty shard (a rank may hold no row of a small table)."""
    return values.amax() if values.numel() else values.new_zeros(())


def _all_reduce(value: Tensor, op: dist.ReduceOp | None, groups: Sequence[dist.ProcessGroup]) -> Tensor:
    """``value`` reduced (sum when ``op`` is None) over every group in ``groups``; as is without groups."""
    for group in groups:
        dist.all_reduce(value, op=dist.ReduceOp.SUM if op is None else op, group=group)
    return value


def _inverse_sqrt(sum_of_squares: Tensor) -> Tensor:
    """``1/√s``, and 0 where ``s = 0`` (a column no live row touches stays zero instead of NaN)."""
    return torch.where(sum_of_squares > 0, sum_of_squares.rsqrt(), 0.0)
