"""Parts of safetensors files without reading (or mapping) the rest: a file's header, one tensor as a memory map, the
rows of one tensor read into memory.

Why not ``safe_open``: it maps the whole file, and every page a read touches stays mapped in the process until the
file is closed, with the kernel's fault-around mapping neighbouring pages that belong to other tensors (other
ranks' experts). While mapped they count to the process's resident and proportional set size. :func:`read_rows`
reads the bytes of the requested rows with ``readinto`` instead: nothing of the file is mapped, and the node's page
cache (shared, reclaimable) is the only other copy.
"""

from __future__ import annotations

import json
import math
import mmap
from pathlib import Path

import torch

SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "F8_E8M0": torch.float8_e8m0fnu,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


def safetensors_header(path: str | Path) -> tuple[int, dict]:
    """(byte offset of the data, header) of a safetensors file: an 8-byte little-endian length, then JSON."""
    with open(path, "rb") as handle:
        length = int.from_bytes(handle.read(8), "little")
        return 8 + length, json.loads(handle.read(length))


def tensor_entries(paths) -> dict[str, tuple[Path, int, dict]]:
    """Every tensor stored in the safetensors files ``paths``: name -> (file, byte offset of its data, header
    entry)."""
    entries = {}
    for path in paths:
        data_start, header = safetensors_header(path)
        entries.update({name: (Path(path), data_start, e) for name, e in header.items() if name != "__metadata__"})
    return entries


def entry_dtype(entry: dict) -> torch.dtype:
    """The torch dtype of a header entry."""
    dtype = SAFETENSORS_DTYPES.get(entry["dtype"])
    if dtype is None:
        raise ValueError(f"safetensors dtype {entry['dtype']} is not supported here")
    return dtype


def mapped_tensor(path: str | Path, data_start: int, entry: dict) -> torch.Tensor:
    """A tensor of a safetensors file backed by a private memory map, advised for random access: a lookup reads the
    pages of its rows and no read-ahead around them."""
    begin, end = entry["data_offsets"]
    with open(path, "rb") as handle:
        mapping = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_COPY)  # copy-on-write: writable, never written
    if hasattr(mapping, "madvise"):
        mapping.madvise(mmap.MADV_RANDOM)
    raw = torch.frombuffer(mapping, dtype=torch.uint8, count=end - begin, offset=data_start + begin)
    return raw.view(entry_dtype(entry)).view(entry["shape"])  # keeps `mapping` alive


def read_rows(
    path: str | Path, data_start: int, entry: dict, start: int, stop: int, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Rows ``[start, stop)`` (along the first dim) of a tensor of a safetensors file, read into ``out`` (contiguous,
    of their size in bytes; any dtype: the bytes as stored) or into a new tensor; a 0-dim tensor is read whole
    (``start``, ``stop`` ignored)."""
    shape, dtype = entry["shape"], entry_dtype(entry)
    begin, end = entry["data_offsets"]
    if not shape:
        start, stop, row_bytes = 0, 1, end - begin
    else:
        if not 0 <= start <= stop <= shape[0]:
            raise ValueError(f"rows [{start}, {stop}) of a tensor of {shape[0]} rows")
        row_bytes = math.prod(shape[1:]) * dtype.itemsize
    size = (stop - start) * row_bytes
    if out is not None and (not out.is_contiguous() or out.nbytes != size or out.device.type != "cpu"):
        raise ValueError(
            f"reading {size} bytes into a {'non-contiguous ' * (not out.is_contiguous())}"
            f"{out.device.type} tensor of {out.nbytes} bytes"
        )
    target = torch.empty(size, dtype=torch.uint8) if out is None else out.view(-1).view(torch.uint8)
    view, offset = memoryview(target.numpy()), data_start + begin + start * row_bytes
    with open(path, "rb", buffering=0) as handle:
        handle.seek(offset)
        done = 0
        while done < len(view):
            read = handle.readinto(view[done:])
            if not read:
                raise OSError(f"{path} ends before the bytes of a tensor stored in it")
            done += read
    return out if out is not None else target.view(dtype).view([stop - start, *shape[1:]] if shape else [])


__all__ = ["SAFETENSORS_DTYPES", "entry_dtype", "mapped_tensor", "read_rows", "safetensors_header", "tensor_entries"]
