"""The LoRA fine-tuning planner (``dsv41 inspect --devices NxSIZE --train lora``, training/planning.py): its activation
model (training/activation_memory.py) against measured steps of natively loaded stand-ins with the README's adapters,
its adapter count against PEFT, and its sums."""

from __future__ import annotations

import re

import pytest
import torch
from peft import LoraConfig, get_peft_model
from reference_fixture import QUANT_FORMAT_TEXT, stub_tokenizer

from benchmarks.memory import LiveTensorBytes
from configuration import DeepseekV41Config
from modeling_dsv41 import DeepseekV41ForCausalLM
from modeling_dsv41.cli import main
from modeling_dsv41.cli.inspection import build_meta_model
from modeling_dsv41.training.activation_memory import (
    activation_peak,
    layer_constant_bytes,
    layer_saved_bytes_per_token,
)
from modeling_dsv41.training.planning import (
    LORA_EXPERTS,
    LORA_LINEARS,
    longest_sequence,
    lora_parameters,
    plan_lora_training,
)

GIB = 2**30
DEVICE = 8 * GIB  # above the planner's fixed reserve (3 GiB)
RANK = 4
# Stand-ins in the released storage format (FP8 Linears, FP4 experts), loaded natively: a window-only layer, an
# Engram + ratio-2 KV and index source, a ratio-1 KV and index source, a window-only layer. A peaks at the end of a
# layer's forward (mHC's expand), B is A at other widths; C (many heads, a wide window, one query chunk) peaks in the
# sparse attention's backward, I (many index heads) in the indexer, V (a large vocabulary) at the loss.
STAND_INS = {
    "A": dict(
        QUANT_FORMAT_TEXT,
        num_hidden_layers=4,
        compress_ratios=[0, 2, 1, 0],
        kv_source_layer_ids=[1, 2],
        index_source_layer_ids=[1, 2],
        engram_layer_ids=[1],
        engram_num_embeddings=[660],
        query_chunk_size=64,
    ),
}
STAND_INS["B"] = dict(
    STAND_INS["A"],
    hidden_size=384,
    moe_intermediate_size=256,
    num_attention_heads=6,
    head_dim=128,
    qk_rope_head_dim=32,
    q_lora_rank=128,
    o_lora_rank=64,
    o_groups=3,
    n_routed_experts=6,
    num_experts_per_tok=3,
    sliding_window=24,
    index_topk=12,
    index_n_heads=2,
    index_head_dim=128,
)
STAND_INS["C"] = dict(
    STAND_INS["A"],
    num_attention_heads=16,
    head_dim=128,
    qk_rope_head_dim=32,
    sliding_window=96,
    index_topk=32,
    o_groups=4,
    query_chunk_size=4096,
)
STAND_INS["I"] = dict(STAND_INS["A"], index_n_heads=32, query_chunk_size=4096)
STAND_INS["V"] = dict(STAND_INS["A"], vocab_size=16000)
LINEAR_TARGETS = [
    "attn.wq_a",
    "attn.wq_b",
    "attn.wkv",
    "attn.wo_b",
    "shared_experts.w1",
    "shared_experts.w2",
    "shared_experts.w3",
]


@pytest.fixture(scope="module")
def stand_in(tmp_path_factory):
    """name → (the natively loaded base, the PEFT model with the README's adapters), gradient checkpointing on."""
    import modeling_dsv41  # noqa: F401
    from modeling_dsv41.released.writing import save_released_checkpoint

    built = {}

    def build(name):
        if name not in built:
            torch.manual_seed(0)
            model = DeepseekV41ForCausalLM(DeepseekV41Config(text_config=STAND_INS[name], vision_config=None))
            folder = tmp_path_factory.mktemp(f"released_{name}")
            save_released_checkpoint(model.to(torch.bfloat16), folder, max_shard_bytes=1 << 22)
            stub_tokenizer().save(str(folder / "tokenizer.json"))
            base = DeepseekV41ForCausalLM.from_pretrained(folder)
            base.activation_checkpointing_enable()
            lora = LoraConfig(
                r=RANK,
                lora_alpha=8,
                target_modules=LINEAR_TARGETS,
                init_lora_weights=False,
                target_parameters=["experts.gate_up_proj", "experts.down_proj"],
            )
            built[name] = base, get_peft_model(base, lora).train()
        return built[name]

    return build


def token_ids(seq_len: int) -> torch.Tensor:
    return torch.randint(3, 500, (1, seq_len), generator=torch.Generator().manual_seed(0))


def saved_bytes_per_layer(base, model, seq_len: int) -> list[int]:
    """What each decoder layer's forward saves for its backward, measured: every tensor autograd packs, counted once
    by storage, the parameters and the layer's own inputs left out."""
    captured = {}
    hooks = [
        layer.register_forward_pre_hook(lambda m, a, k, i=i: captured.update({i: (a, k)}), with_kwargs=True)
        for i, layer in enumerate(base.model.layers)
    ]
    with torch.no_grad():
        model(input_ids=token_ids(seq_len))
    for hook in hooks:
        hook.remove()
    parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
    measured = []
    for i, layer in enumerate(base.model.layers):
        args, kwargs = captured[i]
        args = [a.detach().requires_grad_(a.is_floating_point()) if isinstance(a, torch.Tensor) else a for a in args]
        given = {t.untyped_storage().data_ptr() for t in [*args, *kwargs.values()] if isinstance(t, torch.Tensor)}
        saved = {}

        def pack(tensor):
            pointer = tensor.untyped_storage().data_ptr()
            if pointer not in parameters and pointer not in given:
                saved[pointer] = tensor.untyped_storage().nbytes()
            return tensor

        layer.gradient_checkpointing = False
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            layer(*args, **kwargs)
        layer.gradient_checkpointing = True
        measured.append(sum(saved.values()))
    return measured


def step_activation_peak(model, seq_len: int) -> int:
    """The peak of the tensor bytes a checkpointed training step makes and holds at once, the adapters' gradients
    already there (as from an earlier step)."""
    ids = token_ids(seq_len)
    for parameter in model.parameters():
        if parameter.requires_grad and parameter.grad is None:
            parameter.grad = torch.zeros_like(parameter)
    with LiveTensorBytes() as tracker:
        model(input_ids=ids, labels=ids).loss.backward()
    return tracker.peak


@pytest.mark.parametrize("name", ["A", "B"])
def test_the_saved_tensors_per_layer_match_a_measured_forward(stand_in, name):
    """Every layer kind (window-only, Engram + ratio 2, ratio 1) within 10% of what autograd really saves at two
    lengths. Measured within 0.2%: the model counts every tensor but a few scalars."""
    base, model = stand_in(name)
    text = base.config.text_config
    for seq_len in (128, 256):
        for layer_id, measured in enumerate(saved_bytes_per_layer(base, model, seq_len)):
            planned = layer_saved_bytes_per_token(text, layer_id, seq_len, RANK) * seq_len + layer_constant_bytes(text)
            assert planned == pytest.approx(measured, rel=0.10), (name, seq_len, layer_id)


@pytest.mark.parametrize(
    "name, seq_len, moment",
    [
        ("A", 128, "the end of its forward"),
        ("A", 256, "the end of its forward"),
        ("B", 256, "the end of its forward"),
        ("C", 256, "sparse attention's backward"),
        ("I", 256, "its indexer"),
        ("V", 128, "the loss"),
    ],
)
def test_the_activation_peak_of_a_step_matches_a_measured_step(stand_in, name, seq_len, moment):
    """The activations at the step's peak (checkpointed inputs and the larger of the loss and the worst layer's
    backward) within 10% of a measured step, each moment where it is the peak. Measured within 1.5%."""
    base, model = stand_in(name)
    planned = activation_peak(base.config.text_config, seq_len, rank=RANK)
    assert moment in planned.moment
    assert planned.total == pytest.approx(step_activation_peak(model, seq_len), rel=0.10), planned.moment


def test_the_adapter_count_is_what_peft_builds():
    model = DeepseekV41ForCausalLM(DeepseekV41Config.from_preset("tiny"))
    planned = lora_parameters(model, rank=4)
    config = LoraConfig(
        r=4,
        target_modules=LORA_LINEARS.pattern.replace("(^|\\.)", r"model\."),
        target_parameters=["experts.gate_up_proj", "experts.down_proj"],
    )
    peft_model = get_peft_model(model, config)
    built = sum(p.numel() for name, p in peft_model.named_parameters() if "lora_" in name)
    assert planned == built > 0
    assert any(LORA_EXPERTS.search(name) for name, _ in model.named_modules())


def test_the_plan_shards_the_frozen_weights_and_gathers_only_running_units():
    text = {
        **DeepseekV41Config.from_preset("tiny").text_config.to_dict(),
        "dspark_block_size": 3,
        "num_nextn_predict_layers": 2,
        "dspark_target_layer_ids": [4, 5],
        "dspark_noise_token_id": 7,
    }
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
    # the activations are the activation model's, at its peak; offloading them leaves one layer's inputs (and those
    # the layers share: most of them in the tiny model) and every layer's chosen experts on the device
    peak = activation_peak(config.text_config, 64, rank=4)
    activations = ("checkpointed layer inputs", "recomputed layer", "logits + loss")
    assert sum(two.terms[term] for term in activations) == pytest.approx(peak.total)
    moved = plan_lora_training(model, {0: DEVICE, 1: DEVICE}, seq_len=64, rank=4, offload_activations=True)
    assert moved.terms["checkpointed layer inputs"] < two.terms["checkpointed layer inputs"] / 2
    assert moved.host_bytes["checkpointed layer inputs (this rank)"] > two.terms["checkpointed layer inputs"] / 2
    assert not plan_lora_training(model, {0: 2**20, 1: 2**20}, seq_len=64, rank=4).fits


def test_under_expert_parallelism_a_unit_gathers_only_the_rank_s_experts():
    """--ep N: the same frozen shards (1/N of everything), but a layer in use gathers E/N of its routed experts, and
    the routed slots' all-to-all buffers are added (bf16 there and back in, fp32 outputs back)."""
    from modeling_dsv41.placement import native_held_bytes

    model = build_meta_model(DeepseekV41Config.from_preset("tiny"))
    devices = {i: DEVICE for i in range(4)}
    plans = {ep: plan_lora_training(model, devices, seq_len=64, rank=4, ep_size=ep) for ep in (1, 2, 4)}
    unit = dict(model.named_modules())[plans[1].largest_unit]
    experts = sum(
        native_held_bytes(f"{plans[1].largest_unit}.{name}", p)
        for name, p in unit.named_parameters()
        if ".ffn.experts." in f".{name}"
    )
    assert experts > 0
    text = model.config.text_config
    for ep, plan in plans.items():
        assert plan.terms["frozen shards"] == plans[1].terms["frozen shards"]
        assert plan.terms["root weights (gathered all step)"] == plans[1].terms["root weights (gathered all step)"]
        assert plan.largest_unit == plans[1].largest_unit  # the tiny model's layers differ in their non-expert parts
        gathered = plans[1].terms["gathered units (one + prefetch)"] - 2 * experts * (1 - 1 / ep)
        assert plan.terms["gathered units (one + prefetch)"] == pytest.approx(gathered)
        slots = 64 * text.num_experts_per_tok * text.hidden_size * 12
        assert plan.terms.get("all-to-all buffers (routed slots)", 0) == (slots if ep > 1 else 0)
    with pytest.raises(ValueError, match="ep_size=3 must divide the 4 devices"):
        plan_lora_training(model, devices, ep_size=3)


def test_the_longest_sequence_is_the_last_that_fits():
    model = build_meta_model(DeepseekV41Config.from_preset("tiny"))
    devices = {0: 4 * GIB, 1: 4 * GIB}
    longest = longest_sequence(model, devices, rank=4, step=256)
    assert longest % 256 == 0 and longest > 0
    assert plan_lora_training(model, devices, seq_len=longest, rank=4).fits
    assert not plan_lora_training(model, devices, seq_len=longest + 256, rank=4).fits
    assert longest_sequence(model, devices, rank=4, step=256, offload_activations=True) >= longest
    assert longest_sequence(model, {0: 2**20, 1: 2**20}, rank=4) == 0


def totals(out: str) -> list[float]:
    return [
        float(value)
        for value in re.search(r"^total((?:\s+[\d.]+ GiB){3})$", out, re.MULTILINE).group(1).replace("GiB", "").split()
    ]


def longest(out: str) -> list[int]:
    return [
        int(value)
        for value in re.findall(
            r"(\d+) tokens", re.search(r"^longest sequence per device that fits.*$", out, re.MULTILINE).group(0)
        )
    ]


def test_inspect_plans_lora_on_the_released_model(capsys):
    """At rank 16 and 4096 tokens per device the released model fits 8×80 GiB with everything resident (the draft
    head's experts split like the backbone's), with room to spare once the checkpointed inputs are offloaded;
    8×141 GiB takes 16384 tokens and more (tests/test_docs_facts.py checks the figures the docs give)."""
    assert main(["inspect", "--devices", "8x80GiB", "--train", "lora"]) == 0
    out = capsys.readouterr().out
    assert "FSDP2 over 8 devices" in out and "micro-batch 1 × 4096 tokens" in out
    resident, activations_offloaded, everything_offloaded = totals(out)
    assert everything_offloaded < activations_offloaded < resident < 80
    assert re.search(r"^on 80\.0 GiB devices\s+fits\s+fits\s+fits$", out, re.MULTILINE)
    assert 4096 <= longest(out)[0] < longest(out)[1] < longest(out)[2]
    assert "host memory, Engram tables: 188.8 GiB (every case)" in out
    assert main(["inspect", "--devices", "8x141GiB", "--train", "lora"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^on 141\.0 GiB devices\s+fits\s+fits\s+fits$", out, re.MULTILINE)
    assert 16384 <= longest(out)[0] < longest(out)[1]
    assert main(["inspect", "--devices", "8x141GiB", "--train", "lora", "--seq", "2048", "--rank", "8"]) == 0
    assert "micro-batch 1 × 2048 tokens" in capsys.readouterr().out
    # --ep 8 (the launch's --expert_parallel_size 8): a layer's 384 experts are no longer gathered whole: room for
    # longer sequences with everything resident
    assert main(["inspect", "--devices", "8x80GiB", "--train", "lora", "--ep", "8"]) == 0
    split = capsys.readouterr().out
    assert "the routed experts split over 8 of them: --expert_parallel_size 8" in split
    assert totals(split)[0] < resident and longest(split)[0] > 4096


def test_inspect_train_needs_devices_and_the_native_storage(capsys):
    assert main(["inspect", "tiny", "--train", "lora"]) == 2
    assert "give them with --devices" in capsys.readouterr().err
    assert main(["inspect", "tiny", "--devices", "2x1GiB", "--train", "lora", "--tp", "2"]) == 2
    assert "drop --tp and --storage" in capsys.readouterr().err
    assert main(["inspect", "tiny", "--devices", "4x1GiB", "--train", "lora", "--ep", "3"]) == 2
    assert "ep_size=3 must divide the 4 devices" in capsys.readouterr().err
