"""``dsv41 export --format released`` (modeling_dsv41.serving.released_export) refuses the models the release's
storage cannot hold, before writing anything, with what to do instead: a model carrying a PEFT adapter, a
bitsandbytes-quantized model, and a model of another type."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from peft import LoraConfig, get_peft_model
from transformers import BitsAndBytesConfig, LlamaConfig, LlamaForCausalLM

import tiny_models
from modeling_dsv41.serving.released_export import export_released_checkpoint


def _tiny():
    return tiny_models.tiny_model(tiny_models.tiny_config(vision=False), engram_map="default")


def test_a_model_with_an_adapter_is_refused(tmp_path):
    adapted = get_peft_model(_tiny(), LoraConfig(r=2, target_modules=["wq_a"]))
    with pytest.raises(ValueError, match=r"carries PEFT adapters: merge them first.*--format vllm-lora"):
        export_released_checkpoint(adapted, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_bitsandbytes_model_is_refused(tmp_path):
    model = _tiny()
    model.hf_quantizer = SimpleNamespace(quantization_config=BitsAndBytesConfig(load_in_4bit=True))
    with pytest.raises(ValueError, match=r"(?i)quantized with bitsandbytes:.*load the fine-tune unquantized"):
        export_released_checkpoint(model, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_model_of_another_type_is_refused(tmp_path):
    config = LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2
    )
    with pytest.raises(ValueError, match=r"not a DeepSeek-V4\.1 model \(its config is LlamaConfig\)"):
        export_released_checkpoint(LlamaForCausalLM(config), tmp_path / "out")
    assert not (tmp_path / "out").exists()
