"""Convert a checkpoint in DeepSeek's released storage into our plain format, one output tensor at a time.

The released files keep dense weights as FP8 with 32×32-block E8M0 scales, routed experts as packed FP4 and Engram
tables as FP8 with per-row scales (see :mod:`~modeling_dsv41.codec`). ``from_pretrained`` can read them directly; a
converted copy loads without the dequantization pass, can be memory-mapped, and is what fine-tuning tools expect.
It is written in our layout (``model.`` prefix, ``lm_head``, each layer's routed experts fused into
``gate_up_proj``/``down_proj``), named by the same conversions ``from_pretrained`` applies. Memory stays at one
output shard plus one output tensor (a layer's fused experts at most), whatever the model size: the released
DeepSeek-V4.1-Flash converts on a machine with far less RAM than the model.
"""

from __future__ import annotations

import json
import math
import re
import shutil
from contextlib import ExitStack
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm.auto import tqdm

from configuration import DeepseekV41Config

from ..codec import dequantize_released_weight
from .conversions import (
    NOT_LOADED,
    NOT_LOADED_WITHOUT_DSPARK,
    fuse_experts,
    released_sources,
    released_storage_conversions,
)

# what the released checkpoint holds that our model does not load (with the DSpark draft head, and without)
IGNORED_KEYS = re.compile("|".join(NOT_LOADED))
IGNORED_KEYS_WITHOUT_DSPARK = re.compile("|".join((*NOT_LOADED, NOT_LOADED_WITHOUT_DSPARK)))
# files copied next to the converted weights (tokenizer, chat template, generation defaults, licence)
COPIED_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
    "chat_template.jinja",
    "LICENSE",
)
_PACKED_FP4_DTYPES = (torch.int8, torch.uint8, torch.float4_e2m1fn_x2)
_PACKED_FP4_NAMES = ("I8", "U8", "F4")
_SCALE, _WEIGHT = ".scale", ".weight"
MAX_SHARD_BYTES = 5 * 2**30
_SAFETENSORS_ITEMSIZE = {
    "F64": 8,
    "I64": 8,
    "F32": 4,
    "I32": 4,
    "F16": 2,
    "BF16": 2,
    "I16": 2,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "F8_E8M0": 1,
    "I8": 1,
    "U8": 1,
    "BOOL": 1,
}


class _ReleasedCheckpoint:
    """Tensor access by name across the shards of a checkpoint folder; each shard is opened once (memory-mapped)."""

    def __init__(self, folder: Path):
        self._stack = ExitStack()
        self._handles: dict[Path, object] = {}
        index = folder / "model.safetensors.index.json"
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            self.files = {name: folder / file for name, file in weight_map.items()}
        else:
            shards = sorted(folder.glob("*.safetensors"))
            if not shards:
                raise FileNotFoundError(f"no *.safetensors files in {folder}")
            self.files = {name: shard for shard in shards for name in self._handle(shard).keys()}
        missing = sorted({str(path) for path in self.files.values() if not path.is_file()})
        if missing:
            raise FileNotFoundError(f"the checkpoint index names missing files: {', '.join(missing[:3])}")

    def __enter__(self) -> "_ReleasedCheckpoint":
        return self

    def __exit__(self, *exc_info) -> None:
        self._stack.close()

    def _handle(self, path: Path):
        if path not in self._handles:
            self._handles[path] = self._stack.enter_context(safe_open(path, "pt"))
        return self._handles[path]

    def tensor(self, name: str) -> torch.Tensor:
        return self._handle(self.files[name]).get_tensor(name)

    def stored_size(self, name: str) -> tuple[int, str]:
        """(element count, safetensors dtype string), without reading the data."""
        piece = self._handle(self.files[name]).get_slice(name)
        return math.prod(piece.get_shape()), piece.get_dtype()

    def scale_of(self, name: str) -> str | None:
        """The ``.scale`` stored with weight ``name``, if any."""
        if not name.endswith(_WEIGHT):
            return None
        scale = name[: -len(_WEIGHT)] + _SCALE
        return scale if scale in self.files else None

    def output_names(self, ignored: re.Pattern = IGNORED_KEYS) -> list[str]:
        """Released tensors to convert, in file order: scales are folded into their weights, ``ignored`` keys
        dropped."""
        folded = {
            name for name in self.files if name.endswith(_SCALE) and name[: -len(_SCALE)] + _WEIGHT in self.files
        }
        return [
            name
            for name in sorted(self.files, key=lambda n: (str(self.files[n]), n))
            if name not in folded and not ignored.match(name)
        ]

    def outputs(self, names: list[str]) -> dict[str, list[str]]:
        """Our name → the released tensors it is made of (:func:`~.conversions.released_sources`)."""
        return released_sources(names, released_storage_conversions())

    def output_bytes(self, names: list[str], dtype: torch.dtype) -> int:
        total = 0
        for name in names:
            numel, stored = self.stored_size(name)
            if self.scale_of(name):  # dequantized into `dtype`; packed FP4 holds two values per byte
                total += numel * (2 if stored in _PACKED_FP4_NAMES else 1) * dtype.itemsize
            else:
                total += numel * _SAFETENSORS_ITEMSIZE.get(stored, 4)
        return total

    def fused(self, sources: list[str], dtype: torch.dtype) -> torch.Tensor:
        """One output tensor: a single converted tensor, or the experts' weights stacked and concatenated as
        :class:`~.conversions.MergeReleasedExperts` fuses them."""
        if len(sources) == 1 and ".ffn.experts." not in sources[0]:
            return self.converted(sources[0], dtype)
        return fuse_experts(sources, {name: self.converted(name, dtype) for name in sources})

    def converted(self, name: str, dtype: torch.dtype) -> torch.Tensor:
        """``name`` dequantized into ``dtype`` if it has a scale, else as stored."""
        tensor = self.tensor(name)
        scale = self.scale_of(name)
        if scale is None:
            return tensor
        columns = tensor.shape[-1] * (2 if tensor.dtype in _PACKED_FP4_DTYPES else 1)
        return dequantize_released_weight(tensor, self.tensor(scale), columns, dtype)


def _check_destination(destination: Path, needed_bytes: int) -> None:
    if destination.exists() and (not destination.is_dir() or any(destination.iterdir())):
        raise FileExistsError(f"destination {destination} exists and is not an empty folder")
    try:
        destination.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise OSError(f"cannot create {destination}: {error.strerror or error}") from None
    free = shutil.disk_usage(destination).free
    if free < needed_bytes:
        raise OSError(
            f"not enough disk space at {destination}: the converted checkpoint needs "
            f"{needed_bytes / 2**30:.2f} GiB, {free / 2**30:.2f} GiB are free"
        )


def _write_shards(
    checkpoint: _ReleasedCheckpoint,
    names: list[str],
    destination: Path,
    dtype: torch.dtype,
    max_shard_bytes: int,
    progress: bool,
) -> tuple[int, list[tuple[Path, list[str]]]]:
    """Write the converted tensors into shards of at most ``max_shard_bytes``; returns (bytes, [(file, names)])."""
    current: dict[str, torch.Tensor] = {}
    current_bytes, total_bytes = 0, 0
    parts: list[tuple[Path, list[str]]] = []  # written shards, renamed once their count is known

    def flush() -> None:
        path = destination / f"model-part-{len(parts) + 1:05d}.safetensors"
        save_file(current, path, metadata={"format": "pt"})
        parts.append((path, list(current)))
        current.clear()

    outputs = checkpoint.outputs(names)
    with tqdm(total=len(outputs), unit="tensor", desc="Converting", disable=not progress) as bar:
        for name, sources in outputs.items():
            tensor = checkpoint.fused(sources, dtype)
            size = tensor.numel() * tensor.element_size()
            if current and current_bytes + size > max_shard_bytes:
                flush()
                current_bytes = 0
            current[name] = tensor.contiguous()
            current_bytes += size
            total_bytes += size
            bar.update(1)
            bar.set_postfix_str(f"{total_bytes / 2**30:.2f} GiB written", refresh=False)
        if current or not parts:
            flush()

    return total_bytes, parts


def convert_released_checkpoint(
    source: str | Path,
    destination: str | Path,
    dtype: torch.dtype = torch.bfloat16,
    max_shard_bytes: int = MAX_SHARD_BYTES,
    progress: bool = True,
) -> dict[str, int]:
    """Dequantize ``source`` (released format) into ``destination`` (a new or empty folder).

    Quantized weights become ``dtype``; tensors stored unquantized are copied as they are; the DSpark draft head
    (``mtp.*``) is kept when the config has it (``dspark_*`` keys), dropped otherwise. Writes ``config.json`` (our
    layout), safetensors shards with an index, and the tokenizer files found in ``source``. Returns ``{"tensors": n,
    "bytes": total}``.
    """
    source, destination = Path(source), Path(destination)
    if not source.is_dir():
        raise FileNotFoundError(f"source checkpoint folder {source} does not exist")
    if not (source / "config.json").is_file():
        raise FileNotFoundError(f"no config.json in {source}")
    # our layout or DeepSeek's flat inference/config.json
    config = DeepseekV41Config.from_dict(json.loads((source / "config.json").read_text()))
    if hasattr(config, "quantization_config"):  # the weights are no longer stored quantized
        del config.quantization_config
    with _ReleasedCheckpoint(source) as checkpoint:
        names = checkpoint.output_names(IGNORED_KEYS if config.text_config.has_dspark else IGNORED_KEYS_WITHOUT_DSPARK)
        _check_destination(destination, checkpoint.output_bytes(names, dtype))
        total_bytes, parts = _write_shards(checkpoint, names, destination, dtype, max_shard_bytes, progress)

    weight_map = {}
    for index, (path, tensor_names) in enumerate(parts, start=1):
        final = destination / f"model-{index:05d}-of-{len(parts):05d}.safetensors"
        path.rename(final)
        weight_map.update(dict.fromkeys(tensor_names, final.name))
    (destination / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total_bytes}, "weight_map": weight_map}, indent=2)
    )
    config.save_pretrained(destination)
    for file_name in COPIED_FILES:
        if (source / file_name).is_file():
            shutil.copy2(source / file_name, destination / file_name)
    return {"tensors": sum(len(tensor_names) for _, tensor_names in parts), "bytes": total_bytes}


__all__ = ["COPIED_FILES", "IGNORED_KEYS", "IGNORED_KEYS_WITHOUT_DSPARK", "convert_released_checkpoint"]
