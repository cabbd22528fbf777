"""Released checkpoints in their native precision: FP8 Linears and FP4 experts kept quantized in memory.

A released folder implies transformers' fine-grained FP8 quantization (:func:`released_quantization_config`): dense
Linears FP8 e4m3 with one E8M0 scale per 32x32 block, routed experts packed FP4 with one E8M0 scale per row and 32
columns (``FineGrainedFP8Config(scale_fmt="ue8m0", expert_dtype="fp4", weight_block_size=(32, 32))``). Its quantizer
swaps the Linears the release stores in FP8 for :class:`~transformers.integrations.finegrained_fp8.FP8Linear` and the
fused routed experts for ``FP8Experts`` (``weight`` + ``weight_scale_inv``; ``gate_up_proj`` [E, 2·I, D/2] int8 +
``gate_up_proj_scale_inv`` [E, 2·I, D/32], ``down_proj`` [E, D, I/2] + ``down_proj_scale_inv`` [E, D, I/32]).

:class:`DeepseekV41FP8Quantizer` is transformers' ``FineGrainedFP8HfQuantizer`` with two changes:

* where transformers' FP8 kernels cannot run (no CUDA device of compute capability 8.9+, the model loaded on the CPU,
  or the ``kernels`` package missing), transformers dequantizes the whole model to bf16 on load; here the modules
  become :class:`WeightOnlyFP8Linear` / :class:`WeightOnlyFP4Experts` instead, the same parameters dequantized inside
  the forward (a Linear's weight per call, an expert's weights only when tokens are routed to it), so resident
  memory stays near the checkpoint's size. Both dequantize exactly as the dequantizing loader does, so the logits
  equal those of the model loaded in bf16, bit for bit, on the same device;
* the released ``X.scale`` tensors are paired with their weights by this package's conversions
  (:mod:`.conversions`) rather than renamed by the quantizer, and are never cast on load.

The quantized weights and scales are frozen on load. Backward through a weight-only module is backward through the
dequantized weight it computes with, so the input's gradient is exact (the same as the dequantized model's); the
weight is dequantized again for the backward rather than kept (:func:`frozen_quantized_linear`),
so training holds no dequantized copy of a layer. Where the kernels run, the quantizer keeps them but swaps in
:class:`FP8KernelLinear` / :class:`FP4KernelExperts`: the kernel call inside a custom autograd function whose backward
goes through the dequantized weights, so the gradient is that of the weight-only modules (transformers' FP4 expert
kernels have no backward: an error, or a dropped gradient). Training
goes through adapters: LoRA on the FP8 Linears (PEFT's ``target_modules``) and on the FP4 experts (PEFT's
``target_parameters``, adapters of the logical shape: :mod:`.native_lora`, whose forward is
:func:`fp4_experts_forward` with the delta added to each expert's output) trains under ``DeepseekV41Trainer`` and
transformers' ``Trainer``. Full fine-tuning is refused by our own error (:func:`check_trainable`, from
``DeepseekV41Trainer`` and, through the quantizer's ``is_trainable``, transformers' ``Trainer``), which says to load
with ``FineGrainedFP8Config(dequantize=True)`` instead; so is an expert adapter of the packed width, which could not
act.

The config saves as transformers' own ``quant_method: "fp8"``.
"""

from __future__ import annotations

import copy
import re
import weakref
from collections.abc import Callable, Mapping

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parametrize
from transformers import FineGrainedFP8Config
from transformers.integrations import finegrained_fp8
from transformers.integrations.finegrained_fp8 import FP8Experts, FP8Linear
from transformers.quantizers.quantizer_finegrained_fp8 import FineGrainedFP8HfQuantizer
from transformers.utils.import_utils import is_kernels_available

from ..hub.registration import register_quantization_config, register_quantizer
from ..moe import DeepseekV41Experts, per_slot_experts_forward, routed_experts_forward
from ..codec import RELEASED_BLOCK_SIZE, dequantize_released_weight
from .reference_gemms import emulates_reference_gemms, record_reference_gemms, reference_gemm_product

QUANT_METHOD = "deepseek_v41_fp8"
# our Linears the release stores FP8 and that compute through their forward, in the backbone's layers and the DSpark
# draft blocks (a `Linear` the model reads `.weight` of, `engram.wkv`, and the block-diagonal `wo_a` are dequantized on
# load instead)
_NATIVE_FP8_LINEAR = re.compile(
    r"(^|\.)(layers|mtp)\.\d+\.(attn\.(wq_a|wq_b|wkv|wo_b|indexer\.wq_b)|ffn\.shared_experts\.w[123]|main_proj)$"
)


def _fp8_kernels_usable() -> bool:
    """Whether transformers' FP8/FP4 kernels (DeepGEMM / Triton, from the ``kernels`` package) can run here."""
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9) and is_kernels_available()


def _on_accelerator(device_map) -> bool:
    if device_map is None:
        return False
    devices = device_map.values() if isinstance(device_map, dict) else [device_map]
    return any(str(device) not in ("cpu", "disk", "meta") for device in devices)


def modules_kept_in_high_precision(model: nn.Module) -> list[str]:
    """Patterns (layer numbers as ``\\d+``) of the Linears of ``model`` the release does not store in FP8 or that
    must not become ``FP8Linear``: the quantizer's ``modules_to_not_convert``."""
    patterns = []
    for name, module in model.named_modules():
        if type(module) is nn.Linear and not _NATIVE_FP8_LINEAR.search(name):
            pattern = r"\.".join(r"\d+" if part.isdigit() else re.escape(part) for part in name.split("."))
            if pattern not in patterns:
                patterns.append(pattern)
    return patterns


@register_quantization_config(QUANT_METHOD)
class DeepseekV41FP8Config(FineGrainedFP8Config):
    """:class:`~transformers.FineGrainedFP8Config` for DeepSeek-V4.1's released storage, loaded by
    :class:`DeepseekV41FP8Quantizer` (weight-only where transformers' FP8 kernels cannot run). Saved as
    ``quant_method: "fp8"``."""

    def __init__(self, **kwargs):
        kwargs.pop("quant_method", None)
        released = {"scale_fmt": "ue8m0", "expert_dtype": "fp4", "weight_block_size": (RELEASED_BLOCK_SIZE,) * 2}
        kwargs = {**released, **kwargs}
        super().__init__(**kwargs)
        self.quant_method = QUANT_METHOD

    def to_dict(self) -> dict:
        return {**super().to_dict(), "quant_method": "fp8"}


def released_quantization_config(model: nn.Module, **kwargs) -> DeepseekV41FP8Config:
    """The quantization a released folder implies, for ``model`` (any device, even meta)."""
    return DeepseekV41FP8Config(modules_to_not_convert=modules_kept_in_high_precision(model), **kwargs)


def saved_quantization_config(model: nn.Module):
    """The ``quantization_config`` a save of the natively loaded ``model`` writes: its own, where ``model`` holds no
    unquantized copy of a module the release stores FP8 / FP4; else a copy whose ``modules_to_not_convert`` also names
    those modules (merged by ``merge_and_unload()``: plain ``nn.Linear`` / :class:`DeepseekV41Experts`), so that they
    load back as they were saved rather than as FP8 / FP4 modules missing their scales."""
    config = model.config.quantization_config
    merged = [
        re.escape(name)
        for name, module in model.named_modules()
        if (type(module) is nn.Linear and _NATIVE_FP8_LINEAR.search(name)) or type(module) is DeepseekV41Experts
    ]
    if not merged:
        return config
    config = copy.deepcopy(config)
    if isinstance(config, dict):
        config["modules_to_not_convert"] = [*(config.get("modules_to_not_convert") or []), *merged]
    else:
        config.modules_to_not_convert = [*(config.modules_to_not_convert or []), *merged]
    return config


def quantization_method(config) -> str | None:
    """The ``quant_method`` of ``config.quantization_config`` as a plain string (``"fp8"``, ``"bitsandbytes"``), or
    None where the model is not quantized; the config may hold it as a dict or as a config object with an enum."""
    quantization = getattr(config, "quantization_config", None)
    method = (
        quantization.get("quant_method")
        if isinstance(quantization, dict)
        else getattr(quantization, "quant_method", None)
    )
    method = getattr(method, "value", method)
    return str(method) if method else None


def _tuner_layers(model: nn.Module) -> list[nn.Module]:
    """The adapter layers PEFT put in ``model``."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    return [module for module in model.modules() if isinstance(module, BaseTunerLayer)]


def _on_packed_bytes(layer: nn.Module) -> bool:
    """Whether ``layer`` adapts FP4 experts with factors of the packed width (``in/2``): PEFT's own
    ``target_parameters`` wrapper, whose delta would act on the bytes and round away. The adapters of the logical
    shape (:mod:`.native_lora`) have the experts' true input width."""
    experts = layer.get_base_layer()
    if not isinstance(experts, FP8Experts) or not hasattr(layer, "parameter_name"):
        return False
    return layer.in_features != 2 * getattr(experts, layer.parameter_name).shape[-1]


def check_trainable(model: nn.Module) -> None:
    """Refuse to train a natively loaded model (its FP8 / FP4 weights as stored) unless adapters do the training,
    and say how to train it instead.

    Its quantized weights have no gradient (the modules pass the input's exactly, backward through the dequantized
    weight), so full fine-tuning cannot update them. LoRA trains: on the FP8 Linears (``target_modules``) and on the
    FP4 experts (``target_parameters``, adapters of the logical per-expert shape, :mod:`.native_lora`). An expert
    adapter of the packed width could not act, so it is refused."""
    if not isinstance(getattr(model, "hf_quantizer", None), DeepseekV41FP8Quantizer):
        return
    dequantized = "from_pretrained(..., quantization_config=FineGrainedFP8Config(dequantize=True))"
    layers = _tuner_layers(model)
    if any(_on_packed_bytes(layer) for layer in layers):
        raise ValueError(
            "This model's routed experts carry adapters built on their packed FP4 bytes (half their input width), "
            "which would do nothing: load the model with from_pretrained (its PEFT dispatch builds expert adapters "
            f"of the logical shape), or load it dequantized with {dequantized}."
        )
    if not layers:
        raise ValueError(
            "This model was loaded in the released precision (FP8 Linears, FP4 experts kept quantized): its quantized "
            "weights are frozen, so full fine-tuning cannot train them. Attach LoRA adapters with PEFT (its Linears "
            "through target_modules, its routed experts through target_parameters=['experts.gate_up_proj', "
            f"'experts.down_proj']), or, to fine-tune every weight, load it with {dequantized} (bf16 weights)."
        )


class _FrozenQuantizedLinear(torch.autograd.Function):
    """``product(input)``, ``input @ W.T`` for a frozen quantized ``W`` (by a kernel, or on ``W`` dequantized for the
    product), with the backward of the dequantized product, ``W`` dequantized again: nothing dequantized outlives
    either pass (autograd through ``F.linear`` would keep the dequantized weight until the backward, as much memory
    per layer as a bf16 copy of it)."""

    @staticmethod
    def forward(ctx, input, weight, scale, columns, product):
        ctx.save_for_backward(weight, scale)
        ctx.columns = columns
        return product(input)

    @staticmethod
    def backward(ctx, grad_output):
        weight, scale = ctx.saved_tensors
        dense = dequantize_released_weight(weight, scale, ctx.columns, grad_output.dtype)
        return grad_output @ dense, None, None, None, None


def frozen_quantized_linear(
    input: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    columns: int,
    bias: torch.Tensor | None = None,
    product: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """``F.linear(input, dequantize_released_weight(weight, scale, columns, input.dtype), bias)`` (or
    ``product(input)``, a kernel computing the same) with the exact input gradient and none for the (frozen) weight and
    bias, holding only the stored bytes between the forward and the backward."""

    @torch.no_grad()
    def dequantized_product(x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(x, dequantize_released_weight(weight, scale, columns, x.dtype), bias)

    product = product or dequantized_product
    if not (torch.is_grad_enabled() and input.requires_grad):
        return product(input)
    return _FrozenQuantizedLinear.apply(input, weight, scale, columns, torch.no_grad()(product))


class WeightOnlyFP8Linear(FP8Linear):
    """``FP8Linear`` computed by dequantizing its weight to the input's dtype in the forward (no FP8 kernel). Under
    tensor parallelism it runs on its local shard (whole 32x32 scale blocks), whose width is the weight's own."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        # frozen weights: the input still gets its gradient, as through `FP8LinearFunction`
        weight, scale, columns = self.weight, self.weight_scale_inv, self.weight.shape[-1]
        product = reference_gemm_product(weight, scale, columns, self.bias) if emulates_reference_gemms(self) else None
        return frozen_quantized_linear(input, weight, scale, columns, self.bias, product)


# the tensors of the natively loaded FP4 experts: packed bytes [E, out, in/2] and E8M0 scales [E, out, in/32]
FP4_EXPERT_TENSORS = ("gate_up_proj", "gate_up_proj_scale_inv", "down_proj", "down_proj_scale_inv")
# expert e → the LoRA factors adapting its weight [out, in]: [(lora_A [r, in], lora_B [out, r], scaling), ...]
ExpertFactors = Callable[[int], list[tuple[torch.Tensor, torch.Tensor, float]]]


class FrozenExpertWeight:
    """One routed expert's FP4 weight [out, in] as :func:`~modeling_dsv41.moe.routed_experts_forward` applies it
    (a :class:`~modeling_dsv41.moe.ProjectedWeight`): dequantized inside each product and again in its backward
    (:func:`frozen_quantized_linear`), so no dequantized expert waits for the backward, and LoRA
    factors added to the output, ``x·Wᵀ + scaling·(x·Aᵀ)·Bᵀ``, so only the rank-r intermediate is kept. With
    ``reference_gemm``, the product is the reference's ``fp4_gemm`` (:func:`reference_gemm_product`)."""

    def __init__(
        self, packed: torch.Tensor, scale: torch.Tensor, factors: list | None = None, reference_gemm: bool = False
    ):
        self.packed, self.scale, self.factors, self.reference_gemm = packed, scale, factors or [], reference_gemm
        self.shape = torch.Size((packed.shape[0], 2 * packed.shape[1]))

    def linear(self, x: torch.Tensor, rows: slice) -> torch.Tensor:
        packed, scale, columns = self.packed[rows], self.scale[rows], self.shape[1]
        product = reference_gemm_product(packed, scale, columns) if self.reference_gemm else None
        out = frozen_quantized_linear(x, packed, scale, columns, product=product)
        for lora_a, lora_b, scaling in self.factors:  # in the factors' dtype, as PEFT's Linear computes its delta
            delta = F.linear(F.linear(x.to(lora_a.dtype), lora_a), lora_b[rows]) * scaling
            out = out + delta.to(out.dtype)
        return out


def fp4_experts_forward(
    experts: FP8Experts,
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    adapters: Mapping[str, ExpertFactors] | None = None,
) -> torch.Tensor:
    """The FP4 ``experts`` computed as :class:`~modeling_dsv41.moe.DeepseekV41Experts`' eager forward, only the experts
    tokens are routed to, each weight a :class:`FrozenExpertWeight` with the LoRA factors ``adapters[name]``
    (``"gate_up_proj"`` / ``"down_proj"``) gives it, if any (the adapters of the logical shape, :mod:`.native_lora`).
    hidden_states [N, D], top_k_index / top_k_weights [N, k] → fp32 [N, D].

    Decoding (no more slots than experts, no adapter, no input gradient), each slot's expert is dequantized from
    its gathered bytes (:func:`~modeling_dsv41.moe.per_slot_experts_forward`: no host sync); otherwise, and where it
    :func:`emulates_reference_gemms` (the reference's ``fp4_gemm`` per expert, on its rows), the loop over the
    experts with tokens (one host sync reading how many each got)."""
    stored = {name: getattr(experts, name) for name in FP4_EXPERT_TENSORS}
    needs_input_grad = torch.is_grad_enabled() and hidden_states.requires_grad
    reference_gemm = emulates_reference_gemms(experts)
    if not (adapters or needs_input_grad or reference_gemm) and top_k_index.numel() <= experts.num_experts:
        return per_slot_experts_forward(
            hidden_states,
            top_k_index,
            top_k_weights,
            experts.limit or 0.0,
            stored["gate_up_proj"].shape[0],
            lambda ids: (
                _gathered_fp4(stored, "gate_up_proj", ids, hidden_states.dtype),
                _gathered_fp4(stored, "down_proj", ids, hidden_states.dtype),
            ),
        )
    return routed_experts_forward(
        hidden_states,
        top_k_index,
        top_k_weights,
        experts.num_experts,
        experts.limit or 0.0,
        fp4_expert_weights(stored, adapters, reference_gemm=reference_gemm),
    )


def _gathered_fp4(
    stored: Mapping[str, torch.Tensor], name: str, ids: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """Experts ``ids`` [n] of the FP4 tensor ``name`` dequantized to ``dtype``: [n, out, in]."""
    packed = stored[name].index_select(0, ids)  # [n, out, in/2]
    scale = stored[f"{name}_scale_inv"].index_select(0, ids)
    columns = 2 * packed.shape[-1]
    dense = dequantize_released_weight(packed.flatten(0, 1), scale.flatten(0, 1), columns, dtype)
    return dense.view(*packed.shape[:2], columns)


def fp4_expert_weights(
    stored: Mapping[str, torch.Tensor],
    adapters: Mapping[str, ExpertFactors] | None = None,
    first: int = 0,
    reference_gemm: bool = False,
) -> Callable[[int], tuple[FrozenExpertWeight, FrozenExpertWeight]]:
    """Expert ``e`` of ``stored`` (the :data:`FP4_EXPERT_TENSORS` of some experts, [E_held, ...]) → its ``gate_up`` and
    ``down`` as :class:`FrozenExpertWeight`, with the LoRA factors of expert ``first + e`` (``first``: the number of
    the first expert held, under expert parallelism), computing as the reference's ``fp4_gemm`` if
    ``reference_gemm``."""
    adapters = adapters or {}

    def weight(name: str, expert: int) -> FrozenExpertWeight:
        packed, scale = stored[name][expert], stored[f"{name}_scale_inv"][expert]
        factors = adapters[name](first + expert) if name in adapters else None
        return FrozenExpertWeight(packed, scale, factors, reference_gemm)

    return lambda expert: (weight("gate_up_proj", expert), weight("down_proj", expert))


class WeightOnlyFP4Experts(FP8Experts):
    """``FP8Experts`` (FP4 weights) computed by :func:`fp4_experts_forward`: each expert's weights dequantized only
    when tokens are routed to it."""

    def forward(
        self,
        hidden_states: torch.Tensor,
        top_k_index: torch.Tensor,
        top_k_weights: torch.Tensor,
        adapters: Mapping[str, ExpertFactors] | None = None,
    ) -> torch.Tensor:
        """hidden_states [N, D], top_k_index / top_k_weights [N, k] → fp32 [N, D]; ``adapters``: the LoRA factors of
        the wrappers around it (:mod:`.native_lora`), passed through the module's own forward so that its hooks
        (an FSDP2 unit's all-gather) run."""
        if parametrize.is_parametrized(self):
            raise ValueError(
                "a parametrization of the natively loaded FP4 experts (such as PEFT's own target_parameters adapter, "
                "built on the packed bytes [E, out, in/2]) would act on packed bytes, whose rounding back to FP4 "
                "drops its delta: it would do nothing. Load the model with from_pretrained (which makes PEFT build "
                "adapters of the logical shape there) or with "
                "quantization_config=FineGrainedFP8Config(dequantize=True)."
            )
        return fp4_experts_forward(self, hidden_states, top_k_index, top_k_weights, adapters)


class FP8KernelLinear(FP8Linear):
    """``FP8Linear`` running transformers' FP8 kernel (DeepGEMM / Triton), with the exact input gradient: backward
    through the dequantized weight (:func:`frozen_quantized_linear`), the gradient
    :class:`WeightOnlyFP8Linear` gives."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        weight, scale, columns = self.weight, self.weight_scale_inv, self.weight.shape[-1]
        if emulates_reference_gemms(self):  # the reference's fp8_gemm, rather than the kernel's own quantization
            product = reference_gemm_product(weight, scale, columns, self.bias)
        else:
            product = self._kernel_product
        return frozen_quantized_linear(input, weight, scale, columns, self.bias, product=product)

    def _kernel_product(self, input: torch.Tensor) -> torch.Tensor:
        return finegrained_fp8.fp8_linear(
            input,
            self.weight,
            self.weight_scale_inv,
            self.block_size,
            self.bias,
            self.activation_scale,
            not self._deepgemm_disabled,
        )


class _KernelExpertsFunction(torch.autograd.Function):
    """The routed experts run by transformers' kernels (forward only), differentiated as :func:`fp4_experts_forward`:
    the backward recomputes them on the dequantized weights (as activation checkpointing would; nothing dequantized
    is kept by that either) and differentiates the recomputation for the hidden states and the routing weights.
    Only the inputs are saved."""

    @staticmethod
    def forward(ctx, experts, hidden_states, top_k_index, top_k_weights):
        ctx.experts = experts
        ctx.save_for_backward(hidden_states, top_k_index, top_k_weights)
        return FP8Experts.forward(experts, hidden_states, top_k_index, top_k_weights)

    @staticmethod
    def backward(ctx, grad_output):
        hidden_states, top_k_index, top_k_weights = ctx.saved_tensors
        hidden_states = hidden_states.detach().requires_grad_(ctx.needs_input_grad[1])
        top_k_weights = top_k_weights.detach().requires_grad_(ctx.needs_input_grad[3])
        wanted = [t for t in (hidden_states, top_k_weights) if t.requires_grad]
        with torch.enable_grad():
            out = fp4_experts_forward(ctx.experts, hidden_states, top_k_index, top_k_weights)
        grads = iter(torch.autograd.grad(out, wanted, grad_output.to(out.dtype)))
        hidden_grad, weights_grad = (next(grads) if t.requires_grad else None for t in (hidden_states, top_k_weights))
        return None, hidden_grad, None, weights_grad


class FP4KernelExperts(FP8Experts):
    """``FP8Experts`` (FP4 weights) running transformers' kernels (whichever ``experts_implementation`` dispatches
    them), with the exact input gradient: backward through the dequantized weights (:class:`_KernelExpertsFunction`).
    transformers' FP4 expert kernels have no backward of their own (its eager and grouped paths raise for FP4 weights,
    its DeepGEMM and batched paths drop the gradient). Adapted experts run :func:`fp4_experts_forward` instead
    (:mod:`.native_lora`: the kernels take no delta)."""

    def forward(
        self,
        hidden_states: torch.Tensor,
        top_k_index: torch.Tensor,
        top_k_weights: torch.Tensor,
        adapters: Mapping[str, ExpertFactors] | None = None,
    ) -> torch.Tensor:
        # the kernels take no delta, nor quantize as the reference does: the weight-only computation
        if adapters or emulates_reference_gemms(self):
            return fp4_experts_forward(self, hidden_states, top_k_index, top_k_weights, adapters)
        if not (torch.is_grad_enabled() and (hidden_states.requires_grad or top_k_weights.requires_grad)):
            return super().forward(hidden_states, top_k_index, top_k_weights)
        return _KernelExpertsFunction.apply(self, hidden_states, top_k_index, top_k_weights)


def _with_exact_gradient(module: nn.Module, config, num_experts: int | None = None) -> nn.Module:
    """The kernel-path module with our backward (same parameters, same kernels)."""
    return _replacement(module, config, FP4KernelExperts, FP8KernelLinear, num_experts)


def _weight_only(module: nn.Module, config, num_experts: int | None = None) -> nn.Module:
    return _replacement(module, config, WeightOnlyFP4Experts, WeightOnlyFP8Linear, num_experts)


def _replacement(
    module: nn.Module, config, experts_class: type, linear_class: type, num_experts: int | None = None
) -> nn.Module:
    """The module natively loaded in place of transformers' ``FP8Linear`` / ``FP8Experts`` ``module``; experts with
    ``num_experts`` of them (the DSpark draft blocks' count: transformers sizes them by the backbone's)."""
    with torch.device("meta"):
        if isinstance(module, FP8Experts):
            sized = module.config
            if num_experts is not None and num_experts != module.num_experts:
                sized = copy.copy(module.config)
                sized.n_routed_experts = num_experts
            new = experts_class(
                sized,
                block_size=config.weight_block_size,
                scale_fmt=config.scale_fmt,
                expert_dtype=config.expert_dtype,
            )
            new.config = module.config  # the model's: what experts_implementation dispatches on
        else:
            new = linear_class(
                module.in_features,
                module.out_features,
                block_size=config.weight_block_size,
                scale_fmt=config.scale_fmt,
                has_bias=module.bias is not None,
            )
    # transformers' TP styles run a quantized module on its local shards (its forward takes no DTensors)
    new._hf_quantized_needs_local_tp = getattr(module, "_hf_quantized_needs_local_tp", False)
    return new


@register_quantizer(QUANT_METHOD)
class DeepseekV41FP8Quantizer(FineGrainedFP8HfQuantizer):
    """transformers' fine-grained FP8 quantizer for the released storage, weight-only where its kernels cannot run
    (see the module docstring)."""

    def validate_environment(self, *args, device_map=None, **kwargs):
        if self.quantization_config.dequantize:
            raise ValueError(
                "DeepseekV41FP8Config keeps the released weights quantized; to dequantize a released checkpoint on "
                "load, pass quantization_config=FineGrainedFP8Config(dequantize=True) to from_pretrained instead"
            )
        self.weight_only = not (_fp8_kernels_usable() and _on_accelerator(device_map))
        if self.quantization_config.expert_dtype != "fp4" or self.quantization_config.scale_fmt != "ue8m0":
            raise ValueError("the released storage has FP4 experts and E8M0 (ue8m0) scales")

    def _process_model_before_weight_loading(self, model, **kwargs):
        expert_counts = {name: m.num_experts for name, m in model.named_modules() if isinstance(m, DeepseekV41Experts)}
        super()._process_model_before_weight_loading(model, **kwargs)
        replace = _weight_only if self.weight_only else _with_exact_gradient
        for name, module in list(model.named_modules()):
            if type(module) is FP8Linear or isinstance(module, FP8Experts):
                model.set_submodule(name, replace(module, self.quantization_config, expert_counts.get(name)))

    def get_new_dtype(self, converter, param, dtype):
        """Quantized checkpoint tensors (FP8 weights, E8M0 scales, FP4 bytes) load as stored: the conversions read
        them raw, and a cast to the target's dtype would round the scales to e4m3."""
        quantized = (
            param.get_dtype().startswith(("F8", "I8", "U8"))
            if hasattr(param, "get_dtype")
            else param.element_size() == 1
        )
        return None if quantized else dtype

    def update_weight_conversions(self, weight_conversions, model):
        # the released conversions pair `X.scale` with `X.weight` themselves (no renaming to `weight_scale_inv`)
        return weight_conversions + self.get_weight_conversions()

    def _process_model_after_weight_loading(self, model, **kwargs):
        super()._process_model_after_weight_loading(model, **kwargs)
        for module in model.modules():
            if isinstance(module, (FP8Linear, FP8Experts)):
                # frozen: the loader hands them over as parameters that require a gradient
                module.requires_grad_(False)
                # the dtype of their inputs and outputs (the load's `dtype`): what a merged copy of them holds
                module.model_dtype = model.config.dtype
        record_reference_gemms(model, (FP8Linear, FP8Experts))  # in reference numerics: the reference's kernels
        self._model = weakref.ref(model)  # for `is_trainable`, which transformers asks without the model

    @property
    def is_trainable(self) -> bool:
        """transformers reads this only to validate a model for training (``Trainer.__init__``): our refusal
        (:func:`check_trainable`), which says what to do instead, is raised here rather than transformers' generic
        one; with adapters it trains."""
        model = getattr(self, "_model", lambda: None)()
        if model is None:
            return False
        check_trainable(model)
        return True


__all__ = [
    "DeepseekV41FP8Config",
    "DeepseekV41FP8Quantizer",
    "FP4KernelExperts",
    "FP4_EXPERT_TENSORS",
    "FP8KernelLinear",
    "WeightOnlyFP4Experts",
    "WeightOnlyFP8Linear",
    "check_trainable",
    "fp4_expert_weights",
    "frozen_quantized_linear",
    "modules_kept_in_high_precision",
    "released_quantization_config",
    "saved_quantization_config",
]
