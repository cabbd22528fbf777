"""The config's tensor-, expert- and pipeline-parallel plans, run by transformers: ``from_pretrained(tp_plan="auto")``,
``DistributedConfig(tp_size=2, ep_size=2, tp_plan={})`` and ``DistributedConfig(pp_size=2)`` on 2 gloo CPU processes
give the logits and the greedy tokens of one process.

The reference runs in the pytest process on the same saved folder; each worker loads it sharded and compares.
"""

from __future__ import annotations

import inspect
import os
import re
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from dsv41_testers import prompt_inputs
from gloo_processes import WORLD, spawn
from safetensors.torch import load_file

from configuration import DeepseekV41Config
from modeling_dsv41 import DeepseekV41ForCausalLM
from modeling_dsv41.modeling_dsv41 import DeepseekV41DecoderLayer

PROMPT_LEN, NEW_TOKENS = 12, 6
# fp32 throughout: sharding changes only the order of the experts' (and the vocabulary's) fp32 sums, measured at
# ~1e-6 on these logits (|logits| ~ 1); 1e-4 leaves room for other CPUs' kernels while a wrong shard moves them by
# ~0.1. The pipeline split changes no sum (each stage runs whole layers on the stream it receives, sent at its own
# dtype): only the workers' single-threaded GEMMs block differently from the reference process's, measured at ~2e-7;
# held to the same bound.
ATOL = RTOL = 1e-4


def _tiny_config(kind: str = "tp") -> DeepseekV41Config:
    # tiny preset, text-only but for "pp_image": 4 experts (2 per rank), I = 32 (16 per rank), vocab 512 (256 per rank)
    config = DeepseekV41Config.from_preset("tiny", **({} if kind == "pp_image" else {"vision_config": None}))
    if kind.startswith("pp"):
        # 6 layers: stage 0 runs 0-2, stage 1 runs 3-5. An Engram layer on each stage, and layer 3 (stage 1) reads the
        # compressed K=V, index keys and candidate blocks that layer 1 (stage 0) made, so all of the stream crosses.
        text = config.text_config
        text.engram_layer_ids = [1, 4]
        text.compress_ratios = [0, 2, 2, 2, 1, 1]
        text.kv_source_layer_ids, text.index_source_layer_ids, text.candidate_source_layer_id = [1, 4], [1, 3, 4], 1
        config = DeepseekV41Config.from_dict(config.to_dict())  # validated anew
    return config


def _reference(folder: Path, fixtures: Path, kind: str) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = DeepseekV41ForCausalLM(_tiny_config(kind)).eval()
    model.model.engram_hasher.token_map.copy_(load_file(fixtures / "v41_tiny_vl/engram.safetensors")["token_map"])
    model.save_pretrained(folder)
    model = DeepseekV41ForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    inputs = prompt_inputs(model.config, PROMPT_LEN)
    with torch.no_grad():
        logits = model(**inputs).logits
        tokens = model.generate(**inputs, max_new_tokens=NEW_TOKENS, do_sample=False)
    reference = {"inputs": inputs, "logits": logits, "tokens": tokens}
    torch.save(reference, folder / "reference.pt")
    return reference


def _load_sharded_and_compare(rank: int, folder: Path, kind: str) -> None:
    from transformers.distributed import DistributedConfig

    # the environment transformers' distributed loading reads (as torchrun sets it)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD))
    if kind.startswith("pp"):
        model = _load_pipeline_stage(rank, folder, kind)
    elif kind == "tp":
        model = DeepseekV41ForCausalLM.from_pretrained(folder, dtype=torch.float32, tp_plan="auto")
        experts = model.model.layers[0].ffn.experts
        assert experts.gate_up_proj.to_local().shape[1] == 2 * 32 // WORLD  # each rank: its I/2 of gate and of up
        assert experts.down_proj.to_local().shape[-1] == 32 // WORLD
        shared = model.model.layers[0].ffn.shared_experts  # I/2 rows of w1 and w3, columns of w2
        assert shared.w1.weight.to_local().shape[0] == shared.w2.weight.to_local().shape[1] == 32 // WORLD
    else:
        # ep_size == tp_size: the experts follow the EP plan, the rest the TP plan (a `tp_plan={}` for EP alone is
        # refused by transformers 5.24 when tp_size > 1: "has no `tp_plan`"). "auto" picks the all-reduce dispatch at
        # inference; "all_to_all" exchanges the routed tokens.
        implementation = "auto" if kind == "ep" else "all_to_all"
        config = DistributedConfig(tp_size=WORLD, ep_size=WORLD, ep_implementation=implementation)
        model = DeepseekV41ForCausalLM.from_pretrained(folder, dtype=torch.float32, distributed_config=config)
        experts = model.model.layers[0].ffn.experts
        assert experts.num_experts == 4 // WORLD
        assert experts.gate_up_proj.to_local().shape[0] == 4 // WORLD  # whole experts per rank
    model.eval()
    reference = torch.load(folder / "reference.pt")
    with torch.no_grad():
        logits = model(**reference["inputs"]).logits
        tokens = model.generate(**reference["inputs"], max_new_tokens=NEW_TOKENS, do_sample=False)
    torch.testing.assert_close(logits, reference["logits"], atol=ATOL, rtol=RTOL)
    assert torch.equal(tokens, reference["tokens"]), (tokens, reference["tokens"])
    if kind.startswith("pp"):  # a rank given other tokens (as sampling seeded per rank would) is refused on every rank
        other = {**reference["inputs"], "input_ids": reference["inputs"]["input_ids"] + rank}
        with pytest.raises(ValueError, match="different inputs"), torch.no_grad():
            model(**other)


def _load_pipeline_stage(rank: int, folder: Path, kind: str) -> DeepseekV41ForCausalLM:
    """Stage ``rank`` of a 2-stage pipeline, checked to hold (and to have loaded) only its own modules."""
    from transformers.distributed import DistributedConfig

    # the text case also memory-maps the Engram tables (as the released model's stay in host memory): each stage maps
    # only its own layers' tables
    model, info = DeepseekV41ForCausalLM.from_pretrained(
        folder,
        dtype=torch.float32,
        distributed_config=DistributedConfig(pp_size=WORLD),
        output_loading_info=True,
        engram_tables="mmap" if kind == "pp" else "auto",
    )
    assert not info["unexpected_keys"] and not info["missing_keys"], info
    own = range(0, 3) if rank == 0 else range(3, 6)
    state = model.state_dict()
    layers = {int(key.split(".")[2]) for key in state if key.startswith("model.layers.")}
    assert layers == set(own), layers
    assert ("model.embed.weight" in state) == (rank == 0)
    vision = {key.split(".")[1] for key in state if key.startswith(("model.vision.", "model.aligner."))}
    assert vision == ({"vision", "aligner"} if rank == 0 and model.config.has_vision else set()), vision
    assert ("lm_head.weight" in state) == ("model.norm.weight" in state) == (rank == 1)
    with pytest.raises(ValueError, match="one pipeline stage"):  # a stage's save would be a partial checkpoint
        model.save_pretrained(folder.parent / f"stage{rank}")
    assert not (folder.parent / f"stage{rank}").exists()
    return model


def test_plans_name_only_modules_of_the_model():
    model = DeepseekV41ForCausalLM(_tiny_config())
    names = {n for n, _ in model.named_modules()} | {n for n, _ in model.named_parameters()}
    for plan in (model.tp_plan, model.ep_plan):
        assert plan
        for key in plan:
            pattern = key.replace(".", r"\.").replace("*", r"\d+")
            assert any(re.fullmatch(pattern, name) for name in names), key
    for key in model.pp_plan:
        assert key in names, key
    # what crosses a stage boundary is what a decoder layer takes and hands on (the residual stream), by name
    stream = list(inspect.signature(DeepseekV41DecoderLayer.forward).parameters)
    inputs, outputs = model.pp_plan["model.layers"]
    assert inputs == outputs == [name for name in stream if name in inputs]
    assert inputs == ["hidden_states", "pre_mix", "compress_kv", "index_k", "selection", "candidates"]


@pytest.mark.skipif(not dist.is_available(), reason="torch built without torch.distributed")
@pytest.mark.parametrize("kind", ["tp", "ep", "ep_all_to_all", "pp", "pp_image"])
def test_two_gloo_processes_match_one(tmp_path, fixtures_dir, kind):
    _reference(tmp_path, fixtures_dir, kind)
    spawn(_load_sharded_and_compare, tmp_path, kind)
