"""The update rules of :class:`~.mixed.MixedOptimizer`'s kinds, one function per rule (see :mod:`.kinds`).

Each rule is ``step(state, group, params)``: ``state`` is the optimizer's per-parameter state (already
initialized), ``params`` the group's parameters that have a gradient. Sharded parameters (DTensor) get exactly
the unsharded update: element-wise work on the local shards, whole matrices on one owner rank (see
:mod:`.distributed`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor
from torch.optim.adam import adam

from .distributed import _Layout, grad_like_param, is_dtensor, local, owner_compute, row_groups, sharded_dims
from .muon import head_blocks, update_scale, zeropower_via_newton_schulz
from .sinkhorn import sinkhorn_balance

State = Mapping[Tensor, dict[str, Tensor]]

# Same-shape matrices are stacked and orthogonalized in one batched call, in chunks of at most this many
# elements so that the temporary stack stays small next to the model (≈128 MiB in bf16).
MAX_BATCH_NUMEL = 1 << 26


def _nesterov_into(out: Tensor, grad: Tensor, buf: Tensor, momentum: float, nesterov: bool) -> Tensor:
    """Write the (Nesterov) momentum update into ``out``; ``buf`` was already advanced."""
    if nesterov:
        return torch.lerp(grad, buf, momentum, out=out)
    return out.copy_(buf)


def muon_step(state: State, group: dict[str, Any], params: list[Tensor]) -> None:
    """Momentum and weight decay on the local shards; Newton–Schulz on whole matrices (see .distributed)."""
    momentum, lr = group["momentum"], float(group["lr"])
    grads = [local(grad_like_param(p)) for p in params]
    bufs = [local(state[p]["momentum_buffer"]) for p in params]
    shards = [local(p) for p in params]
    torch._foreach_lerp_(bufs, grads, 1 - momentum)
    if group["weight_decay"] != 0:
        torch._foreach_mul_(shards, 1 - lr * group["weight_decay"])

    whole, split = [], []  # split: rows or columns of a matrix are spread over ranks
    for i, p in enumerate(params):
        (split if sharded_dims(p) & {p.ndim - 2, p.ndim - 1} else whole).append(i)
    _muon_whole(group, [shards[i] for i in whole], [grads[i] for i in whole], [bufs[i] for i in whole], lr)
    if split:
        _muon_split(group, [params[i] for i in split], [grads[i] for i in split], [bufs[i] for i in split], lr)


def _muon_whole(
    group: dict[str, Any], params: list[Tensor], grads: list[Tensor], bufs: list[Tensor], lr: float
) -> None:
    """Tensors that hold whole matrices on this rank: same-shape ones share one stacked, batched update."""
    buckets: dict[tuple, list[int]] = {}
    for i, p in enumerate(params):
        buckets.setdefault((p.shape, p.dtype, p.device), []).append(i)
    for (shape, dtype, device), members in buckets.items():
        per_chunk = max(1, MAX_BATCH_NUMEL // max(1, math.prod(shape)))
        for start in range(0, len(members), per_chunk):
            chunk = members[start : start + per_chunk]
            stacked = torch.empty((len(chunk), *shape), dtype=dtype, device=device)  # [P, ..., rows, cols]
            for row, i in enumerate(chunk):
                _nesterov_into(stacked[row], grads[i], bufs[i], group["momentum"], group["nesterov"])
            _apply_orthogonalized(group, [params[i] for i in chunk], stacked, lr)


def _apply_orthogonalized(group: dict[str, Any], params: list[Tensor], stacked: Tensor, lr: float) -> None:
    """``p -= lr · scale · NS(block)`` for every (head) block of every matrix in ``stacked [P, ..., rows, cols]``."""
    rows, cols = stacked.shape[-2:]
    if stacked.numel() == 0:  # e.g. a rank that holds none of the experts
        return
    matrices = stacked.reshape(-1, rows, cols)  # [P·E, rows, cols]: every leading index is one matrix
    for start, size, heads in _blocks(group, rows):
        head_rows = size // heads
        segment = matrices[:, start : start + size].reshape(-1, head_rows, cols)  # [P·E·heads, size/heads, cols]
        ortho = zeropower_via_newton_schulz(segment, group["ns_coefficients"])
        ortho = ortho.reshape(len(params), *stacked.shape[1:-2], size, cols)
        alpha = -lr * update_scale(head_rows, cols, group["update_rms"])
        torch._foreach_add_([p[..., start : start + size, :] for p in params], list(ortho.unbind(0)), alpha=alpha)


def _blocks(group: dict[str, Any], rows: int) -> tuple[tuple[int, int, int], ...]:
    """``(start, size, heads)`` row segments orthogonalized on their own: head blocks or the whole matrix."""
    if group["kind"] == "muon_headwise":
        return head_blocks(rows, group["num_heads"], group["split_sizes"])
    return ((0, rows, 1),)


def _muon_split(
    group: dict[str, Any], params: list[Tensor], grads: list[Tensor], bufs: list[Tensor], lr: float
) -> None:
    """Matrices sharded along rows or columns: each is orthogonalized whole on one owner rank.

    The update travels in bfloat16: Newton–Schulz casts to it first, so this changes no bit of the result.
    """
    updates = [
        _nesterov_into(torch.empty_like(b), g, b, group["momentum"], group["nesterov"]).to(torch.bfloat16)
        for g, b in zip(grads, bufs)
    ]
    orthos = owner_compute(updates, params, lambda wholes: _orthogonalize(group, wholes), MAX_BATCH_NUMEL)
    for p, ortho in zip(params, orthos):
        rows, cols = p.shape[-2:]
        blocks = _blocks(group, rows)
        if len(blocks) == 1 and blocks[0][2] == 1:  # one scale for the whole matrix
            local(p).add_(ortho, alpha=-lr * update_scale(rows, cols, group["update_rms"]))
            continue
        row_region = _row_region(p)
        shard = local(p)
        for start, size, heads in blocks:
            first, last = max(start, row_region.start), min(start + size, row_region.stop)
            if first < last:
                alpha = -lr * update_scale(size // heads, cols, group["update_rms"])
                rows_here = slice(first - row_region.start, last - row_region.start)
                shard[..., rows_here, :].add_(ortho[..., rows_here, :], alpha=alpha)


def _orthogonalize(group: dict[str, Any], update: Tensor) -> Tensor:
    """Newton–Schulz of every (head) block of every matrix of a whole ``update [..., rows, cols]`` (bfloat16)."""
    rows, cols = update.shape[-2:]
    out = torch.empty_like(update, dtype=torch.bfloat16)
    for start, size, heads in _blocks(group, rows):
        segment = update[..., start : start + size, :]
        blocks = segment.reshape(*segment.shape[:-2], heads, size // heads, cols)
        out[..., start : start + size, :] = zeropower_via_newton_schulz(blocks, group["ns_coefficients"]).reshape(
            segment.shape
        )
    return out


def _row_region(p: Tensor) -> slice:
    """The global rows of the matrices whose shard this rank holds (all of them unless dim -2 is sharded)."""
    if p.ndim - 2 not in sharded_dims(p):
        return slice(0, p.shape[-2])
    layout = _Layout(tuple(p.shape), tuple(p.device_mesh.shape), tuple(p.placements))
    return layout.region(p.device_mesh.get_coordinate())[-2]


def sinkhorn_step(state: State, group: dict[str, Any], params: list[Tensor]) -> None:
    """Row-sharded tables (FSDP2's ``Shard(0)``) balance their local rows with all-reduced column sums."""
    momentum, lr = group["momentum"], float(group["lr"])
    alpha = -lr * group["update_rms"]
    for p in params:
        grad, buf_shard, shard = local(grad_like_param(p)), local(state[p]["momentum_buffer"]), local(p)
        buf_shard.lerp_(grad, 1 - momentum)
        update = _nesterov_into(torch.empty_like(buf_shard), grad, buf_shard, momentum, group["nesterov"])
        groups = row_groups(p) if is_dtensor(p) else []
        if groups is None:  # columns split too: the whole table on one owner rank
            (direction,) = owner_compute([update.float()], [p], lambda wholes: _dense_sinkhorn(group, wholes), 1)
            shard.add_(direction.to(p.dtype), alpha=alpha)
            continue
        live_rows, direction = sinkhorn_balance(update, group["sinkhorn_iters"], group["row_mask_tau"], groups)
        shard.index_add_(0, live_rows, direction.to(p.dtype), alpha=alpha)


def _dense_sinkhorn(group: dict[str, Any], updates: Tensor) -> Tensor:
    """The Sinkhorn direction of every table in ``updates [k, rows, cols]``, zero on the masked rows."""
    out = torch.zeros_like(updates)
    for update, direction in zip(updates, out):
        live_rows, balanced = sinkhorn_balance(update, group["sinkhorn_iters"], group["row_mask_tau"])
        direction.index_copy_(0, live_rows, balanced)
    return out


def adamw_step(state: State, group: dict[str, Any], params: list[Tensor]) -> None:
    """torch's functional AdamW on exactly the state ``torch.optim.AdamW`` would hold."""
    beta1, beta2 = group["betas"]
    # On the local shards (the same storage as the DTensors): element-wise, so exactly torch's update,
    # without DTensor's per-op dispatch.
    adam(
        [local(p) for p in params],
        [local(grad_like_param(p)) for p in params],
        [local(state[p]["exp_avg"]) for p in params],
        [local(state[p]["exp_avg_sq"]) for p in params],
        [],
        [state[p]["step"] for p in params],
        has_complex=any(torch.is_complex(p) for p in params),
        decoupled_weight_decay=True,
        amsgrad=False,
        beta1=beta1,
        beta2=beta2,
        lr=group["lr"],
        weight_decay=group["weight_decay"],
        eps=group["eps"],
        maximize=False,
    )
