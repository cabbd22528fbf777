"""Loading with a :class:`~transformers.BitsAndBytesConfig`: transformers' bitsandbytes quantizers, extended so that
the routed experts are quantized too (:mod:`.bnb_experts`), and what such a load reports and would store.

:class:`DeepseekV41BitsAndBytesConfig` is the config ``from_pretrained`` turns a user's ``BitsAndBytesConfig`` into;
its quantizers (:class:`DeepseekV41Bnb4BitQuantizer`, :class:`DeepseekV41Bnb8BitQuantizer`) do what transformers'
do to the Linears, replace the experts by :class:`~.bnb_experts.Bnb4bitExperts` /
:class:`~.bnb_experts.Bnb8bitExperts` before the weights load, quantize each expert weight as it loads, keep
``Linear4bit`` differentiable on AVX512-BF16 CPUs, and log what stays in high precision.
:func:`quantized_storage_bytes` counts the bytes such a load takes (``dsv41 inspect --storage nf4`` / ``int8``).
"""

from __future__ import annotations

import copy
import logging
import re

import torch
from torch import nn
from transformers import BitsAndBytesConfig
from transformers.core_model_loading import ConversionOps
from transformers.quantizers.quantizer_bnb_4bit import Bnb4BitHfQuantizer
from transformers.quantizers.quantizer_bnb_8bit import Bnb8BitHfQuantizer
from transformers.quantizers.quantizers_utils import get_module_from_name, should_convert_module

from .bnb_experts import (
    BLOCK_4BIT,
    EXPERT_WEIGHTS,
    NESTED_BLOCK,
    Bnb4bitExperts,
    Bnb8bitExperts,
    BnbExperts,
    dequantized_experts,
)
from .hub.registration import register_quantization_config, register_quantizer
from .moe import DeepseekV41Experts

logger = logging.getLogger(__name__)

QUANT_METHOD = "deepseek_v41_bitsandbytes"


# ---------------------------------------------------------------------------------------------------------------------
# Linear4bit on CPUs with AVX512-BF16: repacked for inference, restored for gradients
# ---------------------------------------------------------------------------------------------------------------------

_QUANT_STATE_FIELDS = ("absmax", "nested", "offset", "state2", "dtype")


def _repacks_for_cpu(module: nn.Module, x: torch.Tensor) -> bool:
    """Whether ``Linear4bit.forward`` is about to repack ``module``'s weight for its CPU inference kernel (its own
    condition: an AVX512-BF16 CPU, eval mode, an input that needs no gradient)."""
    state = module.weight.quant_state
    return (
        x.device.type == "cpu"
        and module.support_avx512bf16_for_cpu
        and not module.training
        and not x.requires_grad
        and not getattr(state, "packing_format_for_cpu", False)
    )


def _restore_before_gradients(module: nn.Module, args: tuple) -> None:
    """Forward pre-hook of a ``Linear4bit``: keep what its CPU repacking replaces, and put it back when the module
    trains or its input needs a gradient. The repacked weight runs through ``bitsandbytes::gemv_4bit``, which has no
    autograd formula (the gradient reaching the adapters below would be wrong), with its block scales rounded to bf16;
    the codes are unshuffled exactly by bitsandbytes' inverse, the scales (and a nested state) are the ones kept."""
    x, state = args[0], module.weight.quant_state
    if _repacks_for_cpu(module, x):
        module._dsv41_quant_state = {name: getattr(state, name, None) for name in _QUANT_STATE_FIELDS}
    elif getattr(state, "packing_format_for_cpu", False) and (module.training or x.requires_grad):
        import bitsandbytes.functional as bnb_functional

        kept = module._dsv41_quant_state
        with torch.no_grad():
            codes, state = bnb_functional._convert_weight_packed_for_cpu_inverse(module.weight.data, state)
        for name, value in kept.items():
            setattr(state, name, value)
        module.weight.data, module.weight.quant_state = codes, state


def keep_linear_4bit_differentiable(model: nn.Module) -> None:
    """Give every ``bitsandbytes.nn.Linear4bit`` of ``model`` :func:`_restore_before_gradients`: evaluating then
    training a QLoRA model on an AVX512-BF16 CPU computes the same gradients as training alone."""
    import bitsandbytes as bnb

    for module in model.modules():
        if isinstance(module, bnb.nn.Linear4bit):
            module.register_forward_pre_hook(_restore_before_gradients)


# ---------------------------------------------------------------------------------------------------------------------
# Loading: transformers' bitsandbytes quantizers, extended to the experts
# ---------------------------------------------------------------------------------------------------------------------


def _pattern(name: str) -> str:
    """``model.layers.3.attn.wkv`` → ``model.layers.*.attn.wkv``."""
    return re.sub(r"\.\d+(?=\.|$)", ".*", name)


def _summary(names: list[str]) -> str:
    patterns = list(dict.fromkeys(_pattern(name) for name in names))
    return ", ".join(patterns) if patterns else "none"


class _QuantizeExperts(ConversionOps):
    """transformers' bitsandbytes quantize operation, which quantizes an expert weight as it loads into the storage
    of its :class:`BnbExperts` (every other tensor goes to transformers' own operation)."""

    def __init__(self, linear_operation: ConversionOps):
        self.linear_operation = linear_operation

    @torch.no_grad()
    def convert(self, input_dict: dict, model: nn.Module | None = None, missing_keys=None, **kwargs) -> dict:
        out, rest = {}, {}
        for key, value in input_dict.items():
            module, name = get_module_from_name(model, key)
            if not isinstance(module, BnbExperts):
                rest[key] = value
                continue
            value = value[0] if isinstance(value, list) else value
            prefix = key[: -len(name)]
            for attribute, tensor in module.quantize(name, value).items():
                out[prefix + attribute] = tensor
                if missing_keys is not None:
                    missing_keys.discard(prefix + attribute)
            module._is_hf_initialized = True
        if rest:
            out |= self.linear_operation.convert(rest, model=model, missing_keys=missing_keys, **kwargs)
        return out


class _ExpertsQuantizing:
    """What the two bitsandbytes quantizers add to transformers': the routed experts become ``experts_class``
    (unless ``llm_int8_skip_modules`` names them or their shape does not fit), quantized as they load, and a log line
    says what stays in high precision."""

    experts_class: type[BnbExperts]
    kind: str
    experts_note = ""  # how the quantized experts compute, where it differs from the Linears

    def preprocess_model(self, model, **kwargs):
        super().preprocess_model(model, **kwargs)
        model.quantization_method = "bitsandbytes"  # what transformers, PEFT and the Trainer check

    def _experts_kwargs(self) -> dict:
        return {}

    def _process_model_before_weight_loading(self, model, device_map=None, **kwargs):
        super()._process_model_before_weight_loading(model, device_map=device_map, **kwargs)
        self.experts_kept = []
        for name, module in list(model.named_modules()):
            if type(module) is not DeepseekV41Experts:
                continue
            reason = None if should_convert_module(name, self.modules_to_not_convert) else "llm_int8_skip_modules"
            reason = reason or self.experts_class.unfit(module)
            if reason:
                self.experts_kept.append(f"{name} ({reason})")
                continue
            quantized = self.experts_class(module.config, module.num_experts, **self._experts_kwargs())
            model.set_submodule(name, quantized)

    def param_needs_quantization(self, model, param_name: str, **kwargs) -> bool:
        module, name = get_module_from_name(model, param_name)
        if isinstance(module, BnbExperts):
            return name in EXPERT_WEIGHTS
        return super().param_needs_quantization(model, param_name, **kwargs)

    def get_quantize_ops(self):
        return _QuantizeExperts(super().get_quantize_ops())

    def _process_model_after_weight_loading(self, model, **kwargs):
        model = super()._process_model_after_weight_loading(model, **kwargs) or model
        keep_linear_4bit_differentiable(model)
        report = high_precision_report(model, self.kind, getattr(self, "experts_kept", []))
        implementation = model.config.get_text_config()._experts_implementation
        quantized = any(isinstance(m, BnbExperts) for m in model.modules())
        if quantized and implementation not in (None, "eager"):
            report += (
                f"; the quantized experts compute eagerly, dequantizing the experts tokens reach "
                f"(experts_implementation={implementation!r} runs the unquantized ones)"
            )
        if quantized and self.experts_note:
            report += f"; {self.experts_note}"
        logger.warning(report)
        return model

    def is_serializable(self, *args, **kwargs) -> bool:
        """Saving the quantized experts is not supported (transformers' bitsandbytes loader could not read their
        states back): ``save_pretrained`` raises after this warning says what to do instead."""
        logger.warning(
            "A model loaded with bitsandbytes, its routed experts quantized too, cannot be saved quantized: save its "
            "LoRA adapters (PEFT's save_pretrained) and load the base again with the same BitsAndBytesConfig, or save "
            "the unquantized model (or model.dequantize() first)"
        )
        return False

    def _dequantize(self, model, dtype=None):
        """``model.dequantize()``: the Linears by transformers, the experts back to :class:`~.moe.DeepseekV41Experts`
        holding their dequantized weights."""
        model = super()._dequantize(model, dtype=dtype)
        for name, module in list(model.named_modules()):
            if isinstance(module, BnbExperts):
                model.set_submodule(name, dequantized_experts(module, dtype or module.compute_dtype or torch.bfloat16))
        return model


@register_quantization_config(f"{QUANT_METHOD}_4bit")
@register_quantization_config(f"{QUANT_METHOD}_8bit")
class DeepseekV41BitsAndBytesConfig(BitsAndBytesConfig):
    """A :class:`~transformers.BitsAndBytesConfig` that loads through :class:`DeepseekV41Bnb4BitQuantizer` /
    :class:`DeepseekV41Bnb8BitQuantizer` (the routed experts quantized too); ``from_pretrained`` turns a user's
    ``BitsAndBytesConfig`` into one. The model's ``quantization_method`` and the saved config say
    ``"bitsandbytes"``."""

    def __init__(self, *args, **kwargs):
        kwargs.pop("quant_method", None)
        super().__init__(*args, **kwargs)
        self.quant_method = f"{QUANT_METHOD}_{'8bit' if self.load_in_8bit else '4bit'}"

    @classmethod
    def from_bitsandbytes(cls, config: BitsAndBytesConfig) -> "DeepseekV41BitsAndBytesConfig":
        """A copy of ``config`` (every option as the user set it) of this class."""
        new = cls.__new__(cls)
        new.__dict__.update(copy.deepcopy(config.__dict__))
        new.quant_method = f"{QUANT_METHOD}_{'8bit' if new.load_in_8bit else '4bit'}"
        return new

    def to_dict(self) -> dict:
        return {**super().to_dict(), "quant_method": "bitsandbytes"}


@register_quantizer(f"{QUANT_METHOD}_4bit")
class DeepseekV41Bnb4BitQuantizer(_ExpertsQuantizing, Bnb4BitHfQuantizer):
    """transformers' bitsandbytes 4-bit quantizer, with the routed experts quantized too (:class:`Bnb4bitExperts`)."""

    experts_class = Bnb4bitExperts

    @property
    def kind(self) -> str:
        config = self.quantization_config
        return (
            f"4-bit ({config.bnb_4bit_quant_type}"
            f"{', double quantization' if config.bnb_4bit_use_double_quant else ''})"
        )

    def _experts_kwargs(self) -> dict:
        config = self.quantization_config
        if config.bnb_4bit_quant_storage not in (None, torch.uint8):
            raise ValueError(
                f"bnb_4bit_quant_storage={config.bnb_4bit_quant_storage}: the routed experts are stored as uint8 "
                "(their packed bytes are a parameter of their own shape); leave bnb_4bit_quant_storage at its default"
            )
        return dict(
            compute_dtype=config.bnb_4bit_compute_dtype,
            quant_type=config.bnb_4bit_quant_type,
            double_quant=config.bnb_4bit_use_double_quant,
        )


@register_quantizer(f"{QUANT_METHOD}_8bit")
class DeepseekV41Bnb8BitQuantizer(_ExpertsQuantizing, Bnb8BitHfQuantizer):
    """transformers' bitsandbytes 8-bit quantizer, with the routed experts quantized too (:class:`Bnb8bitExperts`)."""

    experts_class = Bnb8bitExperts
    kind = "8-bit"
    experts_note = (
        "the int8 experts compute on their dequantized weights (weight-only: llm_int8_threshold's outlier "
        "decomposition applies to the Linears)"
    )


# ---------------------------------------------------------------------------------------------------------------------
# What a load stores and reports
# ---------------------------------------------------------------------------------------------------------------------


def _linear_4bit_bytes(numel: int, double_quant: bool) -> float:
    """A ``Linear4bit`` weight's bytes: packed codes, and one absmax per 64 weights (fp32, or 8-bit with a nested
    fp32 absmax per 256 of them and an fp32 offset)."""
    blocks = -(-numel // BLOCK_4BIT)
    scales = blocks + 4 * -(-blocks // NESTED_BLOCK) + 4 if double_quant else 4 * blocks
    return numel / 2 + scales


def quantized_storage_bytes(model: nn.Module, quantization_config: BitsAndBytesConfig) -> dict[str, float]:
    """Bytes each parameter of ``model`` (on the meta device; its modules are replaced in place) takes once loaded with
    ``quantization_config`` (a :class:`DeepseekV41BitsAndBytesConfig` naming the modules to skip), its block scales
    included, by the unquantized parameter names. Not counted: the per-tensor lookup tables (16 or 256 values).
    Backs ``dsv41 inspect --storage nf4`` / ``int8``."""
    import bitsandbytes as bnb

    quantizer = (DeepseekV41Bnb4BitQuantizer if quantization_config.load_in_4bit else DeepseekV41Bnb8BitQuantizer)(
        quantization_config
    )
    quantizer._process_model_before_weight_loading(model, device_map=None)
    double_quant = quantization_config.load_in_4bit and quantization_config.bnb_4bit_use_double_quant
    sizes = {}
    for module_name, module in model.named_modules():
        prefix = f"{module_name}." if module_name else ""
        for name, param in module.named_parameters(recurse=False):
            if isinstance(module, BnbExperts) and name in EXPERT_WEIGHTS:
                states = [t for key, t in module.named_buffers(recurse=False) if key.startswith(f"{name}_")]
                nbytes = sum(t.numel() * t.element_size() for t in (param, *states))
            elif isinstance(module, bnb.nn.Linear4bit) and name == "weight":
                nbytes = _linear_4bit_bytes(param.numel(), double_quant)
            elif isinstance(module, bnb.nn.Linear8bitLt) and name == "weight":
                nbytes = param.numel() + 4 * module.out_features  # int8 rows and their fp32 absmax (SCB)
            else:
                nbytes = param.numel() * param.element_size()
            sizes[prefix + name] = nbytes
    return sizes


def high_precision_report(model: nn.Module, kind: str, experts_kept: list[str]) -> str:
    """The log line of a bitsandbytes load: the share of parameters quantized, and what stays in high precision."""
    import bitsandbytes as bnb

    quantized_linear = (bnb.nn.Linear4bit, bnb.nn.Linear8bitLt)
    quantized = kept_linear = total = 0
    kept_linears, other = [], {}
    for name, module in model.named_modules():
        if isinstance(module, BnbExperts):
            count = sum(torch.Size(module.weight_shape(w)).numel() for w in EXPERT_WEIGHTS)
            quantized += count
            total += count
            continue
        for param_name, param in module.named_parameters(recurse=False):
            numel = param.numel() * (2 if isinstance(module, bnb.nn.Linear4bit) and param_name == "weight" else 1)
            total += numel
            if isinstance(module, quantized_linear) and param_name == "weight":
                quantized += numel
            elif isinstance(module, nn.Linear):
                kept_linear += numel
                kept_linears.append(name)
            else:
                key = _pattern(f"{name}.{param_name}" if name else param_name).rsplit(".", 1)[-1]
                other[key] = other.get(key, 0) + numel
    return (
        f"bitsandbytes {kind}: {quantized / total:.1%} of the parameters quantized (the Linears and the routed "
        f"experts); kept in high precision: Linears {_summary(kept_linears)} ({kept_linear / total:.1%}), routed "
        f"experts {', '.join(experts_kept) or 'none'}, and the parameters that are not Linears "
        f"({(total - quantized - kept_linear) / total:.1%}: {', '.join(sorted(other))})"
    )


__all__ = [
    "DeepseekV41Bnb4BitQuantizer",
    "DeepseekV41Bnb8BitQuantizer",
    "DeepseekV41BitsAndBytesConfig",
    "high_precision_report",
    "keep_linear_4bit_differentiable",
    "quantized_storage_bytes",
]
