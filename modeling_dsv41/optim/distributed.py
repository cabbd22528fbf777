"""Sharded parameters (DTensor: FSDP2's ``fully_shard``, tensor/expert parallel meshes) in :class:`MixedOptimizer`.

Element-wise work (momentum, weight decay, AdamW) runs on each rank's local shard. What needs a whole matrix
is computed whole, exactly once:

- Newton–Schulz of a matrix sharded along its rows or columns: every matrix gets one *owner* rank (round-robin
  over the ranks of its mesh), one ``all_to_all`` sends each rank's shard to the owner, the owner
  orthogonalizes the whole matrix, a second ``all_to_all`` returns every rank its shard of the result
  (in the spirit of Moonlight's distributed Muon and microsoft/dion's FSDP Muon). Each rank sends and
  receives about one shard per matrix, and no rank orthogonalizes more than its share.
- A stack of matrices sharded only along leading (batch) dims, e.g. experts ``[E, out, in]`` with
  ``Shard(0)``, holds whole matrices on every rank: orthogonalized locally, no communication.
- Sinkhorn on a row-sharded table: rows are local, the column sums are all-reduced (see :mod:`.sinkhorn`).

Layouts other than ``Shard``/``Replicate`` on a 1-D mesh or on a mesh spanning the whole default group
(e.g. FSDP2's ``_StridedShard`` on top of tensor parallelism) take DTensor's own all-gather and
re-sharding: correct, but every rank then computes every matrix.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

try:
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard  # FSDP2 over TP; not a Shard subclass
except ImportError:  # torch built without distributed
    DTensor = Replicate = Shard = _StridedShard = None

# Error for optimizers handed DeepSpeed ZeRO's flat partitions (ZeRO-1/2 swap the groups' params for flat 1-D
# fp32 slices after construction; ZeRO-3 replaces ``param.data`` by an empty placeholder with ``ds_*`` attributes).
DEEPSPEED_HINT = (
    "DeepSpeed ZeRO hands optimizers flat 1-D partitions, on which Muon and Sinkhorn would compute a different "
    "update; shard with FSDP2 instead (torch.distributed.fsdp.fully_shard, or accelerate's FSDP plugin with "
    "fsdp_version: 2), or use DDP; under DeepSpeed only 'adamw' groups are supported"
)


def is_dtensor(tensor: Tensor) -> bool:
    return DTensor is not None and isinstance(tensor, DTensor)


def local(tensor: Tensor) -> Tensor:
    """The rank's own shard (the same storage: in-place ops on it update the DTensor)."""
    return tensor.to_local() if is_dtensor(tensor) else tensor


def grad_like_param(param: Tensor) -> Tensor:
    """``param.grad`` laid out like ``param`` (a ``Partial`` or otherwise placed gradient is redistributed)."""
    grad = param.grad
    if is_dtensor(param) and (grad.device_mesh != param.device_mesh or grad.placements != param.placements):
        grad = grad.redistribute(param.device_mesh, param.placements)
    return grad


def is_flat_partition(param: Tensor) -> bool:
    """Whether ``param`` is a DeepSpeed ZeRO-3 placeholder (its real shape lives in ``ds_shape``)."""
    return hasattr(param, "ds_id") or hasattr(param, "ds_shape")


def sharded_dims(tensor: Tensor) -> set[int]:
    """Tensor dims split across ranks (empty for a plain tensor or a replicated DTensor)."""
    if not is_dtensor(tensor):
        return set()
    return {p.dim % tensor.ndim for p in tensor.placements if isinstance(p, (Shard, _StridedShard))}


def row_groups(tensor: Tensor) -> list[dist.ProcessGroup] | None:
    """Process groups across which only the rows (dim 0) of ``tensor`` are split, or None for another layout."""
    placements = tensor.placements
    if not all(isinstance(p, Replicate) or (type(p) is Shard and p.dim % tensor.ndim == 0) for p in placements):
        return None
    mesh = tensor.device_mesh
    return [mesh.get_group(i) for i, p in enumerate(placements) if isinstance(p, Shard)]


@dataclass(frozen=True)
class _Layout:
    """Where every rank's shard of a DTensor lies in the global tensor (``Shard``/``Replicate`` placements)."""

    shape: tuple[int, ...]
    mesh_shape: tuple[int, ...]
    placements: tuple

    def region(self, coordinate: Sequence[int]) -> tuple[slice, ...]:
        """The global index region held at mesh ``coordinate`` (``torch.chunk`` rule, mesh dims in order)."""
        starts, sizes = [0] * len(self.shape), list(self.shape)
        for mesh_dim, placement in enumerate(self.placements):
            if isinstance(placement, Shard):
                dim = placement.dim % len(self.shape)
                chunk = math.ceil(sizes[dim] / self.mesh_shape[mesh_dim]) if sizes[dim] else 0
                begin = min(coordinate[mesh_dim] * chunk, sizes[dim])
                starts[dim] += begin
                sizes[dim] = min(chunk, sizes[dim] - begin)
        return tuple(slice(s, s + n) for s, n in zip(starts, sizes))

    def is_source(self, coordinate: Sequence[int]) -> bool:
        """One copy of each shard is sent: the one at coordinate 0 of every replicated mesh dim."""
        return all(c == 0 for c, p in zip(coordinate, self.placements) if not isinstance(p, Shard))


def _supported(tensor: Tensor) -> bool:
    mesh = tensor.device_mesh
    if mesh.ndim > 1 and mesh.size() != dist.get_world_size():
        return False
    return all(type(p) is Shard or isinstance(p, Replicate) for p in tensor.placements)


def _group_coordinates(mesh) -> tuple[dist.ProcessGroup, tuple[tuple[int, ...], ...]]:
    """The process group spanning ``mesh`` and, per rank of that group, its mesh coordinate."""
    group = mesh.get_group() if mesh.ndim == 1 else dist.group.WORLD
    coordinates: list[tuple[int, ...] | None] = [None] * dist.get_world_size(group)
    for coordinate in itertools.product(*(range(n) for n in mesh.shape)):
        global_rank = int(mesh.mesh[coordinate])
        coordinates[dist.get_group_rank(group, global_rank)] = coordinate
    return group, tuple(coordinates)


def owner_compute(
    updates: Sequence[Tensor], like: Sequence[Tensor], fn: Callable[[Tensor], Tensor], max_numel: int
) -> list[Tensor]:
    """``fn`` of every whole tensor, once, on one owner rank; returns this rank's shard of each result.

    ``updates`` are local shards (one dtype) laid out like the DTensors ``like``; ``fn`` maps a stack of whole
    same-shape tensors ``[k, *shape]`` to one of the same shape and dtype (each tensor on its own). Tensors are
    processed in chunks of at most ``max_numel`` elements per rank; every rank must call this with the same
    tensors in the same order.
    """
    results: list[Tensor | None] = [None] * len(updates)
    by_mesh: dict = {}
    for i, tensor in enumerate(like):
        key = (tensor.device_mesh, _supported(tensor))
        by_mesh.setdefault(key, []).append(i)
    for (mesh, supported), members in by_mesh.items():
        if not supported:
            for i in members:
                results[i] = _via_replicate(updates[i], like[i], fn)
            continue
        group, coordinates = _group_coordinates(mesh)
        for chunk in _chunks(members, [like[i].numel() for i in members], max_numel * len(coordinates)):
            layouts = [_Layout(tuple(like[i].shape), tuple(mesh.shape), tuple(like[i].placements)) for i in chunk]
            local_results = _exchange([updates[i] for i in chunk], layouts, fn, group, coordinates)
            for i, result in zip(chunk, local_results):
                results[i] = result
    return results


def _chunks(members: list[int], sizes: list[int], budget: int) -> list[list[int]]:
    chunks, current, total = [], [], 0
    for i, size in zip(members, sizes):
        if current and total + size > budget:
            chunks.append(current)
            current, total = [], 0
        current.append(i)
        total += size
    return chunks + [current] if current else chunks


def _numel(region: tuple[slice, ...]) -> int:
    return math.prod(s.stop - s.start for s in region)


def _exchange(
    updates: list[Tensor],
    layouts: list[_Layout],
    fn: Callable[[Tensor], Tensor],
    group: dist.ProcessGroup,
    coordinates: tuple[tuple[int, ...], ...],
) -> list[Tensor]:
    """Two ``all_to_all_single``: shards to their owner (``i % world``), ``fn``'s result shards back."""
    world, me = len(coordinates), dist.get_rank(group)
    mine = coordinates[me]
    dtype, device = updates[0].dtype, updates[0].device
    owned = [i for i in range(len(updates)) if i % world == me]

    # 1. Every source shard goes to the owner of its tensor.
    send = [[] for _ in range(world)]
    for i, (update, layout) in enumerate(zip(updates, layouts)):
        if layout.is_source(mine):
            send[i % world].append(update.reshape(-1))
    recv_sizes = [sum(_numel(layouts[i].region(c)) for i in owned if layouts[i].is_source(c)) for c in coordinates]
    received = _all_to_all(send, recv_sizes, dtype, device, group)
    wholes = {i: torch.empty(layouts[i].shape, dtype=dtype, device=device) for i in owned}
    for source, flat in enumerate(received):
        offset = 0
        for i in owned:
            if layouts[i].is_source(coordinates[source]):
                region = layouts[i].region(coordinates[source])
                piece = flat[offset : offset + _numel(region)]
                wholes[i][region] = piece.view([s.stop - s.start for s in region])
                offset += _numel(region)

    # 2. The owner computes each whole tensor once (same shapes batched) and returns every rank its shard.
    computed: dict[int, Tensor] = {}
    by_shape: dict[tuple[int, ...], list[int]] = {}
    for i in owned:
        by_shape.setdefault(layouts[i].shape, []).append(i)
    for members in by_shape.values():
        computed.update(zip(members, fn(torch.stack([wholes[i] for i in members])).unbind(0)))
    send = [[computed[i][layouts[i].region(c)].reshape(-1) for i in owned] for c in coordinates]
    recv_sizes = [
        sum(_numel(layouts[i].region(mine)) for i in range(len(updates)) if i % world == owner)
        for owner in range(world)
    ]
    received = _all_to_all(send, recv_sizes, dtype, device, group)
    results: list[Tensor] = [None] * len(updates)  # type: ignore[list-item]
    for owner, flat in enumerate(received):
        offset = 0
        for i in range(owner, len(updates), world):
            region = layouts[i].region(mine)
            results[i] = flat[offset : offset + _numel(region)].view([s.stop - s.start for s in region])
            offset += _numel(region)
    return results


def _all_to_all(
    send: list[list[Tensor]], recv_sizes: list[int], dtype: torch.dtype, device: torch.device, group
) -> list[Tensor]:
    send_sizes = [sum(t.numel() for t in pieces) for pieces in send]
    pieces = [t for per_rank in send for t in per_rank]
    flat_in = torch.cat(pieces) if pieces else torch.empty(0, dtype=dtype, device=device)
    flat_out = torch.empty(sum(recv_sizes), dtype=dtype, device=device)
    dist.all_to_all_single(flat_out, flat_in.to(dtype), recv_sizes, send_sizes, group=group)
    return list(flat_out.split(recv_sizes))


def _via_replicate(update: Tensor, like: Tensor, fn: Callable[[Tensor], Tensor]) -> Tensor:
    """Fallback for other layouts: DTensor all-gathers, every rank computes, then keeps its own shard."""
    sharded = DTensor.from_local(update, like.device_mesh, like.placements, shape=like.shape, stride=like.stride())
    replicate = [Replicate()] * like.device_mesh.ndim
    whole = sharded.redistribute(like.device_mesh, replicate).to_local()
    result = DTensor.from_local(fn(whole.unsqueeze(0)).squeeze(0), like.device_mesh, replicate)
    return result.redistribute(like.device_mesh, like.placements).to_local()
