"""Each rank's shards of a released checkpoint, read from its safetensors files and nothing more: the tensors of a
model sharded on the meta device (FSDP2's ``DTensor`` parameters, any ``Shard`` placement) filled with exactly the
values ``from_pretrained`` followed by sharding gives them, bit for bit.

Keys go through the conversions ``from_pretrained`` applies (:mod:`.conversions`, found as transformers finds them),
so every target parameter knows the checkpoint tensors it is made of. Then only the rows of the rank's box of each
are read:

* tensors kept as stored (FP8 weights, their E8M0 scales, packed FP4 experts and their scales; an FSDP2 shard splits
  a weight and its scales independently) and plain ones: the box itself, cast as the loader casts (read straight
  into the rank's tensor when the bytes are the same);
* FP8 weights dequantized on load (the block-diagonal ``wo_a``, Engram ``wkv``): the rows of the box widened to
  whole 32-row scale blocks with their scales, dequantized (an elementwise product: the same bits as the whole
  tensor's) and cropped;
* the routed experts: only the rank's experts (and rows of them), each from its per-expert ``w1`` / ``w3`` / ``w2``.

The bytes are read, not mapped (:mod:`~modeling_dsv41.safetensors_files`): while loading, a process holds its shards
and the one tensor being read, and no page of another rank's part of a file.
"""

from __future__ import annotations

import copy
import json
import logging
import math
import re
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from ..codec import RELEASED_BLOCK_SIZE, dequantize_released_weight, stored_scale
from ..safetensors_files import entry_dtype, read_rows, tensor_entries
from .conversions import RELEASED_SCALE, RELEASED_WEIGHT, DequantizeReleasedWeight, MergeReleasedExperts

logger = logging.getLogger(__name__)

# the part of a tensor a rank holds: one (start, stop) per dim
Box = tuple[tuple[int, int], ...]
# fills a target tensor's box (the rank's local tensor, given) from the checkpoint
Filler = Callable[[Box, torch.Tensor], None]


def local_box(tensor: torch.Tensor) -> Box:
    """The rank's part of ``tensor``: its local shard's place in the global tensor (a DTensor), else all of it."""
    from torch.distributed.tensor import DTensor

    if isinstance(tensor, DTensor):
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        shape, offset = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, tensor.placements)
        return tuple((o, o + n) for o, n in zip(offset, shape))
    return tuple((0, n) for n in tensor.shape)


def _fill(out: torch.Tensor, value: torch.Tensor, key: str) -> None:
    if value.shape != out.shape:
        raise ValueError(f"{key}: the checkpoint gives {tuple(value.shape)} for this rank's {tuple(out.shape)}")
    out.copy_(value)


class _Files:
    """The checkpoint's safetensors files, read by rows (:func:`~modeling_dsv41.safetensors_files.read_rows`): no
    page of them is mapped into the process."""

    def __init__(self, folder: Path):
        index = folder / "model.safetensors.index.json"
        names = set(json.loads(index.read_text())["weight_map"].values()) if index.is_file() else {"model.safetensors"}
        self._entries = tensor_entries(sorted(folder / name for name in names))
        self.keys = list(self._entries)

    def shape(self, key: str) -> list[int]:
        return self._entries[key][2]["shape"]

    def read(self, key: str, box: Box, out: torch.Tensor | None = None) -> torch.Tensor:
        """The ``box`` of tensor ``key`` as stored, or, given ``out`` (a tensor of the box's shape), ``out`` filled
        with it as the loader hands it over (:func:`_as_stored`). Whole rows of the same bytes are read straight into
        ``out`` (on the CPU): loading holds no second copy of them."""
        path, data_start, entry = self._entries[key]
        shape = entry["shape"]
        whole_rows = bool(box) and all(a == 0 and b == n for (a, b), n in zip(box[1:], shape[1:]))
        if out is None:
            return self._read(key, box, whole_rows)
        stored = entry_dtype(entry)
        same_bytes = stored == out.dtype or (out.dtype == torch.int8 and stored.itemsize == 1)
        if not (whole_rows and same_bytes and out.is_contiguous() and out.device.type == "cpu"):
            _fill(out, _as_stored(self._read(key, box, whole_rows), out.dtype), key)
        elif list(out.shape) != [box[0][1] - box[0][0], *shape[1:]]:
            raise ValueError(f"{key}: the checkpoint stores {shape}, this rank holds {tuple(out.shape)} of it")
        else:
            read_rows(path, data_start, entry, *box[0], out=out)
        return out

    def _read(self, key: str, box: Box, whole_rows: bool) -> torch.Tensor:
        path, data_start, entry = self._entries[key]
        if not box:  # a scalar
            return read_rows(path, data_start, entry, 0, 0)
        rows = read_rows(path, data_start, entry, *box[0])
        return rows if whole_rows else rows[(slice(None), *(slice(a, b) for a, b in box[1:]))].clone()


def _as_stored(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``tensor`` in the parameter's ``dtype`` as the loader hands it over: FP4 bytes viewed as int8, E8M0 scales as
    stored, anything else cast."""
    if tensor.dtype == dtype:
        return tensor
    if dtype == torch.float8_e8m0fnu:
        return stored_scale(tensor)
    if dtype == torch.int8 and tensor.element_size() == 1:
        return tensor.view(torch.int8)
    return tensor.to(dtype)


def _overlaps(box: tuple[int, int], start: int, stop: int) -> tuple[int, int] | None:
    """The part of [start, stop) inside ``box``, relative to ``start`` (None if empty)."""
    a, b = max(box[0], start), min(box[1], stop)
    return (a - start, b - start) if a < b else None


def _plain(files: _Files, key: str) -> Filler:
    return lambda box, out: files.read(key, box, out)


def _dequantized(files: _Files, weight: str, scale: str, columns: int) -> Filler:
    """A 2-D FP8 weight dequantized on load: the box's rows widened to whole scale blocks."""

    def fill(box: Box, out: torch.Tensor) -> None:
        (r0, r1), cols = box
        rows = files.shape(weight)[0]
        if r0 >= r1:
            return
        per_row = files.shape(scale)[0] == rows  # [R, C/32] (Engram tables) or [ceil(R/32), ceil(C/32)] blocks
        b = 1 if per_row else RELEASED_BLOCK_SIZE
        start, stop = r0 // b * b, min(math.ceil(r1 / b) * b, rows)
        all_columns = (0, files.shape(weight)[1])
        stored = files.read(weight, ((start, stop), all_columns))
        scales = files.read(scale, ((start // b, math.ceil(stop / b)), (0, files.shape(scale)[1])))
        dense = dequantize_released_weight(stored, scales, columns, out.dtype)
        _fill(out, dense[r0 - start : r1 - start, cols[0] : cols[1]], weight)

    return fill


def _experts(
    files: _Files, parts: list[list[str]], scales: list[list[str]] | None, columns: int, stored: bool
) -> Filler:
    """A fused expert tensor [E, rows, cols]: expert e's rows are the rows of ``parts[0][e]``, then ``parts[1][e]``
    (``w1`` then ``w3``). ``stored``: the tensors themselves (bytes or scales), else dequantized with ``scales``.
    Each piece goes straight to its place in the rank's tensor."""

    def fill(box: Box, out: torch.Tensor) -> None:
        experts, rows, cols = box
        for e in range(*experts):
            offset, filled = 0, 0
            for i, keys in enumerate(parts):
                n = files.shape(keys[e])[0]
                span = _overlaps(rows, offset, offset + n)
                offset += n
                if span is None:
                    continue
                place = out[e - experts[0], filled : filled + span[1] - span[0]]
                filled += span[1] - span[0]
                if stored or scales is None:
                    files.read(keys[e], (span, cols), place)
                    continue
                weight = files.read(keys[e], (span, (0, files.shape(keys[e])[1])))
                scale = files.read(scales[i][e], (span, (0, files.shape(scales[i][e])[1])))
                dense = dequantize_released_weight(weight, scale, columns, out.dtype)
                _fill(place, dense[:, cols[0] : cols[1]], keys[e])
            if filled != rows[1] - rows[0]:
                raise ValueError(
                    f"{parts[0][e]}: the checkpoint's parts of this expert hold {offset} rows, fewer than "
                    f"this rank's rows [{rows[0]}, {rows[1]}) of it"
                )

    return fill


def _scale_name(state: dict[str, torch.Tensor], target: str) -> str:
    """Where a kept-as-stored FP8 weight's scales go: ``weight_scale_inv`` on an ``FP8Linear``, ``scale`` on an FP8
    Engram table."""
    module = target.rpartition(".")[0]
    return f"{module}.weight_scale_inv" if f"{module}.weight_scale_inv" in state else f"{module}.scale"


def unwrapped_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """``model.state_dict(keep_vars=True)`` under the names of the model without adapters: PEFT's wrappers insert
    ``base_layer`` into the names of the tensors they wrap (and add their own, kept here under theirs)."""
    return {re.sub(r"\.base_layer(?=\.)", "", name): t for name, t in model.state_dict(keep_vars=True).items()}


def released_readers(model: nn.Module, files: _Files) -> dict[str, Filler]:
    """For every tensor of ``model`` (a ``PreTrainedModel``, its parameters anywhere, meta included; names as in
    :func:`unwrapped_state`) the released checkpoint of ``files`` stores: how to fill any box of it."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, dot_natural_key, rename_source_key

    state = unwrapped_state(model)
    mapping = copy.deepcopy(get_model_conversion_mapping(model, None, getattr(model, "hf_quantizer", None)))
    renamings = [m for m in mapping if not isinstance(m, WeightConverter)]
    converters = [m for m in mapping if isinstance(m, WeightConverter)]
    by_pattern = {pattern: c for c in converters for pattern in c.source_patterns}
    skipped = [re.compile(p) for p in getattr(model, "_keys_to_ignore_on_load_unexpected", None) or ()]

    groups: dict[str, dict[str, list[str]]] = {}
    converter_of: dict[str, WeightConverter | None] = {}
    for key in sorted(files.keys, key=dot_natural_key):
        target, pattern = rename_source_key(key, renamings, converters, model.base_model_prefix, state)
        if target not in state:
            if not any(p.search(key) for p in skipped):
                logger.warning("the checkpoint holds %s, which %s does not load", key, type(model).__name__)
            continue
        groups.setdefault(target, {}).setdefault(pattern or key, []).append(key)
        converter_of[target] = by_pattern.get(pattern) if pattern is not None else None

    readers: dict[str, Filler] = {}
    for target, sources in groups.items():
        converter = converter_of[target]
        if converter is None:
            readers[target] = _plain(files, sources[next(iter(sources))][0])
            continue
        operation = converter.operations[0] if converter.operations else None
        if isinstance(operation, MergeReleasedExperts):
            weights = [p for p in converter.source_patterns if p.endswith(".weight")]
            parts = [sources[p] for p in weights]
            scales = [sources.get(p[: -len(".weight")] + ".scale") for p in weights]
            scales = scales if all(s is not None for s in scales) else None
            param = state[target]
            if param.element_size() == 1:  # native FP4 experts: bytes and scales as stored
                readers[target] = _experts(files, parts, None, param.shape[-1], stored=True)
                readers[target + "_scale_inv"] = _experts(files, scales, None, param.shape[-1], stored=True)
            else:
                readers[target] = _experts(files, parts, scales, param.shape[-1], stored=False)
        elif isinstance(operation, DequantizeReleasedWeight):
            weight, scale = sources[RELEASED_WEIGHT][0], sources.get(RELEASED_SCALE, [None])[0]
            param = state[target]
            if scale is None:
                readers[target] = _plain(files, weight)
            elif param.dtype == torch.float8_e4m3fn:  # kept as stored, with its scales
                readers[target] = _plain(files, weight)
                readers[_scale_name(state, target)] = _plain(files, scale)
            else:
                readers[target] = _dequantized(files, weight, scale, param.shape[-1])
        else:
            raise ValueError(f"{target}: no sharded reading for the conversion {converter}")
    return readers


@torch.no_grad()
def read_released_shards(model: nn.Module, folder: str | Path, tensors: dict[str, torch.Tensor]) -> set[str]:
    """Fill ``tensors`` (names as in :func:`unwrapped_state`; each a materialized parameter or buffer, a DTensor
    holding the rank's shard or a whole tensor) from the released checkpoint at ``folder``, reading only each one's
    part. Returns the names filled (the others: not stored by the checkpoint)."""
    from torch.distributed.tensor import DTensor

    readers = released_readers(model, _Files(Path(folder)))
    filled = set()
    for name, tensor in tensors.items():
        if name not in readers:
            continue
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        readers[name](local_box(tensor), local)
        filled.add(name)
    return filled


__all__ = ["local_box", "read_released_shards", "released_readers", "unwrapped_state"]
