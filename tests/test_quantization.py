"""FP8 / FP4 QDQ and checkpoint dequantization, checked bit-for-bit.

Two kinds of evidence: hand-computed vectors whose QDQ result follows from the format definitions (fixtures README §3),
and a straightforward reimplementation that enumerates each format's value grid in float64 and picks the nearest
value, ties to the even code. Checkpoint dequantization is checked against the reference's own dequantized values.
"""

import json
import math

import pytest
import torch
from safetensors.torch import load_file

from modeling_dsv41.codec import (
    QuantizeDequantize,
    dequantize_fp4_rows,
    dequantize_fp8_block,
    dequantize_fp8_rows,
    fp4_qdq_e4m3_scale,
    fp4_qdq_e8m0_scale,
    fp8_gemm_linear,
    fp8_qdq,
    quantize_fp4_rows,
    quantize_fp8_block,
    straight_through,
    unpack_fp4,
)
from reference_fixture import dequantize_released_tensor

# ---------------------------------------------------------------------------------------------------------------------
# Independent reference: value grids from the bit layouts, nearest value with ties to the even code, in float64
# ---------------------------------------------------------------------------------------------------------------------


def _minifloat_grid(exponent_bits: int, mantissa_bits: int, bias: int, drop_last: bool) -> torch.Tensor:
    """Non-negative values of a sign/exponent/mantissa format, indexed by code (so even index = even mantissa)."""
    values = []
    for e in range(2**exponent_bits):
        for m in range(2**mantissa_bits):
            fraction = m / 2**mantissa_bits
            values.append(math.ldexp(fraction, 1 - bias) if e == 0 else math.ldexp(1 + fraction, e - bias))
    if drop_last:  # e4m3fn spends its all-ones code on NaN
        values.pop()
    return torch.tensor(values, dtype=torch.float64)


E4M3_GRID = _minifloat_grid(4, 3, bias=7, drop_last=True)  # 0 .. 448
E2M1_GRID = _minifloat_grid(2, 1, bias=1, drop_last=False)  # 0, 0.5, 1, 1.5, 2, 3, 4, 6


def _round_to_grid(v: torch.Tensor, grid: torch.Tensor) -> torch.Tensor:
    """Nearest grid value to each float64 in v (|v| <= grid max), ties to the even code, sign kept (also on zero)."""
    mag = v.abs()
    hi = torch.searchsorted(grid, mag).clamp(max=len(grid) - 1)
    lo = (hi - 1).clamp(min=0)
    d_lo, d_hi = mag - grid[lo], grid[hi] - mag
    pick_hi = (d_hi < d_lo) | ((d_hi == d_lo) & (hi % 2 == 0))
    return torch.copysign(torch.where(pick_hi, grid[hi], grid[lo]), v)


def _pow2_at_least(num: torch.Tensor, denom: float) -> torch.Tensor:
    """Smallest power of two p with num <= denom * p, found with exact float64 comparisons."""
    out = []
    for a in num.flatten().tolist():
        k = math.ceil(math.log2(a / denom))
        while math.ldexp(denom, k - 1) >= a:
            k -= 1
        while math.ldexp(denom, k) < a:
            k += 1
        out.append(math.ldexp(1.0, k))
    return torch.tensor(out, dtype=torch.float64).view(num.shape)


def reference_qdq(x: torch.Tensor, block_size: int, fmt: str) -> torch.Tensor:
    groups = x.double().unflatten(-1, (-1, block_size))
    amax = groups.abs().amax(dim=-1, keepdim=True)
    if fmt == "fp8":
        scale = _pow2_at_least(amax.clamp_min(float(torch.tensor(1e-4))), 448.0)
        values = _round_to_grid((groups / scale).clamp(-448, 448), E4M3_GRID)
    elif fmt == "fp4_e4m3":
        scale = _round_to_grid((amax.clamp_min(6 * 2**-9) / 6).clamp(max=448), E4M3_GRID)
        values = _round_to_grid((groups / scale).clamp(-6, 6), E2M1_GRID)
    else:
        scale = _pow2_at_least(amax.clamp_min(6 * 2**-126), 6.0)
        values = _round_to_grid((groups / scale).clamp(-6, 6), E2M1_GRID)
    return (values * scale).flatten(-2).to(x.dtype)


QDQ = {"fp8": (fp8_qdq, 32), "fp4_e4m3": (fp4_qdq_e4m3_scale, 16), "fp4_e8m0": (fp4_qdq_e8m0_scale, 32)}


def assert_bits_equal(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Bitwise equality, so -0.0 vs 0.0 and NaN payloads count."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    int_dtype = {2: torch.int16, 4: torch.int32, 8: torch.int64}[actual.element_size()]
    diff = actual.view(int_dtype) != expected.view(int_dtype)
    assert not diff.any(), (
        f"{int(diff.sum())} elements differ, first at {diff.nonzero()[0].tolist()}: "
        f"{actual[diff][:4].tolist()} vs {expected[diff][:4].tolist()}"
    )


def one_block(values: list[float], block_size: int, dtype=torch.float32) -> torch.Tensor:
    """A single block: `values` followed by zeros."""
    return torch.tensor(values + [0.0] * (block_size - len(values)), dtype=dtype)


def test_reference_grids_match_the_formats():
    e4m3_bytes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).double()
    assert torch.equal(E4M3_GRID, e4m3_bytes[:127]) and E4M3_GRID.max() == 448
    assert E2M1_GRID.tolist() == [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


# ---------------------------------------------------------------------------------------------------------------------
# Hand-computed vectors
# ---------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_qdq_hand_computed(dtype):
    # amax 448 -> scale 1: representable values stay; ties go to the even mantissa; subnormals exist down to 2^-9
    x = one_block([448, -448, 1.0625, 1.1875, 232, 248, 2**-9, 3 * 2**-11, 2**-10, -0.0, 0.3], 32, dtype)
    expected = one_block([448, -448, 1.0, 1.25, 224, 256, 2**-9, 2**-9, 0.0, -0.0, 0.3125], 32, dtype)
    assert_bits_equal(fp8_qdq(x), expected)

    # amax just above 448 * 2^k takes the next power: 450 -> scale 2, 450/2 = 225 -> 224 -> 448
    assert_bits_equal(fp8_qdq(one_block([450, 17], 32, dtype)), one_block([448, 16], 32, dtype))
    # amax exactly 448 * 2^k keeps 2^k: 896 -> scale 2, 17/2 = 8.5 -> 8 (tie, even) -> 16; 19/2 = 9.5 -> 10 -> 20
    assert_bits_equal(fp8_qdq(one_block([896, 17, 19], 32, dtype)), one_block([896, 16, 20], 32, dtype))

    # tiny amax is floored at 1e-4: scale 2^ceil(log2(1e-4/448)) = 2^-22, so the smallest nonzero output is 2^-31
    tiny = one_block([2**-31, 3 * 2**-33, 2**-32, -(2**-40), 2**-24], 32, dtype)
    assert_bits_equal(fp8_qdq(tiny), one_block([2**-31, 2**-31, 0.0, -0.0, 2**-24], 32, dtype))


def test_fp8_qdq_blocks_are_independent_and_odd():
    x = torch.cat([one_block([448, 2**-10], 32), one_block([0.5, 2**-10], 32)])
    # first block: scale 1, 2^-10 is half the smallest subnormal -> 0 (tie, even);
    # second: scale 2^-9, 2^-10 -> 0.5 exact
    expected = torch.cat([one_block([448, 0.0], 32), one_block([0.5, 2**-10], 32)])
    assert_bits_equal(fp8_qdq(x), expected)
    y = torch.randn(8, 64, dtype=torch.bfloat16)
    assert_bits_equal(fp8_qdq(-y), -fp8_qdq(y))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp4_qdq_e4m3_scale_hand_computed(dtype):
    # amax 6 -> scale e4m3(1) = 1: the E2M1 grid, with every midpoint tie going to the even code
    x = one_block([6, -6, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5, 0.3, -0.75, -0.0, 5.5], 16, dtype)
    expected = one_block([6, -6, 0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 0.5, -1.0, -0.0, 6.0], 16, dtype)
    assert_bits_equal(fp4_qdq_e4m3_scale(x), expected)

    # amax 9 -> scale 1.5 (not a power of two): 4.5 -> 3 -> 4.5; 3.75 -> 2.5 -> 2 (tie) -> 3; 1.125 -> 0.75 -> 1 -> 1.5
    assert_bits_equal(
        fp4_qdq_e4m3_scale(one_block([9, 4.5, 3.75, 1.125], 16, dtype)), one_block([9, 4.5, 3.0, 1.5], 16, dtype)
    )
    # amax 6.375: 6.375/6 = 1.0625 is an e4m3 tie -> scale 1.0, so 6.375 is clamped to 6
    assert_bits_equal(fp4_qdq_e4m3_scale(one_block([6.375, 2.5], 16, dtype)), one_block([6.0, 2.0], 16, dtype))
    # amax 7.125: 1.1875 -> scale 1.25 (tie, even); 7.125 / 1.25 = 5.7 -> 6 -> 7.5
    assert_bits_equal(fp4_qdq_e4m3_scale(one_block([7.125], 16, dtype)), one_block([7.5], 16, dtype))
    # huge amax saturates the scale at 448, so values are clamped to 6 * 448 = 2688
    assert_bits_equal(
        fp4_qdq_e4m3_scale(one_block([8192, -8192, 448], 16, dtype)), one_block([2688, -2688, 448], 16, dtype)
    )
    # tiny amax is floored at 6 * 2^-9 -> scale 2^-9: 2^-10 is 0.5 on the grid; 2^-12 -> 0.125 -> 0; 3 * 2^-12 -> 0.5
    assert_bits_equal(
        fp4_qdq_e4m3_scale(one_block([2**-10, 2**-12, -3 * 2**-12], 16, dtype)),
        one_block([2**-10, 0.0, -(2**-10)], 16, dtype),
    )
    assert_bits_equal(fp4_qdq_e4m3_scale(torch.zeros(2, 16, dtype=dtype)), torch.zeros(2, 16, dtype=dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp4_qdq_e8m0_scale_hand_computed(dtype):
    x = one_block([6, -6, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5, 0.3, -0.75, -0.0], 32, dtype)
    expected = one_block([6, -6, 0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 0.5, -1.0, -0.0], 32, dtype)
    assert_bits_equal(fp4_qdq_e8m0_scale(x), expected)
    # amax 7 -> scale 2: 7/2 = 3.5 -> 4 (tie) -> 8; 5/2 = 2.5 -> 2 (tie) -> 4; 0.5/2 = 0.25 -> 0 (tie)
    assert_bits_equal(fp4_qdq_e8m0_scale(one_block([7, 5, 0.5], 32, dtype)), one_block([8, 4, 0.0], 32, dtype))
    # amax exactly 6 * 2^k keeps 2^k: 12 -> scale 2, 2.5/2 = 1.25 -> 1 (tie) -> 2
    assert_bits_equal(fp4_qdq_e8m0_scale(one_block([12, 2.5], 32, dtype)), one_block([12, 2], 32, dtype))
    # the amax floor 6 * 2^-126 gives scale 2^-126, so 2^-127 (subnormal) is 0.5 on the grid and survives
    assert_bits_equal(
        fp4_qdq_e8m0_scale(one_block([2**-127, -(2**-129)], 32, dtype)), one_block([2**-127, -0.0], 32, dtype)
    )


def test_fp4_qdq_e8m0_scale_fp32_just_above_a_power():
    # 6.0000005 (next fp32 after 6) -> scale 2, 3.00000025 -> 3 -> 6: the value drops below its input
    x = one_block([float(torch.nextafter(torch.tensor(6.0), torch.tensor(7.0)))], 32)
    assert_bits_equal(fp4_qdq_e8m0_scale(x), one_block([6.0], 32))


# ---------------------------------------------------------------------------------------------------------------------
# Random vectors over many magnitudes against the independent reimplementation
# ---------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", list(QDQ))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
def test_qdq_matches_independent_reimplementation(fmt, dtype):
    qdq, block_size = QDQ[fmt]
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(6, 8, 2 * block_size, generator=gen, dtype=torch.float64)
    max_log10 = 3 if dtype == torch.float16 else 30
    magnitude = 10.0 ** torch.empty(6, 8, 1, dtype=torch.float64).uniform_(-max_log10, max_log10, generator=gen)
    spread = torch.rand(6, 8, 2 * block_size, generator=gen, dtype=torch.float64) ** 6  # many values far below amax
    x = (x * spread * magnitude).to(dtype)
    x[0, 0] = 0.0
    x[0, 1] = -0.0
    y = qdq(x)
    assert y.dtype == dtype
    assert_bits_equal(y, reference_qdq(x, block_size, fmt))


@pytest.mark.parametrize("fmt", list(QDQ))
def test_qdq_is_idempotent_and_shape_preserving(fmt):
    qdq, block_size = QDQ[fmt]
    x = torch.randn(3, 5, 4 * block_size, dtype=torch.bfloat16)
    once = qdq(x)
    assert once.shape == x.shape
    assert_bits_equal(qdq(once), once)


def test_qdq_rejects_bad_input():
    with pytest.raises(ValueError, match="multiple of block_size"):
        fp8_qdq(torch.randn(4, 48))
    with pytest.raises(ValueError, match="floating-point"):
        fp4_qdq_e8m0_scale(torch.ones(4, 32, dtype=torch.int32))
    with pytest.raises(ValueError, match="straight_through"):
        fp4_qdq_e4m3_scale(torch.randn(4, 16, requires_grad=True))


# ---------------------------------------------------------------------------------------------------------------------
# Straight-through gradient
# ---------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", list(QDQ))
def test_straight_through_forward_is_qdq_and_gradient_is_identity(fmt):
    qdq, block_size = QDQ[fmt]
    x = torch.randn(4, 2 * block_size, dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn_like(x)
    y = straight_through(qdq)(x)
    assert_bits_equal(y.detach(), qdq(x.detach()))
    assert not torch.equal(y.detach(), x.detach())  # the forward really quantized
    y.backward(grad)
    assert_bits_equal(x.grad, grad)


def test_straight_through_forwards_arguments():
    x = torch.randn(2, 16, requires_grad=True)
    y = straight_through(fp8_qdq)(x, block_size=16)
    assert_bits_equal(y.detach(), fp8_qdq(x.detach(), block_size=16))
    z = QuantizeDequantize.apply(x, fp4_qdq_e4m3_scale)
    (y * 3 + z).sum().backward()
    assert_bits_equal(x.grad, torch.full_like(x, 4.0))


# ---------------------------------------------------------------------------------------------------------------------
# The reference's FP8 / FP4 GEMMs
# ---------------------------------------------------------------------------------------------------------------------


def reference_block_scaled_gemm(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``fp8_gemm`` / ``fp4_gemm`` after ``act_quant(x, 32, "ue8m0")``, as their CPU port and the kernels define them,
    from codes and scales: the input's E8M0 scales and e4m3 codes (float64 grids), the weight's codes [N, K] and
    per-row, per-32 scales [N, K/32]; per K block, the codes' product (exact in fp64, rounded to fp32 as reference
    numerics does) times the input's and the weight's scales, summed in fp32 from zero in K order, cast to x's
    dtype."""
    groups = x.double().unflatten(-1, (-1, 32))
    x_scales = _pow2_at_least(groups.abs().amax(dim=-1, keepdim=True).clamp_min(float(torch.tensor(1e-4))), 448.0)
    x_codes = _round_to_grid((groups / x_scales).clamp(-448, 448), E4M3_GRID)
    acc = torch.zeros(x.shape[0], codes.shape[0], dtype=torch.float32)
    for k in range(x_codes.shape[1]):
        partial = (x_codes[:, k] @ codes[:, 32 * k : 32 * (k + 1)].double().T).float()
        acc += partial * x_scales[:, k].float() * scales[:, k].float().unsqueeze(0)
    return acc.to(x.dtype)


@pytest.mark.parametrize("weight_format", ["fp8", "fp4"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fp8_gemm_linear_is_the_reference_kernels_block_sum(weight_format, dtype):
    gen = torch.Generator().manual_seed(11)
    magnitudes = 10.0 ** torch.empty(48, 16, 1).uniform_(-3, 3, generator=gen)  # one per 32-wide block
    x = (torch.randn(48, 16, 32, generator=gen) * magnitudes).flatten(1).to(dtype)
    weight = torch.randn(96, 512, generator=gen) * 10.0 ** torch.empty(96, 1).uniform_(-2, 2, generator=gen)
    if weight_format == "fp8":
        codes, block_scales = quantize_fp8_block(weight)
        dense = dequantize_fp8_block(codes, block_scales)
        scales = block_scales.float().repeat_interleave(32, dim=0)[: weight.shape[0]]
    else:
        packed, scales = quantize_fp4_rows(weight)
        dense, codes = dequantize_fp4_rows(packed, scales), unpack_fp4(packed).view(weight.shape)
    out = fp8_gemm_linear(x, dense.to(dtype))
    assert out.dtype == dtype
    assert_bits_equal(out, reference_block_scaled_gemm(x, codes, scales))
    # both halves matter: the input's quantization, and the fp32 sum of the blocks (not the product rounded once)
    assert not torch.equal(out, torch.nn.functional.linear(x.double(), dense.double()).to(dtype))
    if dtype == torch.float32:
        assert not torch.equal(out, torch.nn.functional.linear(fp8_qdq(x).double(), dense.double()).to(dtype))


# ---------------------------------------------------------------------------------------------------------------------
# Checkpoint formats
# ---------------------------------------------------------------------------------------------------------------------


def test_unpack_fp4_all_bytes_from_bit_layout():
    codes = torch.arange(256)
    packed = codes.to(torch.uint8)

    def decode(code: torch.Tensor) -> torch.Tensor:  # s eem: 0.5 * m for e == 0, else (1 + m/2) * 2^(e-1)
        sign, exponent, mantissa = code >> 3, (code >> 1) & 3, code & 1
        magnitude = torch.where(exponent == 0, 0.5 * mantissa, (1 + 0.5 * mantissa) * 2.0 ** (exponent - 1))
        return torch.where(sign == 1, -magnitude, magnitude).float()

    expected = torch.stack([decode(codes & 0xF), decode(codes >> 4)], dim=-1).flatten()  # even column = low nibble
    for dtype in (torch.uint8, torch.int8, torch.float4_e2m1fn_x2):
        assert_bits_equal(unpack_fp4(packed.view(dtype)), expected)
    assert unpack_fp4(torch.tensor([[0x21, 0x8F]], dtype=torch.uint8)).tolist() == [[0.5, 1.0, -6.0, -0.0]]


def test_dequantize_fp8_block_ceil_rows():
    weight = torch.ones(40, 64).to(torch.float8_e4m3fn)
    scale = torch.tensor([[1.0, 2.0], [4.0, 0.5]]).to(torch.float8_e8m0fnu)  # [ceil(40/32), 64/32]
    out = dequantize_fp8_block(weight, scale)
    assert out.dtype == torch.float32 and out.shape == (40, 64)
    assert out[:32, :32].eq(1).all() and out[:32, 32:].eq(2).all()
    assert out[32:, :32].eq(4).all() and out[32:, 32:].eq(0.5).all()


def test_dequantize_rows_formats():
    weight = torch.tensor([[1.5] * 32 + [-3.0] * 32, [0.25] * 64]).to(torch.float8_e4m3fn)
    scale = torch.tensor([[2.0, 0.5], [8.0, 1.0]]).to(torch.float8_e8m0fnu)
    expected = torch.tensor([[3.0] * 32 + [-1.5] * 32, [2.0] * 32 + [0.25] * 32])
    assert_bits_equal(dequantize_fp8_rows(weight, scale), expected)

    packed = torch.full((2, 32), 0x9B, dtype=torch.uint8)  # low nibble 0xB = -1.5, high 0x9 = -0.5
    out = dequantize_fp4_rows(packed.view(torch.int8), scale)
    assert out.shape == (2, 64)
    assert out[0, :32].tolist() == [-3.0, -1.0] * 16 and out[1, 32:].tolist() == [-1.5, -0.5] * 16


def test_dequantize_rejects_mismatched_inputs():
    fp8 = torch.zeros(40, 64).to(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="scale shape"):
        dequantize_fp8_block(fp8, torch.ones(1, 2).to(torch.float8_e8m0fnu))
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        dequantize_fp8_rows(torch.zeros(4, 32), torch.ones(4, 1).to(torch.float8_e8m0fnu))
    with pytest.raises(ValueError, match="float8_e8m0fnu"):
        dequantize_released_tensor(fp8, torch.ones(2, 2))
    with pytest.raises(ValueError, match="fits neither"):
        dequantize_released_tensor(fp8, torch.ones(3, 2).to(torch.float8_e8m0fnu))
    with pytest.raises(ValueError, match="cannot dequantize"):
        dequantize_released_tensor(torch.zeros(4, 32, dtype=torch.bfloat16), torch.ones(4, 1).to(torch.float8_e8m0fnu))
    with pytest.raises(ValueError, match="scale shape"):
        dequantize_released_tensor(torch.zeros(4, 16, dtype=torch.int8), torch.ones(4, 2).to(torch.float8_e8m0fnu))


def test_released_checkpoint_dequantizes_exactly(fixtures_dir):
    quant_dir = fixtures_dir / "quant_format"
    manifest = json.loads((quant_dir / "manifest.json").read_text())
    stored = load_file(quant_dir / "checkpoint_format.safetensors")
    expected = load_file(quant_dir / "dequantized_fp32.safetensors")
    weights = [name for name in manifest if name.endswith(".weight")]
    assert sorted(weights) == sorted(expected) and len(weights) == 10
    kinds = set()
    for name in weights:
        weight, scale = stored[name], stored[name.removesuffix("weight") + "scale"]
        assert str(weight.dtype) == manifest[name]["dtype"] and list(weight.shape) == manifest[name]["shape"]
        rows = weight.shape[0]
        if weight.dtype == torch.int8:
            kind, direct = "fp4_rows", dequantize_fp4_rows(weight, scale)
        elif scale.shape[0] == rows:
            kind, direct = "fp8_rows", dequantize_fp8_rows(weight, scale)
        else:
            kind, direct = "fp8_block", dequantize_fp8_block(weight, scale)
        kinds.add(kind)
        assert_bits_equal(direct, expected[name])
        assert_bits_equal(dequantize_released_tensor(weight, scale), expected[name])
    assert kinds == {"fp4_rows", "fp8_rows", "fp8_block"}
