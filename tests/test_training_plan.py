"""The LoRA fine-tuning planner (``dsv41 inspect --devices NxSIZE --train lora``, training/planning.py): its
activation model against a measured forward, its adapter count against PEFT, and its sums."""

from __future__ import annotations

import collections
import re

import pytest
import torch
from peft import LoraConfig, get_peft_model

from configuration import DeepseekV41Config
from modeling_dsv41 import DeepseekV41ForCausalLM
from modeling_dsv41.cli import main
from modeling_dsv41.cli.inspection import build_meta_model
from modeling_dsv41.training.planning import (
    LORA_EXPERTS,
    LORA_LINEARS,
    layer_saved_bytes_per_token,
    lora_parameters,
    plan_lora_training,
)

GIB = 2**30
DEVICE = 8 * GIB  # above the planner's fixed reserve (3 GiB)


def saved_bytes_per_layer(config: DeepseekV41Config, seq_len: int) -> dict[int, int]:
    """What each decoder layer's forward saves for backward, measured: every tensor autograd packs, counted once by
    storage (views of one tensor share it)."""
    torch.manual_seed(0)
    model = DeepseekV41ForCausalLM(config).to(torch.bfloat16)
    ids = torch.randint(3, config.text_config.vocab_size, (1, seq_len), generator=torch.Generator().manual_seed(0))
    saved, seen, layer = collections.Counter(), set(), [None]

    def pack(tensor):
        key = (tensor.untyped_storage().data_ptr(), tensor.dtype)
        if key not in seen:
            seen.add(key)
            saved[layer[0]] += tensor.untyped_storage().nbytes()
        return tensor

    for i, block in enumerate(model.model.layers):
        block.register_forward_pre_hook(lambda module, args, i=i: layer.__setitem__(0, i))
        block.register_forward_hook(lambda module, args, out: layer.__setitem__(0, None))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        model(input_ids=ids, labels=ids)
    return {i: saved[i] for i in range(len(model.model.layers))}


def wider_tiny() -> DeepseekV41Config:
    """The tiny preset with other widths, so that every term of the model scales with its own dimensions."""
    config = DeepseekV41Config.from_preset("tiny")
    widths = {"hidden_size": 96, "num_attention_heads": 3, "q_lora_rank": 40, "o_lora_rank": 24,
              "moe_intermediate_size": 48, "n_routed_experts": 5, "num_experts_per_tok": 3, "index_topk": 12,
              "sliding_window": 20}
    for name, value in widths.items():
        setattr(config.text_config, name, value)
    return config


@pytest.mark.parametrize("make_config, seq_len", [(lambda: DeepseekV41Config.from_preset("tiny"), 256), (wider_tiny, 200)])
def test_the_saved_activations_per_layer_match_a_measured_forward(make_config, seq_len):
    """Every layer kind (window-only, ratio 2 and 1, Engram) within 10% of what autograd really saves. Not exact:
    the model counts the terms that grow with the widths and leaves out scalars and index tensors."""
    config = make_config()
    text = config.get_text_config()
    for layer_id, measured in saved_bytes_per_layer(config, seq_len).items():
        planned = layer_saved_bytes_per_token(text, layer_id, seq_len) * seq_len
        assert planned == pytest.approx(measured, rel=0.10), (layer_id, text.compress_ratios[layer_id])


def test_the_adapter_count_is_what_peft_builds():
    model = DeepseekV41ForCausalLM(DeepseekV41Config.from_preset("tiny"))
    planned = lora_parameters(model, rank=4)
    config = LoraConfig(r=4, target_modules=LORA_LINEARS.pattern.replace("(^|\\.)", r"model\."),
                        target_parameters=["experts.gate_up_proj", "experts.down_proj"])
    peft_model = get_peft_model(model, config)
    built = sum(p.numel() for name, p in peft_model.named_parameters() if "lora_" in name)
    assert planned == built > 0
    assert any(LORA_EXPERTS.search(name) for name, _ in model.named_modules())


def test_the_plan_shards_the_frozen_weights_and_gathers_only_running_units():
    text = {**DeepseekV41Config.from_preset("tiny").text_config.to_dict(), "dspark_block_size": 3,
            "num_nextn_predict_layers": 2, "dspark_target_layer_ids": [4, 5], "dspark_noise_token_id": 7}
    config = DeepseekV41Config.from_preset("tiny", text_config=text)
    model = build_meta_model(config)
    two = plan_lora_training(model, {0: DEVICE, 1: DEVICE}, seq_len=64, rank=4)
    four = plan_lora_training(model, {i: DEVICE for i in range(4)}, seq_len=64, rank=4)
    assert two.terms["frozen shards"] == pytest.approx(2 * four.terms["frozen shards"])
    assert two.terms["adapters + grads + AdamW"] == pytest.approx(2 * four.terms["adapters + grads + AdamW"])
    assert two.terms["gathered units (one + prefetch)"] == four.terms["gathered units (one + prefetch)"]
    assert re.fullmatch(r"model\.layers\.\d+", two.largest_unit)  # the draft blocks do not run in backbone training
    assert two.per_device == pytest.approx(sum(two.terms.values())) and two.fits
    offloaded = plan_lora_training(model, {0: DEVICE, 1: DEVICE}, seq_len=64, rank=4, offload=True)
    assert "frozen shards" not in offloaded.terms and offloaded.per_device < two.per_device
    assert offloaded.host_bytes["frozen shards and adapter state (all ranks)"] == pytest.approx(
        2 * two.terms["frozen shards"] + 2 * two.terms["adapters + grads + AdamW"]
    )
    longer = plan_lora_training(model, {0: DEVICE, 1: DEVICE}, seq_len=128, rank=4)
    assert longer.terms["logits + loss"] == 2 * two.terms["logits + loss"]
    assert not plan_lora_training(model, {0: 2**20, 1: 2**20}, seq_len=64, rank=4).fits


def test_inspect_plans_lora_on_the_released_model(capsys):
    assert main(["inspect", "--devices", "8x80GiB", "--train", "lora"]) == 0
    out = capsys.readouterr().out
    assert "FSDP2 over 8 devices" in out and "micro-batch 1 × 4096 tokens" in out
    totals = re.search(r"^total\s+([\d.]+) GiB\s+([\d.]+) GiB$", out, re.MULTILINE)
    resident, offloaded = float(totals.group(1)), float(totals.group(2))
    assert offloaded < 80 < resident  # the figures README gives
    assert re.search(r"^on 80\.0 GiB devices\s+does not fit\s+fits$", out, re.MULTILINE)
    assert "host memory, Engram tables: 188.8 GiB" in out
    assert main(["inspect", "--devices", "8x141GiB", "--train", "lora", "--seq", "2048", "--rank", "8"]) == 0
    assert re.search(r"^on 141\.0 GiB devices\s+fits\s+fits$", capsys.readouterr().out, re.MULTILINE)


def test_inspect_train_needs_devices_and_the_native_storage(capsys):
    assert main(["inspect", "tiny", "--train", "lora"]) == 2
    assert "give them with --devices" in capsys.readouterr().err
    assert main(["inspect", "tiny", "--devices", "2x1GiB", "--train", "lora", "--tp", "2"]) == 2
    assert "drop --tp, --ep and --storage" in capsys.readouterr().err
