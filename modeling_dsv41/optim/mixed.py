"""One ``torch.optim.Optimizer`` for the whole model: Muon, head-wise Muon, Sinkhorn-balanced and AdamW groups.

Being a single optimizer (rather than one per algorithm) is what lets transformers' LR schedulers,
``clip_grad_norm_``, accelerate's wrapper and ``Trainer`` checkpointing work unchanged: they only ever see
``param_groups`` with an ``lr`` and a ``state_dict``. Each group names its algorithm in ``kind``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor
from torch.optim.adam import adam

from .distributed import (
    DEEPSPEED_HINT,
    Replicate,
    Shard,
    _Layout,
    grad_like_param,
    is_dtensor,
    is_flat_partition,
    local,
    owner_compute,
    row_groups,
    sharded_dims,
)
from .kinds import KIND_DEFAULTS, KINDS
from .muon import head_blocks, update_scale, zeropower_via_newton_schulz
from .policy import build_param_groups
from .sinkhorn import sinkhorn_balance

_REQUIRED = {"muon_headwise": ("num_heads",)}
_COMMON_KEYS = {"params", "param_names", "kind", "lr"}

# Same-shape matrices are stacked and orthogonalized in one batched call, in chunks of at most this many
# elements so that the temporary stack stays small next to the model (≈128 MiB in bf16).
MAX_BATCH_NUMEL = 1 << 26


class MixedOptimizer(torch.optim.Optimizer):
    r"""DeepSeek-V4.1's optimizer: every param group carries a ``kind`` and that kind's hyperparameters.

    - ``"muon"``: Nesterov momentum, Newton–Schulz orthogonalization (one ``(a, b, c)`` per step in
      ``ns_coefficients``; default DeepSeek-V4's 8 + 2 hybrid), update scaled to RMS ``update_rms`` so that
      ``lr`` and decoupled ``weight_decay`` mean the same as for AdamW. A tensor ``[..., rows, cols]`` with
      more than two dims is a batch of matrices (e.g. stacked experts ``[E, out, in]``), each orthogonalized
      on its own.
    - ``"muon_headwise"``: as muon, but rows are cut into ``num_heads`` blocks (per split of ``split_sizes``
      for fused projections) and every head block is orthogonalized and RMS-scaled on its own.
    - ``"sinkhorn"``: Nesterov momentum, then :func:`~.sinkhorn.sinkhorn_balance`; rows with ~0 momentum are
      left exactly unchanged; update RMS ``update_rms``; 2-D parameters only, no weight decay.
    - ``"adamw"``: exactly ``torch.optim.AdamW`` (``betas``, ``eps``, decoupled ``weight_decay``).

    Sharded parameters (DTensor: FSDP2's ``fully_shard``, tensor/expert parallel meshes) get exactly the
    unsharded update: element-wise work runs on the local shards, every matrix (head block) is orthogonalized
    whole once, on one owner rank, and Sinkhorn all-reduces its column sums (see :mod:`.distributed`). Every
    rank must step the same parameters. DeepSpeed ZeRO's flat partitions are refused (``ValueError``).

    State per parameter: ``momentum_buffer`` (muon kinds, sinkhorn) or ``step``, ``exp_avg``, ``exp_avg_sq``
    (adamw), all tensors, so ``torch.load(weights_only=True)`` reads a saved ``state_dict``; from the first step
    on every parameter has it, zeros (the same as none) for those that got no gradient yet. Momentum follows
    torch.optim.Muon's convention ``B ← μ·B + (1 − μ)·g``, Nesterov ``g + μ·(B − g)``. Keys a group leaves
    out come from :data:`KIND_DEFAULTS` (torch.optim.Muon's and torch.optim.AdamW's defaults plus the recipe's), then
    from ``lr``; unknown keys raise.

    ``params`` are the groups of :func:`~.policy.build_param_groups`, or the model itself: then the groups are built
    here, ``build_param_groups(model, lr=lr, **policy)``. That is how a ``Trainer`` that builds the optimizer from
    ``optimizer_cls_and_kwargs`` (TRL's trainers too) gets the policy: it hands ``kwargs["model"]`` over as the
    parameters, ``optimizer_cls_and_kwargs=(MixedOptimizer, {"model": model, "lr": args.learning_rate})``.

    Example::

        groups = build_param_groups(model, lr=3e-4)  # the docs/design.md §6 policy, see .policy
        optimizer = MixedOptimizer(groups)
        optimizer = MixedOptimizer(model, lr=3e-4, weight_decay=0.1)  # the same groups, built here
    """

    def __init__(self, params: Any, lr: float = 1e-3, **policy: Any) -> None:
        if lr < 0:
            raise ValueError(f"lr must be >= 0, got {lr}")
        if isinstance(params, torch.nn.Module):
            params = build_param_groups(params, lr=lr, **policy)
        elif policy:
            raise ValueError(
                f"MixedOptimizer takes {sorted(policy)} only with the model as params (the groups are then built "
                "with build_param_groups); with ready groups, set them in build_param_groups(model, ...)"
            )
        super().__init__(params, {"lr": lr})

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        kind = param_group.get("kind")
        if kind not in KINDS:
            raise ValueError(
                f"every param group needs a 'kind' in {KINDS}, got {kind!r}: the kinds follow the parameter names, "
                "so build the groups with build_param_groups(model, lr=...) or pass the model itself, "
                "MixedOptimizer(model, lr=...); in a Trainer (TRL's too), "
                "optimizer_cls_and_kwargs=(MixedOptimizer, {'model': model, 'lr': args.learning_rate})"
            )
        for key, value in KIND_DEFAULTS[kind].items():
            param_group.setdefault(key, value)
        for key in _REQUIRED.get(kind, ()):
            if key not in param_group:
                raise ValueError(f"a {kind!r} param group needs {key!r}")
        unknown = set(param_group) - _COMMON_KEYS - set(KIND_DEFAULTS[kind]) - set(_REQUIRED.get(kind, ()))
        if unknown:
            raise ValueError(f"unknown keys {sorted(unknown)} for a {kind!r} param group")
        super().add_param_group(param_group)
        _VALIDATORS[kind](self.param_groups[-1])

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """``Optimizer.load_state_dict``, refusing a checkpoint whose groups have other kinds."""
        saved = [group.get("kind") for group in state_dict["param_groups"]]
        current = [group["kind"] for group in self.param_groups]
        if len(saved) == len(current) and saved != current:
            raise ValueError(f"checkpoint param-group kinds {saved} do not match this optimizer's {current}")
        super().load_state_dict(state_dict)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        work = [(group, [p for p in group["params"] if p.grad is not None]) for group in self.param_groups]
        for group, params in work:  # every check before any update
            for p in params:
                if p.grad.is_sparse:
                    raise ValueError(f"{group['kind']} does not support sparse gradients")
                if group["kind"] != "adamw":
                    _check_shape(group["kind"], p)  # DeepSpeed ZeRO-1/2 swap in flat partitions after __init__
        for group, params in work:
            self._init_state(group)
            if params:
                _STEPS[group["kind"]](self, group, params)
        return loss

    def _init_state(self, group: dict[str, Any]) -> None:
        """Zero state, equal to none, for every parameter of ``group``, gradient or not: a checkpoint then holds
        the same keys whichever parameters got gradients (e.g. the ViT in text-only batches), which sharded
        (DCP) checkpoints need to resume, since their loader asks for the state of every parameter."""
        for p in group["params"]:
            state = self.state[p]
            if state:
                continue
            if group["kind"] == "adamw":
                state["step"] = torch.tensor(0.0, dtype=torch.float32)
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            else:
                state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)

    def _momentum_buffers(self, params: list[Tensor]) -> list[Tensor]:
        return [self.state[p]["momentum_buffer"] for p in params]


def _nesterov_into(out: Tensor, grad: Tensor, buf: Tensor, momentum: float, nesterov: bool) -> Tensor:
    """Write the (Nesterov) momentum update into ``out``; ``buf`` was already advanced."""
    if nesterov:
        return torch.lerp(grad, buf, momentum, out=out)
    return out.copy_(buf)


def _muon_step(opt: MixedOptimizer, group: dict[str, Any], params: list[Tensor]) -> None:
    """Momentum and weight decay on the local shards; Newton–Schulz on whole matrices (see .distributed)."""
    momentum, lr = group["momentum"], float(group["lr"])
    grads = [local(grad_like_param(p)) for p in params]
    bufs = [local(b) for b in opt._momentum_buffers(params)]
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


def _sinkhorn_step(opt: MixedOptimizer, group: dict[str, Any], params: list[Tensor]) -> None:
    """Row-sharded tables (FSDP2's ``Shard(0)``) balance their local rows with all-reduced column sums."""
    momentum, lr = group["momentum"], float(group["lr"])
    alpha = -lr * group["update_rms"]
    bufs = opt._momentum_buffers(params)
    for p, buf in zip(params, bufs):
        grad, buf_shard, shard = local(grad_like_param(p)), local(buf), local(p)
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


def _adamw_step(opt: MixedOptimizer, group: dict[str, Any], params: list[Tensor]) -> None:
    """torch's functional AdamW on exactly the state ``torch.optim.AdamW`` would hold."""
    beta1, beta2 = group["betas"]
    # On the local shards (the same storage as the DTensors): element-wise, so exactly torch's update,
    # without DTensor's per-op dispatch.
    adam(
        [local(p) for p in params],
        [local(grad_like_param(p)) for p in params],
        [local(opt.state[p]["exp_avg"]) for p in params],
        [local(opt.state[p]["exp_avg_sq"]) for p in params],
        [],
        [opt.state[p]["step"] for p in params],
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


_STEPS: dict[str, Callable[[MixedOptimizer, dict[str, Any], list[Tensor]], None]] = {
    "muon": _muon_step,
    "muon_headwise": _muon_step,
    "sinkhorn": _sinkhorn_step,
    "adamw": _adamw_step,
}


def _check_common(group: dict[str, Any]) -> None:
    if group["lr"] < 0:
        raise ValueError(f"lr must be >= 0, got {group['lr']}")
    if group["weight_decay"] < 0:
        raise ValueError(f"weight_decay must be >= 0, got {group['weight_decay']}")
    for p in group["params"]:
        if torch.is_complex(p) and group["kind"] != "adamw":
            raise ValueError(f"{group['kind']} does not support complex parameters")


def _check_momentum(group: dict[str, Any]) -> None:
    if not 0 <= group["momentum"] < 1:
        raise ValueError(f"momentum must be in [0, 1), got {group['momentum']}")
    if group["update_rms"] <= 0:
        raise ValueError(f"update_rms must be > 0, got {group['update_rms']}")


def _check_muon(group: dict[str, Any]) -> None:
    _check_common(group)
    _check_momentum(group)
    coefficients = tuple(tuple(float(c) for c in abc) for abc in group["ns_coefficients"])
    if not coefficients or any(len(abc) != 3 for abc in coefficients):
        raise ValueError("ns_coefficients must be a non-empty sequence of (a, b, c), one per Newton–Schulz step")
    group["ns_coefficients"] = coefficients
    if group["kind"] == "muon_headwise":
        group["num_heads"] = _as_int_or_tuple(group["num_heads"])
        if group["split_sizes"] is not None:
            group["split_sizes"] = tuple(int(s) for s in group["split_sizes"])
    for p in group["params"]:
        _check_shape(group["kind"], p)
        if group["kind"] == "muon_headwise":
            head_blocks(p.shape[-2], group["num_heads"], group["split_sizes"])  # raises on a bad layout
            if p.ndim - 2 in sharded_dims(p) and not all(type(pl) in (Shard, Replicate) for pl in p.placements):
                raise ValueError(f"head-wise Muon needs rows sharded with Shard or Replicate, got {p.placements}")


def _check_sinkhorn(group: dict[str, Any]) -> None:
    _check_common(group)
    _check_momentum(group)
    if group["weight_decay"] != 0:
        raise ValueError("sinkhorn groups take no weight decay (masked rows must stay exactly unchanged)")
    if group["sinkhorn_iters"] < 1 or group["sinkhorn_iters"] % 2 == 0:
        raise ValueError(f"sinkhorn_iters must be odd (rows first and last), got {group['sinkhorn_iters']}")
    if group["row_mask_tau"] < 0:
        raise ValueError(f"row_mask_tau must be >= 0, got {group['row_mask_tau']}")
    for p in group["params"]:
        _check_shape("sinkhorn", p)


def _check_shape(kind: str, p: Tensor) -> None:
    """Muon kinds need matrices (or batches of them), Sinkhorn 2-D tables; flat partitions are refused."""
    if is_flat_partition(p) or p.ndim == 1:
        raise ValueError(f"{kind} needs matrices, got a flat tensor of shape {tuple(p.shape)}. {DEEPSPEED_HINT}")
    if kind == "sinkhorn" and p.ndim != 2:
        raise ValueError(f"sinkhorn needs 2-D parameters [rows, cols], got shape {tuple(p.shape)}")
    if p.ndim < 2:
        raise ValueError(f"{kind} needs matrices (or batches of them), got shape {tuple(p.shape)}")


def _check_adamw(group: dict[str, Any]) -> None:
    _check_common(group)
    beta1, beta2 = group["betas"]
    if not (0 <= beta1 < 1 and 0 <= beta2 < 1):
        raise ValueError(f"betas must be in [0, 1), got {group['betas']}")
    if group["eps"] < 0:
        raise ValueError(f"eps must be >= 0, got {group['eps']}")
    group["betas"] = (beta1, beta2)


def _as_int_or_tuple(value: int | Sequence[int]) -> int | tuple[int, ...]:
    return int(value) if isinstance(value, int) else tuple(int(v) for v in value)


_VALIDATORS: dict[str, Callable[[dict[str, Any]], None]] = {
    "muon": _check_muon,
    "muon_headwise": _check_muon,
    "sinkhorn": _check_sinkhorn,
    "adamw": _check_adamw,
}
