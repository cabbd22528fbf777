"""DeepSeek's reference inference code loads our ``dsv41 export --format released`` and decodes as our model does.

``tests/data/reference_export.safetensors`` (made by ``tests/data/make_goldens.py``, see tests/data/README.md) holds
what the reference did with the export of a seeded fine-tune of the dense fixture
(``reference_fixture.released_finetune``): the sha256 of every file it read, and its greedy decode of
``EXPORT_NEW_TOKENS`` ids from ``export_prompt()``, built two ways, each reproduced here by our ``from_pretrained`` of
the same export (rebuilt from scratch, with the same bytes) in reference numerics, QDQ on as released:

* ``bf16``: every weight dequantized by the convert step (the build the fixtures were made with), so every Linear is
  a bf16 product. Ours: the export loaded dequantized (``FineGrainedFP8Config(dequantize=True)``), plain bf16 Linears
  and experts.
* ``fp8``: as released, the FP8 Linears and FP4 experts through ``fp8_gemm`` / ``fp4_gemm``, which quantize their
  inputs to FP8 too (one E8M0 scale per 32 values) and sum the 32-wide K blocks' products in fp32. Ours: the export
  loaded in its native storage (FP8 / FP4 weights kept), whose modules compute as those kernels do in reference
  numerics with ``emulate_quantization`` (``codec.fp8_gemm_linear``).

Both decodes equal the reference's, ids and logits, bit for bit.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file
from transformers import FineGrainedFP8Config

from configuration import DeepseekV41Config
from modeling_dsv41 import DeepseekV41ForCausalLM
from modeling_dsv41.generation.cache import DeepseekV41Cache
from modeling_dsv41.released.native_precision import WeightOnlyFP4Experts, WeightOnlyFP8Linear
from reference_fixture import EXPORT_NEW_TOKENS, export_prompt, export_read_files, released_finetune

GOLDEN = Path(__file__).parent / "data" / "reference_export.safetensors"


@pytest.fixture(scope="module")
def golden() -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    with safe_open(GOLDEN, "pt") as f:
        hashes = json.loads(f.metadata()["sha256"])
    return load_file(GOLDEN), hashes


@pytest.fixture(scope="module")
def exported(fixtures_dir, tmp_path_factory) -> Path:
    return released_finetune(fixtures_dir, tmp_path_factory.mktemp("released-export"))


def load(exported: Path, **kwargs) -> DeepseekV41ForCausalLM:
    config = DeepseekV41Config.from_pretrained(exported)
    config.text_config.emulate_quantization = True  # the reference's window KV, compressed KV and indexer QDQ
    config.reference_numerics = True
    return DeepseekV41ForCausalLM.from_pretrained(exported, config=config, dtype=torch.bfloat16, **kwargs).eval()


@pytest.fixture(scope="module")
def bf16_build(exported) -> DeepseekV41ForCausalLM:
    """The ``bf16`` reference build's counterpart: every weight dequantized on load."""
    model = load(exported, quantization_config=FineGrainedFP8Config(dequantize=True))
    assert not any(isinstance(m, (WeightOnlyFP8Linear, WeightOnlyFP4Experts)) for m in model.modules())
    return model


@pytest.fixture(scope="module")
def fp8_build(exported) -> DeepseekV41ForCausalLM:
    """The ``fp8`` reference build's counterpart: the release's native storage, FP8 Linears and FP4 experts kept."""
    model = load(exported)
    layer = model.model.layers[0]
    assert isinstance(layer.attn.wq_a, WeightOnlyFP8Linear) and isinstance(layer.ffn.experts, WeightOnlyFP4Experts)
    return model


def decode(model: DeepseekV41ForCausalLM, forced: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy decode of EXPORT_NEW_TOKENS ids after ``export_prompt()`` with our cache, as the reference decodes:
    the ids and each step's last-position logits. With ``forced``, those ids are fed instead of our argmax."""
    cache, ids, logits = DeepseekV41Cache(model.config), [], []
    with torch.no_grad():
        out = model(export_prompt(), cache=cache)
        for step in range(EXPORT_NEW_TOKENS):
            last = out.logits[0, -1]
            ids.append(last.argmax())
            logits.append(last)
            if step + 1 < EXPORT_NEW_TOKENS:
                fed = ids[-1] if forced is None else forced[step]
                out = model(fed.view(1, 1), cache=cache)
    return torch.stack(ids), torch.stack(logits)


def test_the_export_has_the_bytes_the_reference_read(golden, exported):
    tensors, hashes = golden
    assert torch.equal(tensors["prompt_ids"], export_prompt())
    assert export_read_files(exported) == hashes


def test_our_decode_of_the_export_is_the_bf16_reference_s_bit_for_bit(golden, bf16_build):
    tensors, _ = golden
    ids, logits = decode(bf16_build)
    assert ids.tolist() == tensors["bf16_output_ids"].tolist()
    expected = tensors["bf16_logits"]
    assert logits.dtype == expected.dtype and torch.equal(logits, expected), (logits - expected).abs().max()


def test_our_natively_stored_decode_is_the_fp8_reference_s_bit_for_bit(golden, fp8_build):
    tensors, _ = golden
    ids, logits = decode(fp8_build)
    assert ids.tolist() == tensors["fp8_output_ids"].tolist()
    expected = tensors["fp8_logits"]
    assert logits.dtype == expected.dtype and torch.equal(logits, expected), (logits - expected).abs().max()
