"""The released checkpoint's storage read as values: FP8 e4m3 with E8M0 scales (per 32x32 block for dense Linears,
per row and 32 columns for the Engram tables) and packed FP4 E2M1 with per-row, per-32-column E8M0 scales (routed
experts), dequantized exactly as the reference kernels read them. Shared by the loader (:mod:`.checkpoint_loading`,
dequantizing on load) and the weight-only modules of native loading (:mod:`.native_precision`, dequantizing in the
forward).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from ..quantization import RELEASED_BLOCK_SIZE, dequantize_fp8_block, dequantize_fp8_rows, unpack_fp4

_FP4_BYTE_DTYPES = (torch.int8, torch.uint8, torch.float4_e2m1fn_x2)
# dequantize at most this many elements at once: bounds the fp32 temporaries of a huge tensor (LM head, Engram table)
_CHUNK_ELEMENTS = 1 << 22


def stored_scale(scale: torch.Tensor) -> torch.Tensor:
    """The E8M0 scales as stored. The loader casts every source tensor to the target parameter's dtype first: powers
    of two survive bf16 and fp32 exactly, but float16 flushes those outside [2^-24, 2^15] to 0 or inf."""
    if scale.dtype == torch.float8_e8m0fnu:
        return scale
    if not bool((torch.isfinite(scale) & (scale > 0)).all()):
        raise ValueError(
            f"E8M0 scales cannot be represented in {scale.dtype}: load the released checkpoint with "
            "dtype=torch.bfloat16 or torch.float32 (and cast the model afterwards if needed)"
        )
    return scale.to(torch.float8_e8m0fnu)


def _stored_weight(weight: torch.Tensor, packed: bool) -> torch.Tensor:
    """FP8 values and FP4 bytes as stored (their cast to bf16/fp16/fp32 by the loader is exact, hence reversible)."""
    if packed:
        return weight if weight.dtype in _FP4_BYTE_DTYPES else weight.to(torch.int8)
    return weight if weight.dtype == torch.float8_e4m3fn else weight.to(torch.float8_e4m3fn)


# the two E2M1 values of every byte value, [256, 2]: one table lookup per byte instead of two per nibble
_FP4_BYTE_VALUES = unpack_fp4(torch.arange(256, dtype=torch.uint8).unsqueeze(0)).view(256, 2)


def _dequantize_fp4_rows(packed: torch.Tensor, scale: torch.Tensor, block_size: int) -> torch.Tensor:
    """``quantization.dequantize_fp4_rows`` (same values), a few times faster: experts are most of the checkpoint."""
    rows = packed.shape[0]
    values = torch.nn.functional.embedding(packed.view(torch.uint8).int(), _FP4_BYTE_VALUES.to(packed.device))
    return (values.view(rows, -1, block_size) * scale.float().unsqueeze(-1)).view(rows, -1)


def dequantize_released_weight(
    weight: torch.Tensor, scale: torch.Tensor, columns: int, dtype: torch.dtype
) -> torch.Tensor:
    """One quantized tensor of the released checkpoint → ``[rows, columns]`` in ``dtype``, exactly as the reference
    kernels read it (then rounded to ``dtype``).

    ``weight`` holds FP8 values ``[rows, columns]`` or packed FP4 bytes ``[rows, columns / 2]``, as stored or cast to
    a float dtype by the loader; ``columns`` (the parameter's width) tells the two apart. The scale layout follows
    from its shape: ``[rows, columns / 32]`` per row (FP4 experts, Engram tables) or ``[ceil(rows / 32),
    ceil(columns / 32)]`` per 32x32 block (dense FP8). Works through the rows in chunks.
    """
    if weight.dim() != 2 or scale.dim() != 2:
        raise ValueError(f"expected 2-D weight and scale, got {tuple(weight.shape)} and {tuple(scale.shape)}")
    rows, stored_columns = weight.shape
    if columns == 2 * stored_columns:
        packed = True
    elif columns == stored_columns:
        packed = False
    else:
        raise ValueError(f"a stored weight of width {stored_columns} fits neither FP8 nor packed FP4 for {columns} columns")
    b = RELEASED_BLOCK_SIZE
    if columns % b == 0 and tuple(scale.shape) == (rows, columns // b):
        dequantize, rows_per_scale = (_dequantize_fp4_rows if packed else dequantize_fp8_rows), 1
    elif not packed and tuple(scale.shape) == (math.ceil(rows / b), math.ceil(columns / b)):
        dequantize, rows_per_scale = dequantize_fp8_block, b
    else:
        raise ValueError(f"scale shape {tuple(scale.shape)} does not match a released layout for a "
                         f"{'packed FP4' if packed else 'FP8'} weight of {rows}x{columns}")
    scale = stored_scale(scale)
    out = torch.empty(rows, columns, dtype=dtype, device=weight.device)
    step = max(b, _CHUNK_ELEMENTS // columns // b * b)  # whole 32-row blocks
    for start in range(0, rows, step):
        stop = min(start + step, rows)
        chunk_scale = scale[start // rows_per_scale : math.ceil(stop / rows_per_scale)]
        out[start:stop] = dequantize(_stored_weight(weight[start:stop], packed), chunk_scale, b)
    return out


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
    input: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, columns: int, bias: torch.Tensor | None = None,
    product: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """``F.linear(input, dequantize_released_weight(weight, scale, columns, input.dtype), bias)`` (or ``product(input)``,
    a kernel computing the same) with the exact input gradient and none for the (frozen) weight and bias, holding only
    the stored bytes between the forward and the backward."""

    @torch.no_grad()
    def dequantized_product(x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(x, dequantize_released_weight(weight, scale, columns, x.dtype), bias)

    product = product or dequantized_product
    if not (torch.is_grad_enabled() and input.requires_grad):
        return product(input)
    return _FrozenQuantizedLinear.apply(input, weight, scale, columns, torch.no_grad()(product))


__all__ = ["dequantize_released_weight", "frozen_quantized_linear", "stored_scale"]
