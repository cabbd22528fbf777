"""Merging a LoRA adapter of a natively loaded release (FP8 Linears, FP4 experts: :mod:`~..released.native_lora`)
into the weights, with the part of the adapter's effect each merge keeps measured on a calibration batch
(docs/merging.md).

A LoRA delta is mostly below one FP8 / FP4 step: requantized into the release's storage (``base + delta`` through
the release's own quantizers, as :func:`~..released.writing.save_released_checkpoint` writes it), most of it rounds
away, and with fresh FP4 scales the merge can be farther from the adapter than the base is. PEFT's
``merge_and_unload()`` merges into bf16 copies instead (:mod:`~..released.native_lora`). :func:`measure_merge`
measures either merge, per adapted module and on the logits, as the **kept fraction** of the delta's effect::

    kept = 1 - ||y_merged - y_adapter|| / ||y_adapter - y_base||

(1: all of it kept; 0: as if there were no adapter; below 0: worse than no adapter), where ``y_base`` is the
quantized base's output, ``y_adapter`` the unmerged adapter's and ``y_merged`` the merged module's, all three on the
module's inputs of the calibration batch, in fp32 (the weight rounding alone; a Linear's difference is taken on the
weights, so no cancellation enters); the routed experts' over the experts the batch routes tokens to.
:func:`merge_into_released_storage` merges into the release's storage and refuses (or warns) where a module keeps
less than a threshold, with the numbers.
"""

from __future__ import annotations

import copy
import math
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from peft import PeftModel
from peft.tuners.lora import Linear as PeftLoraLinear
from peft.tuners.lora import LoraLayer
from peft.tuners.tuners_utils import BaseTunerLayer
from torch import nn
from transformers.integrations.finegrained_fp8 import FP8Linear

from ..codec import dequantize_released_weight, quantize_fp4_rows, quantize_fp8_block, quantize_fp8_rows
from ..moe import routed_experts_forward
from ..released.native_lora import FP8LoraLinear, ParamWrapper
from ..released.native_precision import DeepseekV41FP8Quantizer, quantization_method
from ..released.writing import released_quantizer

DEFAULT_MIN_KEPT = 0.9
INTO = ("released", "dequantized")
_TARGET = {"released": "the release storage", "dequantized": "dequantized copies (merge_and_unload())"}
ON_LOW = ("raise", "warn")
_PEFT_PREFIX = "base_model.model."
FP8_BLOCKS, FP4_ROWS = "FP8 32x32 blocks", "FP4 rows"
_STORAGE = {quantize_fp8_block: FP8_BLOCKS, quantize_fp4_rows: FP4_ROWS, quantize_fp8_rows: "FP8 rows"}
_ALTERNATIVES = (
    "merge into bf16 instead (peft_model.merge_and_unload(): the adapted modules become bf16 copies), or serve the "
    "adapter unmerged (dsv41 export --format vllm-lora)"
)


@dataclass(frozen=True)
class ModuleKept:
    """One adapted module's merge: where it is stored, and the kept fraction of the delta's effect on its output
    (None: the calibration batch never reached it), from ``effect`` = ||y_adapter - y_base|| and ``error`` =
    ||y_merged - y_adapter|| over the batch."""

    name: str
    storage: str
    kept: float | None
    effect: float
    error: float

    def describe(self) -> str:
        if self.kept is None:
            return f"{self.name} ({self.storage}): not reached by the calibration batch, its kept fraction is unknown"
        return f"{self.name} ({self.storage}): kept {self.kept:.1%} (effect {self.effect:.3g}, error {self.error:.3g})"


@dataclass(frozen=True)
class MergeReport:
    """The kept fractions of a merge (``into``: ``"released"`` or ``"dequantized"``): per adapted module, worst first,
    and on the logits of the calibration batch. ``print(report)`` shows them."""

    into: str
    modules: tuple[ModuleKept, ...]
    logits_kept: float
    logits_effect: float
    logits_error: float

    def below(self, min_kept: float) -> list[ModuleKept]:
        """The modules whose kept fraction is below ``min_kept`` or unknown, worst first."""
        return [m for m in self.modules if m.kept is None or m.kept < min_kept]

    def __str__(self) -> str:
        lines = [
            f"merge into {_TARGET[self.into]}: logits kept "
            f"{self.logits_kept:.1%} of the adapter's effect (effect {self.logits_effect:.3g}, error "
            f"{self.logits_error:.3g})"
        ]
        return "\n".join(lines + [f"  {m.describe()}" for m in self.modules])


def kept_fraction(effect: float, error: float) -> float:
    """``1 - error / effect``; an adapter without effect keeps everything (1) if the merge changes nothing too,
    and is made worse (-inf) if it changes something."""
    if effect == 0:
        return 1.0 if error == 0 else -math.inf
    return 1.0 - error / effect


# ---------------------------------------------------------------------------------------------------------------------
# the adapted modules
# ---------------------------------------------------------------------------------------------------------------------


@dataclass
class _Site:
    """One adapted module: the merged module to put in its place, and the sums of squares measured on its inputs."""

    name: str  # in the base model
    layer: nn.Module  # the outermost tuner layer
    storage: str
    merged: nn.Module
    measure: Callable[[tuple, dict], tuple[torch.Tensor, torch.Tensor]]  # inputs → (effect, error) [..., out]
    effect2: float = 0.0
    error2: float = 0.0
    has_delta: bool = True  # whether the adapter changes the module's weight at all
    calls: int = 0
    hooks: list = field(default_factory=list)

    def result(self) -> ModuleKept:
        effect, error = math.sqrt(self.effect2), math.sqrt(self.error2)
        reached = self.calls > 0 and (effect > 0 or not self.has_delta)
        return ModuleKept(self.name, self.storage, kept_fraction(effect, error) if reached else None, effect, error)


def _active(layer: LoraLayer) -> list[str]:
    return [name for name in layer.active_adapters if name in layer.lora_A]


def _with(module: nn.Module, **parameters: torch.Tensor) -> nn.Module:
    """A shallow copy of ``module`` (the same class, buffers and other parameters) holding ``parameters`` frozen."""
    new = copy.copy(module)
    new._parameters = dict(module._parameters)
    for name, tensor in parameters.items():
        setattr(new, name, nn.Parameter(tensor, requires_grad=False))
    return new


def _linear_measure(base: torch.Tensor, delta: torch.Tensor, merged: torch.Tensor):
    """A Linear's (effect, error) on input x, from its fp32 weights: x·deltaᵀ and x·(merged − base − delta)ᵀ."""
    residual = merged - base - delta

    def measure(args: tuple, kwargs: dict) -> tuple[torch.Tensor, torch.Tensor]:
        x = (args[0] if args else kwargs["x"]).float()
        return F.linear(x, delta), F.linear(x, residual)

    return measure


def _fp8_site(name: str, layer: FP8LoraLinear, into: str) -> _Site:
    base = layer.get_base_layer()
    dequantized = dequantize_released_weight(base.weight, base.weight_scale_inv, base.in_features, torch.float32)
    delta = sum(layer.get_delta_weight(a).float() for a in _active(layer))
    if into == "dequantized":
        merged = layer.unload_and_optionally_merge_module(True, False, None)
        merged_weight, storage = merged.weight.float(), str(merged.weight.dtype).removeprefix("torch.")
    else:
        weight, scale = quantize_fp8_block(dequantized + delta)
        merged, storage = _with(base, weight=weight, weight_scale_inv=scale), FP8_BLOCKS
        merged_weight = dequantize_released_weight(weight, scale, base.in_features, torch.float32)
    measure = _linear_measure(dequantized, delta, merged_weight)
    return _Site(name, layer, storage, merged, measure, has_delta=bool(delta.any()))


def _release_quantizer(name: str):
    """The quantizer :func:`~..released.writing.save_released_checkpoint` applies to our Linear ``name``'s weight (a
    Linear a native load dequantized, such as the Engram ``wkv``), or None where the release stores it as it is."""
    released = "head" if name == "lm_head" else name.removeprefix("model.")
    return released_quantizer(f"{released}.weight")


def _plain_site(name: str, layer: PeftLoraLinear, into: str) -> _Site:
    """PEFT's LoRA on a Linear the native load holds unquantized: merged in its dtype, and where the release stores
    it FP8 (the writer quantizes it on saving), in that FP8 as well."""
    base = layer.get_base_layer()
    weight = base.weight.float()
    delta = sum(layer.get_delta_weight(a).float() for a in _active(layer))
    merged_weight, storage = weight + delta, str(base.weight.dtype).removeprefix("torch.")
    quantize = _release_quantizer(name) if into == "released" else None
    if quantize is not None:  # held dequantized, written quantized: what a save and load give back
        stored, scale = quantize(merged_weight)
        merged_weight = dequantize_released_weight(stored, scale, weight.shape[1], torch.float32)
        storage = _STORAGE[quantize]
    held = merged_weight.to(base.weight.dtype)
    measure = _linear_measure(weight, delta, held.float())
    return _Site(name, layer, storage, _with(base, weight=held), measure, has_delta=bool(delta.any()))


def _experts_site(name: str, layer: ParamWrapper, into: str) -> _Site:
    """Our LoRA of the FP4 experts (one wrapper per adapted tensor, nested), merged expert by expert."""
    wrappers, experts = {}, layer
    while isinstance(experts, ParamWrapper):
        wrappers[experts.parameter_name] = experts
        experts = experts.base_layer
    num_experts = experts.gate_up_proj.shape[0]

    def dequantized(tensors: Mapping[str, torch.Tensor], weight: str, expert: int) -> torch.Tensor:
        packed, scale = tensors[weight][expert], tensors[f"{weight}_scale_inv"][expert]
        return dequantize_released_weight(packed, scale, 2 * packed.shape[-1], torch.float32)

    base = {
        n: getattr(experts, n) for n in ("gate_up_proj", "gate_up_proj_scale_inv", "down_proj", "down_proj_scale_inv")
    }
    adapt = {n: w._merged(_active(w)) for n, w in wrappers.items()}
    if into == "dequantized":
        merged = layer.unload_and_optionally_merge_module(True, False, None)

        def merged_weight(weight: str, expert: int) -> torch.Tensor:
            return getattr(merged, weight)[expert].float()

        storage = str(merged.gate_up_proj.dtype).removeprefix("torch.")
    else:
        stored = {}
        for weight in adapt:
            pairs = [quantize_fp4_rows(adapt[weight](e, dequantized(base, weight, e))) for e in range(num_experts)]
            stored[weight] = torch.stack([p for p, _ in pairs])
            stored[f"{weight}_scale_inv"] = torch.stack([s for _, s in pairs])
        merged, storage, held = _with(experts, **stored), FP4_ROWS, {**base, **stored}

        def merged_weight(weight: str, expert: int) -> torch.Tensor:
            return dequantized(held, weight, expert)

    def weights(kind: str) -> Callable[[int], tuple[torch.Tensor, torch.Tensor]]:
        def expert_weights(expert: int) -> tuple[torch.Tensor, torch.Tensor]:
            out = []
            for weight in ("gate_up_proj", "down_proj"):
                if kind == "merged":
                    out.append(merged_weight(weight, expert))
                    continue
                dense = dequantized(base, weight, expert)
                out.append(adapt[weight](expert, dense) if kind == "adapter" and weight in adapt else dense)
            return tuple(out)

        return expert_weights

    def measure(args: tuple, kwargs: dict) -> tuple[torch.Tensor, torch.Tensor]:
        names = ("hidden_states", "top_k_index", "top_k_weights")
        hidden, index, routing = (*args, *(kwargs[n] for n in names[len(args) :]))[:3]
        limit = experts.limit or 0.0
        y = {
            kind: routed_experts_forward(hidden.float(), index, routing.float(), num_experts, limit, weights(kind))
            for kind in ("base", "adapter", "merged")
        }
        return y["adapter"] - y["base"], y["merged"] - y["adapter"]

    has_delta = any(
        w.lora_A[a].weight.any() and w.lora_B[a].weight.any() for w in wrappers.values() for a in _active(w)
    )
    return _Site(name, layer, storage, merged, measure, has_delta=has_delta)


def _plain_linear(module: nn.Module) -> bool:
    """An unquantized Linear (ours subclass ``nn.Linear``, e.g. the fp32 compressor projections)."""
    return isinstance(module, nn.Linear) and not isinstance(module, FP8Linear) and module.weight.is_floating_point()


def _sites(peft_model: PeftModel, into: str) -> list[_Site]:
    sites = []
    for module_name, module in peft_model.named_modules():
        if not isinstance(module, BaseTunerLayer) or module_name.endswith(".base_layer"):
            continue  # an inner expert wrapper is merged with its outer one
        name = module_name.removeprefix(_PEFT_PREFIX)
        if isinstance(module, FP8LoraLinear):
            sites.append(_fp8_site(name, module, into))
        elif isinstance(module, ParamWrapper):
            sites.append(_experts_site(name, module, into))
        elif type(module) is PeftLoraLinear and _plain_linear(module.get_base_layer()):
            sites.append(_plain_site(name, module, into))
        else:
            raise ValueError(
                f"{name} is adapted by a {type(module).__name__} on a {type(module.get_base_layer()).__name__}: this "
                f"merge takes LoRA on Linears and on the routed experts only; {_ALTERNATIVES}"
            )
    if not sites:
        raise ValueError("the PeftModel has no active LoRA layers: nothing to merge")
    return sites


# ---------------------------------------------------------------------------------------------------------------------
# checks
# ---------------------------------------------------------------------------------------------------------------------


def _check_model(peft_model: PeftModel) -> None:
    if not isinstance(peft_model, PeftModel):
        raise TypeError(
            f"expected a PEFT model (peft.PeftModel, from get_peft_model or PeftModel.from_pretrained), got "
            f"{type(peft_model).__name__}"
        )
    for adapter in peft_model.active_adapters:
        config = peft_model.peft_config[adapter]
        peft_type = str(getattr(config.peft_type, "value", config.peft_type))
        if peft_type != "LORA":
            raise ValueError(f"adapter {adapter!r} is {peft_type}: this merge takes LoRA adapters only")
        if config.use_dora:
            raise ValueError(
                f"adapter {adapter!r} is DoRA (use_dora=True): its magnitude vector rescales whole weight columns, "
                "which this merge does not fold in; merge it with merge_and_unload() on a bf16 base"
            )
        if config.lora_bias:
            raise ValueError(f"adapter {adapter!r} has LoRA biases (lora_bias=True), which the release does not store")
        if config.modules_to_save:
            raise ValueError(
                f"adapter {adapter!r} trains whole modules (modules_to_save={config.modules_to_save}): this merge "
                "merges LoRA factors only; use merge_and_unload()"
            )
    base = peft_model.get_base_model()
    quantizer = getattr(base, "hf_quantizer", None)
    if quantization_method(getattr(base, "config", None)) == "bitsandbytes":
        raise ValueError(
            "the base is bitsandbytes-quantized (NF4 / int8), not the release's FP8 / FP4 storage: merge_and_unload() "
            "on it, or load the released folder natively (from_pretrained) and this adapter onto it"
        )
    if not isinstance(quantizer, DeepseekV41FP8Quantizer):
        raise ValueError(
            f"the base ({type(base).__name__}) is not a natively loaded release (FP8 Linears, FP4 experts): its "
            "weights are plain, and merge_and_unload() merges into them. To merge into the release's storage, "
            "load the released folder with from_pretrained (kept in FP8 / FP4) and this adapter onto it"
        )


def _calibration_kwargs(calibration) -> dict:
    """The calibration batch as forward keyword arguments: input ids [B, S] or a mapping (``BatchEncoding``)."""
    if isinstance(calibration, torch.Tensor):
        calibration = {"input_ids": calibration}
    if not isinstance(calibration, Mapping):
        raise TypeError(
            f"the calibration batch is input ids (a tensor) or a mapping of forward inputs, got {type(calibration)}"
        )
    inputs = calibration.get("input_ids", calibration.get("inputs_embeds"))
    if not isinstance(inputs, torch.Tensor) or inputs.numel() == 0:
        raise ValueError("the calibration batch is empty: give input ids (or inputs_embeds) of at least one token")
    return dict(calibration)


def _check_threshold(min_kept: float, on_low: str) -> None:
    if isinstance(min_kept, bool) or not isinstance(min_kept, (int, float)) or not 0.0 <= min_kept <= 1.0:
        raise ValueError(f"min_kept is a fraction of the adapter's effect, in [0, 1]: got {min_kept!r}")
    if on_low not in ON_LOW:
        raise ValueError(f"on_low is one of {ON_LOW}: got {on_low!r}")


# ---------------------------------------------------------------------------------------------------------------------
# measuring and merging
# ---------------------------------------------------------------------------------------------------------------------


def _swap(peft_model: PeftModel, sites: list[_Site], merged: bool) -> None:
    """Put each site's merged module (or its tuner layer back) in the tuner layer's place."""
    for site in sites:
        parent, _, leaf = (_PEFT_PREFIX + site.name).rpartition(".")
        setattr(peft_model.get_submodule(parent), leaf, site.merged if merged else site.layer)


def _measure(peft_model: PeftModel, calibration, into: str) -> tuple[MergeReport, list[_Site]]:
    _check_model(peft_model)
    if into not in INTO:
        raise ValueError(f"into is one of {INTO}: got {into!r}")
    inputs = _calibration_kwargs(calibration)
    training = peft_model.training
    peft_model.eval()  # no LoRA dropout
    try:
        with torch.no_grad():
            sites = _sites(peft_model, into)
            for site in sites:

                def hook(module, args, kwargs, site=site):
                    effect, error = site.measure(args, kwargs)
                    site.effect2 += effect.double().pow(2).sum().item()
                    site.error2 += error.double().pow(2).sum().item()
                    site.calls += 1

                site.hooks.append(site.layer.register_forward_pre_hook(hook, with_kwargs=True))
            try:
                adapter = peft_model(**inputs).logits.float()
            finally:
                for site in sites:
                    for handle in site.hooks:
                        handle.remove()
            with peft_model.disable_adapter():
                base = peft_model(**inputs).logits.float()
            _swap(peft_model, sites, merged=True)
            try:
                merged = peft_model(**inputs).logits.float()
            finally:
                _swap(peft_model, sites, merged=False)
    finally:
        peft_model.train(training)
    effect, error = (adapter - base).double().norm().item(), (merged - adapter).double().norm().item()
    modules = sorted((s.result() for s in sites), key=lambda m: -math.inf if m.kept is None else m.kept)
    return MergeReport(into, tuple(modules), kept_fraction(effect, error), effect, error), sites


def measure_merge(peft_model: PeftModel, calibration, into: str = "released") -> MergeReport:
    """The kept fractions of merging ``peft_model``'s active LoRA adapter(s) (on a natively loaded release) into
    ``into``: ``"released"``, the release's storage (:func:`merge_into_released_storage`), or ``"dequantized"``,
    the copies in the model's dtype of ``merge_and_unload()``; measured on ``calibration`` (input ids [B, S] or a
    mapping of forward inputs). Leaves the model as it was."""
    return _measure(peft_model, calibration, into)[0]


def merge_into_released_storage(
    peft_model: PeftModel, calibration, *, min_kept: float = DEFAULT_MIN_KEPT, on_low: str = "raise"
) -> nn.Module:
    """The base model of ``peft_model`` (a LoRA on a natively loaded release) with its active adapter(s) merged
    into the release's storage: each adapted FP8 Linear holds FP8 32x32 blocks of base + delta, the adapted FP4
    experts FP4 rows (the release's quantizers, fresh scales, as ``save_released_checkpoint`` writes them), a
    Linear the native load holds in bf16 the merge in its dtype (in FP8 where the release stores it so).

    Measured first on ``calibration`` (:func:`measure_merge`): where a module keeps less than ``min_kept`` (in
    [0, 1]) of the adapter's effect, or the batch did not reach its delta, raises ValueError with the numbers and
    leaves the PEFT model as it was (``on_low="raise"``), or warns and merges (``on_low="warn"``). The logits' kept
    fraction is reported, not checked: it also holds the model's own rounding and the top-k choices that rounding
    flips (a bf16 merge's, a noise floor, is far below 1 on small deltas). The report is the returned model's
    ``merge_report``. Like ``merge_and_unload()``, consumes the PEFT model."""
    _check_threshold(min_kept, on_low)
    report, sites = _measure(peft_model, calibration, "released")
    low = report.below(min_kept)
    if low:
        message = (
            f"merging the adapter into the release's FP8 / FP4 storage keeps less than min_kept={min_kept:g} of its "
            f"effect in {len(low)} of {len(report.modules)} adapted modules, worst: "
            + "; ".join(m.describe() for m in low[:5])
            + f" (on the calibration logits: kept {report.logits_kept:.1%}). Most of a LoRA delta is below one "
            f"FP8 / FP4 step and rounds away: {_ALTERNATIVES}"
        )
        if on_low == "raise":
            raise ValueError(message + "; or pass on_low='warn' to merge anyway")
        warnings.warn(message, stacklevel=2)
    _swap(peft_model, sites, merged=True)
    model = peft_model.unload()
    model.merge_report = report
    return model


__all__ = [
    "DEFAULT_MIN_KEPT",
    "MergeReport",
    "ModuleKept",
    "kept_fraction",
    "measure_merge",
    "merge_into_released_storage",
]
