"""PEFT LoRA on the model's Linears (by their released names) and on the fused routed experts (``target_parameters``):
adapters act where they are put (or PEFT refuses them), train, save, reload and merge to the same function."""

import ast
import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from peft.tuners.lora import LoraLayer
from torch.utils.data import Dataset

from modeling_dsv41 import DeepseekV41ForCausalLM
from modeling_dsv41.numerics import reference_numerics
from modeling_dsv41.training.trainer import DeepseekV41Trainer, DeepseekV41TrainingArguments

import tiny_models

# the released names: attention, shared experts (w1/w2/w3), ViT (wqkv, wo, mlp w1/w2, patch proj), aligner (w1/w2).
# Suffix matching also reaches the compressor's and Engram's `wkv` and the indexer's `wq_b`.
RELEASED_TARGETS = ["wq_a", "wq_b", "wkv", "wo_b", "w1", "w2", "w3", "wqkv", "wo", "proj"]
# the routed experts are two fused 3-D parameters per layer: PEFT adapts them per expert through target_parameters
EXPERT_PARAMETERS = ["experts.gate_up_proj", "experts.down_proj"]
IMAGE_TOKEN_ID = 510  # tiny preset


def tiny_model(seed: int = 0) -> DeepseekV41ForCausalLM:
    """Without the FP8/FP4 KV quantization emulation: merging B·A into the weights reorders fp32 sums, and QDQ would
    turn those ulps into whole quantization steps (measured: 0.012 on the logits), hiding what the tests compare.
    Any complete Engram map will do here; in training mode."""
    return tiny_models.tiny_model(seed=seed, engram_map="default", emulate_quantization=False).train()


def image_batch(seed: int = 0) -> dict[str, torch.Tensor]:
    """Two rows, the first with one 6×6-patch image (a 2×2 token grid: an 8-position span); labels are the text."""
    gen = torch.Generator().manual_seed(seed)
    types = torch.full((2, 20), -1)
    types[0, 3:11] = torch.tensor([0, 1, 1, 2, 1, 1, 2, 3])
    input_ids = torch.randint(3, 500, (2, 20), generator=gen).masked_fill(types >= 0, IMAGE_TOKEN_ID)
    return {
        "input_ids": input_ids,
        "pixel_values": torch.randn(36, 3, 14, 14, generator=gen),
        "image_grid_hw": torch.tensor([[6, 6]]),
        "image_token_types": types,
        "labels": input_ids.masked_fill(types >= 0, -100),
        "use_cache": False,
    }


class SameBatch(Dataset):
    """Indices only: the collator hands the Trainer :func:`image_batch` at every step."""

    def __len__(self) -> int:
        return 16

    def __getitem__(self, index: int) -> int:
        return index

    @staticmethod
    def collate(_: list[int]) -> dict[str, torch.Tensor]:
        return image_batch()


def logits(model, batch) -> torch.Tensor:
    with torch.no_grad():
        return model(**batch).logits


def adapted_modules(peft_model) -> dict[str, LoraLayer]:
    return {
        name.removeprefix("base_model.model."): m for name, m in peft_model.named_modules() if isinstance(m, LoraLayer)
    }


def test_lora_on_released_names_trains_saves_reloads_and_merges(tmp_path):
    batch = image_batch()
    base = tiny_model().eval()
    base.save_pretrained(tmp_path / "base")
    base_logits = logits(base, batch)
    frozen_before = base.model.layers[2].attn.wq_a.weight.detach().clone()
    experts_before = base.model.layers[2].ffn.experts.down_proj.detach().clone()

    config = LoraConfig(r=4, lora_alpha=8, target_modules=RELEASED_TARGETS, target_parameters=EXPERT_PARAMETERS)
    model = get_peft_model(base, config)
    names = adapted_modules(model)
    for expected in (
        "layers.0.attn.wq_a",
        "layers.0.attn.wq_b",
        "layers.0.attn.wkv",
        "layers.0.attn.wo_b",
        "layers.1.attn.compressor.wkv",
        "layers.0.engram.wkv",
        "layers.0.ffn.experts",
        "layers.5.ffn.shared_experts.w3",
        "vision.blocks.1.attn.wqkv",
        "vision.blocks.1.attn.wo",
        "vision.blocks.0.mlp.w1",
        "vision.patch_embed.proj",
        "aligner.w1",
        "aligner.w2",
    ):
        assert f"model.{expected}" in names, expected
    # both fused expert tensors carry an adapter: one rank-r factor pair per expert
    expert_adapters = [m for n, m in model.named_modules() if isinstance(m, LoraLayer) and "layers.0.ffn.experts" in n]
    assert {m.parameter_name for m in expert_adapters} == {"gate_up_proj", "down_proj"}
    assert all(m.num_experts == base.config.text_config.n_routed_experts for m in expert_adapters)
    assert not any(name.endswith("wo_a") for name in names)
    # LoRA starts at B = 0: the adapted model computes exactly what the base model does
    torch.testing.assert_close(logits(model, batch), base_logits, rtol=0, atol=0)

    # DeepseekV41Trainer: its mixed optimizer puts the LoRA factors (the only trainable parameters) in AdamW
    assert all("lora_" in name for name, p in model.named_parameters() if p.requires_grad)
    args = DeepseekV41TrainingArguments(
        output_dir=str(tmp_path / "run"),
        max_steps=4,
        per_device_train_batch_size=2,
        learning_rate=5e-3,
        lr_scheduler_type="constant",
        bias_update_speed=0.0,  # adapters leave the routing biases as loaded
        report_to="none",
        save_strategy="no",
        logging_strategy="no",
        remove_unused_columns=False,
        use_cpu=True,
    )
    trainer = DeepseekV41Trainer(model=model, args=args, train_dataset=SameBatch(), data_collator=SameBatch.collate)
    loss_before = model(**batch).loss.item()
    trainer.train()
    model.eval()
    trainable = {id(p) for p in model.parameters() if p.requires_grad}
    optimized = {id(p): group["kind"] for group in trainer.optimizer.param_groups for p in group["params"]}
    assert optimized.keys() == trainable and set(optimized.values()) == {"adamw"}
    assert model(**batch).loss.item() < loss_before
    torch.testing.assert_close(base.model.layers[2].attn.wq_a.base_layer.weight, frozen_before, rtol=0, atol=0)
    experts = base.get_submodule("model.layers.2.ffn.experts").get_base_layer()
    torch.testing.assert_close(experts.down_proj, experts_before, rtol=0, atol=0)
    assert any(p.abs().sum() > 0 for n, p in model.named_parameters() if "ffn.experts" in n and "lora_B" in n)
    trained = logits(model, batch)
    assert (trained - base_logits).abs().max() > 1e-3

    model.save_pretrained(tmp_path / "adapter")
    assert (tmp_path / "adapter" / "adapter_model.safetensors").is_file()
    reloaded = PeftModel.from_pretrained(
        DeepseekV41ForCausalLM.from_pretrained(tmp_path / "base"), tmp_path / "adapter"
    ).eval()
    torch.testing.assert_close(logits(reloaded, batch), trained, rtol=0, atol=0)

    merged = reloaded.merge_and_unload()
    assert not any(isinstance(m, LoraLayer) for m in merged.modules())
    # folding B·A into the weights changes only the fp32 summation order
    torch.testing.assert_close(logits(merged, batch), trained, rtol=1e-4, atol=1e-4)


def test_every_adapter_is_applied_and_merges_to_the_same_function():
    """Random (non-zero) LoRA factors on every layer "all-linear" picks: each adapted module must run in the forward
    pass (a consumer reading ``.weight`` directly would skip its adapter silently), and the merged model must equal
    the adapted one."""
    batch = image_batch()
    base = tiny_model().eval()
    base_logits = logits(base, batch)
    config = LoraConfig(r=4, target_modules="all-linear", target_parameters=EXPERT_PARAMETERS, init_lora_weights=False)
    model = get_peft_model(base, config)
    calls = {name: 0 for name in adapted_modules(model)}
    hooks = [
        module.register_forward_hook(lambda *_, name=name: calls.__setitem__(name, calls[name] + 1))
        for name, module in adapted_modules(model).items()
    ]
    adapted = logits(model, batch)
    for hook in hooks:
        hook.remove()
    assert {name.rsplit(".", 1)[-1] for name in calls} >= {
        "wq_a",
        "wq_b",
        "wkv",
        "wo_b",
        "wgate",
        "w1",
        "w2",
        "w3",
        "wqkv",
        "wo",
        "proj",
        "experts",
    }
    # every adapted module ran, the fused routed experts of every layer included
    assert [name for name, count in calls.items() if count == 0] == []
    assert (adapted - base_logits).abs().max() > 1e-3
    # merging B·A into the weights changes only the fp32 summation order (a silently skipped adapter differs by O(1))
    torch.testing.assert_close(logits(model.merge_and_unload(), batch), adapted, rtol=1e-4, atol=1e-4)


def test_lora_on_the_fp32_head_is_applied():
    batch = image_batch()
    base = tiny_model().eval()
    model = get_peft_model(base, LoraConfig(r=4, target_modules=["lm_head"], init_lora_weights=False))
    adapted = logits(model, batch)
    assert adapted.dtype == torch.float32
    with model.disable_adapter():
        plain = logits(model, batch)
    assert (adapted - plain).abs().max() > 1e-3
    torch.testing.assert_close(logits(model.merge_and_unload(), batch), adapted, rtol=1e-5, atol=1e-5)


def test_lora_on_the_grouped_wo_a_is_refused():
    """``wo_a`` is block-diagonal (one block per output group): an adapter treating it as one dense matrix would be
    wrong, so it must be refused with PEFT's error, not wrapped."""
    with pytest.raises(ValueError, match=r"DeepseekV41GroupedLinear.*block-diagonal.*not supported"):
        get_peft_model(tiny_model(), LoraConfig(r=4, target_modules=["wo_a"]))


def lora_gradients(checkpointing: dict | None) -> dict[str, torch.Tensor | None]:
    base = tiny_model()
    if checkpointing is not None:
        base.activation_checkpointing_enable(activation_checkpointing_kwargs=checkpointing)
        base.enable_input_require_grads()  # what PEFT and the Trainer do for checkpointed adapters
    config = LoraConfig(
        r=4, target_modules=["wq_a", "wo_b", "w1"], target_parameters=EXPERT_PARAMETERS, init_lora_weights=False
    )
    model = get_peft_model(base, config)
    assert model.get_input_embeddings() is base.model.embed
    model.train()
    model(**image_batch()).loss.backward()
    return {name: p.grad for name, p in model.named_parameters() if p.requires_grad}


def assert_same_gradients(checkpointed, plain):
    assert all(grad is not None for grad in plain.values())
    for name, grad in plain.items():
        if grad is None:
            assert checkpointed[name] is None, name
        else:
            torch.testing.assert_close(checkpointed[name], grad, rtol=1e-4, atol=1e-6, msg=name)


def test_gradient_checkpointing_gives_the_same_lora_gradients():
    """transformers' default (non-reentrant) checkpointing, with the embeddings' output hooked to require grad."""
    assert_same_gradients(lora_gradients({"use_reentrant": False}), lora_gradients(None))


def test_reentrant_checkpointing_is_exact_or_refused():
    """Reentrant checkpointing tracks tensor arguments only, and layers hand compressed KV on in a context object:
    the model must refuse it (it does, with a ValueError) or get the same gradients, never silently others."""
    try:
        checkpointed = lora_gradients({"use_reentrant": True})
    except ValueError as error:
        assert "non-reentrant" in str(error)
        return
    assert_same_gradients(checkpointed, lora_gradients(None))


# ---------------------------------------------------------------------------------------------------------------
# the README's recipe: exact targets, and an adapter that reloads as the model it trained
# ---------------------------------------------------------------------------------------------------------------
README = Path(__file__).resolve().parents[1] / "README.md"


def readme_lora_config() -> LoraConfig:
    """The ``LoraConfig(...)`` of the README's LoRA snippet, evaluated as written."""
    for block in re.findall(r"```python\n(.*?)```", README.read_text(), re.DOTALL):
        for node in ast.walk(ast.parse(block)):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "LoraConfig":
                return eval(ast.get_source_segment(block, node), {"LoraConfig": LoraConfig})
    raise AssertionError("README.md has no LoraConfig(...) snippet")


def test_readme_lora_targets_the_language_model_only(caplog):
    base = tiny_model()
    model = get_peft_model(base, readme_lora_config())
    names = {name.removesuffix(".base_layer") for name in adapted_modules(model)}  # the two expert tensors nest
    layers = range(base.config.text_config.num_hidden_layers)
    expected = {f"model.layers.{i}.attn.{m}" for i in layers for m in ("wq_a", "wq_b", "wkv", "wo_b")}
    expected |= {f"model.layers.{i}.ffn.shared_experts.w{k}" for i in layers for k in (1, 2, 3)}
    expected |= {f"model.layers.{i}.ffn.experts" for i in layers}
    assert names == expected
    with caplog.at_level(logging.WARNING, logger="modeling_dsv41.training.trainer"):
        args = DeepseekV41TrainingArguments(output_dir="unused", report_to="none", bias_update_speed=0)
        DeepseekV41Trainer(model=model, args=args)
    assert not caplog.records  # nothing frozen


def test_the_trainer_warns_when_it_freezes_adapter_weights(caplog):
    """Suffix targets catch the indexer's ``wq_b``; the Trainer freezes it (no gradient reaches it) and says so."""
    model = get_peft_model(tiny_model(), LoraConfig(r=4, target_modules=["wq_a", "wq_b"]))
    indexer = [n for n, p in model.named_parameters() if ".indexer." in n and p.requires_grad]
    assert indexer
    with caplog.at_level(logging.WARNING, logger="modeling_dsv41.training.trainer"):
        DeepseekV41Trainer(model=model, args=DeepseekV41TrainingArguments(output_dir="unused", report_to="none"))
    message = " ".join(r.getMessage() for r in caplog.records)
    assert f"froze {len(indexer)} adapter tensors" in message and "indexer" in message and "target_modules" in message
    assert not any(p.requires_grad for n, p in model.named_parameters() if ".indexer." in n)


RELOAD_SCRIPT = """
import sys
import torch
from peft import PeftModel
from modeling_dsv41 import DeepseekV41ForCausalLM
from modeling_dsv41.numerics import reference_numerics

base, adapter, batch, out, threads = sys.argv[1:]
torch.set_num_threads(int(threads))  # fp32 GEMMs block their sums by thread count
model = PeftModel.from_pretrained(DeepseekV41ForCausalLM.from_pretrained(base), adapter).eval()
with torch.no_grad(), reference_numerics():
    torch.save(model(**torch.load(batch)).logits, out)
"""


def test_an_adapter_trained_with_the_defaults_reloads_exactly_in_a_fresh_process(tmp_path, caplog):
    """DeepseekV41Trainer's defaults (balancing on) on a LoRA model: the frozen base, router biases included, stays
    as loaded, so base + saved adapter in another process computes the trained model's logits."""
    batch = image_batch()
    base = tiny_model()
    base.save_pretrained(tmp_path / "base")
    biases = {n: b.clone() for n, b in base.named_buffers() if ".gate.bias" in n}
    model = get_peft_model(base, readme_lora_config())
    args = DeepseekV41TrainingArguments(
        output_dir=str(tmp_path / "run"),
        max_steps=3,
        per_device_train_batch_size=2,
        learning_rate=5e-3,
        report_to="none",
        save_strategy="no",
        logging_strategy="no",
        remove_unused_columns=False,
        use_cpu=True,
    )
    assert args.bias_update_speed > 0
    with caplog.at_level(logging.WARNING, logger="modeling_dsv41.training.trainer"):
        trainer = DeepseekV41Trainer(
            model=model, args=args, train_dataset=SameBatch(), data_collator=SameBatch.collate
        )
    assert trainer.router_balancing is None and "stay as loaded" in caplog.text
    trainer.train()
    for name, bias in base.named_buffers():
        if name in biases:
            assert torch.equal(bias, biases[name]), name
    model.eval()
    with torch.no_grad(), reference_numerics():
        trained = model(**batch).logits
    model.save_pretrained(tmp_path / "adapter")
    torch.save(batch, tmp_path / "batch.pt")
    (tmp_path / "reload.py").write_text(RELOAD_SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(README.parent)}
    files = [str(tmp_path / "base"), str(tmp_path / "adapter"), "batch.pt", "out.pt", str(torch.get_num_threads())]
    run = subprocess.run(
        [sys.executable, "reload.py", *files],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-4000:]
    reloaded = torch.load(tmp_path / "out.pt")
    with model.disable_adapter(), torch.no_grad(), reference_numerics():
        assert (trained - model(**batch).logits).abs().max() > 1e-3  # the adapter trained
    torch.testing.assert_close(reloaded, trained, rtol=0, atol=0)  # same bits: reference numerics on both sides
