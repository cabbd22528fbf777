"""The steps ``from_pretrained`` takes for a DeepSeek-V4.1 checkpoint around transformers' own loading: the released
storage format, a model saved after a native load, bitsandbytes, parallel loads, the Engram token map.

**Released storage** (fixtures README §7). Dense Linears are FP8 e4m3 with one E8M0 scale per 32x32 block, routed
experts packed FP4 (two E2M1 codes per byte, even column in the low nibble) with one E8M0 scale per row and 32
columns, Engram tables FP8 with per-row, per-32-column E8M0 scales; each quantized ``X.weight`` has a sibling
``X.scale``. By default the FP8 Linears and FP4 experts stay as stored (:mod:`.native_precision`: the
``quantization_config`` a released folder implies, added to the config by :func:`prepare_checkpoint_load`). With
``quantization_config=FineGrainedFP8Config(dequantize=True)``, and for the tensors that stay in high precision (the
block-diagonal ``wo_a``, Engram ``wkv``), the conversions (:mod:`.conversions`) dequantize them into the parameter's
dtype (FP8 Engram tables stay as stored when the config says ``engram_table_dtype="fp8"``). Such checkpoints are read
one target parameter at a time (:func:`~.reading.sequential_loading`) and each tensor is dequantized in row chunks, so
the peak is the final model plus the tensor being converted.

**Engram token map.** Our checkpoints hold the hasher's ``token_map`` (token id → compressed id); the released one does
not, so :func:`ensure_engram_token_map` builds it from ``tokenizer.json`` next to the weights or from
``engram_tokenizer``.

**bitsandbytes.** Linears the model reads as raw tensors (the fp32 head and ratio-2 compressors, Engram ``wkv``, the
ViT patch embedding) and, for 4-bit, those whose shape bnb's CPU kernels cannot pack (in-features a multiple of 64,
out-features of 32) join ``llm_int8_skip_modules``. Norms, gates, mHC and the Engram gate parameters are not Linears,
and the block-diagonal ``wo_a`` is not one either: bnb leaves them alone. The fused routed experts (3-D parameters,
which transformers' bnb integration leaves alone) are quantized too, one state per expert
(:mod:`~modeling_dsv41.bnb_quantizer`: the config becomes a ``DeepseekV41BitsAndBytesConfig``, whose quantizers are
transformers' extended to them); QLoRA adapts them through PEFT's ``target_parameters``. A log line at load says what
stays in high precision. A folder in the released storage refuses a bitsandbytes config (its FP8 / FP4 weights load
natively), and so does a tensor- or expert-parallel load (the plans do not split the experts' block states).
"""

from __future__ import annotations

import copy
import importlib.util
import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from torch import nn
from transformers import BitsAndBytesConfig, FineGrainedFP8Config, PreTrainedConfig

from ..bnb_quantizer import DeepseekV41BitsAndBytesConfig
from ..parallel import check_parallel_load, requested_parallelism
from ..placement import meta_instance
from ..validation import check_safetensors_folder
from .conversions import storage_conversions_registered
from .native_precision import QUANT_METHOD, released_quantization_config
from .reading import checkpoint_file, sequential_loading, stores_quantized_weights, stores_scales

# bnb's 4-bit CPU kernels quantize in blocks of 64 inputs and pack weights in blocks of 32 outputs
BNB_4BIT_IN_BLOCK, BNB_4BIT_OUT_BLOCK = 64, 32
# Linears whose forward reads `.weight` itself (fp32 upcasts, a grouped einsum, dtype queries): never quantized
_READS_RAW_WEIGHT = re.compile(r"(^|\.)(lm_head|compressor\.wkv|compressor\.wgate|engram\.wkv|patch_embed\.proj)$")


def _config(cls, source, config: PreTrainedConfig | str | None, hub_kwargs: dict) -> PreTrainedConfig:
    """The config ``from_pretrained(source, config=config)`` loads with."""
    if isinstance(config, PreTrainedConfig):
        return config
    return cls.config_class.from_pretrained(config or source, **hub_kwargs)


def _asks_native_precision(quantization_config) -> bool:
    """No quantization config, or a fine-grained FP8 one that does not ask to dequantize."""
    return quantization_config is None or (
        isinstance(quantization_config, FineGrainedFP8Config) and not quantization_config.dequantize
    )


def loads_natively(source, kwargs: dict, hub_kwargs: dict) -> bool:
    """Whether ``from_pretrained(source, **kwargs)`` keeps the released FP8 Linears and FP4 experts as stored (what the
    device-map planner sizes them by)."""
    return (
        source is not None
        and _asks_native_precision(kwargs.get("quantization_config"))
        and stores_scales(source, **hub_kwargs)
        and stores_quantized_weights(source, **hub_kwargs)
    )


# ---------------------------------------------------------------------------------------------------------------------
# Before transformers loads
# ---------------------------------------------------------------------------------------------------------------------


def prepare_checkpoint_load(cls, source, kwargs: dict, hub_kwargs: dict) -> bool:
    """Adjust ``from_pretrained``'s ``kwargs`` (in place) to the checkpoint at ``source``; returns whether it is in the
    released storage format (then read one tensor at a time, :func:`~.reading.sequential_loading`).

    A truncated local file is an error naming it; a :class:`~transformers.BitsAndBytesConfig` gets the modules that
    must stay in high precision; released storage loads natively (the quantization its folder implies) unless
    ``FineGrainedFP8Config(dequantize=True)`` asks otherwise, and in bf16 unless ``dtype`` says otherwise (its FP8/FP4
    tensors have no natural "auto" dtype); a model saved after a native load loads natively again; a parallel load is
    checked against the sizes it splits.
    """
    if source is not None:
        check_safetensors_folder(Path(source, hub_kwargs.get("subfolder") or ""))
    quantization_config = kwargs.get("quantization_config")
    released = stores_scales(source, **hub_kwargs)
    if isinstance(quantization_config, BitsAndBytesConfig):
        _check_bitsandbytes_source(cls, source, released, kwargs.get("config"), hub_kwargs)
        if requested_parallelism(kwargs) is not None:
            raise ValueError(
                "bitsandbytes with tensor or expert parallelism (tp_plan / tp_size / distributed_config) is not "
                "supported: the parallel plans do not split the quantized experts' block states. Load with device_map "
                "(each quantized module whole on one device), or in parallel without quantization_config"
            )
        kwargs["quantization_config"] = _with_high_precision_modules(
            cls, source, quantization_config, kwargs.get("config"), hub_kwargs
        )
    if isinstance(quantization_config, FineGrainedFP8Config):  # released storage only: ours below, or none
        del kwargs["quantization_config"]
    native = _asks_native_precision(quantization_config)
    native_load = native and released and stores_quantized_weights(source, **hub_kwargs)
    if native_load:
        kwargs["config"] = _with_native_quantization(cls, source, kwargs.get("config"), hub_kwargs)
    elif released:  # dequantized: the folder's quantization_config describes what it stores, not what loads
        kwargs["config"] = _without_quantization_config(_config(cls, source, kwargs.get("config"), hub_kwargs))
    elif source is not None and not released:
        saved = _saved_native_config(cls, source, kwargs.get("config"), hub_kwargs)
        if saved is not None and not native:
            raise ValueError(
                f"{source} holds a model saved after a native load (FP8 / FP4 weights in our layout), which loads "
                "natively only: load it without dequantize=True and cast the parameters you need, or dequantize the "
                "released checkpoint instead"
            )
        if saved is not None:
            kwargs["config"] = saved
    parallel = requested_parallelism(kwargs)
    if parallel is not None and source is not None:
        config = _config(cls, source, kwargs.get("config"), hub_kwargs)
        check_parallel_load(config, parallel, native=native_load, released=released)
    if released and kwargs.get("dtype", "auto") == "auto":
        kwargs["dtype"] = torch.bfloat16
    return released


def _check_bitsandbytes_source(cls, source, released: bool, config, hub_kwargs: dict) -> None:
    """Refuse bitsandbytes on a checkpoint stored FP8 / FP4 (released, or saved after a native load): it would quantize
    the dequantized FP4 experts again, only adding error, to about the size they are stored at."""
    stored_quantized = released and stores_quantized_weights(source, **hub_kwargs)
    if stored_quantized or (source is not None and _saved_native_config(cls, source, config, hub_kwargs) is not None):
        raise ValueError(
            f"{source} stores its Linears FP8 and its routed experts FP4 (the released storage, or a model saved "
            "after a native load): quantizing them again "
            "with bitsandbytes would only add error to weights already stored in 4 and 8 bits. Load it without "
            "quantization_config: it loads natively, the FP8 / FP4 weights kept as stored (QLoRA-style training goes "
            "through LoRA adapters on them, see docs/released-model.md); or apply bitsandbytes to a bf16 checkpoint"
        )


@contextmanager
def released_storage_loading(model_type: str) -> Iterator[None]:
    """How transformers loads a folder in the released storage: with the conversions that read the scales, one
    tensor at a time (:func:`~.reading.sequential_loading`)."""
    with storage_conversions_registered(model_type), sequential_loading():
        yield


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
    probe = meta_instance(_config(cls, source, config, hub_kwargs), cls)
    quantization_config = copy.deepcopy(quantization_config)
    skipped = set(quantization_config.llm_int8_skip_modules or [])
    skipped |= set(high_precision_modules(probe, quantization_config.load_in_4bit))
    quantization_config.llm_int8_skip_modules = sorted(skipped)
    return DeepseekV41BitsAndBytesConfig.from_bitsandbytes(quantization_config)


def _with_native_quantization(
    cls, source, config: PreTrainedConfig | str | None, hub_kwargs: dict
) -> PreTrainedConfig:
    """A copy of the config whose ``quantization_config`` is the one the released folder implies (FP8 Linears and FP4
    experts kept quantized, :mod:`.native_precision`), for the Linears of a meta-device instance of the model."""
    config = copy.deepcopy(_config(cls, source, config, hub_kwargs))
    probe = meta_instance(config, cls)
    # a dict, as in a config.json, naming the quant method transformers dispatches to our quantizer
    config.quantization_config = {**released_quantization_config(probe).to_dict(), "quant_method": QUANT_METHOD}
    return config


def _without_quantization_config(config: PreTrainedConfig) -> PreTrainedConfig:
    """A copy of ``config`` without a ``quantization_config`` (transformers would quantize by it)."""
    config = copy.deepcopy(config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    return config


def _saved_native_config(
    cls, source, config: PreTrainedConfig | str | None, hub_kwargs: dict
) -> PreTrainedConfig | None:
    """For a model saved after a native load (``quant_method: "fp8"`` with FP4 experts in its config, transformers'
    FP8 layout in its weights): a copy of the config that loads through our quantizer (weight-only on the CPU), else
    None."""
    if (
        not isinstance(config, PreTrainedConfig)
        and checkpoint_file(config or source, "config.json", hub_kwargs) is None
    ):
        return None
    config = _config(cls, source, config, hub_kwargs)
    saved = getattr(config, "quantization_config", None)
    saved = saved.to_dict() if hasattr(saved, "to_dict") else saved
    if not isinstance(saved, dict) or saved.get("quant_method") != "fp8" or saved.get("expert_dtype") != "fp4":
        return None
    config = copy.deepcopy(config)
    config.quantization_config = {**saved, "quant_method": QUANT_METHOD}
    return config


def empty_native_model(
    cls,
    source: str | os.PathLike,
    config: PreTrainedConfig | None = None,
    engram_tokenizer=None,
    device: torch.device | str | None = None,
    **hub_kwargs,
) -> nn.Module:
    """``cls.from_pretrained(source)`` of a released checkpoint in its native precision, without its weights: every
    parameter on the meta device, in the dtype and the module (``FP8Linear``, ``FP8Experts``, fp32-kept ones) the
    load would give it; the buffers real (the Engram hasher's are computed, its token map built as
    :func:`finish_checkpoint_load` builds it). Shard it (``training.fsdp.shard_model``), then fill it with
    ``training.fsdp.load_sharded_weights``, which reads each rank's shards only.

    ``device``: where the weights will live (an accelerator lets the quantizer keep transformers' FP8 kernels where
    they run, as ``device_map`` does for ``from_pretrained``)."""
    from transformers.quantizers import AutoHfQuantizer

    kwargs = {} if config is None else {"config": config}
    _check_released_storage(cls, source, kwargs, hub_kwargs)
    quantizer = AutoHfQuantizer.from_config(kwargs["config"].quantization_config, pre_quantized=True)
    quantizer.validate_environment(device_map=None if device is None else {"": str(device)})
    return _empty_model(cls, source, kwargs, quantizer, engram_tokenizer, hub_kwargs)


def empty_dequantized_model(
    cls, source: str | os.PathLike, config: PreTrainedConfig | None = None, engram_tokenizer=None, **hub_kwargs
) -> nn.Module:
    """``cls.from_pretrained(source, quantization_config=FineGrainedFP8Config(dequantize=True))`` of a released
    checkpoint, without its weights: the model for full fine-tuning (plain modules in bf16, fp32-kept ones fp32), on
    the meta device as :func:`empty_native_model` builds it. Shard it (``training.fsdp.shard_model``, with
    ``expert_parallel_size`` too), then ``training.fsdp.load_sharded_weights`` dequantizes what each rank reads of
    its shards (FP8 rows in whole 32-row scale blocks, its FP4 experts), bit for bit as the dequantizing load."""
    kwargs = {"quantization_config": FineGrainedFP8Config(dequantize=True)}
    if config is not None:
        kwargs["config"] = config
    _check_released_storage(cls, source, kwargs, hub_kwargs)
    return _empty_model(cls, source, kwargs, None, engram_tokenizer, hub_kwargs)


def _check_released_storage(cls, source, kwargs: dict, hub_kwargs: dict) -> None:
    released = prepare_checkpoint_load(cls, source, kwargs, hub_kwargs)
    if not (released and stores_quantized_weights(source, **hub_kwargs)):
        raise ValueError(
            f"{source} is not a released checkpoint with FP8 / FP4 weights (no .scale tensors beside them)"
        )


def _empty_model(cls, source, kwargs: dict, quantizer, engram_tokenizer, hub_kwargs: dict) -> nn.Module:
    """The model ``from_pretrained`` builds with the ``config`` and ``dtype`` of ``kwargs`` (as
    :func:`prepare_checkpoint_load` set them) and ``quantizer`` (or none), its parameters on the meta device."""
    from accelerate import init_empty_weights
    from transformers import initialization as init

    config, dtype = kwargs["config"], kwargs["dtype"]
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with init_empty_weights(include_buffers=False), init.no_init_weights(), init.no_tie_weights():
            model = cls(copy.deepcopy(config))
            if quantizer is not None:
                quantizer.preprocess_model(model=model, dtype=dtype, device_map=None, checkpoint_files=None)
    finally:
        torch.set_default_dtype(previous)
    kept_fp32 = model._get_dtype_plan(dtype)
    if kept_fp32:  # the dtype the loader reads these in (``_keep_in_fp32_modules_strict``); quantized ones as stored
        from transformers.core_model_loading import build_glob_alternation

        matcher = build_glob_alternation(list(kept_fp32))[0]
        for name, param in model.named_parameters():
            if matcher.search(name) and param.dtype != torch.float32 and param.element_size() > 1:
                param.data = torch.empty_like(param, dtype=torch.float32)
    model.config.name_or_path = str(source)
    if quantizer is not None:
        model.hf_quantizer = quantizer
        quantizer.postprocess_model(model)
    finish_checkpoint_load(model, source, engram_tokenizer, hub_kwargs)
    return model.eval()


# ---------------------------------------------------------------------------------------------------------------------
# After transformers loaded
# ---------------------------------------------------------------------------------------------------------------------


def finish_checkpoint_load(model: nn.Module, source, engram_tokenizer, hub_kwargs: dict) -> None:
    """What a loaded model still needs: every registered conversion for saving in the released layout, its Engram
    token map, and PEFT's dispatch to native LoRA when it was loaded natively or with bitsandbytes."""
    # The conversions map the two layouts one-to-one: saving in the released layout applies all of them, not only
    # those this load happened to use (transformers keeps just those).
    model._weight_conversions = None
    ensure_engram_token_map(model, source, engram_tokenizer, **hub_kwargs)
    quantization_config = getattr(getattr(model, "hf_quantizer", None), "quantization_config", None)
    if isinstance(quantization_config, DeepseekV41BitsAndBytesConfig) or (
        quantization_config is not None and quantization_config.quant_method == QUANT_METHOD
    ):
        _adapt_natively_with_peft()


def ensure_engram_token_map(model: nn.Module, source: str | os.PathLike, tokenizer=None, **hub_kwargs) -> None:
    """Give ``model``'s Engram hasher its compressed token map unless the checkpoint held one.

    ``tokenizer`` (a ``tokenizers.Tokenizer``, a transformers fast tokenizer or a path to ``tokenizer.json``) wins
    when given; otherwise the ``tokenizer.json`` next to the weights at ``source`` is used.
    """
    hasher = getattr(model.base_model, "engram_hasher", None)
    if hasher is None or (tokenizer is None and hasher.has_token_map):
        return
    if tokenizer is None:
        tokenizer = checkpoint_file(source, "tokenizer.json", hub_kwargs)
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


def _adapt_natively_with_peft() -> None:
    """Where PEFT is installed, make its LoRA adapt a natively loaded model's FP8 Linears and FP4 experts, and the
    bitsandbytes experts, as the bf16 model's (:mod:`.native_lora`)."""
    if importlib.util.find_spec("peft") is None:
        return
    from .native_lora import install_peft_dispatch

    install_peft_dispatch()


__all__ = [
    "empty_dequantized_model",
    "empty_native_model",
    "ensure_engram_token_map",
    "finish_checkpoint_load",
    "high_precision_modules",
    "loads_natively",
    "prepare_checkpoint_load",
    "released_storage_loading",
]
