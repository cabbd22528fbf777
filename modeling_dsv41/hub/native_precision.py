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
  (:mod:`.checkpoint_loading`) rather than renamed by the quantizer, and are never cast on load.

The quantized weights and scales are frozen on load. Backward through a weight-only module is backward through the
dequantized weight it computes with, so the input's gradient is exact (the same as the dequantized model's). Where
the kernels run, the quantizer keeps them but swaps in :class:`FP8KernelLinear` / :class:`FP4KernelExperts`: the
kernel call inside a custom autograd function whose backward goes through the dequantized weights, so the gradient
is that of the weight-only modules (transformers' FP4 expert kernels have no backward: none, or an error). Training
goes through adapters: LoRA on the FP8 Linears (PEFT's ``target_modules``) trains under ``DeepseekV41Trainer`` and
transformers' ``Trainer``. Full fine-tuning is refused by our own error (:func:`check_trainable`, from
``DeepseekV41Trainer`` and, through the quantizer's ``is_trainable``, transformers' ``Trainer``), which says to load
with ``FineGrainedFP8Config(dequantize=True)`` instead; so is an adapter on the packed FP4 experts (PEFT
``target_parameters``), which could not act.

The config saves as transformers' own ``quant_method: "fp8"``.
"""

from __future__ import annotations

import re
import weakref

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parametrize
from transformers import FineGrainedFP8Config
from transformers.integrations import finegrained_fp8
from transformers.integrations.finegrained_fp8 import FP8Experts, FP8Linear
from transformers.quantizers.quantizer_finegrained_fp8 import FineGrainedFP8HfQuantizer
from transformers.utils.import_utils import is_kernels_available

from ..moe import routed_experts_forward
from ..quantization import RELEASED_BLOCK_SIZE
from .registration import register_quantization_config, register_quantizer
from .released_storage import dequantize_released_weight

QUANT_METHOD = "deepseek_v41_fp8"
# our Linears the release stores FP8 and that compute through their forward (a `Linear` the model reads `.weight`
# of, `engram.wkv`, and the block-diagonal `wo_a` are dequantized on load instead)
_NATIVE_FP8_LINEAR = re.compile(r"(^|\.)layers\.\d+\.(attn\.(wq_a|wq_b|wkv|wo_b|indexer\.wq_b)|ffn\.shared_experts\.w[123])$")


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
    if getattr(model, "mtp", None) is not None:
        # the DSpark draft head loads dequantized: transformers builds FP8Experts from the config's expert count,
        # the backbone's, and the draft blocks have their own
        patterns.append("mtp")
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


def _adapted_modules(model: nn.Module) -> list[nn.Module]:
    """The modules PEFT adapts (their base layers)."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    return [module.get_base_layer() for module in model.modules() if isinstance(module, BaseTunerLayer)]


def check_trainable(model: nn.Module) -> None:
    """Refuse to train a natively loaded model (its FP8 / FP4 weights as stored) unless adapters do the training,
    and say how to train it instead.

    Its quantized weights have no gradient (the modules pass the input's exactly, backward through the dequantized
    weight), so full fine-tuning cannot update them. LoRA on the FP8 Linears trains (PEFT's ``Linear`` around them);
    on the packed FP4 experts PEFT's ``target_parameters`` adapters could not act, so they are refused."""
    if not isinstance(getattr(model, "hf_quantizer", None), DeepseekV41FP8Quantizer):
        return
    dequantized = "from_pretrained(..., quantization_config=FineGrainedFP8Config(dequantize=True))"
    adapted = _adapted_modules(model)
    if any(isinstance(module, FP8Experts) for module in adapted):
        raise ValueError(
            "This model was loaded in the released precision (FP4 experts kept packed): adapters on its routed "
            "experts (target_parameters) would act on the packed bytes and do nothing. Adapt its Linears "
            f"(target_modules), or load it dequantized with {dequantized} to adapt the experts too."
        )
    if not adapted:
        raise ValueError(
            "This model was loaded in the released precision (FP8 Linears, FP4 experts kept quantized): its quantized "
            "weights are frozen, so full fine-tuning cannot train them. Attach LoRA adapters to its Linears with "
            "PEFT (target_modules), or, to fine-tune every weight, load it with "
            f"{dequantized} (bf16 weights)."
        )


class _DequantizedBackwardLinear(torch.autograd.Function):
    """``product(input)`` (``input @ W.T`` by an FP8 kernel or on the dequantized weight, not differentiated) with
    the backward of the dequantized product: ``grad_input = grad_output @ W``, ``W`` dequantized again from the
    saved FP8 weight (frozen: no weight gradient). Only the quantized weight is kept for backward, never a
    dequantized copy."""

    @staticmethod
    def forward(ctx, input, weight, weight_scale_inv, columns, product):
        ctx.save_for_backward(weight, weight_scale_inv)
        ctx.columns = columns
        return product(input)

    @staticmethod
    def backward(ctx, grad_output):
        weight, weight_scale_inv = ctx.saved_tensors
        dense = dequantize_released_weight(weight, weight_scale_inv, ctx.columns, grad_output.dtype)
        return grad_output @ dense, None, None, None, None


def _linear_with_dequantized_backward(module: FP8Linear, input: torch.Tensor, product) -> torch.Tensor:
    if not (torch.is_grad_enabled() and input.requires_grad):
        return product(input)
    columns = module.weight.shape[-1]
    return _DequantizedBackwardLinear.apply(input, module.weight, module.weight_scale_inv, columns, product)


class WeightOnlyFP8Linear(FP8Linear):
    """``FP8Linear`` computed by dequantizing its weight to the input's dtype in the forward (no FP8 kernel). Under
    tensor parallelism it runs on its local shard (whole 32x32 scale blocks), whose width is the weight's own.
    Backward dequantizes the weight again (:class:`_DequantizedBackwardLinear`): a training step holds no
    dequantized copy of the weights between forward and backward."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return _linear_with_dequantized_backward(self, input, self._dequantized_product)

    @torch.no_grad()
    def _dequantized_product(self, input: torch.Tensor) -> torch.Tensor:
        weight = dequantize_released_weight(self.weight, self.weight_scale_inv, self.weight.shape[-1], input.dtype)
        return F.linear(input, weight, self.bias)


# the most bytes of dequantized expert weights one step of the experts' backward holds (transformers' FP8 grouped
# backward has the same kind of budget); DeepSeek-V4.1's experts exceed it one by one: one expert at a time
_BACKWARD_BUDGET_BYTES = 1 << 26


class _DequantizedBackwardExperts(torch.autograd.Function):
    """``run(hidden_states, top_k_index, top_k_weights)`` (the routed experts by transformers' kernels or on
    dequantized weights, not differentiated) with the backward of :class:`WeightOnlyFP4Experts`' computation: it is
    recomputed on the dequantized weights, as activation checkpointing would, a group of experts at a time (at most
    :data:`_BACKWARD_BUDGET_BYTES` of their weights dequantized at once; the other slots routed to the skipped id
    ``num_experts``, as expert parallelism does), and differentiated for the hidden states, the routing weights and
    the module's trainable parameters (``params``). Only the inputs are saved, no dequantized expert weights."""

    @staticmethod
    def forward(ctx, experts, run, hidden_states, top_k_index, top_k_weights, *params):
        ctx.experts = experts
        ctx.save_for_backward(hidden_states, top_k_index, top_k_weights, *params)
        return run(hidden_states, top_k_index, top_k_weights)

    @staticmethod
    def backward(ctx, grad_output):
        hidden_states, top_k_index, top_k_weights, *params = ctx.saved_tensors
        experts = ctx.experts
        hidden_states = hidden_states.detach().requires_grad_(ctx.needs_input_grad[2])
        top_k_weights = top_k_weights.detach().requires_grad_(ctx.needs_input_grad[4])
        inputs = [hidden_states, top_k_weights, *params]
        needs = ctx.needs_input_grad[2:3] + ctx.needs_input_grad[4:]
        wanted = [t for t, need in zip(inputs, needs) if need]
        sums = [None] * len(wanted)  # fp32: the groups' contributions add up without bf16 rounding in between
        expert_bytes = 3 * experts.intermediate_dim * experts.hidden_dim * hidden_states.element_size()
        per_group = max(1, _BACKWARD_BUDGET_BYTES // expert_bytes)
        for first in range(0, experts.num_experts, per_group):
            in_group = (top_k_index >= first) & (top_k_index < first + per_group)
            if not in_group.any():
                continue
            index = top_k_index.masked_fill(~in_group, experts.num_experts)
            with torch.enable_grad():
                out = experts._dequantized_forward(hidden_states, index, top_k_weights)
            grads = torch.autograd.grad(out, wanted, grad_output.to(out.dtype), allow_unused=True)
            sums = [s if g is None else g.float() if s is None else s + g for s, g in zip(sums, grads)]
        totals = iter(None if s is None else s.to(t.dtype) for s, t in zip(sums, wanted))
        hidden_grad, weights_grad, *param_grads = (next(totals) if need else None for need in needs)
        return None, None, hidden_grad, None, weights_grad, *param_grads


def _experts_with_dequantized_backward(experts: FP8Experts, hidden_states, top_k_index, top_k_weights, run):
    params = [p for p in experts.parameters() if p.requires_grad]
    if not (torch.is_grad_enabled() and (hidden_states.requires_grad or top_k_weights.requires_grad or params)):
        return run(hidden_states, top_k_index, top_k_weights)
    return _DequantizedBackwardExperts.apply(experts, run, hidden_states, top_k_index, top_k_weights, *params)


class WeightOnlyFP4Experts(FP8Experts):
    """``FP8Experts`` (FP4 weights) computed as :class:`~modeling_dsv41.moe.DeepseekV41Experts`' eager forward, each
    expert's weights dequantized only when tokens are routed to it. Backward recomputes the experts
    (:class:`_DequantizedBackwardExperts`): a training step holds no dequantized expert weights between forward
    and backward."""

    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        """hidden_states [N, D], top_k_index / top_k_weights [N, k] → fp32 [N, D]."""
        if parametrize.is_parametrized(self):
            raise ValueError(
                "an adapter on the natively loaded FP4 experts (PEFT target_parameters=['experts.gate_up_proj', "
                "'experts.down_proj']) would act on packed bytes [E, out, in/2], whose rounding back to FP4 drops its "
                "delta: it would do nothing. Load the model with quantization_config=FineGrainedFP8Config("
                "dequantize=True) to adapt the experts."
            )
        run = torch.no_grad()(self._dequantized_forward)
        return _experts_with_dequantized_backward(self, hidden_states, top_k_index, top_k_weights, run)

    def _dequantized_forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        @torch.no_grad()
        def expert_weights(expert: int) -> tuple[torch.Tensor, torch.Tensor]:
            dtype = hidden_states.dtype
            gate_up = dequantize_released_weight(
                self.gate_up_proj[expert], self.gate_up_proj_scale_inv[expert], self.hidden_dim, dtype
            )
            down = dequantize_released_weight(
                self.down_proj[expert], self.down_proj_scale_inv[expert], 2 * self.down_proj.shape[-1], dtype
            )
            return gate_up, down

        return routed_experts_forward(
            hidden_states, top_k_index, top_k_weights, self.num_experts, self.limit or 0.0, expert_weights
        )


class FP8KernelLinear(FP8Linear):
    """``FP8Linear`` running transformers' FP8 kernel (DeepGEMM / Triton), with the exact input gradient: backward
    through the dequantized weight (:class:`_DequantizedBackwardLinear`), the gradient :class:`WeightOnlyFP8Linear`
    gives."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return _linear_with_dequantized_backward(self, input, self._kernel_product)

    @torch.no_grad()
    def _kernel_product(self, input: torch.Tensor) -> torch.Tensor:
        return finegrained_fp8.fp8_linear(
            input, self.weight, self.weight_scale_inv, self.block_size, self.bias, self.activation_scale,
            not self._deepgemm_disabled,
        )


class FP4KernelExperts(FP8Experts):
    """``FP8Experts`` (FP4 weights) running transformers' kernels (whichever ``experts_implementation`` dispatches
    them), with the exact input gradient: backward through the dequantized weights, as :class:`WeightOnlyFP4Experts`
    (:class:`_DequantizedBackwardExperts`). transformers' FP4 expert kernels have no backward of their own (its eager
    and grouped paths raise for FP4 weights, its DeepGEMM and batched paths drop the gradient)."""

    _dequantized_forward = WeightOnlyFP4Experts._dequantized_forward

    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        run = torch.no_grad()(super().forward)
        return _experts_with_dequantized_backward(self, hidden_states, top_k_index, top_k_weights, run)


def _with_exact_gradient(module: nn.Module, config) -> nn.Module:
    """The kernel-path module with our backward (same parameters, same kernels)."""
    return _replacement(module, config, FP4KernelExperts, FP8KernelLinear)


def _weight_only(module: nn.Module, config) -> nn.Module:
    return _replacement(module, config, WeightOnlyFP4Experts, WeightOnlyFP8Linear)


def _replacement(module: nn.Module, config, experts_class: type, linear_class: type) -> nn.Module:
    with torch.device("meta"):
        if isinstance(module, FP8Experts):
            new = experts_class(
                module.config, block_size=config.weight_block_size, scale_fmt=config.scale_fmt,
                expert_dtype=config.expert_dtype,
            )
        else:
            new = linear_class(
                module.in_features, module.out_features, block_size=config.weight_block_size,
                scale_fmt=config.scale_fmt, has_bias=module.bias is not None,
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
        super()._process_model_before_weight_loading(model, **kwargs)
        replace = _weight_only if self.weight_only else _with_exact_gradient
        for name, module in list(model.named_modules()):
            if type(module) is FP8Linear or isinstance(module, FP8Experts):
                model.set_submodule(name, replace(module, self.quantization_config))

    def get_new_dtype(self, converter, param, dtype):
        """Quantized checkpoint tensors (FP8 weights, E8M0 scales, FP4 bytes) load as stored: the conversions read
        them raw, and a cast to the target's dtype would round the scales to e4m3."""
        quantized = param.get_dtype().startswith(("F8", "I8", "U8")) if hasattr(param, "get_dtype") else param.element_size() == 1
        return None if quantized else dtype

    def update_weight_conversions(self, weight_conversions, model):
        # the released conversions pair `X.scale` with `X.weight` themselves (no renaming to `weight_scale_inv`)
        return weight_conversions + self.get_weight_conversions()

    def _process_model_after_weight_loading(self, model, **kwargs):
        super()._process_model_after_weight_loading(model, **kwargs)
        for module in model.modules():  # frozen: the loader hands them over as parameters that require a gradient
            if isinstance(module, (FP8Linear, FP8Experts)):
                module.requires_grad_(False)
        self._model = weakref.ref(model)  # for `is_trainable`, which transformers asks without the model

    @property
    def is_trainable(self) -> bool:
        """transformers reads this only to validate a model for training (``Trainer.__init__``): our refusal
        (:func:`check_trainable`), which says what to do instead, is raised here rather than transformers' generic
        one; with adapters on the Linears it trains."""
        model = getattr(self, "_model", lambda: None)()
        if model is None:
            return False
        check_trainable(model)
        return True


__all__ = [
    "DeepseekV41FP8Config",
    "DeepseekV41FP8Quantizer",
    "FP4KernelExperts",
    "FP8KernelLinear",
    "WeightOnlyFP4Experts",
    "WeightOnlyFP8Linear",
    "check_trainable",
    "modules_kept_in_high_precision",
    "released_quantization_config",
]
