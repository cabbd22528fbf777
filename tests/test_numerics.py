"""Reference numerics: what the mode changes, and that the parity results it gives do not depend on the CPU."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

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


@pytest.mark.parametrize("name", PRODUCTS)
def test_bf16_products_are_computed_in_fp32_and_rounded_once(name):
    a, b = _bf16(24, 96), _bf16(40, 96)
    with torch.no_grad(), reference_numerics():
        got = PRODUCTS[name](a, b)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, (a.float() @ b.float().T).bfloat16())


def test_fp32_integer_and_mixed_products_are_left_alone():
    a, b = torch.randn(8, 16), torch.randn(16, 4)
    ints = torch.randint(-5, 5, (8, 16)), torch.randint(-5, 5, (16, 4))
    with reference_numerics():
        assert torch.equal(a @ b, torch.matmul(a, b)) and (a @ b).dtype == torch.float32
        assert torch.equal(ints[0] @ ints[1], torch.matmul(*ints))
        with pytest.raises(RuntimeError):  # a mixed-dtype product fails as it does without the mode
            a.bfloat16() @ b


def test_disabled_mode_is_a_no_op_and_gradients_flow():
    a, b = _bf16(4, 8).requires_grad_(), _bf16(8, 3)
    with reference_numerics(enabled=False):
        assert torch.equal(a @ b, torch.matmul(a, b))
    with reference_numerics():
        (a @ b).float().sum().backward()
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


# The parity runs under torch's and oneDNN's instruction-set limits: ATen's AVX2 and scalar ("default") kernels and
# oneDNN's AVX2 ones stand in for CPUs without AVX-512 or AMX. In reference numerics every logit is the same bits.
ISA_LIMITS = {
    "unlimited": {},
    "avx2": {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"},
    "default": {"ATEN_CPU_CAPABILITY": "default", "ONEDNN_MAX_CPU_ISA": "AVX2"},
}

_PARITY_RUN = """
import sys, torch
from pathlib import Path
from safetensors.torch import save_file
sys.path.insert(0, str(Path(sys.argv[1]) / "tests"))
from reference_fixture import reference_inputs, reference_model
torch.set_num_threads(2)
fixtures, out, runs = Path(sys.argv[2]), sys.argv[3], sys.argv[4:]
logits = {}
for run in runs:
    variant, mode = run.split("-")
    model = reference_model(fixtures, variant, emulate_quantization=(mode == "qdq"))
    with torch.no_grad():
        logits[run] = model(**reference_inputs(fixtures)).logits[0].contiguous()
save_file(logits, out)
"""
# variant-mode; the sparse selection with QDQ is the most sensitive one (test_parity's REFERENCE_QDQ goldens)
PARITY_RUNS = ("dense-qdq", "sparse-noqdq", "sparse-qdq")


@pytest.mark.slow
def test_parity_logits_are_identical_under_isa_limits(fixtures_dir, tmp_path):
    results = {}
    for name, limits in ISA_LIMITS.items():
        out = tmp_path / f"{name}.safetensors"
        env = {k: v for k, v in os.environ.items() if k not in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA")}
        subprocess.run(
            [sys.executable, "-c", _PARITY_RUN, str(REPO_ROOT), str(fixtures_dir), str(out), *PARITY_RUNS],
            env={**env, **limits, "PYTHONPATH": str(REPO_ROOT)}, check=True, timeout=600,
        )
        results[name] = load_file(out)
    for name in ("avx2", "default"):
        for run in PARITY_RUNS:
            assert torch.equal(results[name][run], results["unlimited"][run]), (name, run)
