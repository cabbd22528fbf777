"""PEFT LoRA on a natively loaded model (:mod:`.native_precision`): expert adapters of the logical shape on the packed
FP4 experts (and on bitsandbytes' experts, :mod:`~modeling_dsv41.bnb_experts`), and merging into dequantized copies.

PEFT builds a ``target_parameters`` adapter (``lora.ParamWrapper``) from the shape of the parameter it targets and
applies it as a parametrization of that parameter. On the natively loaded experts the parameter is packed FP4 bytes
``[E, out, in/2]`` (int8): the factors would have half the input width and their delta would be cast to int8 and
dropped. :func:`install_peft_dispatch` makes PEFT build, for the released FP4 experts, :class:`ParamWrapper`
instead: PEFT's class with the factors of the logical per-expert shape ``[out, in]`` (the same shapes and state-dict
keys as on the bf16 :class:`~modeling_dsv41.moe.DeepseekV41Experts`, so adapters move between the two bases), whose
forward adds each adapter's delta to the output of every expert tokens are routed to, ``x·Wᵀ + s·(x·Aᵀ)·Bᵀ``
(:func:`~.native_precision.fp4_experts_forward`): exact gradients to the factors and the input, and neither an
expert stack nor a dequantized expert kept for the backward (PEFT's wrapper on the bf16 experts builds the whole
``[E, out, in]`` delta in every forward). Where transformers' FP4 kernels run, adapted experts run that weight-only
computation too (the kernels take no delta).

Merging: ``merge_and_unload()`` cannot fold a delta into FP8 / FP4 storage without rounding it away (most LoRA
deltas are far below one quantization step). An adapted module is merged into a dequantized copy instead: an FP8
Linear becomes an ``nn.Linear``, the FP4 experts ``DeepseekV41Experts``, each holding dequantized base +
delta, in the model's compute dtype (the ``dtype`` it was loaded in: bf16 by default, fp32 with
``dtype=torch.float32``); the modules without adapters stay quantized. In-place merging (``merge_adapter()``) is
refused.
"""

from __future__ import annotations

import torch
from peft.tuners.lora import Linear as LoraLinear
from peft.tuners.lora import LoraModel
from peft.tuners.lora import ParamWrapper as PeftParamWrapper
from peft.tuners.tuners_utils import BaseTunerLayer, check_adapters_to_merge
from torch import nn
from transformers.integrations.finegrained_fp8 import FP8Experts, FP8Linear

from ..bnb_experts import BnbExperts
from ..moe import DeepseekV41Experts
from ..codec import RELEASED_BLOCK_SIZE, dequantize_released_weight
from .native_precision import FP4KernelExperts, WeightOnlyFP4Experts, fp4_experts_forward

_IN_PLACE_MERGE = (
    "merging a LoRA adapter in place into FP8 / FP4 weights would round its delta away (most of it is below one "
    "quantization step). Call merge_and_unload(): it merges each adapted module of a natively loaded model into a "
    "dequantized copy in the model's compute dtype."
)


def merged_dtype(base: nn.Module) -> torch.dtype:
    """The dtype ``merge_and_unload()``'s copy of the quantized ``base`` holds: the model's compute dtype (the
    ``dtype`` it was loaded in), which the module's inputs have, so that the merged model runs as the adapter did.
    Natively loaded FP8 / FP4 modules carry it from the loader (``model_dtype``), bitsandbytes' experts in their
    config."""
    dtype = base.config.dtype if isinstance(base, BnbExperts) else getattr(base, "model_dtype", None)
    if not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise ValueError(
            f"cannot tell the compute dtype of the model around this {type(base).__name__} (got {dtype!r}): merging "
            "needs a model loaded with from_pretrained, whose loader records it"
        )
    return dtype


def _is_released_fp4(experts: nn.Module) -> bool:
    """Transformers' ``FP8Experts`` holding the release's packed FP4 experts with E8M0 scales."""
    return (
        isinstance(experts, FP8Experts)
        and getattr(experts, "gate_up_proj", None) is not None
        and experts.gate_up_proj.dtype == torch.int8
        and experts.gate_up_proj_scale_inv.dtype == torch.float8_e8m0fnu
    )


def _is_released_fp8(linear: nn.Module) -> bool:
    """Transformers' ``FP8Linear`` holding a released FP8 weight (E8M0 scales, 32x32 blocks)."""
    return (
        isinstance(linear, FP8Linear)
        and linear.weight_scale_inv.dtype == torch.float8_e8m0fnu
        and tuple(linear.block_size or ()) == (RELEASED_BLOCK_SIZE, RELEASED_BLOCK_SIZE)
    )


class ParamWrapper(PeftParamWrapper):
    """PEFT's ``lora.ParamWrapper`` for the released FP4 experts: factors of the logical per-expert shape, applied to
    the dequantized weights of the routed experts. Named as PEFT's class: PEFT recognizes the wrapper of experts
    already adapted on their other parameter by class name.

    One wrapper adapts one of ``gate_up_proj`` / ``down_proj``; adapting both nests two wrappers, and the outer one
    hands its adapter down to the inner one, which runs the experts with both."""

    def _get_in_out_features(self, module: nn.Module) -> tuple[int, int]:
        # PEFT's reading of a 3-D parameter (experts, in, out), swapped in `update_layer` to the experts' own
        # [out, in]: here from the logical shape, two FP4 codes per stored byte (bitsandbytes' experts say theirs)
        num_experts, rows, columns = _logical_shape(self.get_base_layer(), self.parameter_name)
        self.num_experts, self._param_ndim = num_experts, 3
        return rows, columns

    def _factors(self, adapter_names: list[str]):
        """expert e → the named adapters' factors of it, [(lora_A [r, in], lora_B [out, r], scaling), ...], applied to
        the output by the forward (:class:`~.native_precision.FrozenExpertWeight`)."""

        def factors(expert: int) -> list[tuple[torch.Tensor, torch.Tensor, float]]:
            return [
                (
                    self.lora_A[name].weight.view(self.num_experts, -1, self.in_features)[expert],
                    self.lora_B[name].weight.view(self.out_features, -1, self.num_experts)[..., expert],
                    self.scaling[name],
                )
                for name in adapter_names
            ]

        return factors

    def _merged(self, adapter_names: list[str]):
        """expert e, its dequantized weight [out, in] → the weight plus every named adapter's delta
        ``scaling · B_e A_e``, summed in fp32 and rounded to the weight's dtype once, for merging."""
        factors = self._factors(adapter_names)

        def merge(expert: int, weight: torch.Tensor) -> torch.Tensor:
            merged = weight.float()
            for lora_a, lora_b, scaling in factors(expert):
                merged = torch.addmm(merged, lora_b.float(), lora_a.float(), alpha=scaling)
            return merged.to(weight.dtype)

        return merge

    def _active(self) -> list[str]:
        return [] if self.disable_adapters else [name for name in self.active_adapters if name in self.lora_A]

    def forward(
        self, hidden_states: torch.Tensor, *args, expert_adapters: dict | None = None, **kwargs
    ) -> torch.Tensor:
        """hidden_states [N, D], top_k_index / top_k_weights [N, k] → fp32 [N, D]; ``expert_adapters``: those of the
        wrappers around this one."""
        self._check_forward_args(hidden_states, *args, **kwargs)
        adapters = dict(expert_adapters or {})
        active = self._active()
        if active:
            adapters[self.parameter_name] = self._factors(active)
        if isinstance(self.base_layer, ParamWrapper):
            return self.base_layer(hidden_states, *args, expert_adapters=adapters, **kwargs)
        if not adapters:  # adapters disabled: the experts' own forward (the FP4 kernels where they run)
            return self.base_layer(hidden_states, *args, **kwargs)
        if isinstance(self.base_layer, (WeightOnlyFP4Experts, FP4KernelExperts, BnbExperts)):  # its hooks run
            return self.base_layer(hidden_states, *args, adapters=adapters, **kwargs)
        return fp4_experts_forward(self.base_layer, hidden_states, *args, adapters=adapters, **kwargs)

    def merge(self, safe_merge: bool = False, adapter_names: list[str] | None = None) -> None:
        raise ValueError(_IN_PLACE_MERGE)

    def unload_and_optionally_merge_module(
        self, merge: bool, safe_merge: bool, adapter_names: list[str] | None
    ) -> nn.Module:
        """The FP4 experts (``merge=False``), or :class:`DeepseekV41Experts` in the model's compute dtype
        (:func:`merged_dtype`) holding every expert's dequantized weights plus the deltas of this wrapper and those it
        wraps: computed as the adapted forward computes them."""
        experts = self.get_base_layer()
        if not merge:
            return experts
        wrappers, layer = {}, self
        while isinstance(layer, ParamWrapper):
            wrappers[layer.parameter_name] = layer
            layer = layer.base_layer
        dtype = merged_dtype(experts)
        with torch.device("meta"):
            merged = DeepseekV41Experts(experts.config, experts.num_experts)
        for name in ("gate_up_proj", "down_proj"):
            adapt = None
            if name in wrappers:
                adapt = wrappers[name]._merged(check_adapters_to_merge(wrappers[name], adapter_names))
            shape = _logical_shape(experts, name)
            weight = torch.empty(shape, dtype=dtype, device=getattr(experts, name).device)
            with torch.no_grad():
                for expert in range(shape[0]):
                    dequantized = _dequantized_expert(experts, name, expert, dtype)
                    weight[expert] = dequantized if adapt is None else adapt(expert, dequantized)
            if safe_merge and not torch.isfinite(weight).all():
                raise ValueError(f"NaNs or infinities in the merged {name}: the adapter seems to be broken")
            setattr(merged, name, nn.Parameter(weight, requires_grad=False))
        return merged


def _logical_shape(experts: nn.Module, name: str) -> tuple[int, int, int]:
    """[E, out, in] of the weight ``name`` of released FP4 (two codes per stored byte) or bitsandbytes ``experts``."""
    if isinstance(experts, BnbExperts):
        return experts.weight_shape(name)
    num_experts, rows, packed_columns = getattr(experts, name).shape
    return num_experts, rows, 2 * packed_columns


def _dequantized_expert(experts: nn.Module, name: str, expert: int, dtype: torch.dtype) -> torch.Tensor:
    """Expert ``expert``'s weight ``name`` [out, in] of released FP4 or bitsandbytes ``experts``, in ``dtype``."""
    if isinstance(experts, BnbExperts):
        return experts.dequantize(name, expert, dtype=dtype)
    packed, scales = getattr(experts, name), getattr(experts, f"{name}_scale_inv")
    return dequantize_released_weight(packed[expert], scales[expert], 2 * packed.shape[-1], dtype)


class FP8LoraLinear(LoraLinear):
    """PEFT's ``lora.Linear`` on a released FP8 Linear, whose ``merge_and_unload`` gives an ``nn.Linear`` in the
    model's compute dtype (:func:`merged_dtype`; the dequantized weight plus the delta, summed in fp32) instead of
    adding the delta to the FP8 bytes."""

    def merge(self, safe_merge: bool = False, adapter_names: list[str] | None = None) -> None:
        raise ValueError(_IN_PLACE_MERGE)

    def unload_and_optionally_merge_module(
        self, merge: bool, safe_merge: bool, adapter_names: list[str] | None
    ) -> nn.Module:
        base = self.get_base_layer()
        if not merge:
            return base
        dtype = merged_dtype(base)
        with torch.no_grad():
            weight = dequantize_released_weight(base.weight, base.weight_scale_inv, base.in_features, torch.float32)
            for name in check_adapters_to_merge(self, adapter_names):
                if name in self.lora_A:
                    weight += self.get_delta_weight(name).float()
            if safe_merge and not torch.isfinite(weight).all():
                raise ValueError("NaNs or infinities in a merged Linear: the adapter seems to be broken")
            merged = nn.Linear(base.in_features, base.out_features, bias=base.bias is not None, device="meta")
            merged.weight = nn.Parameter(weight.to(dtype), requires_grad=False)
            if base.bias is not None:
                merged.bias = nn.Parameter(base.bias.detach().to(dtype), requires_grad=False)
        return merged


def _native_lora_module(
    target: nn.Module, adapter_name: str, lora_config, parameter_name: str | None = None, **kwargs
):
    """Our LoRA layer for a released FP8 Linear or FP4 experts, None for any other target."""
    base = target.get_base_layer() if isinstance(target, BaseTunerLayer) else target
    if parameter_name is not None and (_is_released_fp4(base) or isinstance(base, BnbExperts)):
        return ParamWrapper(target, adapter_name, parameter_name=parameter_name, config=lora_config, **kwargs)
    if parameter_name is None and _is_released_fp8(base):
        return FP8LoraLinear(target, adapter_name, config=lora_config, **kwargs)
    return None


def install_peft_dispatch() -> None:
    """Make PEFT's LoRA build our layers for the released FP8 Linears and FP4 experts (:func:`_native_lora_module`)
    ahead of its own dispatch, so that a plain ``LoraConfig`` (``get_peft_model``, ``PeftModel.from_pretrained``)
    adapts a natively loaded model as it adapts the bf16 one. Idempotent; every other target keeps PEFT's dispatch."""
    create = LoraModel._create_new_module
    if getattr(create, "dispatches_released_precision", False):
        return

    def _create_new_module(lora_config, adapter_name, target, **kwargs):
        module = _native_lora_module(target, adapter_name, lora_config, **kwargs)
        return module if module is not None else create(lora_config, adapter_name, target, **kwargs)

    _create_new_module.dispatches_released_precision = True
    LoraModel._create_new_module = staticmethod(_create_new_module)


__all__ = ["FP8LoraLinear", "ParamWrapper", "install_peft_dispatch", "merged_dtype"]
