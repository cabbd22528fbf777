"""bitsandbytes 8-bit and 4-bit (NF4 / FP4, double quantization) loading through BitsAndBytesConfig, the routed
experts quantized too (modeling_dsv41/bnb_experts.py, loaded by modeling_dsv41/bnb_quantizer.py), QLoRA on them on
CPU, and what the inspector says they hold (bitsandbytes is in the ``test`` extra as well as ``quant``, so these
tests run in CI rather than skip)."""

import collections
import os
import subprocess
import sys
import warnings

import pytest
import torch

from peft import (
    LoraConfig,
    get_peft_model,
    get_peft_model_state_dict,
    prepare_model_for_kbit_training,
    set_peft_model_state_dict,
)
from transformers import BitsAndBytesConfig

import modeling_dsv41  # noqa: F401  (registers the Auto classes)
from configuration import DeepseekV41Config
from modeling_dsv41 import DeepseekV41ForCausalLM
from modeling_dsv41.bnb_experts import Bnb4bitExperts, Bnb8bitExperts, dequantized_experts
from modeling_dsv41.moe import DeepseekV41Experts
from modeling_dsv41.released.writing import save_released_checkpoint
from reference_fixture import stub_tokenizer

# Text-only, two layers (window-only + a ratio-2 KV/index source with Engram). Most widths are multiples of 64 so
# that 4-bit quantizes most Linears on CPU; index_n_heads=4 gives the indexer's weights_proj 4 outputs, which bnb's
# CPU 4-bit kernels cannot pack.
TEXT = dict(
    vocab_size=512,
    hidden_size=64,
    moe_intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    head_dim=64,
    qk_rope_head_dim=16,
    q_lora_rank=64,
    o_lora_rank=32,
    o_groups=2,
    n_routed_experts=4,
    num_experts_per_tok=2,
    sliding_window=16,
    compress_ratios=[0, 2],
    kv_source_layer_ids=[1],
    index_source_layer_ids=[1],
    index_n_heads=4,
    index_head_dim=64,
    index_topk=8,
    candidate_source_layer_id=-1,
    engram_layer_ids=[0],
    engram_num_embeddings=[660],
    engram_vocab_size=100,
    engram_n_heads=2,
    engram_head_dim=32,
    engram_compressed_vocab_size=256,
    num_nextn_predict_layers=0,
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
    for name in (
        "layers.0.attn.wq_a",
        "layers.0.attn.wq_b",
        "layers.1.attn.wkv",
        "layers.1.attn.wo_b",
        "layers.1.ffn.shared_experts.w1",
        "layers.1.attn.indexer.wq_b",
    ):
        assert types[f"model.{name}"] == quantized, name
    # read as raw tensors by the model (fp32 head and ratio-2 compressor, Engram wkv's dtype): never quantized
    for name in (
        "lm_head",
        "model.layers.1.attn.compressor.wkv",
        "model.layers.1.attn.compressor.wgate",
        "model.layers.0.engram.wkv",
    ):
        assert types[name] != quantized, name
    assert (types["model.layers.1.attn.indexer.weights_proj"] == quantized) == (kind == "8bit")  # 4 outputs: no 4-bit
    backbone = model.model
    assert model.lm_head.weight.dtype == backbone.layers[1].hc_attn_fn.dtype == backbone.layers[1].ffn.gate.bias.dtype
    assert model.lm_head.weight.dtype == torch.float32
    assert backbone.layers[0].ffn.gate.weight.dtype == backbone.layers[0].attn_norm.weight.dtype == torch.bfloat16
    assert backbone.layers[0].engram.q_weight.dtype == torch.bfloat16
    # the fused routed experts (3-D parameters, not Linears) are quantized too, in every layer
    experts_class = Bnb4bitExperts if kind == "4bit" else Bnb8bitExperts
    assert all(type(layer.ffn.experts) is experts_class for layer in backbone.layers)
    assert set(model.config.quantization_config.llm_int8_skip_modules) >= {"lm_head", "model.layers.0.engram.wkv"}

    reference = DeepseekV41ForCausalLM.from_pretrained(checkpoint, dtype=torch.bfloat16)
    ids = torch.randint(0, 500, (2, 12), generator=torch.Generator().manual_seed(0))
    ours, theirs = _logits(model, ids), _logits(reference, ids)
    # a tiny random model: NF4 keeps ~4 bits per weight, so only the direction of the logits is close
    assert torch.nn.functional.cosine_similarity(ours.flatten(), theirs.flatten(), dim=0) > (
        0.95 if kind == "4bit" else 0.99
    )


def test_released_checkpoint_refuses_bitsandbytes(checkpoint, tmp_path):
    """FP8 Linears and FP4 experts quantized again by bitsandbytes would only add error: refused, pointing to the
    native load."""
    source = DeepseekV41ForCausalLM.from_pretrained(checkpoint, dtype=torch.bfloat16)
    save_released_checkpoint(source, tmp_path)
    stub_tokenizer().save(str(tmp_path / "tokenizer.json"))
    native = DeepseekV41ForCausalLM.from_pretrained(tmp_path)
    native.save_pretrained(tmp_path / "saved-native")  # FP8 / FP4 as loaded, in transformers' FP8 layout
    for folder in (tmp_path, tmp_path / "saved-native"):
        for config in (BitsAndBytesConfig(**NF4), BitsAndBytesConfig(load_in_8bit=True)):
            with pytest.raises(ValueError, match="released storage.*without\\s+quantization_config.*loads natively"):
                DeepseekV41ForCausalLM.from_pretrained(folder, quantization_config=config, dtype=torch.bfloat16)


def _qlora(model):
    model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=True)
    config = LoraConfig(
        r=8, lora_alpha=16, lora_dropout=0.0, target_modules=LORA_TARGETS, target_parameters=EXPERT_PARAMETERS
    )
    return get_peft_model(model, config)


def test_qlora_trains_the_4bit_experts_adapters(checkpoint):
    model = _qlora(_load(checkpoint, FORMATS["nf4-double"]))
    adapted = collections.Counter(
        getattr(m, "parameter_name", None) or name.split(".")[-1]
        for name, m in model.base_model.model.named_modules()
        if hasattr(m, "lora_A")
    )
    assert adapted == {
        "wq_a": 2,
        "wq_b": 2,
        "wkv": 2,
        "wo_b": 2,
        "w1": 2,
        "w2": 2,
        "w3": 2,
        "gate_up_proj": 2,
        "down_proj": 2,
    }
    assert all("lora_" in name for name, p in model.named_parameters() if p.requires_grad)
    experts = model.base_model.model.model.layers[0].ffn.experts
    assert type(experts.get_base_layer()) is Bnb4bitExperts
    # the adapters have the experts' logical shape: r per expert, the full input width
    assert experts.lora_A["default"].weight.shape == (8 * 4, 64) and experts.lora_B["default"].weight.shape == (64, 32)

    ids = torch.randint(0, 500, (2, 12), generator=torch.Generator().manual_seed(1))
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    model.train()
    losses = []
    for step in range(4):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        if step == 0:
            expert_grads = {n: p.grad for n, p in model.named_parameters() if "ffn.experts" in n and p.requires_grad}
            assert len(expert_grads) == 8 and all(g is not None for g in expert_grads.values())
            # lora_B starts at 0, so only the B factors have a gradient at the first step
            assert all(g.abs().sum() > 0 for n, g in expert_grads.items() if "lora_B" in n)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.05, losses

    # the same adapters on the dequantized experts (PEFT's own target_parameters path on plain experts)
    model.eval()
    reference = _qlora(_with_dequantized_experts(_load(checkpoint, FORMATS["nf4-double"])))
    set_peft_model_state_dict(reference, get_peft_model_state_dict(model))
    reference.eval()
    ours, theirs = _logits(model, ids), _logits(reference, ids)
    scale = theirs.abs().max().item()
    # the training moved the logits by far more than the bound below (by ~1.3 on logits of ~1.2 here)
    assert (ours - _logits(_load(checkpoint, FORMATS["nf4-double"]), ids)).abs().max() > 0.2 * scale
    # the bf16 bound: ours computes each expert in the compute dtype (bf16: the fp32 hidden states rounded to bf16,
    # as Linear4bit does) and adds the adapters' delta in fp32; the reference's experts were cast to fp32 by
    # prepare_model_for_kbit_training (the same dequantized values), so it rounds nothing there. Two bf16 roundings
    # (2^-8 relative each) of the logits' scale bound the difference (measured: 0.33% of it)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=2**-7 * scale)


FORMATS = {
    "nf4": dict(NF4),
    "nf4-double": dict(NF4, bnb_4bit_use_double_quant=True),
    "fp4": dict(NF4, bnb_4bit_quant_type="fp4"),
    "fp4-double": dict(NF4, bnb_4bit_quant_type="fp4", bnb_4bit_use_double_quant=True),
    "int8": dict(load_in_8bit=True),
}


def _load(checkpoint, options: dict, **kwargs):
    return DeepseekV41ForCausalLM.from_pretrained(
        checkpoint, quantization_config=BitsAndBytesConfig(**options), dtype=torch.bfloat16, **kwargs
    )


def _with_dequantized_experts(model):
    """``model`` with its bitsandbytes experts replaced (in place) by plain experts holding their dequantized weights
    in the compute dtype: the reference the quantized experts must compute."""
    for name, module in list(model.named_modules()):
        if isinstance(module, (Bnb4bitExperts, Bnb8bitExperts)):
            model.set_submodule(name, dequantized_experts(module, torch.bfloat16))
    return model


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_each_expert_is_quantized_on_its_own_as_bitsandbytes_quantizes_a_weight(checkpoint, fmt):
    import bitsandbytes.functional as bnb_functional

    model = _load(checkpoint, FORMATS[fmt])
    dense = DeepseekV41ForCausalLM.from_pretrained(checkpoint, dtype=torch.bfloat16)
    experts, original = model.model.layers[1].ffn.experts, dense.model.layers[1].ffn.experts
    for name in ("gate_up_proj", "down_proj"):
        weights = getattr(original, name).detach()
        assert experts.weight_shape(name) == tuple(weights.shape)
        for expert in range(experts.num_experts):
            if fmt == "int8":  # Linear8bitLt's row-wise absmax int8, of the fp16 weight
                codes, scb, _ = bnb_functional.int8_vectorwise_quant(weights[expert].half())
                expected = bnb_functional.int8_vectorwise_dequant(codes, scb).to(torch.bfloat16)
            else:  # bitsandbytes' own 4-bit round trip of this expert alone: one state per expert
                options = FORMATS[fmt]
                data, state = bnb_functional.quantize_4bit(
                    weights[expert],
                    blocksize=64,
                    quant_type=options["bnb_4bit_quant_type"],
                    compress_statistics=options.get("bnb_4bit_use_double_quant", False),
                )
                expected = bnb_functional.dequantize_4bit(data, state)
            # elementwise dequantization, no GEMM: the same bits
            assert torch.equal(experts.dequantize(name, expert, dtype=torch.bfloat16), expected), (name, expert)
            rows = slice(3, 40)
            assert torch.equal(experts.dequantize(name, expert, rows, torch.bfloat16), expected[rows])


AUTOGRAD_FALLBACK = "autograd kernel was not registered"
# top-k expert ids: each of the 4 experts gets one token (two tokens, two experts each), or 64 tokens routed at random
ROUTES = {
    "one token per expert": torch.tensor([[0, 1], [2, 3]]),
    "many tokens": torch.randint(0, 4, (64, 2), generator=torch.Generator().manual_seed(3)),
}


@pytest.mark.parametrize("routes", list(ROUTES))
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_quantized_experts_compute_what_their_dequantized_weights_do(checkpoint, fmt, routes):
    """Outputs and the gradients w.r.t. the experts' inputs (hidden states and routing weights: what reaches the
    adapters below) against plain experts holding the dequantized weights, with no autograd fallback on the way."""
    model = _load(checkpoint, FORMATS[fmt])
    experts = model.model.layers[0].ffn.experts
    reference = dequantized_experts(experts, torch.bfloat16)
    index = ROUTES[routes]
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(len(index), 64, generator=generator, dtype=torch.bfloat16, requires_grad=True)
    weights = torch.rand(len(index), 2, generator=generator, requires_grad=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ours = experts(x, index, weights)
        grad = torch.randn_like(ours)
        ours_grads = torch.autograd.grad(ours, (x, weights), grad)
    assert not [w for w in caught if AUTOGRAD_FALLBACK in str(w.message)]
    theirs = reference(x, index, weights)
    theirs_grads = torch.autograd.grad(theirs, (x, weights), grad)
    # the same products on the same bf16 weights in the same order: equal
    torch.testing.assert_close(ours, theirs, rtol=0, atol=0)
    # the backward products are bf16 too, but autograd's F.linear backward and ours (grad @ W of the dequantized W)
    # may reach different GEMM kernels for one row, which sum in another order: bf16 rounding (2^-8 relative) of
    # each expert's contribution, which the sum over a token's two experts can double
    for a, b in zip(ours_grads, theirs_grads):
        torch.testing.assert_close(a, b, rtol=2**-7, atol=2**-7 * b.abs().max().item())


def _lora_grads(model, ids) -> dict[str, torch.Tensor]:
    model.train()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model(input_ids=ids, labels=ids).loss.backward()
    assert not [w for w in caught if AUTOGRAD_FALLBACK in str(w.message)]
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad and p.grad is not None}
    model.zero_grad()
    return grads


@pytest.mark.parametrize("fmt", ["nf4", "nf4-double", "fp4"])
def test_4bit_linears_repacked_for_cpu_inference_give_the_same_gradients_after(checkpoint, fmt):
    """On an AVX512-BF16 CPU, ``Linear4bit`` repacks its weight for bitsandbytes' inference kernel the first time it
    runs in eval mode without gradients (scales rounded to bf16, a kernel with no autograd formula). Evaluating a QLoRA
    model and then training it must give the gradients training alone gives, with the stored weights unchanged.
    ``support_avx512bf16_for_cpu`` is set by hand to emulate such a CPU: the repacking and the kernel run on any
    CPU."""
    import bitsandbytes as bnb

    ids = torch.randint(0, 500, (2, 12), generator=torch.Generator().manual_seed(5))
    fresh, evaluated = (_qlora(_load(checkpoint, FORMATS[fmt])) for _ in range(2))
    torch.manual_seed(6)
    for name, p in fresh.named_parameters():  # lora_B starts at zero: give the adapters a delta gradients cross
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.02)
    set_peft_model_state_dict(evaluated, get_peft_model_state_dict(fresh))
    linears = {n: m for n, m in evaluated.named_modules() if type(m) is bnb.nn.Linear4bit}
    stored = {n: (m.weight.data.clone(), m.weight.quant_state.absmax.clone()) for n, m in linears.items()}
    for module in linears.values():
        module.support_avx512bf16_for_cpu = True
    evaluated.eval()
    _logits(evaluated, ids)
    assert all(m.weight.quant_state.packing_format_for_cpu for m in linears.values())  # the path was taken

    expected, grads = _lora_grads(fresh, ids), _lora_grads(evaluated, ids)
    for name, module in linears.items():
        data, absmax = stored[name]
        assert not module.weight.quant_state.packing_format_for_cpu
        assert torch.equal(module.weight.data, data) and torch.equal(module.weight.quant_state.absmax, absmax), name
    assert grads.keys() == expected.keys() and len(grads) > 20
    for name in expected:  # the same weights, kernels and order of operations in one process
        torch.testing.assert_close(grads[name], expected[name], rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("fmt", ["nf4-double", "int8"])
def test_quantized_model_logits_and_log_line(checkpoint, fmt, caplog):
    with caplog.at_level("WARNING", logger="modeling_dsv41.bnb_quantizer"):
        model = _load(checkpoint, FORMATS[fmt])
    line = caplog.text
    assert "bitsandbytes" in line and "kept in high precision" in line and "lm_head" in line
    assert "engram.wkv" in line and "routed experts none" in line
    assert ("llm_int8_threshold" in line) == (fmt == "int8")  # the experts' int8 is weight-only
    ids = torch.randint(0, 500, (2, 12), generator=torch.Generator().manual_seed(0))
    ours = _logits(model, ids)
    reference = _with_dequantized_experts(_load(checkpoint, FORMATS[fmt]))
    # the other Linears are the same bnb modules in both: only the experts' storage differs
    torch.testing.assert_close(ours, _logits(reference, ids), rtol=0, atol=0)


def test_skipped_experts_stay_in_high_precision_and_are_logged(checkpoint, caplog):
    options = dict(NF4, llm_int8_skip_modules=["model.layers.1.ffn.experts"])
    with caplog.at_level("WARNING", logger="modeling_dsv41.bnb_quantizer"):
        model = _load(checkpoint, options)
    assert type(model.model.layers[0].ffn.experts) is Bnb4bitExperts
    assert model.model.layers[1].ffn.experts.gate_up_proj.dtype == torch.bfloat16
    assert "routed experts model.layers.1.ffn.experts (llm_int8_skip_modules)" in caplog.text
    assert "compute eagerly" not in caplog.text


def test_an_experts_implementation_the_quantized_experts_do_not_run_is_logged(checkpoint, caplog):
    with caplog.at_level("WARNING", logger="modeling_dsv41.bnb_quantizer"):
        model = _load(checkpoint, FORMATS["nf4"], experts_implementation="batched_mm")
    assert "the quantized experts compute eagerly" in caplog.text and "'batched_mm'" in caplog.text
    assert torch.isfinite(_logits(model, torch.randint(0, 500, (1, 8)))).all()


class _Tokens(torch.utils.data.Dataset):
    """The same random token rows at every step (input_ids, labels)."""

    def __init__(self):
        self.ids = torch.randint(0, 500, (8, 12), generator=torch.Generator().manual_seed(5))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index: int) -> dict:
        return {"input_ids": self.ids[index], "labels": self.ids[index]}


RELOAD_SCRIPT = """
import sys
import torch
from peft import PeftModel, prepare_model_for_kbit_training
from transformers import BitsAndBytesConfig
from modeling_dsv41 import DeepseekV41ForCausalLM

base, adapter, ids, out = sys.argv[1:]
torch.set_num_threads(1)
config = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                            bnb_4bit_compute_dtype=torch.bfloat16)
model = DeepseekV41ForCausalLM.from_pretrained(base, quantization_config=config, dtype=torch.bfloat16)
# as the adapter was trained: prepare_model_for_kbit_training keeps the unquantized parameters in fp32
model = PeftModel.from_pretrained(prepare_model_for_kbit_training(model), adapter).eval()
with torch.no_grad():
    torch.save(model(input_ids=torch.load(ids)).logits, out)
"""


def test_qlora_under_deepseek_trainer_reloads_exactly_in_a_fresh_process(checkpoint, tmp_path):
    from modeling_dsv41.training.trainer import DeepseekV41Trainer, DeepseekV41TrainingArguments

    torch.set_num_threads(1)  # the fresh process computes with one thread too
    model = _qlora(_load(checkpoint, FORMATS["nf4-double"]))
    args = DeepseekV41TrainingArguments(
        output_dir=str(tmp_path / "run"),
        max_steps=3,
        per_device_train_batch_size=4,
        learning_rate=1e-2,
        lr_scheduler_type="constant",
        bias_update_speed=0.0,
        report_to="none",
        save_strategy="no",
        logging_strategy="no",
        use_cpu=True,
    )
    before = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    DeepseekV41Trainer(model=model, args=args, train_dataset=_Tokens()).train()
    moved = [n for n, p in model.named_parameters() if p.requires_grad and not torch.equal(p, before[n])]
    assert any("ffn.experts.lora_A" in n for n in moved) and any("ffn.experts.base_layer.lora_B" in n for n in moved)

    model.eval()
    model.save_pretrained(tmp_path / "adapter")
    ids = _Tokens().ids[:2]
    torch.save(ids, tmp_path / "ids.pt")
    expected = _logits(model, ids)
    subprocess.run(
        [
            sys.executable,
            "-c",
            RELOAD_SCRIPT,
            str(checkpoint),
            str(tmp_path / "adapter"),
            str(tmp_path / "ids.pt"),
            str(tmp_path / "logits.pt"),
        ],
        check=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    # the same quantization of the same checkpoint, the same adapter, the same ops on the same machine: same bits
    torch.testing.assert_close(torch.load(tmp_path / "logits.pt").float(), expected, rtol=0, atol=0)


def test_qlora_under_trl_sft_trainer(checkpoint, tmp_path):
    from datasets import Dataset
    from transformers import PreTrainedTokenizerFast
    from trl import SFTConfig, SFTTrainer

    model = _qlora(_load(checkpoint, FORMATS["nf4"]))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=stub_tokenizer(), pad_token="<pad>", eos_token="<eos>")
    rows = Dataset.from_list([{"input_ids": row.tolist()} for row in _Tokens().ids])
    args = SFTConfig(
        output_dir=str(tmp_path),
        max_steps=3,
        per_device_train_batch_size=4,
        learning_rate=1e-2,
        use_cpu=True,
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
        logging_steps=1,
        activation_checkpointing=True,  # TRL's default, under transformers' new name
    )
    before = {n: p.detach().clone() for n, p in model.named_parameters() if "experts.lora_A" in n}
    trainer = SFTTrainer(model=model, args=args, train_dataset=rows, processing_class=tokenizer)
    trainer.train()
    assert trainer.state.global_step == 3
    assert all(not torch.equal(p, before[n]) for n, p in model.named_parameters() if n in before) and before


def _held_bytes(model) -> dict[str, int]:
    """What each parameter of a loaded model holds, counted on the tensors: its data, bitsandbytes' block scales of a
    quantized Linear (its quant state, or Int8Params' SCB) and the scale buffers of quantized experts."""
    sizes = {}
    for module_name, module in model.named_modules():
        for name, param in module.named_parameters(recurse=False):
            nbytes = param.nbytes
            state = getattr(param, "quant_state", None)
            if state is not None:
                nbytes += state.absmax.nbytes + (
                    state.state2.absmax.nbytes + state.offset.nbytes if state.nested else 0
                )
            if getattr(param, "SCB", None) is not None:
                nbytes += param.SCB.nbytes
            if isinstance(module, (Bnb4bitExperts, Bnb8bitExperts)):
                nbytes += sum(b.nbytes for key, b in module.named_buffers(recurse=False) if key.startswith(f"{name}_"))
            sizes[f"{module_name}.{name}" if module_name else name] = nbytes
    return sizes


@pytest.mark.parametrize(
    "label, fmt",
    [
        ("bitsandbytes NF4, double quantization", "nf4-double"),
        ("bitsandbytes NF4", "nf4"),
        ("bitsandbytes int8", "int8"),
    ],
)
def test_inspector_storage_is_what_the_quantized_model_holds(checkpoint, label, fmt):
    from modeling_dsv41.cli.inspection import storage_costs

    model = _load(checkpoint, FORMATS[fmt])
    predicted = storage_costs(model.config)[label]
    held = _held_bytes(model)
    assert predicted.keys() == held.keys()
    assert {k: v for k, v in predicted.items() if v != held[k]} == {}
    # get_memory_footprint (parameters and buffers) sees the experts quantized: they save what they should
    bf16 = DeepseekV41ForCausalLM.from_pretrained(checkpoint, dtype=torch.bfloat16)
    experts = [n for n in held if ".ffn.experts." in n]
    saved = sum(bf16.get_parameter(n).nbytes - held[n] for n in experts)
    # of their bf16 bytes: 1 - 0.5625/2 for NF4 (an fp32 absmax per 64), 1 - (1 + 4/64)/2 for int8 (rows of 64)
    assert saved >= (0.45 if fmt == "int8" else 0.7) * sum(bf16.get_parameter(n).nbytes for n in experts)
    assert bf16.get_memory_footprint() - model.get_memory_footprint() >= saved


def test_released_preset_nf4_double_quant_under_0_6_bytes_per_parameter():
    """The issue's goal on DeepSeek-V4.1-Flash, counted on the meta device: NF4 with double quantization takes at most
    0.6 bytes per parameter for everything but the Engram tables."""
    from configuration import DeepseekV41Config
    from modeling_dsv41.cli.inspection import build_meta_model, storage_costs
    from modeling_dsv41.placement import is_engram_table_tensor

    config = DeepseekV41Config.from_preset("deepseek-v4.1-flash")
    sizes = storage_costs(config)["bitsandbytes NF4, double quantization"]
    counts = {n: p.numel() for n, p in build_meta_model(config).named_parameters() if not is_engram_table_tensor(n)}
    per_parameter = sum(sizes[n] for n in counts) / sum(counts.values())
    assert 0.5 < per_parameter <= 0.6, per_parameter


def test_the_dspark_heads_experts_are_quantized_too(tmp_path):
    torch.manual_seed(0)
    text = dict(
        TEXT,
        num_nextn_predict_layers=1,
        dspark_block_size=3,
        dspark_target_layer_ids=[0, 1],
        dspark_markov_rank=16,
        dspark_n_routed_experts=2,
        dspark_n_activated_experts=1,
    )
    model = DeepseekV41ForCausalLM(DeepseekV41Config(text_config=text))
    model.model.engram_hasher.load_tokenizer(stub_tokenizer())
    model.save_pretrained(tmp_path)
    quantized = _load(tmp_path, FORMATS["nf4"])
    routed = {n: m for n, m in quantized.named_modules() if n.endswith(".ffn.experts")}
    assert set(routed) == {"model.layers.0.ffn.experts", "model.layers.1.ffn.experts", "mtp.0.ffn.experts"}
    assert all(type(m) is Bnb4bitExperts for m in routed.values())
    head = routed["mtp.0.ffn.experts"]
    assert head.num_experts == 2 and head.gate_up_proj.shape == (2, 128, 32)
    dense = model.mtp[0].ffn.experts.gate_up_proj.detach().to(torch.bfloat16)
    # NF4: within half its widest step (0.28 of the block's absmax, between its levels 0.72 and 1)
    assert (head.dequantized("gate_up_proj", torch.bfloat16) - dense).abs().max() <= 0.2 * dense.abs().max()


def test_saving_the_quantized_model_is_refused_saying_what_to_do(checkpoint, tmp_path, caplog):
    model = _load(checkpoint, FORMATS["nf4"])
    with (
        caplog.at_level("WARNING", logger="modeling_dsv41.bnb_quantizer"),
        pytest.raises(ValueError, match="not serializable"),
    ):
        model.save_pretrained(tmp_path)
    assert "save its LoRA adapters" in caplog.text and "same BitsAndBytesConfig" in caplog.text
    # model.dequantize() gives plain experts holding the dequantized weights, which save
    experts = model.model.layers[0].ffn.experts
    dense = experts.dequantized("gate_up_proj", torch.bfloat16)
    model = model.dequantize()
    assert type(model.model.layers[0].ffn.experts) is DeepseekV41Experts
    assert torch.equal(model.model.layers[0].ffn.experts.gate_up_proj, dense)


@pytest.mark.parametrize("double_quant", [False, True])
def test_4bit_experts_whose_blocks_straddle_rows(double_quant):
    """An expert width of 32 (the demo model's): down_proj's rows are half a 64-weight block, so a row range is
    dequantized from the whole expert. Each expert still equals bitsandbytes' own round trip of it."""
    import bitsandbytes.functional as bnb_functional

    torch.manual_seed(0)
    config = DeepseekV41Config(text_config=dict(TEXT, moe_intermediate_size=32)).get_text_config()
    dense = DeepseekV41Experts(config).to(torch.bfloat16)
    torch.nn.init.normal_(dense.gate_up_proj, std=0.05)
    torch.nn.init.normal_(dense.down_proj, std=0.05)
    experts = Bnb4bitExperts.from_dense(
        dense, compute_dtype=torch.bfloat16, quant_type="nf4", double_quant=double_quant
    )
    assert experts.down_proj.shape == (4, 64, 16) and experts.down_proj_absmax.shape == (4, 32)
    for expert in range(4):
        data, state = bnb_functional.quantize_4bit(
            dense.down_proj[expert].detach(), blocksize=64, quant_type="nf4", compress_statistics=double_quant
        )
        expected = bnb_functional.dequantize_4bit(data, state)
        assert torch.equal(experts.dequantize("down_proj", expert, dtype=torch.bfloat16), expected)
        assert torch.equal(experts.dequantize("down_proj", expert, slice(5, 9), torch.bfloat16), expected[5:9])
    x = torch.randn(10, 64, dtype=torch.bfloat16)
    index, weights = torch.randint(0, 4, (10, 2)), torch.rand(10, 2)
    reference = dequantized_experts(experts, torch.bfloat16)
    torch.testing.assert_close(experts(x, index, weights), reference(x, index, weights), rtol=0, atol=0)


def test_merging_expert_adapters_gives_bf16_experts_holding_dequantized_weights_plus_delta(checkpoint):
    torch.manual_seed(4)
    model = _load(checkpoint, FORMATS["nf4-double"])
    ids = torch.randint(0, 500, (2, 12), generator=torch.Generator().manual_seed(2))
    base_logits = _logits(model, ids)
    config = LoraConfig(
        r=4, lora_alpha=8, target_modules=[], target_parameters=EXPERT_PARAMETERS, init_lora_weights=False
    )  # random B: the adapters act
    model = get_peft_model(model, config).eval()
    adapted = _logits(model, ids)
    wrapper = model.base_model.model.model.layers[0].ffn.experts  # down_proj's, around gate_up_proj's
    lora_a, lora_b, scaling = wrapper._factors(["default"])(1)[0]
    # the base as the experts compute with it (dequantized to bf16) plus the delta, summed in fp32
    dequantized = wrapper.get_base_layer().dequantize("down_proj", 1, dtype=torch.bfloat16).float()
    expected = dequantized + scaling * lora_b @ lora_a
    merged = model.merge_and_unload()
    experts = merged.model.layers[0].ffn.experts
    assert type(experts) is DeepseekV41Experts and experts.gate_up_proj.dtype == torch.bfloat16
    torch.testing.assert_close(experts.down_proj[1].float(), expected, rtol=2**-8, atol=1e-6)  # one bf16 rounding
    # the merged model rounds base + delta to bf16 once where the adapted one adds the fp32 LoRA path to the bf16
    # product, and the routing's top-k turns some of those ulps into other choices: the logits agree to a small share
    # of what the adapters changed (as on the native FP4 experts, tests/test_native_precision.py)
    error = (_logits(merged, ids) - adapted).abs().max() / (adapted - base_logits).abs().max()
    assert error < 0.1, error


@pytest.mark.parametrize("fmt", ["nf4-double", "int8"])
def test_nothing_dequantized_waits_for_the_backward(checkpoint, fmt):
    """The experts' weights are dequantized inside each product and again in its backward: autograd saves no
    dequantized weight (each [64, 64] here; 10 tokens give no activation that large)."""
    experts = _load(checkpoint, FORMATS[fmt]).model.layers[0].ffn.experts
    generator = torch.Generator().manual_seed(4)
    x = torch.randn(10, 64, generator=generator, dtype=torch.bfloat16, requires_grad=True)
    index, weights = torch.randint(0, 4, (10, 2), generator=generator), torch.rand(10, 2, generator=generator)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: (saved.append(tuple(t.shape)), t)[1], lambda t: t):
        out = experts(x, index, weights)
    assert saved and not [shape for shape in saved if shape[-2:] == (64, 64)]
    out.sum().backward()
    assert x.grad is not None and x.grad.abs().sum() > 0


@pytest.mark.parametrize("parallel", [dict(tp_plan="auto"), dict(tp_size=2)])
def test_bitsandbytes_with_tensor_or_expert_parallelism_is_refused(checkpoint, parallel):
    with pytest.raises(ValueError, match="bitsandbytes with tensor or expert parallelism.*device_map"):
        _load(checkpoint, FORMATS["nf4"], **parallel)


def _dense_experts(**text) -> DeepseekV41Experts:
    torch.manual_seed(0)
    dense = DeepseekV41Experts(DeepseekV41Config(text_config=dict(TEXT, **text)).get_text_config()).to(torch.bfloat16)
    torch.nn.init.normal_(dense.gate_up_proj, std=0.05)
    torch.nn.init.normal_(dense.down_proj, std=0.05)
    return dense


# widths: 64-weight blocks within rows; a 40-wide expert whose 40·40 weights end in a partial block and whose
# 2·40·40 / 64 = 50 block scales fill a fifth of a nested block
DECODE_SHAPES = {"64 wide": {}, "partial blocks": dict(hidden_size=40, moe_intermediate_size=40)}


@pytest.mark.parametrize("shape", list(DECODE_SHAPES))
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_a_decode_step_of_the_quantized_experts_reads_nothing_back(fmt, shape):
    """No more slots than experts (decoding): each slot's expert is dequantized from its gathered bytes and states,
    with no value read back (the loop over experts with tokens reads their counts), computing what plain experts
    holding the dequantized weights compute, bit for bit (the same dequantized values in the same per-slot
    products). Fails with the loop: its bincount reads the counts back."""
    from benchmarks.op_counts import StepCounter

    dense = _dense_experts(**DECODE_SHAPES[shape])
    options = FORMATS[fmt]
    if options.get("load_in_8bit"):
        experts = Bnb8bitExperts.from_dense(dense, compute_dtype=torch.bfloat16)
    else:
        experts = Bnb4bitExperts.from_dense(
            dense,
            compute_dtype=torch.bfloat16,
            quant_type=options["bnb_4bit_quant_type"],
            double_quant=options.get("bnb_4bit_use_double_quant", False),
        )
    reference = dequantized_experts(experts, torch.bfloat16)
    hidden = torch.randn(1, dense.hidden_dim, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(1))
    index, weights = torch.tensor([[3, 1]]), torch.tensor([[0.75, 0.25]])
    with torch.no_grad(), StepCounter() as counter:
        out = experts(hidden, index, weights)
    assert dict(counter.count.syncs) == {}
    with torch.no_grad():
        assert torch.equal(out, reference(hidden, index, weights))
