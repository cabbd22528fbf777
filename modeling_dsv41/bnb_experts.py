"""bitsandbytes on the fused routed experts: 4-bit (NF4 / FP4, with or without double quantization) and 8-bit.

transformers' bitsandbytes integration replaces ``nn.Linear`` modules only, so the 3-D ``gate_up_proj`` [E, 2·I, D] and
``down_proj`` [E, D, I] of :class:`~.moe.DeepseekV41Experts` (most of the model's parameters) would load in full
precision. Here the bitsandbytes quantizers transformers picks for a :class:`~transformers.BitsAndBytesConfig` are
extended (:class:`DeepseekV41Bnb4BitQuantizer`, :class:`DeepseekV41Bnb8BitQuantizer`) so that the experts become
:class:`Bnb4bitExperts` / :class:`Bnb8bitExperts`, quantized tensor by tensor as they load, with bitsandbytes' own
functions and one block-wise state per expert (each expert quantized on its own, its scales in row ``e`` of the
state tensors): an expert can be sharded or placed whole, with its state.

* 4-bit: ``bitsandbytes.functional.quantize_4bit`` on each expert's [out, in] weight (blocks of 64 row-major,
  ``bnb_4bit_quant_type``, ``bnb_4bit_use_double_quant`` compressing the block scales to 8 bits with one nested state
  per expert); stored as the packed bytes [E, out, in/2] and ``{name}_absmax`` [E, blocks] (plus, double-quantized,
  ``{name}_nested_absmax`` [E, blocks/256] and ``{name}_nested_offset`` [E]); computed in ``bnb_4bit_compute_dtype``
  as ``Linear4bit`` does.
* 8-bit: ``int8_vectorwise_quant``, the row-wise absmax int8 ``Linear8bitLt`` stores, [E, out, in] int8 and
  ``{name}_scb`` [E, out]; computed weight-only (the weight dequantized to the input's dtype: no outlier
  decomposition, which needs int8 GEMM kernels).

The forward is the reference's eager computation (:func:`~.moe.routed_experts_forward`): only experts tokens are
routed to are dequantized, inside their products and again in the backward (nothing dequantized is kept), with the
input's exact gradient. PEFT's ``target_parameters`` adapters (``LoraConfig(target_parameters=["experts.gate_up_proj",
"experts.down_proj"])``) have the logical per-expert shape and add their delta to each expert's output
(:mod:`~.released.native_lora`), so QLoRA trains them.
"""

from __future__ import annotations

import copy
import logging
import re
from collections.abc import Callable, Mapping

import torch
import torch.nn.functional as F
from torch import nn
from transformers import BitsAndBytesConfig
from transformers.core_model_loading import ConversionOps
from transformers.quantizers.quantizer_bnb_4bit import Bnb4BitHfQuantizer
from transformers.quantizers.quantizer_bnb_8bit import Bnb8BitHfQuantizer
from transformers.quantizers.quantizers_utils import get_module_from_name, should_convert_module

from .hub.registration import register_quantization_config, register_quantizer
from .moe import DeepseekV41Experts, per_slot_experts_forward, routed_experts_forward

logger = logging.getLogger(__name__)

EXPERT_WEIGHTS = ("gate_up_proj", "down_proj")
# bitsandbytes' 4-bit block (its default on every backend) and the nested block of double quantization
BLOCK_4BIT, NESTED_BLOCK = 64, 256
QUANT_METHOD = "deepseek_v41_bitsandbytes"

# expert e → the LoRA factors adapting one of its weights [out, in]: [(lora_A [r, in], lora_B [out, r], scaling), ...]
ExpertFactors = Callable[[int], list[tuple[torch.Tensor, torch.Tensor, float]]]


class _FrozenDequantizedLinear(torch.autograd.Function):
    """``x @ W.T`` for a frozen ``W = dequantize()``, whose backward dequantizes ``W`` again: the dequantized weight is
    never kept between the passes (autograd through ``F.linear`` would keep it until the backward)."""

    @staticmethod
    def forward(ctx, x, dequantize):
        ctx.dequantize = dequantize
        with torch.no_grad():
            return F.linear(x, dequantize())

    @staticmethod
    def backward(ctx, grad_output):
        return grad_output @ ctx.dequantize(), None


class QuantizedExpertWeight:
    """One routed expert's quantized weight [out, in] as :func:`~.moe.routed_experts_forward` applies it (a
    :class:`~.moe.ProjectedWeight`): dequantized for the rows a product needs, in the compute dtype, LoRA factors added
    to the output, ``x·Wᵀ + scaling·(x·Aᵀ)·Bᵀ``."""

    def __init__(self, experts: "BnbExperts", name: str, expert: int, factors: list | None = None):
        self.experts, self.name, self.expert, self.factors = experts, name, expert, factors or []
        self.shape = torch.Size(experts.weight_shape(name)[1:])

    def linear(self, x: torch.Tensor, rows: slice) -> torch.Tensor:
        dtype = self.experts.compute_dtype or x.dtype
        out = _FrozenDequantizedLinear.apply(
            x.to(dtype), lambda: self.experts.dequantize(self.name, self.expert, rows, dtype)
        ).to(x.dtype)
        for lora_a, lora_b, scaling in self.factors:  # in the factors' dtype, as PEFT's Linear computes its delta
            delta = F.linear(F.linear(x.to(lora_a.dtype), lora_a), lora_b[rows]) * scaling
            out = out + delta.to(out.dtype)
        return out


class BnbExperts(DeepseekV41Experts):
    """:class:`~.moe.DeepseekV41Experts` whose ``gate_up_proj`` / ``down_proj`` hold bitsandbytes-quantized bytes, one
    state per expert (subclasses say how). Built on the meta device from the experts it replaces, filled by
    :meth:`quantize` (one tensor at a time, as the checkpoint loads)."""

    def __init__(self, config, num_experts: int | None = None, compute_dtype: torch.dtype | None = None):
        with torch.device("meta"):
            super().__init__(config, num_experts)
        self.compute_dtype = compute_dtype
        self._shapes = {name: tuple(getattr(self, name).shape) for name in EXPERT_WEIGHTS}
        for name in EXPERT_WEIGHTS:
            for state, tensor in self._storage(*self._shapes[name]).items():
                if state:
                    self.register_buffer(f"{name}_{state}", tensor)
                else:
                    setattr(self, name, nn.Parameter(tensor, requires_grad=False))

    @classmethod
    @torch.no_grad()
    def from_dense(cls, experts: DeepseekV41Experts, **kwargs) -> "BnbExperts":
        """``experts`` (loaded, not meta) quantized: what loading with a ``BitsAndBytesConfig`` builds, tensor by
        tensor."""
        quantized = cls(experts.config, experts.num_experts, **kwargs)
        for name in EXPERT_WEIGHTS:
            for attribute, tensor in quantized.quantize(name, getattr(experts, name)).items():
                if attribute in EXPERT_WEIGHTS:
                    tensor = nn.Parameter(tensor, requires_grad=False)
                setattr(quantized, attribute, tensor)
        return quantized

    @classmethod
    def unfit(cls, experts: DeepseekV41Experts) -> str | None:
        """Why ``experts`` cannot be stored this way (None if they can)."""
        return None

    def weight_shape(self, name: str) -> tuple[int, int, int]:
        """The logical shape [E, out, in] of ``name``."""
        return self._shapes[name]

    def _storage(self, experts: int, rows: int, columns: int) -> dict[str, torch.Tensor]:
        """Meta tensors of one weight's storage: the weight itself under key ``""``, its states by suffix."""
        raise NotImplementedError

    def quantize(self, name: str, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        """The storage of the dense ``weight`` [E, out, in] of ``name``: attribute name → tensor."""
        raise NotImplementedError

    def dequantize(
        self, name: str, expert: int, rows: slice = slice(None), dtype: torch.dtype = torch.bfloat16
    ) -> torch.Tensor:
        """Expert ``expert``'s weight ``name`` [out, in] (the ``rows`` of it) in ``dtype``."""
        raise NotImplementedError

    def gathered(self, name: str, experts: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Experts ``experts`` [n] of weight ``name`` dequantized to ``dtype`` at once: [n, out, in], the values
        :meth:`dequantize` gives each, from their gathered bytes and states (no value read back)."""
        raise NotImplementedError

    @torch.no_grad()
    def dequantized(self, name: str, dtype: torch.dtype) -> torch.Tensor:
        """Every expert's weight ``name`` [E, out, in] in ``dtype``."""
        return torch.stack([self.dequantize(name, expert, dtype=dtype) for expert in range(self.num_experts)])

    def forward(
        self,
        hidden_states: torch.Tensor,
        top_k_index: torch.Tensor,
        top_k_weights: torch.Tensor,
        adapters: Mapping[str, ExpertFactors] | None = None,
    ) -> torch.Tensor:
        """hidden_states [N, D], top_k_index / top_k_weights [N, k] → fp32 [N, D], the eager computation with each
        routed expert's weights dequantized inside its products; ``adapters``: the LoRA factors of PEFT's wrappers
        around this module (:mod:`~.released.native_lora`).

        Decoding (no more slots than experts, no adapter, no input gradient, the compute dtype the input's), each
        slot's expert is dequantized from its gathered bytes (:func:`~.moe.per_slot_experts_forward`: no host sync);
        otherwise the loop over the experts with tokens (one host sync reading how many each got)."""
        adapters = adapters or {}
        dtype = self.compute_dtype or hidden_states.dtype
        needs_input_grad = torch.is_grad_enabled() and hidden_states.requires_grad
        decoding = top_k_index.numel() <= self.num_experts
        if decoding and not adapters and not needs_input_grad and dtype == hidden_states.dtype:
            return per_slot_experts_forward(
                hidden_states,
                top_k_index,
                top_k_weights,
                self.swiglu_limit,
                self.num_experts,
                lambda ids: (self.gathered("gate_up_proj", ids, dtype), self.gathered("down_proj", ids, dtype)),
            )

        def weight(name: str, expert: int) -> QuantizedExpertWeight:
            return QuantizedExpertWeight(self, name, expert, adapters[name](expert) if name in adapters else None)

        return routed_experts_forward(
            hidden_states,
            top_k_index,
            top_k_weights,
            self.num_experts,
            self.swiglu_limit,
            lambda expert: (weight("gate_up_proj", expert), weight("down_proj", expert)),
        )


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


def _meta(*shape: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(*shape, dtype=dtype, device="meta")


def _blocks(rows: int, columns: int) -> int:
    return -(-rows * columns // BLOCK_4BIT)


class Bnb4bitExperts(BnbExperts):
    """Experts stored 4-bit (``Linear4bit``'s format, per expert): packed bytes [E, out, in/2] (two codes a byte,
    row-major) and one absmax per 64 weights, [E, ⌈out·in/64⌉] fp32, or 8-bit with double quantization (with
    its nested absmax [E, ⌈blocks/256⌉] and offset [E] per expert)."""

    def __init__(
        self,
        config,
        num_experts: int | None = None,
        compute_dtype: torch.dtype | None = None,
        quant_type: str = "nf4",
        double_quant: bool = False,
    ):
        self.quant_type, self.double_quant = quant_type, double_quant
        super().__init__(config, num_experts, compute_dtype)
        if double_quant:  # bitsandbytes' signed dynamic map, shared by every nested state
            self.register_buffer("nested_code", _meta(256, dtype=torch.float32))

    @classmethod
    def unfit(cls, experts: DeepseekV41Experts) -> str | None:
        if experts.hidden_dim % 2 or experts.intermediate_dim % 2:  # two codes a byte, row by row
            return f"odd hidden or expert width ({experts.hidden_dim}, {experts.intermediate_dim})"
        return None

    def _storage(self, experts: int, rows: int, columns: int) -> dict[str, torch.Tensor]:
        blocks = _blocks(rows, columns)
        storage = {
            "": _meta(experts, rows, columns // 2, dtype=torch.uint8),
            "absmax": _meta(experts, blocks, dtype=torch.uint8 if self.double_quant else torch.float32),
        }
        if self.double_quant:
            storage["nested_absmax"] = _meta(experts, -(-blocks // NESTED_BLOCK), dtype=torch.float32)
            storage["nested_offset"] = _meta(experts, dtype=torch.float32)
        return storage

    def quantize(self, name: str, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        import bitsandbytes.functional as bnb_functional

        packed, absmax, nested_absmax, offsets = [], [], [], []
        for expert in weight:
            data, state = bnb_functional.quantize_4bit(
                expert, blocksize=BLOCK_4BIT, compress_statistics=self.double_quant, quant_type=self.quant_type
            )
            packed.append(data.view(expert.shape[0], -1))
            absmax.append(state.absmax)
            if self.double_quant:
                nested_absmax.append(state.state2.absmax)
                offsets.append(state.offset.reshape(()))
                code = state.state2.code
        out = {name: torch.stack(packed), f"{name}_absmax": torch.stack(absmax)}
        if self.double_quant:
            out |= {
                f"{name}_nested_absmax": torch.stack(nested_absmax),
                f"{name}_nested_offset": torch.stack(offsets),
                "nested_code": code.float(),
            }
        return out

    def _absmax(self, name: str, expert: int) -> torch.Tensor:
        """Expert ``expert``'s fp32 block scales of ``name``, undoing the double quantization."""
        absmax = getattr(self, f"{name}_absmax")[expert]
        if not self.double_quant:
            return absmax
        import bitsandbytes.functional as bnb_functional

        nested = bnb_functional.QuantState(
            absmax=getattr(self, f"{name}_nested_absmax")[expert],
            code=self.nested_code,
            blocksize=NESTED_BLOCK,
            dtype=torch.float32,
        )
        return bnb_functional.dequantize_blockwise(absmax, nested) + getattr(self, f"{name}_nested_offset")[expert]

    def _gathered_absmax(self, name: str, experts: torch.Tensor) -> torch.Tensor:
        """The fp32 block scales [n, blocks] of ``experts`` [n], each padded to whole nested blocks and dequantized in
        one call under double quantization (a nested block never spans two experts)."""
        absmax = getattr(self, f"{name}_absmax").index_select(0, experts)
        if not self.double_quant:
            return absmax
        import bitsandbytes.functional as bnb_functional

        blocks = absmax.shape[1]
        nested_absmax = getattr(self, f"{name}_nested_absmax").index_select(0, experts)  # [n, nested blocks]
        padded = F.pad(absmax, (0, nested_absmax.shape[1] * NESTED_BLOCK - blocks))
        nested = bnb_functional.QuantState(
            absmax=nested_absmax.flatten(), code=self.nested_code, blocksize=NESTED_BLOCK, dtype=torch.float32
        )
        scales = bnb_functional.dequantize_blockwise(padded.flatten(), nested).view(len(experts), -1)[:, :blocks]
        return scales + getattr(self, f"{name}_nested_offset").index_select(0, experts).unsqueeze(1)

    def gathered(self, name: str, experts: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        import bitsandbytes.functional as bnb_functional

        _, out_features, in_features = self._shapes[name]
        count, numel = len(experts), out_features * in_features
        absmax = self._gathered_absmax(name, experts)  # [n, blocks]
        codes = getattr(self, name).index_select(0, experts).view(count, -1)  # [n, out·in/2], two codes a byte
        if numel % BLOCK_4BIT:  # each expert's last block is partial: padded so that no block spans two experts
            codes = F.pad(codes, (0, absmax.shape[1] * BLOCK_4BIT // 2 - codes.shape[1]))
        state = bnb_functional.QuantState(
            absmax=absmax.flatten(),
            shape=torch.Size((count, 2 * codes.shape[1])),
            dtype=dtype,
            blocksize=BLOCK_4BIT,
            quant_type=self.quant_type,
        )
        dense = bnb_functional.dequantize_4bit(codes.reshape(-1, 1), state)
        return dense[:, :numel].view(count, out_features, in_features)

    def dequantize(
        self, name: str, expert: int, rows: slice = slice(None), dtype: torch.dtype = torch.bfloat16
    ) -> torch.Tensor:
        import bitsandbytes.functional as bnb_functional

        _, out_features, in_features = self._shapes[name]
        first, last, _ = rows.indices(out_features)
        absmax = self._absmax(name, expert)
        if in_features % BLOCK_4BIT:  # blocks straddle rows: the whole expert, then its rows
            first, last, rows = 0, out_features, slice(first, last)
        else:  # whole blocks per row: the rows' blocks only
            absmax, rows = absmax[first * in_features // BLOCK_4BIT : last * in_features // BLOCK_4BIT], slice(None)
        state = bnb_functional.QuantState(
            absmax=absmax,
            shape=torch.Size((last - first, in_features)),
            dtype=dtype,
            blocksize=BLOCK_4BIT,
            quant_type=self.quant_type,
        )
        return bnb_functional.dequantize_4bit(getattr(self, name)[expert, first:last].reshape(-1, 1), state)[rows]


class Bnb8bitExperts(BnbExperts):
    """Experts stored as ``Linear8bitLt`` stores its weight, per expert: int8 rows [E, out, in] and each row's absmax
    [E, out] fp32 (``{name}_scb``)."""

    def _storage(self, experts: int, rows: int, columns: int) -> dict[str, torch.Tensor]:
        return {"": _meta(experts, rows, columns, dtype=torch.int8), "scb": _meta(experts, rows, dtype=torch.float32)}

    def quantize(self, name: str, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        import bitsandbytes.functional as bnb_functional

        experts, rows, columns = weight.shape  # of the fp16 weight, as Int8Params quantizes
        codes, scb, _ = bnb_functional.int8_vectorwise_quant(weight.reshape(experts * rows, columns).to(torch.float16))
        return {name: codes.view(experts, rows, columns), f"{name}_scb": scb.view(experts, rows)}

    def dequantize(
        self, name: str, expert: int, rows: slice = slice(None), dtype: torch.dtype = torch.bfloat16
    ) -> torch.Tensor:
        import bitsandbytes.functional as bnb_functional

        codes, scb = getattr(self, name)[expert, rows], getattr(self, f"{name}_scb")[expert, rows]
        return bnb_functional.int8_vectorwise_dequant(codes, scb).to(dtype)

    def gathered(self, name: str, experts: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        import bitsandbytes.functional as bnb_functional

        codes = getattr(self, name).index_select(0, experts)  # [n, out, in]
        scb = getattr(self, f"{name}_scb").index_select(0, experts)  # [n, out]
        return bnb_functional.int8_vectorwise_dequant(codes.flatten(0, 1), scb.flatten()).view(codes.shape).to(dtype)


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
    ``BitsAndBytesConfig`` into one. The model's ``quantization_method`` and the saved config say ``"bitsandbytes"``."""

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
        return f"4-bit ({config.bnb_4bit_quant_type}{', double quantization' if config.bnb_4bit_use_double_quant else ''})"

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


def dequantized_experts(experts: BnbExperts, dtype: torch.dtype) -> DeepseekV41Experts:
    """Plain :class:`~.moe.DeepseekV41Experts` holding ``experts``' dequantized weights in ``dtype``."""
    with torch.device("meta"):
        dense = DeepseekV41Experts(experts.config, experts.num_experts)
    for name in EXPERT_WEIGHTS:
        setattr(dense, name, nn.Parameter(experts.dequantized(name, dtype), requires_grad=False))
    return dense


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
    "Bnb4bitExperts",
    "Bnb8bitExperts",
    "BnbExperts",
    "DeepseekV41Bnb4BitQuantizer",
    "DeepseekV41Bnb8BitQuantizer",
    "DeepseekV41BitsAndBytesConfig",
    "QuantizedExpertWeight",
    "dequantized_experts",
    "high_precision_report",
    "quantized_storage_bytes",
]
