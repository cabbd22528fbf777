"""Writing a model in the released storage format: the release's names (:mod:`.conversions`, reversed) and storage
(FP8 / FP4 with E8M0 scales, :mod:`~modeling_dsv41.codec`), as ``config.json``, safetensors shards and their index. No
Engram token map is written (the release has none; ``from_pretrained`` builds it from the tokenizer).
"""

from __future__ import annotations

import copy
import json
import os
import re
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn
from transformers.core_model_loading import revert_weight_conversion

from configuration.configuration_dsv41 import released_quantization_dict

from ..codec import quantize_fp4_rows, quantize_fp8_block, quantize_fp8_rows

_WEIGHT, _SCALE = ".weight", ".scale"
_NATIVE_SCALE = "_scale_inv"  # transformers' FP8 modules: `weight_scale_inv`, the experts' `{name}_scale_inv`

# which of our tensors the release stores quantized (the reference's `Linear` default dtype, fixtures README §7)
_RELEASED_FP8_BLOCK = re.compile(
    r"^(layers|mtp)\.\d+\.(attn\.(wq_a|wq_b|wkv|wo_a|wo_b|indexer\.wq_b)|ffn\.shared_experts\.w[123]|engram\.wkv|main_proj)"
    r"\.weight$"
)
_RELEASED_FP4_ROWS = re.compile(r"^(layers|mtp)\.\d+\.ffn\.experts\.\d+\.w[123]\.weight$")
_RELEASED_FP8_ROWS = re.compile(r"^layers\.\d+\.engram\.embed\.weight$")


_RELEASED_QUANTIZERS = (
    (_RELEASED_FP8_BLOCK, quantize_fp8_block),
    (_RELEASED_FP4_ROWS, quantize_fp4_rows),
    (_RELEASED_FP8_ROWS, quantize_fp8_rows),
)


def released_quantizer(name: str) -> Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]] | None:
    """The quantizer (:mod:`~modeling_dsv41.codec`: weight → stored bytes, scale) the release stores the tensor of
    released name ``name`` with, or None where it stores it as it is."""
    return next((quantize for pattern, quantize in _RELEASED_QUANTIZERS if pattern.match(name)), None)


def _reverted(model: nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` (our names) under the released names, by every registered conversion reversed."""
    conversions = getattr(model, "_weight_conversions", None)
    model._weight_conversions = None  # all of the registered conversions, whichever the last load used
    try:
        return revert_weight_conversion(model, state)
    finally:
        model._weight_conversions = conversions


def released_layout_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """``model``'s tensors under the released names (per-expert ``w1``/``w2``/``w3``), as the model holds them: plain
    weights unquantized, and what a native load keeps as stored (FP8 Linears, FP4 experts: transformers' ``weight``
    and ``weight_scale_inv``, ``{name}`` and ``{name}_scale_inv``) as stored, each weight followed by its
    ``.scale``."""
    state = {name: tensor.detach() for name, tensor in model.state_dict().items()}
    # the stored scales take the names of the tensors they scale, then the released names as those do
    scales = {name[: -len(_NATIVE_SCALE)]: state.pop(name) for name in list(state) if name.endswith(_NATIVE_SCALE)}
    released = _reverted(model, state)
    if not scales:
        return released
    released_scales = _reverted(model, scales)
    out = {}
    for name, tensor in released.items():
        out[name] = tensor
        if name in released_scales:
            out[name[: -len(_WEIGHT)] + _SCALE] = released_scales[name]
    return out


def released_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """``model``'s tensors as the release stores them: released names, quantized weights with their ``.scale``, no
    token map. Tensors the model holds as stored (a native load's FP8 Linears and FP4 experts, FP8 Engram tables)
    are written as they are; the others are quantized (:mod:`~modeling_dsv41.codec`: canonically, so that a tensor a
    native load dequantized is written back with the bytes it was stored with, when those were canonical)."""
    state = released_layout_state_dict(model)
    state.pop("engram_hasher.token_map", None)
    out = {}
    for name, tensor in state.items():
        quantize = released_quantizer(name)
        stored = name.endswith(_WEIGHT) and name[: -len(_WEIGHT)] + _SCALE in state
        if quantize is None or stored:
            out[name] = tensor
            continue
        out[name], out[name[: -len(_WEIGHT)] + _SCALE] = quantize(tensor)
    return out


def save_released_checkpoint(
    model: nn.Module,
    folder: str | os.PathLike,
    max_shard_bytes: int = 5 * 2**30,
    state_dict: dict[str, torch.Tensor] | None = None,
) -> None:
    """Write ``model`` in the released storage format: ``config.json``, safetensors shards of at most
    ``max_shard_bytes`` and ``model.safetensors.index.json``. No Engram token map is written.

    ``state_dict`` replaces :func:`released_state_dict` of ``model`` as the tensors to write.
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    config = copy.deepcopy(model.config)
    config.quantization_config = released_quantization_dict()  # as the release's config.json says it
    config.save_pretrained(folder)
    state = released_state_dict(model) if state_dict is None else state_dict
    state = {name: tensor.contiguous() for name, tensor in state.items()}
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in state.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += nbytes
    weight_map = {}
    for index, shard in enumerate(shards, start=1):
        filename = f"model-{index:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, folder / filename, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, filename))
    total = sum(t.numel() * t.element_size() for t in state.values())
    # the E8M0 scales have no dtype transformers can infer "auto" from: name the one to load in (from_pretrained
    # of this package defaults to it too)
    index = {"metadata": {"total_size": total, "dtype": "bfloat16"}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


__all__ = ["released_layout_state_dict", "released_quantizer", "released_state_dict", "save_released_checkpoint"]
