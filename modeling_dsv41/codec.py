"""The number formats of DeepSeek-V4.1's release, in one module: E8M0 power-of-two scales, FP8 e4m3 and FP4 E2M1
values, the packing of FP4 codes two to a byte, and the four things done with them:

* **activation QDQ**: the released forward keeps three quantize-dequantize boundaries even when every weight is bf16
  (fixtures README §3):

  - window KV: `fp8_qdq` (e4m3, one E8M0 scale per 32 elements), `act_quant(kv, 32, "ue8m0", inplace=True)`;
  - compressed KV: `fp4_qdq_e4m3_scale` (E2M1, one E4M3 scale per 16), `fp4_act_quant(kv, 16, True, float8_e4m3fn)`;
  - indexer q and k: `fp4_qdq_e8m0_scale` (E2M1, one E8M0 scale per 32), `fp4_act_quant(x, 32, True)`.

  Each is bit-exact with the reference kernels (`kernel_cpu.py`, a torch port of the tilelang kernels): the input is
  upcast to fp32, the scale is computed exactly as the kernel does (reciprocal multiply and exponent round-up for
  E8M0, fp32 division and a round-to-nearest-even cast for E4M3), values are divided by the scale in fp32, saturated
  and rounded to nearest-even, multiplied back by the scale, and cast to the input dtype. They are not
  differentiable; `straight_through` turns any of them into an op with an identity gradient for training.

* **the reference's FP8 / FP4 GEMMs**: where it holds a weight in FP8 or FP4, the reference multiplies by it with
  `fp8_gemm` / `fp4_gemm`, which quantize the input with `act_quant(x, 32, "ue8m0")` and sum 32-wide K blocks in fp32:
  `fp8_gemm_linear`, bit-exact in reference numerics.

* **decoding the checkpoint**: dense Linears are FP8 with 32x32 E8M0 block scales, routed experts packed FP4 with
  per-row, per-32-column E8M0 scales, Engram tables FP8 with per-row, per-32-column E8M0 scales (README §7).
  `dequantize_released_weight` reads any of them (as stored, or after the loader's cast to a float dtype), exactly as
  the reference GEMMs and lookups interpret them.

* **encoding the checkpoint** (`quantize_fp8_block`, `quantize_fp8_rows`, `quantize_fp4_rows`, for writing the
  released format): the same scales (the kernels' E8M0 rounding) and the same round-to-nearest-even. The encoding is
  canonical: a block whose largest value rounds down to half the format's maximum takes the next smaller scale (its
  values doubled, exactly), so that encoding decoded values again gives back the same bytes.
"""

import functools
import math
from typing import Callable

import torch

FP8_E4M3_MAX = 448.0
FP4_E2M1_MAX = 6.0
RELEASED_BLOCK_SIZE = 32  # every scale in the released checkpoint covers 32 elements (32x32 for dense FP8 blocks)

# E2M1 value of each 4-bit code (bit 3 is the sign), as stored in packed FP4 weights.
_E2M1_VALUES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float32)
_E2M1_TABLE = torch.cat([_E2M1_VALUES, -_E2M1_VALUES])
_FP4_PACKED_DTYPES = (torch.int8, torch.uint8, torch.float4_e2m1fn_x2)


# ---------------------------------------------------------------------------------------------------------------------
# Shared rounding helpers (fp32 in, fp32 out)
# ---------------------------------------------------------------------------------------------------------------------


def _e8m0_scale(amax: torch.Tensor, max_value: float) -> torch.Tensor:
    """2^ceil(log2(amax / max_value)) as the kernels' `fast_round_scale` computes it.

    The kernel multiplies by the fp32 reciprocal of `max_value` and rounds the exponent up whenever a mantissa bit is
    set, so the result is the E8M0 scale read straight from the fp32 bits (no log2, no division): adding 2^23 - 1 to
    the bits carries into the exponent exactly when a mantissa bit is set, and the mask keeps the exponent alone.
    """
    ratio = (amax * torch.tensor(1.0 / max_value, dtype=torch.float32)).contiguous()
    return ((ratio.view(torch.int32) + 0x7FFFFF) & 0x7F800000).view(torch.float32)


def _round_e4m3(x: torch.Tensor) -> torch.Tensor:
    """fp32 -> nearest e4m3 value (ties to even), saturating at +-448 like the CUDA `satfinite` conversion."""
    # torch's cast rounds to nearest-even but maps overflow to NaN, hence the clamp first
    return x.clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn).float()


def _round_e2m1(v: torch.Tensor) -> torch.Tensor:
    """fp32 in [-6, 6] -> nearest E2M1 value (ties to the even code, which is IEEE round-half-even), sign of 0 kept."""
    # E2M1 spacing is 0.5 below 2, 1 in [2, 4) and 2 in [4, 6]: half of the power of two at or below |v| (its fp32
    # exponent bits alone), at least 0.5; dividing by a power of two is exact, so rounding the quotient is the rounding
    step = ((v.contiguous().view(torch.int32) & 0x7F800000).view(torch.float32) * 0.5).clamp_min(0.5)
    return torch.round(v / step) * step


def _e2m1_qdq(groups: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """fp32 groups [..., n, block] and scales [..., n, 1] -> E2M1 values times scale (x / scale saturates at +-6)."""
    return _round_e2m1((groups / scale).clamp(-FP4_E2M1_MAX, FP4_E2M1_MAX)) * scale


def _check_qdq_input(x: torch.Tensor, block_size: int, name: str) -> None:
    if not x.is_floating_point():
        raise ValueError(f"{name} expects a floating-point tensor, got {x.dtype}")
    if x.dim() == 0 or x.size(-1) % block_size != 0:
        raise ValueError(f"{name}: last dim {tuple(x.shape)[-1:]} must be a multiple of block_size={block_size}")
    if x.requires_grad and torch.is_grad_enabled():
        raise ValueError(f"{name} has no useful gradient; wrap it with straight_through({name}) for training")


# ---------------------------------------------------------------------------------------------------------------------
# Activation QDQ (forward boundaries of the reference)
# ---------------------------------------------------------------------------------------------------------------------


def fp8_qdq(x: torch.Tensor, block_size: int = 32) -> torch.Tensor:
    """FP8 e4m3 QDQ with one power-of-two (E8M0) scale per `block_size` elements of the last dim.

    Reproduces `act_quant(x, block_size, "ue8m0", inplace=True)` (window KV): scale
    2^ceil(log2(max(amax, 1e-4) / 448)), x / scale saturated to +-448 and rounded to nearest-even e4m3.
    """
    _check_qdq_input(x, block_size, "fp8_qdq")
    groups = x.float().unflatten(-1, (-1, block_size))  # [..., n_groups, block_size]
    amax = groups.abs().amax(dim=-1, keepdim=True).clamp_min(1e-4)
    scale = _e8m0_scale(amax, FP8_E4M3_MAX)
    return (_round_e4m3(groups / scale) * scale).flatten(-2).to(x.dtype)


def fp4_qdq_e4m3_scale(x: torch.Tensor, block_size: int = 16) -> torch.Tensor:
    """FP4 E2M1 QDQ with one E4M3 scale per `block_size` elements of the last dim.

    Reproduces `fp4_act_quant(x, block_size, True, scale_dtype=float8_e4m3fn)` (compressed KV): scale
    e4m3(max(amax, 6 * 2^-9) / 6), x / scale clamped to +-6 and rounded to the nearest E2M1 value, ties to even.
    """
    _check_qdq_input(x, block_size, "fp4_qdq_e4m3_scale")
    groups = x.float().unflatten(-1, (-1, block_size))
    # the floor keeps an all-zero group's scale at the smallest e4m3 subnormal, 2^-9, instead of 0
    amax = groups.abs().amax(dim=-1, keepdim=True).clamp_min(FP4_E2M1_MAX * 2**-9)
    scale = _round_e4m3(amax / FP4_E2M1_MAX)
    return _e2m1_qdq(groups, scale).flatten(-2).to(x.dtype)


def fp4_qdq_e8m0_scale(x: torch.Tensor, block_size: int = 32) -> torch.Tensor:
    """FP4 E2M1 QDQ with one power-of-two (E8M0) scale per `block_size` elements of the last dim.

    Reproduces `fp4_act_quant(x, block_size, True)` (indexer queries and keys): scale
    2^ceil(log2(max(amax, 6 * 2^-126) / 6)), x / scale clamped to +-6 and rounded to the nearest E2M1 value.
    """
    _check_qdq_input(x, block_size, "fp4_qdq_e8m0_scale")
    groups = x.float().unflatten(-1, (-1, block_size))
    amax = groups.abs().amax(dim=-1, keepdim=True).clamp_min(FP4_E2M1_MAX * 2**-126)
    scale = _e8m0_scale(amax, FP4_E2M1_MAX)
    return _e2m1_qdq(groups, scale).flatten(-2).to(x.dtype)


class QuantizeDequantize(torch.autograd.Function):
    """Forward applies a QDQ function; backward passes the gradient through unchanged (straight-through estimator)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, qdq: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        return qdq(x)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad_output, None


def straight_through(qdq: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """Wrap a QDQ function so that training sees an identity gradient: `straight_through(fp8_qdq)(x,
    block_size=32)`."""

    @functools.wraps(qdq)
    def qdq_with_identity_gradient(x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        return QuantizeDequantize.apply(x, lambda t: qdq(t, *args, **kwargs))

    return qdq_with_identity_gradient


def fp8_gemm_linear(x: torch.Tensor, weight: torch.Tensor, block_size: int = 32) -> torch.Tensor:
    """``x @ weight.T`` as the reference computes a Linear whose weight it holds in FP8 or FP4 (``fp8_gemm`` /
    ``fp4_gemm``, run in reference numerics): ``x`` [..., K] and the result [..., N] in the model dtype, ``weight``
    [N, K] the stored weight dequantized (in any float dtype: an e4m3 or E2M1 value times a power of two is exact).

    Those kernels take an FP8 input, so the reference's ``linear`` quantizes the activation first,
    ``act_quant(x, 32, "ue8m0")``: that is :func:`fp8_qdq` (its dequantized values, exact in the input's dtype;
    the gradient passes straight through). They then sum in fp32, from zero, one 32-wide K block at a time in K
    order, each block's product scaled by the input's and the weight's block scales, and round once to the model
    dtype. One block's product of FP8 (or FP4) codes is exact in fp64 in any order, the reference's mode rounds it
    once to fp32, and multiplying by power-of-two scales commutes with that rounding; so the fp64 product of the
    dequantized blocks, rounded to fp32, is the reference's scaled block partial, bit for bit."""
    columns = x.shape[-1]
    blocks = straight_through(fp8_qdq)(x, block_size).reshape(-1, columns).double().split(block_size, dim=-1)
    weight_blocks = weight.double().split(block_size, dim=-1)
    out = torch.zeros(blocks[0].shape[0], weight.shape[0], dtype=torch.float32, device=x.device)
    for block, weight_block in zip(blocks, weight_blocks):  # fixed order: the reference's fp32 running sum
        out = out + (block @ weight_block.T).float()
    return out.to(x.dtype).view(*x.shape[:-1], weight.shape[0])


# ---------------------------------------------------------------------------------------------------------------------
# FP4 packing: two E2M1 codes per byte, the even column in the low nibble
# ---------------------------------------------------------------------------------------------------------------------


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """Packed FP4 [..., C // 2] (int8, uint8 or float4_e2m1fn_x2) -> fp32 E2M1 values [..., C].

    Each byte holds two E2M1 codes, the even column in the low nibble, as the reference's `unpack_fp4` reads them.
    """
    if packed.dtype not in _FP4_PACKED_DTYPES:
        raise ValueError(f"unpack_fp4 expects int8, uint8 or float4_e2m1fn_x2 bytes, got {packed.dtype}")
    codes = packed.view(torch.uint8).long()
    table = _E2M1_TABLE.to(packed.device)
    return torch.stack([table[codes & 0x0F], table[codes >> 4]], dim=-1).flatten(-2)


def pack_fp4(values: torch.Tensor) -> torch.Tensor:
    """E2M1 values [..., C] (fp32, already on the E2M1 grid) -> packed FP4 int8 [..., C // 2]; the sign bit is the
    value's own (a -0.0 keeps it)."""
    codes = torch.searchsorted(_E2M1_VALUES.to(values.device), values.abs().contiguous())
    codes = (codes | torch.signbit(values).long() << 3).to(torch.uint8)
    return (codes[..., 0::2] | codes[..., 1::2] << 4).view(torch.int8)


# the two fp32 E2M1 values of every byte value, as one 8-byte entry per byte [256] (int64 bits): one 1-D lookup per
# byte instead of two per nibble; a 1-D index_select is several times faster on CPU than a lookup of [256, 2] rows
_FP4_BYTE_PAIRS = unpack_fp4(torch.arange(256, dtype=torch.uint8).unsqueeze(0)).view(torch.int64).view(256)


# ---------------------------------------------------------------------------------------------------------------------
# Decoding the released checkpoint -> fp32
# ---------------------------------------------------------------------------------------------------------------------


def _expand_scale(scale: torch.Tensor, rows: int, cols: int, row_block: int, col_block: int) -> torch.Tensor:
    """Repeat each scale over its row_block x col_block tile and crop to [rows, cols] (the last tile may be
    partial)."""
    expanded = scale.float().repeat_interleave(row_block, dim=0).repeat_interleave(col_block, dim=1)
    return expanded[:rows, :cols]


def _check_2d(weight: torch.Tensor, name: str) -> None:
    if weight.dim() != 2:
        raise ValueError(f"{name} expects a 2-D weight, got shape {tuple(weight.shape)}")


def _check_scale(weight: torch.Tensor, scale: torch.Tensor, expected: tuple[int, ...], name: str) -> None:
    if tuple(scale.shape) != tuple(expected):
        raise ValueError(
            f"{name}: scale shape {tuple(scale.shape)} does not match the expected {tuple(expected)} "
            f"for weight shape {tuple(weight.shape)}"
        )


def dequantize_fp8_block(weight: torch.Tensor, scale: torch.Tensor, block_size: int = 32) -> torch.Tensor:
    """FP8 e4m3 weight [R, C] with one scale per block_size x block_size block, [ceil(R/b), ceil(C/b)] -> fp32 [R, C].

    The dense-Linear format read by `fp8_gemm` (and by the convert step for `wo_a`).
    """
    if weight.dtype != torch.float8_e4m3fn:
        raise ValueError(f"dequantize_fp8_block expects a float8_e4m3fn weight, got {weight.dtype}")
    _check_2d(weight, "dequantize_fp8_block")
    rows, cols = weight.shape
    _check_scale(weight, scale, (math.ceil(rows / block_size), math.ceil(cols / block_size)), "dequantize_fp8_block")
    return weight.float() * _expand_scale(scale, rows, cols, block_size, block_size)


def dequantize_fp8_rows(weight: torch.Tensor, scale: torch.Tensor, block_size: int = 32) -> torch.Tensor:
    """FP8 e4m3 rows [..., C] with one scale per row and block_size columns, [..., C/b] -> fp32 [..., C].

    The Engram table format (a whole table or gathered rows), dequantized on lookup by
    `ParallelEngramEmbedding.forward`.
    """
    if weight.dtype != torch.float8_e4m3fn:
        raise ValueError(f"dequantize_fp8_rows expects a float8_e4m3fn weight, got {weight.dtype}")
    cols = weight.size(-1)
    if cols % block_size or tuple(scale.shape) != (*weight.shape[:-1], cols // block_size):
        raise ValueError(
            f"dequantize_fp8_rows: scale shape {tuple(scale.shape)} does not fit: FP8 rows of shape "
            f"{tuple(weight.shape)} needs scales of shape {(*weight.shape[:-1], cols // block_size)} (columns a "
            f"multiple of block_size={block_size})"
        )
    blocks = weight.float().unflatten(-1, (-1, block_size)) * scale.float().unsqueeze(-1)
    return blocks.flatten(-2)


def dequantize_fp4_rows(packed: torch.Tensor, scale: torch.Tensor, block_size: int = 32) -> torch.Tensor:
    """Packed FP4 weight [R, C/2] with one scale per row and block_size columns, [R, C/b] -> fp32 [R, C].

    The routed-expert format read by `fp4_gemm`. One table lookup per byte: experts are most of the checkpoint.
    """
    if packed.dtype not in _FP4_PACKED_DTYPES:
        raise ValueError(f"dequantize_fp4_rows expects int8, uint8 or float4_e2m1fn_x2 bytes, got {packed.dtype}")
    _check_2d(packed, "dequantize_fp4_rows")
    rows, cols = packed.size(0), 2 * packed.size(1)
    if cols % block_size != 0:
        raise ValueError(f"dequantize_fp4_rows: {cols} columns are not a multiple of block_size={block_size}")
    _check_scale(packed, scale, (rows, cols // block_size), "dequantize_fp4_rows")
    pairs = _FP4_BYTE_PAIRS.to(packed.device).index_select(0, packed.view(torch.uint8).flatten().int())
    values = pairs.view(torch.float32).view(rows, cols // block_size, block_size)
    return (values * scale.float().unsqueeze(-1)).view(rows, cols)


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
        return weight if weight.dtype in _FP4_PACKED_DTYPES else weight.to(torch.int8)
    return weight if weight.dtype == torch.float8_e4m3fn else weight.to(torch.float8_e4m3fn)


# dequantize at most this many elements at once: bounds the fp32 temporaries of a huge tensor (LM head, Engram table)
_CHUNK_ELEMENTS = 1 << 22


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
        raise ValueError(
            f"a stored weight of width {stored_columns} fits neither FP8 nor packed FP4 for {columns} columns"
        )
    b = RELEASED_BLOCK_SIZE
    if columns % b == 0 and tuple(scale.shape) == (rows, columns // b):
        dequantize, rows_per_scale = (dequantize_fp4_rows if packed else dequantize_fp8_rows), 1
    elif not packed and tuple(scale.shape) == (math.ceil(rows / b), math.ceil(columns / b)):
        dequantize, rows_per_scale = dequantize_fp8_block, b
    else:
        raise ValueError(
            f"scale shape {tuple(scale.shape)} does not match a released layout for a "
            f"{'packed FP4' if packed else 'FP8'} weight of {rows}x{columns}"
        )
    scale = stored_scale(scale)
    out = torch.empty(rows, columns, dtype=dtype, device=weight.device)
    step = max(b, _CHUNK_ELEMENTS // columns // b * b)  # whole 32-row blocks
    for start in range(0, rows, step):
        stop = min(start + step, rows)
        chunk_scale = scale[start // rows_per_scale : math.ceil(stop / rows_per_scale)]
        out[start:stop] = dequantize(_stored_weight(weight[start:stop], packed), chunk_scale, b)
    return out


# ---------------------------------------------------------------------------------------------------------------------
# Encoding the released checkpoint (writing it)
# ---------------------------------------------------------------------------------------------------------------------

_MIN_E8M0 = 2.0**-127


def _weight_scale(amax: torch.Tensor, max_value: float) -> torch.Tensor:
    """The E8M0 scale of weight blocks (fp32): the kernels' rounding, and the smallest scale for an all-zero block."""
    return torch.where(amax > 0, _e8m0_scale(amax.float(), max_value), _MIN_E8M0)


def _canonical(values: torch.Tensor, scale: torch.Tensor, max_value: float, dims: tuple[int, ...]):
    """Blocks whose largest encoded value is at most half the format's maximum (it rounded down onto it) take half
    the scale and twice the values (exact), so that the encoding of the decoded values is this one. ``values`` holds
    the blocks along ``dims``, ``scale`` one entry per block broadcast over them."""
    halve = (values.abs().amax(dim=dims, keepdim=True) <= max_value / 2) & (scale > _MIN_E8M0)
    return torch.where(halve, values * 2, values), torch.where(halve, scale / 2, scale)


def quantize_fp8_block(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[R, C] → FP8 e4m3 [R, C] and E8M0 scales [ceil(R/32), ceil(C/32)] (dense Linears)."""
    b = RELEASED_BLOCK_SIZE
    rows, cols = weight.shape
    padded = torch.nn.functional.pad(weight.float(), (0, -cols % b, 0, -rows % b))
    blocks = padded.unflatten(0, (-1, b)).unflatten(2, (-1, b))  # [R/b, b, C/b, b]
    scale = _weight_scale(blocks.abs().amax(dim=(1, 3), keepdim=True), FP8_E4M3_MAX)
    values, scale = _canonical(_round_e4m3(blocks / scale), scale, FP8_E4M3_MAX, dims=(1, 3))
    values = values.flatten(2).flatten(0, 1)[:rows, :cols]
    return values.to(torch.float8_e4m3fn), scale[:, 0, :, 0].to(torch.float8_e8m0fnu)


def quantize_fp8_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[R, C] → FP8 e4m3 [R, C] and E8M0 scales [R, C/32] (Engram tables)."""
    groups = weight.float().unflatten(1, (-1, RELEASED_BLOCK_SIZE))
    scale = _weight_scale(groups.abs().amax(dim=-1, keepdim=True), FP8_E4M3_MAX)
    values, scale = _canonical(_round_e4m3(groups / scale), scale, FP8_E4M3_MAX, dims=(-1,))
    return values.flatten(1).to(torch.float8_e4m3fn), scale.squeeze(-1).to(torch.float8_e8m0fnu)


def quantize_fp4_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[R, C] → packed FP4 int8 [R, C/2] (even column in the low nibble) and E8M0 scales [R, C/32] (routed experts)."""
    groups = weight.float().unflatten(1, (-1, RELEASED_BLOCK_SIZE))
    scale = _weight_scale(groups.abs().amax(dim=-1, keepdim=True), FP4_E2M1_MAX)
    values = _round_e2m1((groups / scale).clamp(-FP4_E2M1_MAX, FP4_E2M1_MAX))
    values, scale = _canonical(values, scale, FP4_E2M1_MAX, dims=(-1,))
    return pack_fp4(values.flatten(1)), scale.squeeze(-1).to(torch.float8_e8m0fnu)


__all__ = [
    "FP4_E2M1_MAX",
    "FP8_E4M3_MAX",
    "RELEASED_BLOCK_SIZE",
    "QuantizeDequantize",
    "dequantize_fp4_rows",
    "dequantize_fp8_block",
    "dequantize_fp8_rows",
    "dequantize_released_weight",
    "fp4_qdq_e4m3_scale",
    "fp4_qdq_e8m0_scale",
    "fp8_gemm_linear",
    "fp8_qdq",
    "pack_fp4",
    "quantize_fp4_rows",
    "quantize_fp8_block",
    "quantize_fp8_rows",
    "stored_scale",
    "straight_through",
    "unpack_fp4",
]
