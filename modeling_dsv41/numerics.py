"""Reference numerics: every matrix product and every reduction or transcendental op computed in fp64 and rounded
once to its own dtype, so that results are the same bits on every CPU.

The last bits of a floating-point op depend on the machine in three ways:

- GEMMs: bf16 kernels sum pairs of products in hardware (AVX-512-BF16, AMX) or widen first (AVX2); fp32 GEMMs go to
  MKL, which picks its kernel, and so the order in which each output is summed, by CPU vendor and instruction set
  (``MKL_CBWR`` selects another path on one machine: 3021 of 3648 fp32 outputs of a 57×2304×64 product change).
- Reductions: ATen's vectorized sums (softmax, RMSNorm means, Sinkhorn normalisations) accumulate in lanes whose
  number depends on the ISA, and its scalar kernels in another order again.
- Transcendentals: ``exp``, ``sigmoid``, ``cos``... come from vector libraries (Sleef, MKL VML) or libm by ISA, and
  differ by an ulp here and there. So does ``sqrt``, which ATen also takes from MKL's vector math for fp32 and fp64:
  IEEE 754 defines it correctly rounded, MKL's code paths are not always (through the Engram gate's signed root and
  the router's ``sqrt(softplus)``, MKL's AVX-512 path on an Intel CPU and its path on an AMD one gave image-prompt
  logits 0.12 apart).

A few outputs then round the other way, and FP8 block scales (a power of two of a block's amax), the 8 FP4 levels and
the top-k decisions of the router and the indexer turn one ulp into visibly different logits. In fp64, the order of
a sum and the last bit of an ``exp`` change the result by an fp64 ulp or so; rounding that once to bf16 or fp32 gives
the same bits on every machine, except for values within that error of a rounding midpoint (about 2^-29 of them).

Fused scaled-dot-product attention (the ViT's) is not a plain product: its CPU kernel keeps the scores in fp32,
rounds the softmax numerators to the input dtype for the PV product and divides by an fp32 sum, with vector
lengths and ``exp`` approximations that differ by ISA. The mode computes those same rounding points with
machine-independent ops instead (:func:`portable_attention`).

The mode is a :class:`~torch.overrides.TorchFunctionMode`, so it reaches every op the model runs — its own layers,
wrappers around them (PEFT LoRA), einsums, fused experts, the ViT's attention — and DeepSeek's reference code run
inside it, without a code path of its own in each module. Autograd differentiates through the casts, so it also
works in training (slower). ``sqrt`` is computed correctly rounded (:func:`correctly_rounded_sqrt`). Ops left alone
are exact in any order: elementwise ``+ - * /``, comparisons, ``max``/``topk``, casts and indexing.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode, _get_current_function_mode_stack
from torch.utils._pytree import tree_flatten, tree_map

WIDE = {
    torch.bfloat16: torch.float64,
    torch.float16: torch.float64,
    torch.float32: torch.float64,
    torch.complex64: torch.complex128,
}
ROUNDED_DTYPES = frozenset(WIDE)

_T = torch.Tensor
MATRIX_PRODUCTS = frozenset(
    {
        F.linear,
        F.bilinear,
        torch.matmul,
        torch.mm,
        torch.bmm,
        torch.mv,
        torch.dot,
        torch.inner,
        torch.tensordot,
        torch.einsum,
        torch.addmm,
        torch.addbmm,
        torch.baddbmm,
        torch.addmv,
        _T.matmul,
        _T.__matmul__,
        _T.__rmatmul__,
        _T.mm,
        _T.bmm,
        _T.mv,
        _T.dot,
        _T.addmm,
        _T.baddbmm,
        torch.cdist,
        F.conv1d,
        F.conv2d,
        F.conv3d,  # MKL's / oneDNN's products inside
    }
    | ({torch._grouped_mm} if hasattr(torch, "_grouped_mm") else set())
)
REDUCTIONS = frozenset(
    {
        torch.sum,
        torch.nansum,
        torch.mean,
        torch.prod,
        torch.cumsum,
        torch.logsumexp,
        torch.var,
        torch.std,
        torch.var_mean,
        torch.norm,
        torch.linalg.vector_norm,
        torch.softmax,
        torch.log_softmax,
        _T.sum,
        _T.nansum,
        _T.mean,
        _T.prod,
        _T.cumsum,
        _T.logsumexp,
        _T.var,
        _T.std,
        _T.norm,
        _T.softmax,
        _T.log_softmax,
        F.softmax,
        F.log_softmax,
        F.rms_norm,
        F.layer_norm,
        F.group_norm,
        F.normalize,
    }
)
TRANSCENDENTALS = frozenset(
    {
        torch.exp,
        torch.exp2,
        torch.expm1,
        torch.log,
        torch.log2,
        torch.log1p,
        torch.sigmoid,
        torch.tanh,
        torch.sin,
        torch.cos,
        torch.rsqrt,
        torch.pow,
        torch.erf,
        torch.polar,
        _T.exp,
        _T.exp2,
        _T.expm1,
        _T.log,
        _T.log2,
        _T.log1p,
        _T.sigmoid,
        _T.tanh,
        _T.sin,
        _T.cos,
        _T.rsqrt,
        _T.pow,
        _T.__pow__,
        _T.__rpow__,
        _T.erf,
        _T.exp_,
        _T.log_,
        _T.sigmoid_,
        _T.tanh_,
        _T.sin_,
        _T.cos_,
        _T.rsqrt_,
        _T.pow_,
        F.silu,
        F.gelu,
        F.softplus,
        F.sigmoid,
        F.tanh,
        F.logsigmoid,
        F.elu,
        F.mish,
        torch.tan,
        torch.atan,
        torch.atan2,
        torch.asin,
        torch.acos,
        torch.sinh,
        torch.cosh,
        torch.asinh,
        torch.acosh,
        torch.atanh,
        torch.log10,
        torch.erfc,
        torch.erfinv,
        torch.lgamma,
        torch.digamma,
        torch.hypot,
        torch.logaddexp,
        torch.logaddexp2,
        _T.tan,
        _T.atan,
        _T.atan2,
        _T.asin,
        _T.acos,
        _T.sinh,
        _T.cosh,
        _T.asinh,
        _T.acosh,
        _T.atanh,
        _T.log10,
        _T.erfc,
        _T.erfinv,
        _T.lgamma,
        _T.digamma,
        _T.hypot,
        _T.logaddexp,
        _T.logaddexp2,
        F.selu,
        F.celu,
        F.glu,
    }
)
# vector code fuses their last multiply and add (one rounding), scalar kernels do not: run as separate fp64 steps
FUSED_MULTIPLY_ADDS = frozenset(
    {torch.addcmul, torch.addcdiv, torch.lerp, _T.addcmul, _T.addcdiv, _T.lerp, _T.addcmul_, _T.addcdiv_, _T.lerp_}
)
# complex products (RoPE's rotation) are vector code with their own rounding per ISA; real ones are exact
COMPLEX_PRODUCTS = frozenset({torch.mul, _T.mul, _T.__mul__, _T.__rmul__})
# ATen takes fp32 and fp64 sqrt from MKL's vector math, whose last bit follows MKL's code path: correctly rounded here
SQUARE_ROOTS = frozenset({torch.sqrt, _T.sqrt, _T.sqrt_})
WIDENED = MATRIX_PRODUCTS | REDUCTIONS | TRANSCENDENTALS | FUSED_MULTIPLY_ADDS | COMPLEX_PRODUCTS | SQUARE_ROOTS


class ReferenceNumericsMode(TorchFunctionMode):
    """Runs each matrix product, reduction, transcendental op, fused multiply-add and complex product of
    bf16/fp16/fp32 (complex64) operands in fp64 (complex128) and rounds the result once to the dtype the op would have
    returned; square roots are correctly rounded. A matrix product of mixed dtypes fails as it does without the mode;
    integer, FP8 and fp64 operands, ``out=`` calls and every other op run as they are."""

    def __torch_function__(self, func: Callable, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention and _is_plain_attention(*args, **kwargs):
            return portable_attention(*args[:3], scale=kwargs.get("scale", args[6] if len(args) > 6 else None))
        dtype = _result_dtype(func, args, kwargs)
        if dtype is None:
            return func(*args, **kwargs)
        if func.__name__.endswith("_") and not func.__name__.startswith("__"):  # in place: widen, then write back
            out_of_place = getattr(torch.Tensor, func.__name__[:-1])
            return args[0].copy_(self.__torch_function__(out_of_place, types, args, kwargs))
        if func in SQUARE_ROOTS and not dtype.is_complex:
            return correctly_rounded_sqrt(*args, **kwargs)
        if func in FUSED_MULTIPLY_ADDS:
            func = functools.partial(unfused_multiply_add, func.__name__)
        if kwargs.get("dtype") is not None:
            kwargs = {**kwargs, "dtype": WIDE[kwargs["dtype"]]}
        result = func(*tree_map(_widen, args), **tree_map(_widen, kwargs))
        return tree_map(functools.partial(_round, dtype), result)


def _widen(value: Any) -> Any:
    return value.to(WIDE[value.dtype]) if isinstance(value, torch.Tensor) and value.dtype in WIDE else value


def _round(dtype: torch.dtype, value: Any) -> Any:
    """A widened result back to ``dtype`` (a complex one to ``dtype``'s complex counterpart), rounded once."""
    if not isinstance(value, torch.Tensor) or value.dtype not in (torch.float64, torch.complex128):
        return value
    return value.to(dtype.to_complex() if value.is_complex() and not dtype.is_complex else dtype)


def _result_dtype(func: Callable, args: tuple, kwargs: dict) -> torch.dtype | None:
    """The dtype ``func`` returns on these operands if the mode widens it, else None: the one floating dtype of a
    matrix product's operands; for other ops the promoted floating (or complex) dtype, or the ``dtype=`` asked
    for. Products of real tensors by ``mul`` are exact and left alone."""
    if func not in WIDENED or kwargs.get("out") is not None:
        return None
    leaves, _ = tree_flatten((args, kwargs))
    dtypes = {t.dtype for t in leaves if isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex())}
    if not dtypes or not dtypes <= ROUNDED_DTYPES:
        return None
    if func in COMPLEX_PRODUCTS and torch.complex64 not in dtypes:
        return None
    if func in MATRIX_PRODUCTS:
        return next(iter(dtypes)) if len(dtypes) == 1 else None
    requested = kwargs.get("dtype")
    if requested is not None:
        return requested if requested in ROUNDED_DTYPES else None
    return functools.reduce(torch.promote_types, dtypes)


def correctly_rounded_sqrt(input: torch.Tensor) -> torch.Tensor:
    """√x of a bf16/fp16/fp32 tensor, correctly rounded to its dtype (as IEEE 754 defines ``sqrt``).

    ATen's fp32 and fp64 ``sqrt`` come from MKL's vector math, whose last bit depends on the code path MKL picks for
    the CPU (with ``MKL_CBWR=COMPATIBLE`` 17% of fp32 roots are not the correctly rounded one, on the AVX-512 path
    0.6%). The fp64 root rounded to the dtype is within an ulp of √x whatever library computed it; the halfway
    points to its two neighbours have one bit more than the dtype, so their squares are exact in fp64 and comparing
    them with x picks the correctly rounded root. Gradients flow as through ``sqrt`` of the fp64 value.
    """
    root = input.double().sqrt().to(input.dtype)
    with torch.no_grad():
        wide, near = input.double(), root.double()
        up = torch.nextafter(root, torch.full_like(root, math.inf))
        down = torch.nextafter(root, torch.zeros_like(root))
        halfway_up, halfway_down = (near + up.double()) / 2, (near + down.double()) / 2
        rounded = torch.where(halfway_up * halfway_up < wide, up, root)
        rounded = torch.where(halfway_down * halfway_down > wide, down, rounded)
        moved = (wide > 0) & root.isfinite() & (rounded != root)
        step = torch.where(moved, rounded - root, 0)  # exact: zero or one ulp
    return torch.where(moved, root + step, root)


def unfused_multiply_add(
    name: str, input: torch.Tensor, other: torch.Tensor, third: torch.Tensor | float, *, value: float = 1
) -> torch.Tensor:
    """``addcmul`` / ``addcdiv`` / ``lerp`` as the separate ops of ATen's scalar kernels: ``input + value·t1·t2``,
    ``input + value·(t1 / t2)``, and ``input + w·(end - input)`` (``end - (end - input)·(1 - w)`` where |w| ≥ 0.5).

    Vector code fuses the last multiply and add into one rounding; where the sum cancels, that shows even after
    rounding an fp64 result to fp32 (lerp: 99 of 300k). Separate ops round the same way in every build.
    """
    if name == "addcmul":
        return input + value * other * third
    if name == "addcdiv":
        return input + value * (other / third)
    weight, difference = third, other - input
    if not isinstance(weight, torch.Tensor):
        return input + weight * difference if abs(weight) < 0.5 else other - difference * (1 - weight)
    return torch.where(weight.abs() < 0.5, input + weight * difference, other - difference * (1 - weight))


def _is_plain_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> bool:
    """SDPA without mask, dropout, causality or GQA, on low-precision inputs: what the ViT calls."""
    plain = attn_mask is None and dropout_p == 0.0 and not is_causal and not enable_gqa
    low_precision = query.dtype in (torch.bfloat16, torch.float16)
    return plain and low_precision and query.dtype == key.dtype == value.dtype


def portable_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float | None = None
) -> torch.Tensor:
    """Softmax attention with the rounding points of torch's CPU flash kernel, computed the same way on every machine.

    [..., L, E] × [..., S, E] × [..., S, Ev] → [..., L, Ev] in the input dtype. As the kernel does for bf16/fp16: fp32
    scores, numerators from its fast exponential (:func:`flash_kernel_exp`) rounded to the input dtype for the PV
    product, an fp32 sum of the unrounded numerators, and the product with the sum's fp32 reciprocal rounded once. One
    block over all keys (the kernel's blocks of 512 keys rescale a longer row). The two products and the sum are
    accumulated in fp64 and rounded once to fp32, as every product in reference numerics.
    """
    dtype = query.dtype
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    scores = torch.matmul(query.double(), key.double().transpose(-1, -2)).float() * scale
    numerators = flash_kernel_exp(scores - scores.amax(dim=-1, keepdim=True))
    denominators = numerators.double().sum(dim=-1, keepdim=True).float()
    out = torch.matmul(numerators.to(dtype).double(), value.double()).float()
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
    outer mode sees only the fp64 ops the inner one makes, and leaves them alone."""
    return ReferenceNumericsMode() if enabled else contextlib.nullcontext()


def reference_numerics_active() -> bool:
    """Whether ops run in reference numerics here (a :class:`ReferenceNumericsMode` is on the mode stack)."""
    return any(isinstance(mode, ReferenceNumericsMode) for mode in _get_current_function_mode_stack())


Backward = TypeVar("Backward", bound=Callable[..., Any])


def backward_in_forward_numerics(backward: Backward) -> Backward:
    """Decorates a custom autograd function's ``backward``: runs it in the numerics its forward ran in.

    The autograd engine runs a backward without the torch-function modes that were active in the forward, so the
    backward of a custom function would leave reference numerics, while autograd's own backward of the same ops runs
    on the fp64 tensors the mode made. The forward records ``ctx.reference_numerics = reference_numerics_active()``.
    """

    @functools.wraps(backward)
    def wrapper(ctx: Any, *grads: Any) -> Any:
        with reference_numerics(ctx.reference_numerics):
            return backward(ctx, *grads)

    return wrapper  # type: ignore[return-value]


Forward = TypeVar("Forward", bound=Callable[..., Any])


def under_configured_numerics(forward: Forward) -> Forward:
    """Decorates a model's ``forward``: runs it in reference numerics when ``config.reference_numerics`` is set, and
    then always eagerly: under ``torch.compile`` it is a graph break (an error with ``fullgraph=True``), so that a
    compiled caller still gets the reference's bits."""

    @functools.wraps(forward)
    def wrapper(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        if not getattr(self.config, "reference_numerics", False):
            return forward(self, *args, **kwargs)
        return _eager_in_reference_numerics(forward, self, *args, **kwargs)

    return wrapper  # type: ignore[return-value]


@torch.compiler.disable(
    reason="config.reference_numerics runs eagerly (fp64-widened ops, rounded once), to reproduce the reference bit "
    "for bit: turn it off to compile"
)
def _eager_in_reference_numerics(forward: Callable, *args: Any, **kwargs: Any) -> Any:
    with reference_numerics():
        return forward(*args, **kwargs)
