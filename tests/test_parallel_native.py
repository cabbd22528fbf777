"""The released storage loaded natively (FP8 Linears, FP4 experts kept as stored) under transformers' tensor- and
expert-parallel plans, on 2 gloo CPU processes: each rank loads only its shard (FP8 rows or columns with their
32x32 scale blocks, its experts' FP4 bytes and scales; the DSpark draft head's split as the backbone's) and gives the
logits and greedy tokens of one process's native load, for a text and an image prompt, plain and speculative
(``use_mtp=True``); the Engram tables stay where ``engram_tables=`` puts them; the combinations we do not support are
refused before loading, naming one that works.

The reference runs in the pytest process on the same released folder (``save_released_checkpoint``).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from dsv41_testers import TINY_VISION_CONFIG, prompt_inputs
from gloo_processes import WORLD, spawn
from reference_fixture import QUANT_FORMAT_TEXT, stub_tokenizer
from tiny_models import DSPARK
from torch.distributed.tensor import Shard, distribute_tensor
from transformers.distributed import DistributedConfig
from transformers.distributed.utils import is_dtensor

from configuration import DeepseekV41Config
from modeling_dsv41 import DeepseekV41ForCausalLM
from modeling_dsv41.released.conversions import check_whole_scale_blocks
from modeling_dsv41.released.native_precision import WeightOnlyFP4Experts, WeightOnlyFP8Linear
from modeling_dsv41.released.writing import save_released_checkpoint
from modeling_dsv41.parallel import check_parallel_load, distributed_config
from modeling_dsv41.cli.inspection import build_meta_model
from modeling_dsv41.placement import plan_parallel

PROMPT_LEN, NEW_TOKENS = 12, 6
# fp32 compute on the FP8/FP4 weights (the weight-only modules dequantize into the input's dtype): sharding changes
# only the order of fp32 sums, measured at ~5e-7 on these logits (|logits| ~ 1); the 1e-3 bound still catches
# a wrong shard or scale block, which moves them by ~0.1. (In bf16 each rank's partial sums are rounded to bf16 before
# the all-reduce: ~1e-2 on these logits, as on one process with another summation order.)
ATOL = RTOL = 1e-3


def _config() -> DeepseekV41Config:
    """I = 128 (64 per rank: two 32-wide scale blocks), 4 experts (2 per rank), a tiny ViT, the DSpark head."""
    vocab = QUANT_FORMAT_TEXT["vocab_size"]
    return DeepseekV41Config(
        text_config={**QUANT_FORMAT_TEXT, **DSPARK}, vision_config=TINY_VISION_CONFIG, image_token_id=vocab - 1
    )


@pytest.fixture(scope="module")
def released(tmp_path_factory) -> Path:
    """A released folder and one process's native load of it: logits and greedy tokens of a text and an image
    prompt, and the bytes of every parameter."""
    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("released")
    model = DeepseekV41ForCausalLM(_config()).to(torch.bfloat16)
    model.config.text_config.engram_table_dtype = "fp8"  # loaded as stored (FP8 rows), hence memory-mappable
    save_released_checkpoint(model, folder, max_shard_bytes=1 << 20)
    stub_tokenizer().save(str(folder / "tokenizer.json"))
    model = DeepseekV41ForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    reference = {"bytes": {n: p.numel() * p.element_size() for n, p in model.named_parameters()}}
    for prompt in ("text", "image"):
        inputs = prompt_inputs(model.config, PROMPT_LEN)
        if prompt == "text":
            inputs = {"input_ids": inputs["input_ids"].clamp(max=model.config.image_token_id - 1)}
        with torch.no_grad():
            logits = model(**inputs).logits
            tokens = model.generate(**inputs, max_new_tokens=NEW_TOKENS, do_sample=False)
            drafted = model.generate(**inputs, max_new_tokens=NEW_TOKENS, do_sample=False, use_mtp=True)
        assert torch.equal(drafted, tokens)
        reference[prompt] = {"inputs": inputs, "logits": logits, "tokens": tokens}
    torch.save(reference, folder / "reference.pt")
    return folder


def _mapped_from(tensor: torch.Tensor, folder: Path) -> bool:
    """Whether ``tensor``'s memory lies in a mapping of a file of ``folder`` (Linux's /proc/self/maps)."""
    address = tensor.untyped_storage().data_ptr()
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split()
        start, end = (int(x, 16) for x in fields[0].split("-"))
        if len(fields) >= 6 and fields[5].startswith(str(folder)) and start <= address < end:
            return True
    return False


def _local_bytes(model) -> dict[str, int]:
    out = {}
    for name, param in model.named_parameters():
        local = param.to_local() if is_dtensor(param) else param
        out[name] = local.numel() * local.element_size()
    return out


def _load_and_compare(rank: int, tmp: Path, folder: str, kind: str) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD))  # as torchrun sets them
    folder = Path(folder)
    if kind == "tp":
        # the tables memory-mapped from the checkpoint, as the released model's stay in host memory
        model = DeepseekV41ForCausalLM.from_pretrained(
            folder, tp_plan="auto", dtype=torch.float32, engram_tables="mmap"
        )
    else:
        model = DeepseekV41ForCausalLM.from_pretrained(
            folder,
            distributed_config=DistributedConfig(tp_size=WORLD, ep_size=WORLD),
            dtype=torch.float32,
            engram_tables="cpu",
        )
    model.eval()
    text = model.config.text_config
    inter, hidden = text.moe_intermediate_size, text.hidden_size
    # the backbone's MoE and the DSpark draft block's (its own expert count), split by the same plans
    for layer, experts in (
        (model.model.layers[1], text.n_routed_experts),
        (model.mtp[0], text.dspark_num_routed_experts),
    ):
        routed, shared = layer.ffn.experts, layer.ffn.shared_experts
        assert isinstance(routed, WeightOnlyFP4Experts) and isinstance(shared.w1, WeightOnlyFP8Linear)
        local = {name: tuple(p.to_local().shape) for name, p in routed.named_parameters()}
        if kind == "tp":  # every expert, this rank's I/2 of gate, of up and of down (FP4: two values a byte)
            assert local == {
                "gate_up_proj": (experts, inter, hidden // 2),
                "gate_up_proj_scale_inv": (experts, inter, hidden // 32),
                "down_proj": (experts, hidden, inter // 4),
                "down_proj_scale_inv": (experts, hidden, inter // 64),
            }, local
        else:  # whole experts, half of them
            assert local == {
                "gate_up_proj": (experts // 2, 2 * inter, hidden // 2),
                "gate_up_proj_scale_inv": (experts // 2, 2 * inter, hidden // 32),
                "down_proj": (experts // 2, hidden, inter // 2),
                "down_proj_scale_inv": (experts // 2, hidden, inter // 32),
            }, local
    shared = model.model.layers[1].ffn.shared_experts
    # the shared expert's FP8 Linears: I/2 rows (w1, w3) or columns (w2) with their 32x32 scale blocks (both plans
    # keep the TP plan for the dense part)
    assert tuple(shared.w1.weight.to_local().shape) == (inter // 2, hidden)
    assert tuple(shared.w1.weight_scale_inv.to_local().shape) == (inter // 64, hidden // 32)
    assert tuple(shared.w2.weight.to_local().shape) == (hidden, inter // 2)
    assert tuple(shared.w2.weight_scale_inv.to_local().shape) == (hidden // 32, inter // 64)
    if kind == "tp":  # the loader's own guard, for a plan cutting a block (the check before loading names sizes)
        mesh = shared.w1.weight.device_mesh
        cut = distribute_tensor(torch.empty(96, 64, device="meta"), mesh, [Shard(0)], src_data_rank=None)
        with pytest.raises(ValueError, match=r"gives 48 per rank, which cuts its E8M0 scale blocks \(32 each\)"):
            check_whole_scale_blocks(cut, (32, 32), "w1.weight")
        check_whole_scale_blocks(shared.w1.weight, (32, 32), "w1.weight")
    # the rank holds half of the experts' and the shared experts' bytes (plus the replicated rest)
    reference = torch.load(folder / "reference.pt")
    held = _local_bytes(model)
    split = re.compile(r"\.ffn\.(experts|shared_experts)\.|^model\.embed\.|^lm_head\.")  # and the vocabulary
    for name, nbytes in reference["bytes"].items():
        assert held[name] == (nbytes // WORLD if split.search(name) else nbytes), name
    # the planner behind `dsv41 inspect --tp/--ep` predicts these bytes (on a meta model in the loaded dtype)
    ep = WORLD if kind == "ep" else 1
    plan = plan_parallel(build_meta_model(model.config, dtype=torch.float32), tp_size=WORLD, ep_size=ep, native=True)
    tables = re.compile(r"\.engram\.embed\.")
    assert plan.per_rank_bytes == sum(nbytes for name, nbytes in held.items() if not tables.search(name))
    # the Engram tables: whole on every rank, plain tensors (looked up by hash ids as on one process), where
    # engram_tables= put them
    for engram_layer in (0, 1):
        table = model.model.layers[engram_layer].engram.embed.weight
        assert not is_dtensor(table) and table.device.type == "cpu" and table.dtype == torch.float8_e4m3fn
        if kind == "tp":  # (a table loaded as stored may stay file-backed with "cpu" too: not checked there)
            assert _mapped_from(table, folder)
    for prompt in ("text", "image"):
        expected = reference[prompt]
        with torch.no_grad():
            logits = model(**expected["inputs"]).logits
            tokens = model.generate(**expected["inputs"], max_new_tokens=NEW_TOKENS, do_sample=False)
            drafted = model.generate(**expected["inputs"], max_new_tokens=NEW_TOKENS, do_sample=False, use_mtp=True)
        torch.testing.assert_close(logits, expected["logits"], atol=ATOL, rtol=RTOL)
        assert torch.equal(tokens, expected["tokens"]), (prompt, tokens, expected["tokens"])
        assert torch.equal(drafted, expected["tokens"]), (prompt, drafted, expected["tokens"])  # DSpark: the same


@pytest.mark.skipif(not dist.is_available(), reason="torch built without torch.distributed")
@pytest.mark.parametrize("kind", ["tp", "ep"])
def test_native_parallel_load_matches_one_process(tmp_path, released, kind):
    spawn(_load_and_compare, tmp_path, str(released), kind)


def test_a_split_cutting_a_scale_block_is_refused_naming_working_sizes():
    config = _config()  # I = 128: tp 2 and 4 leave whole 32-wide blocks, tp 8 does not
    check_parallel_load(config, DistributedConfig(tp_size=4), native=True, released=True)
    with pytest.raises(ValueError, match=r"tp_size=8 splits moe_intermediate_size=128 .* use tp_size in \[2, 4\]"):
        check_parallel_load(config, DistributedConfig(tp_size=8), native=True, released=True)
    # our own (plain) checkpoints have no scale blocks to keep whole
    check_parallel_load(config, DistributedConfig(tp_size=8), native=False, released=False)


def test_fsdp_on_native_weights_is_refused_naming_tensor_parallelism():
    with pytest.raises(ValueError, match=r"FSDP .* DistributedConfig\(tp_size=2, ep_size=2\)"):
        check_parallel_load(_config(), DistributedConfig(fsdp_size=2, ep_size=2), native=True, released=True)
    check_parallel_load(_config(), DistributedConfig(fsdp_size=2, ep_size=2), native=False, released=True)


def test_expert_parallelism_alone_is_answered_with_the_combination_that_works():
    with pytest.raises(ValueError, match=r"must divide .* use DistributedConfig\(tp_size=2, ep_size=2\)"):
        distributed_config(ep_size=2)
    assert distributed_config(tp_size=2, ep_size=2).ep_size == 2
    with pytest.raises(ValueError, match=r"ep_size=3 does not divide n_routed_experts=4"):
        check_parallel_load(_config(), DistributedConfig(tp_size=3, ep_size=3), native=False, released=False)
