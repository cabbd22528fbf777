"""Loading DeepSeek-V4.1 checkpoints with ``from_pretrained``: the released names and storage format, the Engram
token map, bitsandbytes.

**Released names.** The release names the backbone's tensors at the root (``embed``, ``layers.{i}...``, ``vision.*``,
``aligner.*``), the LM head ``head`` and each routed expert's ``ffn.experts.{e}.w1/w2/w3``. Our models hold the
backbone as ``model`` with the head ``lm_head`` and fused experts (``ffn.experts.gate_up_proj`` [E, 2·I, D] = each
expert's ``w1`` then ``w3`` rows, ``ffn.experts.down_proj`` [E, D, I] = its ``w2``). The conversions registered
here for ``deepseek_v41`` map one layout onto the other in transformers' loading machinery: a
:class:`~transformers.core_model_loading.WeightRenaming` adds the ``model.`` prefix and renames the head, and a
:class:`~transformers.core_model_loading.WeightConverter` merges the experts (:class:`MergeReleasedExperts`,
dequantizing them first when they are stored FP4). ``save_pretrained`` writes our layout; with
``save_original_format=True`` it applies the same conversions backwards and writes the released names with plain
weights, and :func:`save_released_checkpoint` writes the released names *and* storage (FP8/FP4 with scales).

**Released storage** (fixtures README §7). Dense Linears are FP8 e4m3 with one E8M0 scale per 32x32 block, routed
experts packed FP4 (two E2M1 codes per byte, even column in the low nibble) with one E8M0 scale per row and 32
columns, Engram tables FP8 with per-row, per-32-column E8M0 scales; each quantized ``X.weight`` has a sibling
``X.scale``. By default the FP8 Linears and FP4 experts stay as stored (:mod:`.native_precision`: the
``quantization_config`` a released folder implies, added to the config by :meth:`from_pretrained`); the converters
registered here pair each weight with its scale and hand both over raw (``weight_scale_inv``, the experts' bytes and
scales fused as transformers' ``FP8Experts`` holds them). With ``quantization_config=FineGrainedFP8Config(
dequantize=True)``, and for the tensors that stay in high precision (the block-diagonal ``wo_a``, Engram ``wkv``),
:class:`DequantizeReleasedWeight` turns them into ``X.weight`` in the parameter's dtype (FP8 Engram tables stay as
stored when the config says ``engram_table_dtype="fp8"``; the values are read by :mod:`.released_storage`, which the
weight-only modules of native loading share). Such checkpoints are read one target parameter at a time
(:func:`sequential_loading`) and each tensor is dequantized in row chunks, so the peak is the final model plus the
tensor being converted. Unquantized tensors pass through the same converter.

**Engram token map.** Our checkpoints hold the hasher's ``token_map`` (token id → compressed id); the released one does
not, so ``from_pretrained`` builds it from ``tokenizer.json`` next to the weights or from ``engram_tokenizer``.

**bitsandbytes.** Linears the model reads as raw tensors (the fp32 head and ratio-2 compressors, Engram ``wkv``, the
ViT patch embedding) and, for 4-bit, those whose shape bnb's CPU kernels cannot pack (in-features a multiple of 64,
out-features of 32) join ``llm_int8_skip_modules``. Norms, gates, mHC and the Engram gate parameters are not Linears,
and the block-diagonal ``wo_a`` is not one either: bnb leaves them alone. So are the fused routed experts (3-D
parameters; transformers' bnb integration quantizes Linears only): they load in ``dtype``, and QLoRA adapts them
through PEFT's ``target_parameters``.

:func:`save_released_checkpoint` writes a model in the released format (tests, benchmarks).
"""

from __future__ import annotations

import copy
import importlib.util
import json
import math
import os
import re
from contextlib import contextmanager, nullcontext
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn
from transformers import BitsAndBytesConfig, FineGrainedFP8Config, PreTrainedConfig
from transformers import initialization as init
from transformers.conversion_mapping import register_checkpoint_conversion_mapping
from transformers.core_model_loading import ConversionOps, WeightConverter, WeightRenaming, revert_weight_conversion
from transformers.distributed.utils import is_dtensor
from transformers.utils import cached_file, logging

from ..quantization import FP4_E2M1_MAX, FP8_E4M3_MAX, RELEASED_BLOCK_SIZE
from ..parallel import check_parallel_load, requested_parallelism
from ..validation import check_safetensors_folder
from .native_precision import QUANT_METHOD, released_quantization_config
from .released_storage import dequantize_released_weight, stored_scale

logger = logging.get_logger(__name__)

# Checkpoint key patterns (regexes). A weight or scale name ends the key; a lookahead rather than `$` because
# transformers strips lookarounds when it turns these into literal replacement strings (and back, for saving).
RELEASED_WEIGHT = r"\.weight(?![\w.])"
RELEASED_SCALE = r"\.scale(?![\w.])"
_WEIGHT, _SCALE = ".weight", ".scale"
_NATIVE_SCALE = ".weight_scale_inv"  # transformers' FP8 layers' name for the scales

# bnb's 4-bit CPU kernels quantize in blocks of 64 inputs and pack weights in blocks of 32 outputs
BNB_4BIT_IN_BLOCK, BNB_4BIT_OUT_BLOCK = 64, 32
# Linears whose forward reads `.weight` itself (fp32 upcasts, a grouped einsum, dtype queries): never quantized
_READS_RAW_WEIGHT = re.compile(r"(^|\.)(lm_head|compressor\.wkv|compressor\.wgate|engram\.wkv|patch_embed\.proj)$")


# ---------------------------------------------------------------------------------------------------------------------
# Dequantization on load
# ---------------------------------------------------------------------------------------------------------------------


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
        shape = local_shape(param)
        if any(input_dict.get(p) for p in source_patterns if p.endswith(_SCALE)):
            # any split of the experts or their rows (one scale per row); columns in blocks of 32 (FP4: 16 bytes)
            columns_per_scale = RELEASED_BLOCK_SIZE // 2 if param.element_size() == 1 else RELEASED_BLOCK_SIZE
            check_whole_scale_blocks(param, (1, 1, columns_per_scale), full_layer_name)
        if param.element_size() == 1:  # native FP4 experts (`FP8Experts`): the bytes and scales fused as stored
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
                dtype = weights[0].dtype if weights[0].is_floating_point() and weights[0].element_size() > 1 else param.dtype
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
                    raise ValueError(f"{full_layer_name} is kept in FP4 but the checkpoint stores {pattern} without scales")
                weights.append(torch.stack(stored_weights).view(torch.int8))
                scales.append(torch.stack([stored_scale(s) for s in stored_scales]))
        weight, scale = torch.cat(weights, dim=1), torch.cat(scales, dim=1)
        if weight.shape != shape:
            raise ValueError(f"{full_layer_name}: the checkpoint's FP4 experts make {tuple(weight.shape)}, the "
                             f"parameter (this rank's part) is {tuple(shape)}")
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


def _released_experts(weights: tuple[str, ...], target: str) -> WeightConverter:
    sources = [f"ffn.experts.*.{w}{suffix}" for w in weights for suffix in (_WEIGHT, _SCALE)]
    return WeightConverter(source_patterns=sources, target_patterns=f"ffn.experts.{target}", operations=[MergeReleasedExperts()])


def released_storage_conversions() -> list[WeightRenaming | WeightConverter]:
    """The conversions ``from_pretrained`` applies to DeepSeek-V4.1 checkpoints (and, reversed,
    ``save_pretrained(save_original_format=True)``). Keys already in our layout match none of them."""
    return [
        WeightRenaming(source_patterns=rf"^({_BACKBONE_ROOTS})(?=\.|$)", target_patterns=r"model.\1"),
        WeightRenaming(source_patterns=r"^head\.", target_patterns="lm_head."),
        # experts before the generic converter: a key goes to the first converter that matches it
        _released_experts(("w1", "w3"), "gate_up_proj"),
        _released_experts(("w2",), "down_proj"),
        WeightConverter(
            source_patterns=[RELEASED_WEIGHT, RELEASED_SCALE],
            target_patterns=RELEASED_WEIGHT,
            operations=[DequantizeReleasedWeight()],
        ),
    ]


register_checkpoint_conversion_mapping("deepseek_v41", released_storage_conversions(), overwrite=True)


# ---------------------------------------------------------------------------------------------------------------------
# Reading a released checkpoint
# ---------------------------------------------------------------------------------------------------------------------

_HUB_KWARGS = ("cache_dir", "force_download", "proxies", "local_files_only", "token", "revision", "subfolder")


def _checkpoint_file(source: str | os.PathLike | None, filename: str, hub_kwargs: dict) -> str | None:
    if source is None:  # from_pretrained(None, state_dict=...)
        return None
    return cached_file(
        str(source), filename, _raise_exceptions_for_missing_entries=False,
        _raise_exceptions_for_connection_errors=False, **hub_kwargs,
    )


def _stored_keys(source: str | os.PathLike, hub_kwargs: dict) -> list[str]:
    index = _checkpoint_file(source, "model.safetensors.index.json", hub_kwargs)
    if index is not None:
        return list(json.loads(Path(index).read_text())["weight_map"])
    single = _checkpoint_file(source, "model.safetensors", hub_kwargs)
    if single is None:
        return []
    with safe_open(single, framework="pt") as f:
        return list(f.keys())


def stores_scales(source: str | os.PathLike, **hub_kwargs) -> bool:
    """Whether the safetensors checkpoint at ``source`` holds ``.scale`` tensors (the released storage format)."""
    return any(key.endswith(_SCALE) for key in _stored_keys(source, hub_kwargs))


def stores_quantized_weights(source: str | os.PathLike, **hub_kwargs) -> bool:
    """Whether ``source`` stores Linears or experts quantized (FP8 / FP4 with scales), not only FP8 Engram tables:
    the checkpoints that load natively (:mod:`.native_precision`)."""
    return any(key.endswith(_SCALE) and not key.endswith("engram.embed.scale") for key in _stored_keys(source, hub_kwargs))


@contextmanager
def sequential_loading():
    """Have transformers read each checkpoint tensor only when its parameter is converted.

    By default a thread pool materializes every tensor ahead of conversion, cast to the load dtype. Converted
    tensors then wait their turn in that inflated form (an FP4 byte becomes four bf16 bytes), which can add most of
    the model's size to the peak. ``HF_DEACTIVATE_ASYNC_LOAD`` is transformers' switch for sequential loading.
    """
    previous = os.environ.get("HF_DEACTIVATE_ASYNC_LOAD")
    os.environ["HF_DEACTIVATE_ASYNC_LOAD"] = "1"
    try:
        yield
    finally:
        if previous is None:
            del os.environ["HF_DEACTIVATE_ASYNC_LOAD"]
        else:
            os.environ["HF_DEACTIVATE_ASYNC_LOAD"] = previous


# ---------------------------------------------------------------------------------------------------------------------
# Engram token map
# ---------------------------------------------------------------------------------------------------------------------


def ensure_engram_token_map(model: nn.Module, source: str | os.PathLike, tokenizer=None, **hub_kwargs) -> None:
    """Give ``model``'s Engram hasher its compressed token map unless the checkpoint held one.

    ``tokenizer`` (a ``tokenizers.Tokenizer``, a transformers fast tokenizer or a path to ``tokenizer.json``) wins
    when given; otherwise the ``tokenizer.json`` next to the weights at ``source`` is used.
    """
    hasher = getattr(model.base_model, "engram_hasher", None)
    if hasher is None or (tokenizer is None and hasher.has_token_map):
        return
    if tokenizer is None:
        tokenizer = _checkpoint_file(source, "tokenizer.json", hub_kwargs)
        if tokenizer is None:
            raise ValueError(
                f"{source} has Engram layers but stores no compressed token map (engram_hasher.token_map) and has no "
                "tokenizer.json to build it from: pass engram_tokenizer=<the model's tokenizer or its tokenizer.json> "
                "to from_pretrained, or put tokenizer.json next to the weights"
            )
    if isinstance(tokenizer, (str, os.PathLike)):
        from tokenizers import Tokenizer

        tokenizer = Tokenizer.from_file(str(tokenizer))
    hasher.load_tokenizer(tokenizer)


# ---------------------------------------------------------------------------------------------------------------------
# bitsandbytes
# ---------------------------------------------------------------------------------------------------------------------


def high_precision_modules(model: nn.Module, load_in_4bit: bool) -> list[str]:
    """Names of the Linears bitsandbytes must leave alone in ``model`` (any device, even meta)."""
    names = []
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear):
            continue
        unfit_for_4bit = module.in_features % BNB_4BIT_IN_BLOCK or module.out_features % BNB_4BIT_OUT_BLOCK
        if _READS_RAW_WEIGHT.search(name) or (load_in_4bit and unfit_for_4bit):
            names.append(name)
    return names


def _with_high_precision_modules(
    cls, source, quantization_config: BitsAndBytesConfig, config: PreTrainedConfig | str | None, hub_kwargs: dict
) -> BitsAndBytesConfig:
    """A copy of ``quantization_config`` whose ``llm_int8_skip_modules`` also names the modules bnb must skip, found
    on a meta-device instance of the model."""
    if not isinstance(config, PreTrainedConfig):
        config = cls.config_class.from_pretrained(config or source, **hub_kwargs)
    with torch.device("meta"), init.no_init_weights():
        probe = cls(config)
    quantization_config = copy.deepcopy(quantization_config)
    skipped = set(quantization_config.llm_int8_skip_modules or [])
    skipped |= set(high_precision_modules(probe, quantization_config.load_in_4bit))
    quantization_config.llm_int8_skip_modules = sorted(skipped)
    return quantization_config


def _with_native_quantization(cls, source, config: PreTrainedConfig | str | None, hub_kwargs: dict) -> PreTrainedConfig:
    """A copy of the config whose ``quantization_config`` is the one the released folder implies (FP8 Linears and FP4
    experts kept quantized, :mod:`.native_precision`), for the Linears of a meta-device instance of the model."""
    if not isinstance(config, PreTrainedConfig):
        config = cls.config_class.from_pretrained(config or source, **hub_kwargs)
    config = copy.deepcopy(config)
    with torch.device("meta"), init.no_init_weights():
        probe = cls(config)
    # a dict, as in a config.json, naming the quant method transformers dispatches to our quantizer
    config.quantization_config = {**released_quantization_config(probe).to_dict(), "quant_method": QUANT_METHOD}
    return config


def _saved_native_config(cls, source, config: PreTrainedConfig | str | None, hub_kwargs: dict) -> PreTrainedConfig | None:
    """For a model saved after a native load (``quant_method: "fp8"`` with FP4 experts in its config, transformers'
    FP8 layout in its weights): a copy of the config that loads through our quantizer (weight-only on the CPU), else
    None."""
    if not isinstance(config, PreTrainedConfig):
        if _checkpoint_file(config or source, "config.json", hub_kwargs) is None:
            return None
        config = cls.config_class.from_pretrained(config or source, **hub_kwargs)
    saved = getattr(config, "quantization_config", None)
    saved = saved.to_dict() if hasattr(saved, "to_dict") else saved
    if not isinstance(saved, dict) or saved.get("quant_method") != "fp8" or saved.get("expert_dtype") != "fp4":
        return None
    config = copy.deepcopy(config)
    config.quantization_config = {**saved, "quant_method": QUANT_METHOD}
    return config


# ---------------------------------------------------------------------------------------------------------------------
# The model-side hooks
# ---------------------------------------------------------------------------------------------------------------------


def _asks_native_precision(quantization_config) -> bool:
    """No quantization config, or a fine-grained FP8 one that does not ask to dequantize."""
    return quantization_config is None or (
        isinstance(quantization_config, FineGrainedFP8Config) and not quantization_config.dequantize
    )


def _adapt_natively_with_peft() -> None:
    """Where PEFT is installed, make its LoRA adapt a natively loaded model's FP8 Linears and FP4 experts as the bf16
    model's (:mod:`.native_lora`)."""
    if importlib.util.find_spec("peft") is None:
        return
    from .native_lora import install_peft_dispatch

    install_peft_dispatch()


class DeepseekV41CheckpointLoadingMixin:
    """``from_pretrained`` for DeepSeek-V4.1: released storage, the Engram token map, bitsandbytes skips."""

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *model_args, engram_tokenizer=None, **kwargs):
        """:meth:`PreTrainedModel.from_pretrained`, which also reads the released storage format (FP8/FP4 weights
        with E8M0 scales, kept as stored through the fine-grained FP8 quantization the folder implies, or dequantized
        to ``dtype`` on load with ``quantization_config=FineGrainedFP8Config(dequantize=True)``; FP8 Engram tables
        stay FP8 when the config says ``engram_table_dtype="fp8"``), plus:

        Args:
            engram_tokenizer: the tokenizer (or path to its ``tokenizer.json``) to build the Engram compressed token
                map from. Needed only when the checkpoint has no ``engram_hasher.token_map`` (the released one) and
                no ``tokenizer.json`` sits next to the weights.

        A checkpoint with scales is read one parameter at a time (:func:`sequential_loading`). With a
        :class:`~transformers.BitsAndBytesConfig`, the modules that must stay in high precision are added to its
        ``llm_int8_skip_modules``. Released storage loads in bf16 unless ``dtype`` says otherwise (its FP8/FP4
        tensors have no natural "auto" dtype).
        """
        hub_kwargs = {k: kwargs[k] for k in _HUB_KWARGS if k in kwargs}
        if pretrained_model_name_or_path is not None:  # a truncated local file: an error naming it
            check_safetensors_folder(Path(pretrained_model_name_or_path, hub_kwargs.get("subfolder") or ""))
        quantization_config = kwargs.get("quantization_config")
        if isinstance(quantization_config, BitsAndBytesConfig):
            kwargs["quantization_config"] = _with_high_precision_modules(
                cls, pretrained_model_name_or_path, quantization_config, kwargs.get("config"), hub_kwargs
            )
        released = stores_scales(pretrained_model_name_or_path, **hub_kwargs)
        if isinstance(quantization_config, FineGrainedFP8Config):  # released storage only: ours below, or none
            del kwargs["quantization_config"]
        native = _asks_native_precision(quantization_config)
        if native and released and stores_quantized_weights(pretrained_model_name_or_path, **hub_kwargs):
            kwargs["config"] = _with_native_quantization(cls, pretrained_model_name_or_path, kwargs.get("config"), hub_kwargs)
        elif pretrained_model_name_or_path is not None and not released:
            saved = _saved_native_config(cls, pretrained_model_name_or_path, kwargs.get("config"), hub_kwargs)
            if saved is not None and not native:
                raise ValueError(
                    f"{pretrained_model_name_or_path} holds a model saved after a native load (FP8 / FP4 weights in "
                    "our layout), which loads natively only: load it without dequantize=True and cast the parameters "
                    "you need, or dequantize the released checkpoint instead"
                )
            if saved is not None:
                kwargs["config"] = saved
        parallel = requested_parallelism(kwargs)
        if parallel is not None and pretrained_model_name_or_path is not None:
            config = kwargs.get("config")
            if not isinstance(config, PreTrainedConfig):
                config = cls.config_class.from_pretrained(config or pretrained_model_name_or_path, **hub_kwargs)
            native_load = native and released and stores_quantized_weights(pretrained_model_name_or_path, **hub_kwargs)
            check_parallel_load(config, parallel, native=native_load, released=released)
        if released and kwargs.get("dtype", "auto") == "auto":
            kwargs["dtype"] = torch.bfloat16
        with sequential_loading() if released else nullcontext():
            loaded = super().from_pretrained(pretrained_model_name_or_path, *model_args, **kwargs)
        model = loaded[0] if isinstance(loaded, tuple) else loaded
        # The conversions map the two layouts one-to-one: saving in the released layout applies all of them, not
        # only those this load happened to use (transformers keeps just those).
        model._weight_conversions = None
        ensure_engram_token_map(model, pretrained_model_name_or_path, engram_tokenizer, **hub_kwargs)
        if getattr(getattr(model, "hf_quantizer", None), "quantization_config", None) is not None and (
            model.hf_quantizer.quantization_config.quant_method == QUANT_METHOD
        ):
            _adapt_natively_with_peft()
        return loaded

    @classmethod
    def _loads_natively(cls, source, kwargs: dict) -> bool:
        """Whether ``from_pretrained(source, **kwargs)`` keeps the released FP8 Linears and FP4 experts as stored
        (what the device-map planner sizes them by)."""
        hub_kwargs = {k: kwargs[k] for k in _HUB_KWARGS if k in kwargs}
        return (
            source is not None
            and _asks_native_precision(kwargs.get("quantization_config"))
            and stores_scales(source, **hub_kwargs)
            and stores_quantized_weights(source, **hub_kwargs)
        )

    def save_pretrained(self, save_directory, *args, save_original_format: bool = False, **kwargs) -> None:
        """:meth:`PreTrainedModel.save_pretrained`, in our layout by default. ``save_original_format=True`` writes
        the released layout instead (root names, ``head``, per-expert ``w1``/``w2``/``w3``; plain weights), which
        ``from_pretrained`` reads back unchanged; :func:`save_released_checkpoint` also quantizes as the release.
        A pipeline stage (``DistributedConfig(pp_size > 1)``) is refused: it holds only its own layers."""
        if getattr(self, "_pp_stage", None) is not None:
            raise ValueError(
                "this model is one pipeline stage (DistributedConfig(pp_size > 1)) and holds only its own layers: "
                "save the model loaded without pipeline parallelism"
            )
        super().save_pretrained(save_directory, *args, save_original_format=save_original_format, **kwargs)

    def _get_dtype_plan(self, dtype: torch.dtype) -> dict:
        plan = super()._get_dtype_plan(dtype)
        if self.config.get_text_config().engram_table_dtype == "fp8":
            # tables kept as stored: no cast, or the E8M0 scales would be rounded to the table's e4m3 dtype
            plan[r"engram\.embed\.weight"] = None
        return plan

    def _adjust_missing_and_unexpected_keys(self, loading_info) -> None:
        ignored = re.compile("|".join(f"(?:{p})" for p in self._keys_to_ignore_on_load_unexpected or ()) or "(?!)")
        skipped = sorted(key for key in loading_info.unexpected_keys if ignored.search(key))
        if skipped:
            logger.warning(
                f"Ignoring {len(skipped)} checkpoint weights this model does not load (`image_pad`; the DSpark draft "
                f"head `mtp.*` when the config has none; draft blocks' copies of the shared embed / head), e.g. "
                f"{skipped[0]}"
            )
        super()._adjust_missing_and_unexpected_keys(loading_info)


# ---------------------------------------------------------------------------------------------------------------------
# Writing the released storage format
# ---------------------------------------------------------------------------------------------------------------------

# which of our tensors the release stores quantized (the reference's `Linear` default dtype, fixtures README §7)
_RELEASED_FP8_BLOCK = re.compile(
    r"^(layers|mtp)\.\d+\.(attn\.(wq_a|wq_b|wkv|wo_a|wo_b|indexer\.wq_b)|ffn\.shared_experts\.w[123]|engram\.wkv|main_proj)"
    r"\.weight$"
)
_RELEASED_FP4_ROWS = re.compile(r"^(layers|mtp)\.\d+\.ffn\.experts\.\d+\.w[123]\.weight$")
_RELEASED_FP8_ROWS = re.compile(r"^layers\.\d+\.engram\.embed\.weight$")
_E2M1_MAGNITUDES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def _e8m0_scales(amax: torch.Tensor, max_value: float) -> torch.Tensor:
    """Smallest power of two ``s`` with ``amax / s <= max_value``, as float8_e8m0fnu (2^-127 for all-zero blocks)."""
    exponent = torch.ceil(torch.log2(amax.float() / max_value)).clamp(-127, 127)
    return torch.exp2(exponent).to(torch.float8_e8m0fnu)


def quantize_fp8_block(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[R, C] → FP8 e4m3 [R, C] and E8M0 scales [ceil(R/32), ceil(C/32)] (dense Linears)."""
    b = RELEASED_BLOCK_SIZE
    rows, cols = weight.shape
    padded = torch.nn.functional.pad(weight.float(), (0, -cols % b, 0, -rows % b))
    blocks = padded.unflatten(0, (-1, b)).unflatten(2, (-1, b))  # [R/b, b, C/b, b]
    scale = _e8m0_scales(blocks.abs().amax(dim=(1, 3)), FP8_E4M3_MAX)
    expanded = scale.float().repeat_interleave(b, 0).repeat_interleave(b, 1)[:rows, :cols]
    return (weight.float() / expanded).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn), scale


def quantize_fp8_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[R, C] → FP8 e4m3 [R, C] and E8M0 scales [R, C/32] (Engram tables)."""
    groups = weight.float().unflatten(1, (-1, RELEASED_BLOCK_SIZE))
    scale = _e8m0_scales(groups.abs().amax(dim=-1), FP8_E4M3_MAX)
    values = (groups / scale.float().unsqueeze(-1)).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX)
    return values.flatten(1).to(torch.float8_e4m3fn), scale


def quantize_fp4_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[R, C] → packed FP4 int8 [R, C/2] (even column in the low nibble) and E8M0 scales [R, C/32] (routed experts)."""
    groups = weight.float().unflatten(1, (-1, RELEASED_BLOCK_SIZE))
    scale = _e8m0_scales(groups.abs().amax(dim=-1), FP4_E2M1_MAX)
    values = (groups / scale.float().unsqueeze(-1)).flatten(1)
    codes = (values.abs().unsqueeze(-1) - _E2M1_MAGNITUDES).abs().argmin(dim=-1)  # nearest magnitude
    codes = (codes | (values < 0).long() << 3).to(torch.uint8)
    return (codes[:, 0::2] | codes[:, 1::2] << 4).view(torch.int8), scale


_RELEASED_QUANTIZERS = (
    (_RELEASED_FP8_BLOCK, quantize_fp8_block),
    (_RELEASED_FP4_ROWS, quantize_fp4_rows),
    (_RELEASED_FP8_ROWS, quantize_fp8_rows),
)


def released_layout_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """``model``'s tensors under the released names (per-expert ``w1``/``w2``/``w3``), unquantized."""
    state = {name: tensor.detach() for name, tensor in model.state_dict().items()}
    conversions = getattr(model, "_weight_conversions", None)
    model._weight_conversions = None  # all of the registered conversions, whichever the last load used
    try:
        return revert_weight_conversion(model, state)
    finally:
        model._weight_conversions = conversions


def released_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """``model``'s tensors as the release stores them: released names, quantized weights with their ``.scale``, no
    token map."""
    state = released_layout_state_dict(model)
    state.pop("engram_hasher.token_map", None)
    out = {}
    for name, tensor in state.items():
        if name in out:  # the scale of an FP8 Engram table, written with its weight
            continue
        quantize = next((q for pattern, q in _RELEASED_QUANTIZERS if pattern.match(name)), None)
        if quantize is None or tensor.dtype == torch.float8_e4m3fn:  # kept as is (an FP8 table is already stored)
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
    model.config.save_pretrained(folder)
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


__all__ = [
    "DeepseekV41CheckpointLoadingMixin",
    "DequantizeReleasedWeight",
    "dequantize_released_weight",
    "ensure_engram_token_map",
    "high_precision_modules",
    "quantize_fp4_rows",
    "quantize_fp8_block",
    "quantize_fp8_rows",
    "MergeReleasedExperts",
    "SplitReleasedExperts",
    "released_layout_state_dict",
    "released_state_dict",
    "released_storage_conversions",
    "save_released_checkpoint",
]
