"""Reference numerics: every matrix product computed one precision wider and rounded once to its own dtype.

A bf16 GEMM's result depends on the CPU: AVX-512-BF16 kernels sum pairs of products in hardware, AVX2 kernels
widen first, and oneDNN blocks the reduction by ISA. An output lying close to a bf16 rounding midpoint then rounds
one way on one machine and the other way on the next, and a marginal top-k decision (routing, the indexer) turns
that one ulp into visibly different logits. Summing in fp32 and rounding once gives the correctly rounded bf16
product on every machine, except where the exact sum lies within the fp32 summation error of a bf16 midpoint (no
mode can settle those: which way they round depends on the order of the fp32 sum).

fp32 products are left as they are: their kernels add the products of each output in the same order on every x86
ISA (the vector width changes which outputs are computed together, not the order of one output's sum), and the
reference computes its attention scores, compressors and head in fp32 too.

Fused scaled-dot-product attention (the ViT's) is not a plain product: its CPU kernel keeps the scores in fp32,
rounds the softmax numerators to the input dtype for the PV product and divides by an fp32 sum, with vector
lengths and ``exp`` approximations that differ by ISA. The mode computes those same rounding points with
machine-independent ops instead (:func:`portable_attention`).

The mode is a :class:`~torch.overrides.TorchFunctionMode`, so it reaches every product the model runs — its own
linear layers, wrappers around them (PEFT LoRA), einsums, fused experts, the ViT's attention — without a code path
of its own in each module. Autograd differentiates through the casts, so it also works in training (slower).
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_map

WIDER_DTYPE = {torch.bfloat16: torch.float32, torch.float16: torch.float32}

MATRIX_PRODUCTS = frozenset(
    {
        F.linear, F.bilinear,
        torch.matmul, torch.mm, torch.bmm, torch.addmm, torch.baddbmm, torch.einsum,
        torch.Tensor.matmul, torch.Tensor.__matmul__, torch.Tensor.__rmatmul__, torch.Tensor.mm, torch.Tensor.bmm,
    }
    | ({torch._grouped_mm} if hasattr(torch, "_grouped_mm") else set())
)


class ReferenceNumericsMode(TorchFunctionMode):
    """Runs each matrix product of floating operands of one dtype in :data:`WIDER_DTYPE` of it and rounds the
    result once back to that dtype. Anything else (mixed dtypes, integer or FP8 operands, other ops) runs as is."""

    def __torch_function__(self, func: Callable, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention and _is_plain_attention(*args, **kwargs):
            return portable_attention(*args[:3], scale=kwargs.get("scale", args[6] if len(args) > 6 else None))
        dtype = _common_float_dtype(func, args, kwargs)
        if dtype is None:
            return func(*args, **kwargs)
        wide = WIDER_DTYPE[dtype]

        def widen(value: Any) -> Any:
            return value.to(wide) if isinstance(value, torch.Tensor) and value.dtype == dtype else value

        result = func(*tree_map(widen, args), **tree_map(widen, kwargs))
        return result.to(dtype) if isinstance(result, torch.Tensor) else result


def _common_float_dtype(func: Callable, args: tuple, kwargs: dict) -> torch.dtype | None:
    """The one floating dtype of a matrix product's tensor operands if it has a wider one, else None."""
    if func not in MATRIX_PRODUCTS or kwargs.get("out") is not None:
        return None
    leaves, _ = tree_flatten((args, kwargs))
    dtypes = {t.dtype for t in leaves if isinstance(t, torch.Tensor) and t.is_floating_point()}
    if len(dtypes) != 1:
        return None
    (dtype,) = dtypes
    return dtype if dtype in WIDER_DTYPE else None


def _is_plain_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None, enable_gqa: bool = False,
) -> bool:
    """SDPA without mask, dropout, causality or GQA, on low-precision inputs: what the ViT calls."""
    plain = attn_mask is None and dropout_p == 0.0 and not is_causal and not enable_gqa
    return plain and query.dtype in WIDER_DTYPE and query.dtype == key.dtype == value.dtype


def portable_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float | None = None
) -> torch.Tensor:
    """Softmax attention with the rounding points of torch's CPU flash kernel, computed the same way on every machine.

    [..., L, E] × [..., S, E] × [..., S, Ev] → [..., L, Ev] in the input dtype. As the kernel does for bf16/fp16: fp32
    scores, numerators from its fast exponential (:func:`flash_kernel_exp`) rounded to the input dtype for the PV
    product (accumulated in fp32), an fp32 sum of the unrounded numerators, and the product with the sum's fp32
    reciprocal rounded once. One block over all keys (the kernel's blocks of 512 keys rescale a longer row).
    """
    dtype = query.dtype
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    scores = torch.matmul(query.float(), key.float().transpose(-1, -2)) * scale
    numerators = flash_kernel_exp(scores - scores.amax(dim=-1, keepdim=True))
    denominators = numerators.double().sum(dim=-1, keepdim=True).float()
    out = torch.matmul(numerators.to(dtype).float(), value.float())
    return (out * denominators.reciprocal()).to(dtype)


FLASH_KERNEL_VECTOR = 16  # fp32 lanes of the AVX-512 build; a row's last S % 16 scores take the scalar exp
_LOG2_E = torch.tensor(math.log2(math.e), dtype=torch.float32)
_LN_FLT_MIN = math.log(torch.finfo(torch.float32).tiny)
_LN_FLT_MAX = math.log(torch.finfo(torch.float32).max)
# the kernel's degree-3 correction p(f), f = frac(x·log2 e): 2^(x·log2 e) ≈ bits(2^23 · (x·log2 e - p(f)) + 127 · 2^23)
_FAST_EXP_POLY = tuple(
    torch.tensor(c, dtype=torch.float32)
    for c in (1.0703434948458272e-4, 0.30354260500649682, -0.22433836478672356, -0.079204240219773236)
)


def flash_kernel_exp(x: torch.Tensor) -> torch.Tensor:
    """exp of fp32 ``x`` (≤ 0) as torch's CPU flash-attention kernel computes it: its fast exponential (writes
    2^(x·log2 e) straight into the fp32 bit pattern, good to a bf16 ulp) on whole vectors of
    :data:`FLASH_KERNEL_VECTOR`, and the correctly rounded exp on the remainder of each row."""
    vectorized = x.shape[-1] - x.shape[-1] % FLASH_KERNEL_VECTOR
    head, tail = x[..., :vectorized], x[..., vectorized:]
    return torch.cat([_fast_exp(head), torch.exp(tail.double()).float()], dim=-1)


def _fast_exp(x: torch.Tensor) -> torch.Tensor:
    exponent = x * _LOG2_E
    fraction = exponent - exponent.floor()
    correction = _FAST_EXP_POLY[3]
    for coefficient in (_FAST_EXP_POLY[2], _FAST_EXP_POLY[1], _FAST_EXP_POLY[0]):
        correction = _fused_multiply_add(fraction, correction, coefficient)
    bits = _fused_multiply_add(torch.tensor(2.0**23), exponent - correction, torch.tensor(127 * 2.0**23))
    result = bits.trunc().to(torch.int32).view(torch.float32)
    result = torch.where(x < _LN_FLT_MIN, torch.zeros_like(result), result)
    return torch.where(x > _LN_FLT_MAX, torch.full_like(result, math.inf), result)


def _fused_multiply_add(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """fp32 a·b + c with one rounding, as an FMA instruction: the fp64 product of two fp32 values is exact, and the
    fp64 sum rounds to fp32 the same way except for sums within 2^-29 of an fp32 midpoint."""
    return torch.addcmul(c.double(), a.double(), b.double()).float()


def reference_numerics(enabled: bool = True) -> contextlib.AbstractContextManager:
    """Context manager: reference numerics inside (a no-op when ``enabled`` is False). Nesting is harmless: the
    outer mode sees only the fp32 products the inner one makes, and leaves them alone."""
    return ReferenceNumericsMode() if enabled else contextlib.nullcontext()


Forward = TypeVar("Forward", bound=Callable[..., Any])


def under_configured_numerics(forward: Forward) -> Forward:
    """Decorates a model's ``forward``: runs it in reference numerics when ``config.reference_numerics`` is set."""

    @functools.wraps(forward)
    def wrapper(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        with reference_numerics(getattr(self.config, "reference_numerics", False)):
            return forward(self, *args, **kwargs)

    return wrapper  # type: ignore[return-value]
