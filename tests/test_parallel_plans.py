"""The config's tensor- and expert-parallel plans, run by transformers: ``from_pretrained(tp_plan="auto")`` and
``DistributedConfig(tp_size=2, ep_size=2, tp_plan={})`` on 2 gloo CPU processes give the logits and the greedy tokens
of one process.

The reference runs in the pytest process on the same saved folder; each worker loads it sharded and compares.
"""

from __future__ import annotations

import os
import re
import socket
import time
import traceback
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from safetensors.torch import load_file

from configuration import DeepseekV41Config
from modeling_dsv41 import DeepseekV41ForCausalLM

WORLD = 2
TIMEOUT_S = 120
PROMPT_LEN, NEW_TOKENS = 12, 6
# fp32 throughout: sharding changes only the order of the experts' (and the vocabulary's) fp32 sums, measured at
# ~1e-6 on these logits (|logits| ~ 1); 1e-4 leaves room for other CPUs' kernels while a wrong shard moves them by ~0.1.
ATOL = RTOL = 1e-4


def _tiny_config() -> DeepseekV41Config:
    # text-only tiny preset: 4 experts (2 per rank), I = 32 (16 per rank), vocab 512 (256 per rank)
    return DeepseekV41Config.from_preset("tiny", vision_config=None)


def _reference(folder: Path, fixtures: Path) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = DeepseekV41ForCausalLM(_tiny_config()).eval()
    model.model.engram_hasher.token_map.copy_(load_file(fixtures / "v41_tiny_vl/engram.safetensors")["token_map"])
    model.save_pretrained(folder)
    model = DeepseekV41ForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    input_ids = torch.randint(3, model.config.text_config.vocab_size, (2, PROMPT_LEN))
    with torch.no_grad():
        logits = model(input_ids).logits
        tokens = model.generate(input_ids, max_new_tokens=NEW_TOKENS, do_sample=False)
    reference = {"input_ids": input_ids, "logits": logits, "tokens": tokens}
    torch.save(reference, folder / "reference.pt")
    return reference


def _load_sharded_and_compare(rank: int, folder: Path, kind: str) -> None:
    from transformers.distributed import DistributedConfig

    if kind == "tp":
        model = DeepseekV41ForCausalLM.from_pretrained(folder, dtype=torch.float32, tp_plan="auto")
        experts = model.model.layers[0].ffn.experts
        assert experts.gate_up_proj.to_local().shape[1] == 2 * 32 // WORLD  # each rank: its I/2 of gate and of up
        assert experts.down_proj.to_local().shape[-1] == 32 // WORLD
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
        logits = model(reference["input_ids"]).logits
        tokens = model.generate(reference["input_ids"], max_new_tokens=NEW_TOKENS, do_sample=False)
    torch.testing.assert_close(logits, reference["logits"], atol=ATOL, rtol=RTOL)
    assert torch.equal(tokens, reference["tokens"]), (tokens, reference["tokens"])


def _worker(rank: int, port: int, folder: str, kind: str) -> None:
    # the environment transformers' distributed loading reads (as torchrun sets it)
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD)
    )
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        _load_sharded_and_compare(rank, Path(folder), kind)
    except BaseException:
        (Path(folder) / f"failure_{rank}.txt").write_text(traceback.format_exc())
        raise
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn(folder: Path, kind: str) -> None:
    """Run the comparison on 2 gloo processes; fail (not hang) after TIMEOUT_S."""
    context = mp.start_processes(
        _worker, args=(_free_port(), str(folder), kind), nprocs=WORLD, join=False, start_method="spawn"
    )
    deadline = time.monotonic() + TIMEOUT_S
    try:
        while not context.join(timeout=1):
            if time.monotonic() > deadline:
                pytest.fail(f"{kind} did not finish within {TIMEOUT_S} s")
    except (mp.ProcessRaisedException, mp.ProcessExitedException):
        failures = sorted(folder.glob("failure_*.txt"))
        pytest.fail("\n".join(f.read_text() for f in failures) or "a worker failed")
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()


def test_plans_name_only_modules_of_the_model():
    model = DeepseekV41ForCausalLM(_tiny_config())
    names = {n for n, _ in model.named_modules()} | {n for n, _ in model.named_parameters()}
    for plan in (model.tp_plan, model.ep_plan):
        assert plan
        for key in plan:
            pattern = key.replace(".", r"\.").replace("*", r"\d+")
            assert any(re.fullmatch(pattern, name) for name in names), key
    assert not model.pp_plan  # see the config's comment: our layers pass more than one tensor between stages


@pytest.mark.skipif(not dist.is_available(), reason="torch built without torch.distributed")
@pytest.mark.parametrize("kind", ["tp", "ep", "ep_all_to_all"])
def test_two_gloo_processes_match_one(tmp_path, fixtures_dir, kind):
    _reference(tmp_path, fixtures_dir)
    _spawn(tmp_path, kind)
