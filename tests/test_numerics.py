"""Reference numerics: what the mode changes, and that the parity results it gives do not depend on the CPU."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from modeling_dsv41.numerics import flash_kernel_exp, portable_attention, reference_numerics

REPO_ROOT = Path(__file__).resolve().parents[1]


def _bf16(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(sum(shape))).bfloat16()


def _linear_module(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    layer = torch.nn.Linear(b.shape[1], b.shape[0], bias=False, dtype=b.dtype).requires_grad_(False)
    layer.weight.copy_(b)
    return layer(a)


PRODUCTS = {
    "linear": lambda a, b: F.linear(a, b),
    "nn.Linear": _linear_module,
    "matmul-operator": lambda a, b: a @ b.T,
    "matmul": lambda a, b: torch.matmul(a, b.T),
    "einsum": lambda a, b: torch.einsum("md,nd->mn", a, b),
    "bmm": lambda a, b: torch.bmm(a[None], b.T[None])[0],
}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("name", PRODUCTS)
def test_products_are_accumulated_in_fp64_and_rounded_once(name, dtype):
    a, b = _bf16(24, 96).to(dtype), _bf16(40, 96).to(dtype)
    with torch.no_grad(), reference_numerics():
        got = PRODUCTS[name](a, b)
    assert got.dtype == dtype
    assert torch.equal(got, (a.double() @ b.double().T).to(dtype))


WIDENED_OPS = {
    "sum": lambda x: x.sum(-1),
    "mean": lambda x: torch.mean(x, dim=0),
    "softmax": lambda x: x.softmax(-1),
    "softmax-dtype": lambda x: F.softmax(x, -1, dtype=torch.float32 if x.dtype != torch.float64 else None),
    "logsumexp": lambda x: torch.logsumexp(x, -1),
    "rms_norm": lambda x: F.rms_norm(x, (x.shape[-1],)),
    "exp": torch.exp,
    "sigmoid": lambda x: x.sigmoid(),
    "silu": F.silu,
    "softplus": F.softplus,
    "rsqrt": lambda x: torch.rsqrt(x.abs()),
    "cos": lambda x: x.cos(),
    # MKL's vector math (its last bit follows MKL_CBWR) or, in the scalar kernels, libm
    "tan": lambda x: x.tan(),
    "atan": torch.atan,
    "asin": lambda x: x.clamp(-0.875, 0.875).asin(),
    "acos": lambda x: torch.acos(x.clamp(-0.875, 0.875)),
    "log10": lambda x: x.abs().log10(),
    "erfc": torch.erfc,
    "erfinv": lambda x: x.clamp(-0.875, 0.875).erfinv(),
    "sinh": lambda x: x.sinh(),
    "atanh": lambda x: x.clamp(-0.875, 0.875).atanh(),
    "lgamma": torch.lgamma,
    "atan2": lambda x: torch.atan2(x, x.flip(-1)),
    "hypot": lambda x: torch.hypot(x, x.flip(-1)),
    "logaddexp": lambda x: torch.logaddexp(x, x.flip(-1)),
    "selu": F.selu,
    "glu": lambda x: F.glu(x, -1),
}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("name", WIDENED_OPS)
def test_reductions_and_transcendentals_are_computed_in_fp64_and_rounded_once(name, dtype):
    """ATen's vectorized sums and vector-library exps give other last bits on another ISA; in fp64 they do not."""
    x = torch.randn(33, 70, generator=torch.Generator().manual_seed(1)).to(dtype)
    with reference_numerics():
        got = WIDENED_OPS[name](x)
    exact = WIDENED_OPS[name](x.double())
    assert got.dtype == WIDENED_OPS[name](x).dtype
    assert torch.equal(got, exact.to(got.dtype))


def _weights(x: torch.Tensor) -> torch.Tensor:
    return torch.where(x > 0, 0.875, 0.125).to(x.dtype)  # exact in every dtype, on both sides of 0.5


FUSED = {
    "addcmul": (lambda x, y: torch.addcmul(x, x, y, value=0.3), lambda x, y: x + 0.3 * x * y),
    "addcdiv": (lambda x, y: x.addcdiv(x, y, value=-0.7), lambda x, y: x + -0.7 * (x / y)),
    "lerp": (lambda x, y: torch.lerp(x, y, 0.3), lambda x, y: x + 0.3 * (y - x)),
    "lerp-large": (lambda x, y: torch.lerp(x, y, 0.7), lambda x, y: y - (y - x) * (1 - 0.7)),
    "lerp-tensor": (
        lambda x, y: torch.lerp(x, y, _weights(x)),
        lambda x, y: torch.where(_weights(x) < 0.5, x + _weights(x) * (y - x), y - (y - x) * (1 - _weights(x))),
    ),
    "lerp_": (lambda x, y: x.clone().lerp_(y, 0.3), lambda x, y: x + 0.3 * (y - x)),
}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("name", FUSED)
def test_fused_multiply_adds_are_separate_fp64_steps_rounded_once(name, dtype):
    """Vector code fuses the last multiply and add (one rounding), the scalar kernels do not: where the sum cancels
    that shows even in a rounded fp64 result, so the mode runs them as ATen's scalar formula in fp64."""
    x = torch.randn(64, 70, generator=torch.Generator().manual_seed(5)).to(dtype)
    y = (-x * 7 / 3).to(dtype)  # lerp(x, y, 0.3) = 0.7·x + 0.3·y cancels to a few ulps
    fused, separate = FUSED[name]
    with reference_numerics():
        got = fused(x, y)
    assert got.dtype == dtype
    assert torch.equal(got, separate(x.double(), y.double()).to(dtype))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_distances_and_convolutions_are_accumulated_in_fp64_and_rounded_once(dtype):
    """cdist's products go to MKL, convolutions to oneDNN (its kernel follows ONEDNN_MAX_CPU_ISA)."""
    a, b = _bf16(24, 96).to(dtype), _bf16(40, 96).to(dtype)
    images, kernels = _bf16(2, 8, 30).to(dtype), _bf16(4, 8, 3).to(dtype)
    with torch.no_grad(), reference_numerics():
        distances, convolved = torch.cdist(a, b), F.conv1d(images, kernels, padding=1)
    assert torch.equal(distances, torch.cdist(a.double(), b.double()).to(dtype))
    assert torch.equal(convolved, F.conv1d(images.double(), kernels.double(), padding=1).to(dtype))


def test_complex_products_are_rounded_once_and_real_ones_left_alone():
    """RoPE rotates by a complex product, which ATen computes in vector code of its own per ISA."""
    gen = torch.Generator().manual_seed(2)
    x, y = (
        torch.randn(16, 33, dtype=torch.complex64, generator=gen),
        torch.randn(33, dtype=torch.complex64, generator=gen),
    )
    with reference_numerics():
        got = x * y
        real = x.real * y.real
    assert got.dtype == torch.complex64 and torch.equal(
        got, (x.to(torch.complex128) * y.to(torch.complex128)).to(torch.complex64)
    )
    assert real.dtype == torch.float32 and torch.equal(real, x.real * y.real)


def _every_finite(dtype: torch.dtype, count: int | None = None) -> torch.Tensor:
    """Every finite non-negative value of a 16-bit dtype, or ``count`` random finite non-negative fp32 values (by
    their bits, not through an ISA-dependent random normal)."""
    if count is None:
        values = torch.arange(2**15, dtype=torch.int32).to(torch.int16).view(dtype)
    else:
        bits = torch.randint(0, 0x7F800000, (count,), generator=torch.Generator().manual_seed(3), dtype=torch.int32)
        values = bits.view(torch.float32)
    return values[values.isfinite()]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_sqrt_is_correctly_rounded(dtype):
    """ATen's fp32 sqrt is MKL's vector math, whose last bit follows the CPU (with ``MKL_CBWR=COMPATIBLE`` 17% of
    roots are off by an ulp, on this Intel CPU's AVX-512 path 0.6%): in the mode every root is the correctly rounded
    one, which numpy's float64 root rounded once gives for formats of 24 bits or fewer."""
    x = _every_finite(dtype, count=500_000 if dtype == torch.float32 else None)
    exact = torch.from_numpy(np.sqrt(x.double().numpy())).to(dtype)
    with reference_numerics():
        assert torch.equal(x.sqrt(), exact) and torch.equal(torch.sqrt(x), exact)
        assert torch.equal(x.clone().sqrt_(), exact)
        special = torch.tensor([0.0, -0.0, math.inf, -1.0, math.nan], dtype=dtype).sqrt()
    assert torch.equal(special[:3], torch.tensor([0.0, -0.0, math.inf], dtype=dtype))
    assert special[1].signbit() and special[3:].isnan().all()


def test_sqrt_gradient_is_the_roots():
    x = torch.rand(64, generator=torch.Generator().manual_seed(4)).add(0.01).requires_grad_()
    with reference_numerics():
        x.sqrt().sum().backward()
    assert torch.equal(x.grad, (0.5 / x.detach().double().sqrt()).float())


def test_in_place_ops_are_rounded_once_and_write_back():
    x = torch.randn(8, 40)
    expected = torch.exp(x.double()).float()
    with reference_numerics():
        y = x.exp_()
    assert y is x and torch.equal(x, expected)


def test_exact_integer_and_mixed_ops_are_left_alone():
    a, b = torch.randn(8, 16), torch.randn(16, 4)
    ints = torch.randint(-5, 5, (8, 16)), torch.randint(-5, 5, (16, 4))
    with reference_numerics():
        assert torch.equal(ints[0] @ ints[1], torch.matmul(*ints)) and (ints[0] @ ints[1]).dtype == torch.int64
        assert torch.equal(a.abs().sqrt(), torch.sqrt(a.abs())) and (a + a).dtype == torch.float32
        with pytest.raises(RuntimeError):  # a mixed-dtype product fails as it does without the mode
            a.bfloat16() @ b


def test_disabled_mode_is_a_no_op_and_gradients_flow():
    a, b = _bf16(4, 8).requires_grad_(), _bf16(8, 3)
    with reference_numerics(enabled=False):
        assert torch.equal(a @ b, torch.matmul(a, b))
    with reference_numerics():
        (a @ b).float().softmax(-1).sum().backward()
    assert a.grad is not None and a.grad.dtype == torch.bfloat16


def test_flash_kernel_exp_is_a_bf16_grade_exp():
    x = torch.linspace(-87.0, 0.0, 4099)
    got, exact = flash_kernel_exp(x), torch.exp(x.double())
    # the kernel's fast exponential is good to 1.1e-4 relative (measured): inside one bf16 ulp (2^-8 = 3.9e-3)
    assert ((got.double() - exact).abs() / exact).max().item() < 2**-12
    tail = x.shape[-1] % 16  # the last S % 16 values take the correctly rounded exp
    assert torch.equal(got[-tail:], exact[-tail:].float())
    assert flash_kernel_exp(torch.tensor([-100.0] * 16)).eq(0).all()


def test_portable_attention_is_softmax_attention_within_bf16_rounding():
    q, k, v = _bf16(2, 4, 33, 16), _bf16(2, 4, 50, 16), _bf16(2, 4, 50, 8)
    got = portable_attention(q, k, v)
    exact = F.scaled_dot_product_attention(q.double(), k.double(), v.double())
    # numerators and output each rounded to bf16 once: a few bf16 ulps of the output's scale
    assert got.dtype == torch.bfloat16
    assert (got.double() - exact).abs().max().item() <= 4 * 2**-8 * exact.abs().max().item()
    with reference_numerics():
        assert torch.equal(F.scaled_dot_product_attention(q, k, v), got)
        assert torch.equal(F.scaled_dot_product_attention(q, k, v, scale=0.5), portable_attention(q, k, v, 0.5))


# Another CPU on this one: MKL picks its fp32 GEMM kernel (and summation order) by CPU vendor and instruction set,
# which ``MKL_CBWR`` overrides, and ATen's / oneDNN's kernels follow ``ATEN_CPU_CAPABILITY`` / ``ONEDNN_MAX_CPU_ISA``.
# Outside the mode, MKL_CBWR=COMPATIBLE alone moves these logits by up to 0.44. In the mode every parity case gives
# the same bits under all eight, equal to DeepSeek's reference run in the mode (tests/data).
MKL_PATHS = {
    "unset": {},
    "COMPATIBLE": {"MKL_CBWR": "COMPATIBLE"},
    "AVX2": {"MKL_CBWR": "AVX2"},
    "AVX512": {"MKL_CBWR": "AVX512"},
}
ATEN_PATHS = {"unlimited": {}, "avx2": {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}}
EMULATED_CPUS = {
    f"MKL_CBWR={mkl} ATen={aten}": {**MKL_PATHS[mkl], **ATEN_PATHS[aten]} for mkl in MKL_PATHS for aten in ATEN_PATHS
}
CPU_VARIABLES = ("MKL_CBWR", "ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA")

_PARITY_RUN = """
import sys, torch
from pathlib import Path
from safetensors.torch import load_file, save_file
sys.path.insert(0, str(Path(sys.argv[1]) / "tests"))
from reference_fixture import reference_model
from test_parity import REFERENCE, golden_prompt_inputs
torch.set_num_threads(1)
fixtures, out = Path(sys.argv[2]), sys.argv[3]
logits = {}
for mode in ("noqdq", "qdq"):
    golden = load_file(Path(sys.argv[1]) / "tests" / REFERENCE[mode])
    for variant in ("dense", "sparse"):
        model = reference_model(fixtures, variant, emulate_quantization=(mode == "qdq"))
        for prompt in ("fixture", "text", "image"):
            with torch.no_grad():
                inputs = golden_prompt_inputs(fixtures, golden, prompt)
                logits[f"{variant}-{mode}-{prompt}"] = model(**inputs).logits[0].contiguous()
save_file(logits, out)
"""


@pytest.mark.slow
def test_parity_logits_are_the_same_bits_on_every_emulated_cpu(fixtures_dir, tmp_path):
    """Every case of ``test_parity``'s goldens (the fixture, text and image prompts, dense and sparse, with and
    without QDQ), in one subprocess per emulated CPU, two at a time (one thread each). The image prompt with QDQ
    is the case an MKL-dependent op showed on (``sqrt``, see ``numerics.correctly_rounded_sqrt``)."""
    base = {k: v for k, v in os.environ.items() if k not in CPU_VARIABLES}
    outputs = {name: tmp_path / f"{i}.safetensors" for i, name in enumerate(EMULATED_CPUS)}
    names = list(EMULATED_CPUS)
    for pair in (names[i : i + 2] for i in range(0, len(names), 2)):
        running = [
            subprocess.Popen(
                [sys.executable, "-c", _PARITY_RUN, str(REPO_ROOT), str(fixtures_dir), str(outputs[name])],
                env={**base, **EMULATED_CPUS[name], "PYTHONPATH": str(REPO_ROOT)},
            )
            for name in pair
        ]
        for name, process in zip(pair, running):
            assert process.wait(timeout=600) == 0, name
    goldens = {mode: load_file(REPO_ROOT / f"tests/data/reference_{mode}.safetensors") for mode in ("noqdq", "qdq")}
    for name, path in outputs.items():
        logits = load_file(path)
        assert len(logits) == 12, name
        for run, value in logits.items():
            variant, mode, prompt = run.split("-")
            assert torch.equal(value, goldens[mode][f"{variant}_{prompt}_logits"]), (name, run)
