"""bitsandbytes 8-bit and 4-bit (NF4) loading through BitsAndBytesConfig, and QLoRA on CPU (bitsandbytes is in the
``test`` extra as well as ``quant``, so these tests run in CI rather than skip)."""

import collections

import pytest
import torch

from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
from transformers import BitsAndBytesConfig

import modeling_dsv41  # noqa: F401  (registers the Auto classes)
from configuration import DeepseekV41Config
from modeling_dsv41 import DeepseekV41ForCausalLM
from modeling_dsv41.released.writing import save_released_checkpoint
from reference_fixture import stub_tokenizer

# Text-only, two layers (window-only + a ratio-2 KV/index source with Engram). Most widths are multiples of 64 so
# that 4-bit quantizes most Linears on CPU; index_n_heads=4 gives the indexer's weights_proj 4 outputs, which bnb's
# CPU 4-bit kernels cannot pack.
TEXT = dict(
    vocab_size=512, hidden_size=64, moe_intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
    head_dim=64, qk_rope_head_dim=16, q_lora_rank=64, o_lora_rank=32, o_groups=2, n_routed_experts=4,
    num_experts_per_tok=2, sliding_window=16, compress_ratios=[0, 2], kv_source_layer_ids=[1],
    index_source_layer_ids=[1], index_n_heads=4, index_head_dim=64, index_topk=8, candidate_source_layer_id=-1,
    engram_layer_ids=[0], engram_num_embeddings=[660], engram_vocab_size=100, engram_n_heads=2, engram_head_dim=32,
    engram_compressed_vocab_size=256, num_nextn_predict_layers=0,
)
LORA_TARGETS = r"model\.layers\.\d+\.(attn\.(wq_a|wq_b|wkv|wo_b)|ffn\.shared_experts\.(w1|w2|w3))"
EXPERT_PARAMETERS = ["experts.gate_up_proj", "experts.down_proj"]
NF4 = dict(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.bfloat16)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    torch.manual_seed(0)
    model = DeepseekV41ForCausalLM(DeepseekV41Config(text_config=TEXT))
    model.model.engram_hasher.load_tokenizer(stub_tokenizer())
    folder = tmp_path_factory.mktemp("bnb")
    model.save_pretrained(folder)
    return folder


def _linear_types(model) -> dict[str, str]:
    return {name: type(m).__name__ for name, m in model.named_modules() if "Linear" in type(m).__name__}


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits.float()


@pytest.mark.parametrize("kind", ["4bit", "8bit"])
def test_quantized_load_keeps_high_precision_modules(checkpoint, kind):
    config = BitsAndBytesConfig(**NF4) if kind == "4bit" else BitsAndBytesConfig(load_in_8bit=True)
    model = DeepseekV41ForCausalLM.from_pretrained(checkpoint, quantization_config=config, dtype=torch.bfloat16)
    quantized = "Linear4bit" if kind == "4bit" else "Linear8bitLt"
    types = _linear_types(model)
    for name in ("layers.0.attn.wq_a", "layers.0.attn.wq_b", "layers.1.attn.wkv", "layers.1.attn.wo_b",
                 "layers.1.ffn.shared_experts.w1", "layers.1.attn.indexer.wq_b"):
        assert types[f"model.{name}"] == quantized, name
    # read as raw tensors by the model (fp32 head and ratio-2 compressor, Engram wkv's dtype): never quantized
    for name in ("lm_head", "model.layers.1.attn.compressor.wkv", "model.layers.1.attn.compressor.wgate",
                 "model.layers.0.engram.wkv"):
        assert types[name] != quantized, name
    assert (types["model.layers.1.attn.indexer.weights_proj"] == quantized) == (kind == "8bit")  # 4 outputs: no 4-bit
    backbone = model.model
    assert model.lm_head.weight.dtype == backbone.layers[1].hc_attn_fn.dtype == backbone.layers[1].ffn.gate.bias.dtype
    assert model.lm_head.weight.dtype == torch.float32
    assert backbone.layers[0].ffn.gate.weight.dtype == backbone.layers[0].attn_norm.weight.dtype == torch.bfloat16
    assert backbone.layers[0].engram.q_weight.dtype == torch.bfloat16
    # the fused routed experts are 3-D parameters, not Linears: transformers' bnb integration leaves them in `dtype`
    assert backbone.layers[0].ffn.experts.gate_up_proj.dtype == torch.bfloat16
    assert set(model.config.quantization_config.llm_int8_skip_modules) >= {"lm_head", "model.layers.0.engram.wkv"}

    reference = DeepseekV41ForCausalLM.from_pretrained(checkpoint, dtype=torch.bfloat16)
    ids = torch.randint(0, 500, (2, 12), generator=torch.Generator().manual_seed(0))
    ours, theirs = _logits(model, ids), _logits(reference, ids)
    # a tiny random model: NF4 keeps ~4 bits per weight, so only the direction of the logits is close
    assert torch.nn.functional.cosine_similarity(ours.flatten(), theirs.flatten(), dim=0) > (0.95 if kind == "4bit" else 0.99)


def test_released_checkpoint_quantizes_on_load(checkpoint, tmp_path):
    """FP8/FP4 weights are dequantized first, then bnb quantizes the result."""
    source = DeepseekV41ForCausalLM.from_pretrained(checkpoint, dtype=torch.bfloat16)
    save_released_checkpoint(source, tmp_path)
    stub_tokenizer().save(str(tmp_path / "tokenizer.json"))
    model = DeepseekV41ForCausalLM.from_pretrained(tmp_path, quantization_config=BitsAndBytesConfig(**NF4),
                                                   dtype=torch.bfloat16)
    assert _linear_types(model)["model.layers.0.ffn.shared_experts.w1"] == "Linear4bit"
    # the FP4 routed experts were dequantized and merged into the fused tensors
    source_experts = source.model.layers[0].ffn.experts.gate_up_proj
    assert model.model.layers[0].ffn.experts.gate_up_proj.shape == source_experts.shape
    assert torch.isfinite(_logits(model, torch.randint(0, 500, (1, 8)))).all()


def test_qlora_trains_on_cpu(checkpoint):
    model = DeepseekV41ForCausalLM.from_pretrained(checkpoint, quantization_config=BitsAndBytesConfig(**NF4),
                                                   dtype=torch.bfloat16)
    model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=True)
    config = LoraConfig(
        r=8, lora_alpha=16, lora_dropout=0.0, target_modules=LORA_TARGETS, target_parameters=EXPERT_PARAMETERS
    )
    model = get_peft_model(model, config)
    adapted = collections.Counter(getattr(m, "parameter_name", None) or name.split(".")[-1]
                                  for name, m in model.base_model.model.named_modules() if hasattr(m, "lora_A"))
    assert adapted == {"wq_a": 2, "wq_b": 2, "wkv": 2, "wo_b": 2, "w1": 2, "w2": 2, "w3": 2, "gate_up_proj": 2,
                       "down_proj": 2}
    assert all("lora_" in name for name, p in model.named_parameters() if p.requires_grad)

    ids = torch.randint(0, 500, (2, 12), generator=torch.Generator().manual_seed(1))
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    model.train()
    losses = []
    for _ in range(4):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.05, losses
