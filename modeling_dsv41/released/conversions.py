"""The released checkpoint's names and layout mapped onto ours, in transformers' loading machinery (the model registers
them for ``deepseek_v41``), and back for ``save_pretrained(save_original_format=True)``.

The release names the backbone's tensors at the root (``embed``, ``layers.{i}...``, ``vision.*``, ``aligner.*``), the
LM head ``head`` and each routed expert's ``ffn.experts.{e}.w1/w2/w3``. Our models hold the backbone as ``model`` with
the head ``lm_head`` and fused experts (``ffn.experts.gate_up_proj`` [E, 2·I, D] = each expert's ``w1`` then ``w3``
rows, ``ffn.experts.down_proj`` [E, D, I] = its ``w2``). A :class:`~transformers.core_model_loading.WeightRenaming`
adds the ``model.`` prefix and renames the head, and a :class:`~transformers.core_model_loading.WeightConverter` merges
the experts (:class:`MergeReleasedExperts`, dequantizing them first when they are stored FP4).

Each quantized ``X.weight`` of the release has a sibling ``X.scale``. When the model keeps a tensor as stored (native
precision, :mod:`.native_precision`; FP8 Engram tables with ``engram_table_dtype="fp8"``) the converters pair the
weight with its scale and hand both over raw (``weight_scale_inv``, the experts' bytes and scales fused as
transformers' ``FP8Experts`` holds them); otherwise :class:`DequantizeReleasedWeight` turns them into ``X.weight`` in
the parameter's dtype (:func:`~..codec.dequantize_released_weight`). Unquantized tensors pass through the same
converter.

Two lists, as transformers splits a model's names from its storage: :func:`released_layout_conversions` (names and
fused experts, plain weights) is what the model registers, what ``save_pretrained`` reverses into the released names,
and what transformers' reverse-mapping test checks; :func:`released_storage_conversions` adds the scales, and
``from_pretrained`` loads a folder in the released storage with it (:func:`storage_conversions_registered`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager

import torch
from transformers.conversion_mapping import register_checkpoint_conversion_mapping
from transformers.core_model_loading import (
    ConversionOps,
    WeightConverter,
    WeightRenaming,
    dot_natural_key,
    rename_source_key,
)
from transformers.distributed.utils import is_dtensor

from ..codec import RELEASED_BLOCK_SIZE, dequantize_released_weight, stored_scale

# Checkpoint key patterns (regexes). A weight or scale name ends the key; a lookahead rather than `$` because
# transformers strips lookarounds when it turns these into literal replacement strings (and back, for saving).
RELEASED_WEIGHT = r"\.weight(?![\w.])"
RELEASED_SCALE = r"\.scale(?![\w.])"
_WEIGHT, _SCALE = ".weight", ".scale"
_NATIVE_SCALE = ".weight_scale_inv"  # transformers' FP8 layers' name for the scales
# what the release stores that our model does not load: an unused vector, and the copies of the shared embed / head
# a reference state dict lists under every DSpark block (never stored by the release); and the DSpark head itself
# when the config has none
NOT_LOADED = (r"^image_pad$", r"^mtp\.\d+\.(embed|head)\.weight$")
NOT_LOADED_WITHOUT_DSPARK = r"^mtp\."


def _only(tensors: list[torch.Tensor] | torch.Tensor | None) -> torch.Tensor | None:
    if isinstance(tensors, list):
        if len(tensors) > 1:
            raise ValueError(f"expected one checkpoint tensor per key, got {len(tensors)}")
        return tensors[0] if tensors else None
    return tensors


def check_whole_scale_blocks(param: torch.Tensor, block: tuple[int, ...], name: str) -> None:
    """A tensor- or expert-parallel shard of a block-scaled released tensor must hold whole scale blocks: ``block``
    is the scale block of ``param``'s stored layout per dim (32x32 for FP8 Linears; 1 row x 16 bytes = 32 values for
    the FP4 experts' bytes). A split inside a block would leave a rank values without their scale (or, for FP8,
    silently pair them with the next block's)."""
    if not is_dtensor(param):
        return
    mesh = param.device_mesh
    for mesh_dim, placement in enumerate(param.placements):
        if not hasattr(placement, "dim"):  # replicated on this mesh dim
            continue
        dim = placement.dim % param.ndim
        ranks = mesh.size(mesh_dim) * getattr(placement, "split_factor", 1)
        chunk = math.ceil(param.shape[dim] / ranks)
        if chunk % block[dim]:
            raise ValueError(
                f"{name}: split over {mesh.size(mesh_dim)} ranks, dim {dim} of the stored tensor "
                f"({param.shape[dim]}) gives {chunk} per rank, which cuts its E8M0 scale blocks ({block[dim]} each). "
                f"Use a tp_size that leaves each rank a multiple of {RELEASED_BLOCK_SIZE} of moe_intermediate_size "
                "(modeling_dsv41.parallel.check_parallel_load names them)"
            )


class DequantizeReleasedWeight(ConversionOps):
    """``X.weight`` and its ``X.scale`` (released storage) → ``X.weight`` in the parameter's dtype.

    A weight without a scale passes through. An FP8 Engram table loaded into a model that keeps it as stored
    (``engram_table_dtype="fp8"``) passes through with its scale.
    """

    @torch.no_grad()
    def convert(self, input_dict, source_patterns, target_patterns, model=None, full_layer_name=None, **kwargs):
        weight = _only(input_dict.get(source_patterns[0]))
        scale = _only(input_dict.get(source_patterns[1]))
        if weight is None:
            raise ValueError(f"{full_layer_name}: the checkpoint has a scale but no weight")
        param = model.get_parameter(full_layer_name)
        if param.dtype == torch.float8_e4m3fn:  # kept as stored: the loader left both tensors raw
            module = model.get_submodule(full_layer_name.rpartition(".")[0])
            if scale is None and hasattr(module, "weight_scale_inv"):  # our layout: the scales load by their name
                return {_WEIGHT: weight}
            if scale is None:
                raise ValueError(f"{full_layer_name} is kept in FP8 but the checkpoint stores it without scales")
            check_whole_scale_blocks(param, (RELEASED_BLOCK_SIZE,) * 2, full_layer_name)
            # a native `FP8Linear` names its scales `weight_scale_inv`; an FP8 Engram table, `scale`
            return {_WEIGHT: weight, _NATIVE_SCALE if hasattr(module, "weight_scale_inv") else _SCALE: scale}
        if scale is None:
            return {_WEIGHT: weight}
        check_whole_scale_blocks(param, (RELEASED_BLOCK_SIZE,) * param.ndim, full_layer_name)
        # the loader already cast the sources to the dtype this parameter loads in
        dtype = weight.dtype if weight.is_floating_point() and weight.element_size() > 1 else param.dtype
        return {_WEIGHT: dequantize_released_weight(weight, scale, local_shape(param)[-1], dtype)}

    @property
    def reverse_op(self) -> ConversionOps:
        return _SavePlainWeight()


class _SavePlainWeight(ConversionOps):
    """Reverse of :class:`DequantizeReleasedWeight` for ``save_pretrained``: our checkpoints store plain weights."""

    def convert(self, input_dict, source_patterns, target_patterns, **kwargs):
        return {_WEIGHT: _only(input_dict[source_patterns[0]])}

    @property
    def reverse_op(self) -> ConversionOps:
        return DequantizeReleasedWeight()


def local_shape(param: torch.Tensor) -> torch.Size:
    """The shape of the part of ``param`` this rank holds: its shard under tensor or expert parallelism (a DTensor,
    whose ``shape`` is the global one), else the whole parameter."""
    return param.to_local().shape if is_dtensor(param) else param.shape


class MergeReleasedExperts(ConversionOps):
    """The released per-expert ``w1``/``w3`` (or ``w2``) weights, FP4 with scales or plain → one fused
    ``gate_up_proj`` [E, 2·I, D] (or ``down_proj`` [E, D, I]) in the parameter's dtype.

    The source patterns list each weight pattern followed by its scale pattern; the weights of one pattern are
    stacked in expert order (the loader sorts keys naturally) and the patterns concatenated along dim 1. One op
    rather than ``MergeModulelist`` + ``Concatenate``: the scales must be consumed per expert first, and the
    reverse (:class:`SplitReleasedExperts`) must split into the weight patterns only.

    Under tensor or expert parallelism the loader hands over this rank's shard of each tensor (transformers'
    ``DtensorShardOperation``: only the rank's experts, and of each its slice of rows or columns, scales sliced by
    the same placement), so the result is checked against the rank's local shape.
    """

    @torch.no_grad()
    def convert(self, input_dict, source_patterns, target_patterns, model=None, full_layer_name=None, **kwargs):
        param = model.get_parameter(full_layer_name)
        module_name, _, name = full_layer_name.rpartition(".")
        # bitsandbytes' experts (modeling_dsv41.bnb_experts) hold packed bytes but take the merged dense weight, which
        # the quantize operation then quantizes: they say its logical shape
        logical_shape = getattr(model.get_submodule(module_name), "weight_shape", None)
        shape = torch.Size(logical_shape(name)) if logical_shape else local_shape(param)
        stored_fp4 = logical_shape is None and param.element_size() == 1
        if any(input_dict.get(p) for p in source_patterns if p.endswith(_SCALE)):
            # any split of the experts or their rows (one scale per row); columns in blocks of 32 (FP4: 16 bytes)
            columns_per_scale = RELEASED_BLOCK_SIZE // 2 if stored_fp4 else RELEASED_BLOCK_SIZE
            check_whole_scale_blocks(param, (1, 1, columns_per_scale), full_layer_name)
        if stored_fp4:  # native FP4 experts (`FP8Experts`): the bytes and scales fused as stored
            return self._fuse_stored(input_dict, source_patterns, target_patterns[0], shape, full_layer_name)
        merged = []
        for pattern in source_patterns:
            if not pattern.endswith(_WEIGHT):
                continue
            weights = input_dict.pop(pattern, None)
            scales = input_dict.pop(pattern[: -len(_WEIGHT)] + _SCALE, None)
            if not weights:
                raise ValueError(f"{full_layer_name}: the checkpoint has no {pattern}")
            if scales is not None and len(scales) != len(weights):
                raise ValueError(f"{full_layer_name}: {len(weights)} experts' {pattern} but {len(scales)} scales")
            if scales is not None:
                dtype = (
                    weights[0].dtype
                    if weights[0].is_floating_point() and weights[0].element_size() > 1
                    else param.dtype
                )
                weights = [dequantize_released_weight(w, s, shape[-1], dtype) for w, s in zip(weights, scales)]
            merged.append(torch.stack(weights))
        if sum(t.shape[1] for t in merged) != shape[1] or merged[0].shape[0] != shape[0]:
            raise ValueError(
                f"{full_layer_name}: the checkpoint's experts make {[tuple(t.shape) for t in merged]}, which does not "
                f"fit the parameter's {tuple(shape)} (n_routed_experts, moe_intermediate_size, hidden_size)"
            )
        return {target_patterns[0]: torch.cat(merged, dim=1) if len(merged) > 1 else merged[0]}

    @staticmethod
    def _fuse_stored(input_dict, source_patterns, target: str, shape: torch.Size, full_layer_name: str) -> dict:
        """Packed FP4 bytes [E, rows, C/2] and their E8M0 scales [E, rows, C/32] → ``target`` and
        ``target_scale_inv`` (transformers' ``FP8Experts`` layout), as stored."""
        weights, scales = [], []
        for pattern in source_patterns:
            if pattern.endswith(_WEIGHT):
                stored_weights = input_dict.pop(pattern)
                stored_scales = input_dict.pop(pattern[: -len(_WEIGHT)] + _SCALE, None)
                if stored_scales is None:
                    raise ValueError(
                        f"{full_layer_name} is kept in FP4 but the checkpoint stores {pattern} without scales"
                    )
                weights.append(torch.stack(stored_weights).view(torch.int8))
                scales.append(torch.stack([stored_scale(s) for s in stored_scales]))
        weight, scale = torch.cat(weights, dim=1), torch.cat(scales, dim=1)
        if weight.shape != shape:
            raise ValueError(
                f"{full_layer_name}: the checkpoint's FP4 experts make {tuple(weight.shape)}, the "
                f"parameter (this rank's part) is {tuple(shape)}"
            )
        return {target: weight, target + "_scale_inv": scale}

    @property
    def reverse_op(self) -> ConversionOps:
        return SplitReleasedExperts()


class SplitReleasedExperts(ConversionOps):
    """Reverse of :class:`MergeReleasedExperts` for ``save_pretrained(save_original_format=True)``: one fused
    tensor → the released per-expert weights (plain; :func:`save_released_checkpoint` quantizes them)."""

    @torch.no_grad()
    def convert(self, input_dict, source_patterns, target_patterns, **kwargs):
        fused = _only(input_dict[source_patterns[0]])
        names = [pattern for pattern in target_patterns if pattern.endswith(_WEIGHT)]
        out = {}
        for name, part in zip(names, fused.chunk(len(names), dim=1)):
            out.update({name.replace("*", str(e)): part[e] for e in range(part.shape[0])})
        return out

    @property
    def reverse_op(self) -> ConversionOps:
        return MergeReleasedExperts()


# the backbone's top-level names, which the release keeps at the root
_BACKBONE_ROOTS = r"embed|layers|norm|engram_hasher|vision|aligner|image_start|image_newline|image_end"


def _released_experts(weights: tuple[str, ...], target: str, suffixes: tuple[str, ...]) -> WeightConverter:
    sources = [f"ffn.experts.*.{w}{suffix}" for w in weights for suffix in suffixes]
    return WeightConverter(
        source_patterns=sources, target_patterns=f"ffn.experts.{target}", operations=[MergeReleasedExperts()]
    )


def _released_names(suffixes: tuple[str, ...]) -> list[WeightRenaming | WeightConverter]:
    return [
        WeightRenaming(source_patterns=rf"^({_BACKBONE_ROOTS})(?=\.|$)", target_patterns=r"model.\1"),
        WeightRenaming(source_patterns=r"^head\.", target_patterns="lm_head."),
        # experts before a generic converter: a key goes to the first converter that matches it
        _released_experts(("w1", "w3"), "gate_up_proj", suffixes),
        _released_experts(("w2",), "down_proj", suffixes),
    ]


def released_layout_conversions() -> list[WeightRenaming | WeightConverter]:
    """The released names and per-expert weights mapped onto ours, plain weights only: what the model registers for
    ``deepseek_v41``, and what ``save_pretrained`` reverses (every pattern meets a saved key). Keys already in our
    layout match none of them."""
    return _released_names((_WEIGHT,))


def released_storage_conversions() -> list[WeightRenaming | WeightConverter]:
    """:func:`released_layout_conversions` for a folder in the released storage: each quantized weight paired with its
    ``.scale`` (kept as stored or dequantized, see the module docstring)."""
    return [
        *_released_names((_WEIGHT, _SCALE)),
        WeightConverter(
            source_patterns=[RELEASED_WEIGHT, RELEASED_SCALE],
            target_patterns=RELEASED_WEIGHT,
            operations=[DequantizeReleasedWeight()],
        ),
    ]


def released_sources(
    names: Iterable[str], conversions: list[WeightRenaming | WeightConverter]
) -> dict[str, list[str]]:
    """Our name → the released tensors (of ``names``) it is made of, by ``conversions``: one, or every expert's
    ``w1`` then ``w3`` (or ``w2``) in expert order, in the order their first source comes in ``names``."""
    renamings = [c for c in conversions if isinstance(c, WeightRenaming)]
    converters = [c for c in conversions if isinstance(c, WeightConverter)]
    outputs: dict[str, list[str]] = {}
    for name in names:
        target, _ = rename_source_key(name, renamings, converters)
        outputs.setdefault(target, []).append(name)
    for sources in outputs.values():
        if len(sources) > 1:  # fused experts: weight pattern (w1 before w3), then expert index
            sources.sort(key=lambda n: (n.rsplit(".", 2)[-2], dot_natural_key(n)))
    return outputs


def fuse_experts(sources: list[str], tensors: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """The fused experts tensor of :func:`released_sources`' ``sources`` (as :class:`MergeReleasedExperts` fuses them:
    each weight's experts stacked, the weights concatenated on dim 1)."""
    parts: dict[str, list[torch.Tensor]] = {}
    for name in sources:
        parts.setdefault(name.rsplit(".", 2)[-2], []).append(tensors[name])
    return torch.cat([torch.stack(weights) for weights in parts.values()], dim=1)


def in_our_layout(state_dict: Mapping[str, torch.Tensor], own: set[str]) -> dict[str, torch.Tensor]:
    """``state_dict`` with the keys it holds in the released layout (plain weights, what ``save_pretrained`` writes)
    mapped onto ours, for a model whose keys are ``own`` (a base model's lack the ``model.`` prefix)."""
    if own.issuperset(state_dict):
        return dict(state_dict)
    ours = {}
    for target, sources in released_sources(state_dict, released_layout_conversions()).items():
        if target not in own and target.startswith("model.") and target[len("model.") :] in own:
            target = target[len("model.") :]
        ours[target] = state_dict[sources[0]] if len(sources) == 1 else fuse_experts(sources, state_dict)
    return ours


def register_layout_conversions(model_type: str) -> None:
    """Register :func:`released_layout_conversions` for ``model_type`` with transformers' loading."""
    register_checkpoint_conversion_mapping(model_type, released_layout_conversions(), overwrite=True)


@contextmanager
def storage_conversions_registered(model_type: str) -> Iterator[None]:
    """While loading a folder in the released storage: :func:`released_storage_conversions` registered for
    ``model_type`` instead of the layout ones (transformers reads the registry when it loads)."""
    register_checkpoint_conversion_mapping(model_type, released_storage_conversions(), overwrite=True)
    try:
        yield
    finally:
        register_layout_conversions(model_type)


__all__ = [
    "DequantizeReleasedWeight",
    "MergeReleasedExperts",
    "NOT_LOADED",
    "NOT_LOADED_WITHOUT_DSPARK",
    "RELEASED_SCALE",
    "RELEASED_WEIGHT",
    "SplitReleasedExperts",
    "check_whole_scale_blocks",
    "fuse_experts",
    "in_our_layout",
    "local_shape",
    "register_layout_conversions",
    "released_layout_conversions",
    "released_sources",
    "released_storage_conversions",
    "storage_conversions_registered",
]
