"""The released model's FP8 / FP4 products computed as DeepSeek's reference computes them, in reference numerics.

The reference holds the Linears the release stores in FP8 (and the FP4 routed experts) as stored and multiplies by
them with ``fp8_gemm`` / ``fp4_gemm``, which take an FP8 input: its ``linear`` quantizes the activation first, and the
kernels sum one 32-wide block of K at a time in fp32 (:func:`~modeling_dsv41.codec.fp8_gemm_linear`). Held in bf16
(DeepSeek's convert step dequantizing every weight, or ours on load), the same weights are plain bf16 products.

A model loaded in the release's native storage (:mod:`.native_precision`) reproduces the first build: its FP8 / FP4
modules, and the Linears the release stores in FP8 that it dequantizes on load (Engram ``wkv``:
:class:`DequantizedFP8Linear`), compute as the reference's kernels when :func:`emulates_reference_gemms`, that is in
reference numerics with the config's ``emulate_quantization`` (recorded on each module at load,
:func:`record_reference_gemms`). Outside reference numerics they compute as before.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import torch
from torch import nn

from ..codec import dequantize_released_weight, fp8_gemm_linear
from ..numerics import reference_numerics_active

# our Linears the release stores in FP8 that the native load dequantizes, and the reference multiplies by in FP8
# (the block-diagonal `wo_a` is not one: the reference holds it in bf16)
_DEQUANTIZED_FP8_LINEAR = re.compile(r"(^|\.)(layers|mtp)\.\d+\.engram\.wkv$")


def emulates_reference_gemms(module: nn.Module) -> bool:
    """Whether the natively loaded ``module`` computes its products as the reference's ``fp8_gemm`` / ``fp4_gemm``
    (the input quantized to FP8 too): in reference numerics, where the config's ``emulate_quantization`` was on at
    load."""
    return getattr(module, "reference_gemms", False) and reference_numerics_active()


def reference_gemm_product(
    weight: torch.Tensor, scale: torch.Tensor, columns: int, bias: torch.Tensor | None = None
) -> Callable[[torch.Tensor], torch.Tensor]:
    """``x ↦ x @ Wᵀ (+ bias)`` for the stored ``weight`` / ``scale`` (FP8 or packed FP4 of width ``columns``) as the
    reference's ``fp8_gemm`` / ``fp4_gemm`` compute it (:func:`~modeling_dsv41.codec.fp8_gemm_linear`)."""

    def product(x: torch.Tensor) -> torch.Tensor:
        out = fp8_gemm_linear(x, dequantize_released_weight(weight, scale, columns, torch.float32))
        return out if bias is None else out + bias

    return product


class DequantizedFP8Linear(nn.Linear):
    """A Linear the release stores in FP8 and the native load holds dequantized (the model reads its weight's dtype),
    computing as the reference's ``fp8_gemm`` where :func:`emulates_reference_gemms` (the dequantized weight holds
    the stored values exactly)."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if not emulates_reference_gemms(self):
            return super().forward(input)
        out = fp8_gemm_linear(input, self.weight)
        return out if self.bias is None else out + self.bias


def record_reference_gemms(model: nn.Module, quantized: tuple[type, ...]) -> None:
    """After a native load: record the config's ``emulate_quantization`` on the ``quantized`` modules and on the
    Linears the release stores in FP8 that were dequantized (which become :class:`DequantizedFP8Linear`)."""
    emulate = model.config.get_text_config().emulate_quantization
    for name, module in model.named_modules():
        if type(module) is nn.Linear and _DEQUANTIZED_FP8_LINEAR.search(name):
            module.__class__ = DequantizedFP8Linear
        if isinstance(module, (*quantized, DequantizedFP8Linear)):
            module.reference_gemms = emulate


__all__ = ["DequantizedFP8Linear", "emulates_reference_gemms", "record_reference_gemms", "reference_gemm_product"]
