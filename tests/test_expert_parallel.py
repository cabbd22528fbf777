"""Expert-parallel training on the 2-D mesh (2 EP × 2 data-parallel ranks: 4 gloo processes on CPU, spawned from
pytest, bounded in time): :func:`shard_model` with ``expert_parallel_size``, the mixed optimizer and router balancing,
against one process.

Models are the tiny preset cut to 2 decoder layers (4 routed experts, top 2: each EP rank holds 2, each rank 1),
QDQ emulation off, gradient checkpointing on (its inputs offloaded, as ``offload_activations`` asks). Every step takes
4 micro-batches, one per rank, each of a text row and a row with an image (real pixels through the ViT). One process
runs the same micro-batches and sums their gradients in the order the mesh does, EP group by EP group: (g0 + g1) + (g2
+ g3) (see modeling_dsv41/training/expert_parallel.py; summed in another order the gradients differ in their last bits,
and so would the parameters).

Then DeepseekV41Trainer on the mesh (``expert_parallel_size=2``, as accelerate's FSDP2 launch sets it up): sharded
checkpoints that resume on 4, 2 (and from 2 on 4) processes bit-identical to the uninterrupted run, a process killed
while saving, ``accelerate merge-weights``; docs/training.md's launches; what does not combine.

Process groups are expensive (each process imports torch and transformers): the checks share four spawns. 4
processes: the mesh against one process, the uninterrupted Trainer run, then a run killed while saving. 2 processes:
a run on 2, the 4-process checkpoint resumed on 2, the refusals of ``shard_model``. 4 processes: the 2-process
checkpoint resumed on 4 and the rerun of the killed run. 4 processes: docs/training.md's launch as printed.
"""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from gloo_processes import spawn
from test_trainer_distributed import demo_model  # noqa: F401  (a fixture: the demo model in a folder)
from tiny_models import tiny_training_model

from modeling_dsv41 import DeepseekV41Config, DeepseekV41ForCausalLM, DeepseekV41Trainer, DeepseekV41TrainingArguments
from modeling_dsv41.numerics import reference_numerics
from modeling_dsv41.optim import MixedOptimizer, assign_kinds, build_param_groups, freeze_default_parameters
from modeling_dsv41.training.router_balancing import RouterBiasBalancer

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch built without torch.distributed")

WORLD, EP_SIZE = 4, 2
EP_GROUPS = ((0, 1), (2, 3))  # the ranks of each EP group (ep is the inner mesh dimension)
STEPS = 3
SEQ = 16
LR = 1e-2
SPEED = 0.25  # a power of two: biases stay exact in fp32
IMAGE_SPAN = [0, 1, 1, 2, 1, 1, 2, 3]  # a 6×6-patch image: start, 2 rows of (2 tokens + newline), end
IMAGE_TOKEN_ID = 510


def tiny_model(seed: int = 0):
    model = tiny_training_model(num_hidden_layers=2, seed=seed)
    freeze_default_parameters(model)
    model.activation_checkpointing_enable()
    return model


def micro_batch(seed: int) -> dict[str, torch.Tensor]:
    """A text row and a row with an image at position 3 (its positions unlabelled): every micro-batch has as many
    label tokens as the others, so the mean of their losses is the loss of the whole step's batch."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 500, (2, SEQ), generator=g)
    types = torch.full((2, SEQ), -1)
    types[1, 3 : 3 + len(IMAGE_SPAN)] = torch.tensor(IMAGE_SPAN)
    ids = ids.masked_fill(types != -1, IMAGE_TOKEN_ID)
    return {
        "input_ids": ids,
        "labels": ids.masked_fill(types != -1, -100),
        "attention_mask": torch.ones_like(ids),
        "image_token_types": types,
        "pixel_values": torch.rand(36, 3, 14, 14, generator=g) * 2 - 1,
        "image_grid_hw": torch.tensor([[6, 6]]),
    }


def step_batches(steps: int = STEPS) -> list[list[dict[str, torch.Tensor]]]:
    return [[micro_batch(100 * step + rank) for rank in range(WORLD)] for step in range(steps)]


def optimizer_step(model, optimizer, balancer) -> None:
    with reference_numerics():  # Newton–Schulz's bf16 products rounded once: the same bits at any batch of matrices
        optimizer.step()
    optimizer.zero_grad()
    balancer.step()


def train_one_process(model, optimizer, balancer, steps) -> None:
    """One process, every rank's micro-batch of each step, the gradients summed EP group by EP group."""
    for micro_batches in steps:
        groups = []
        for ranks in EP_GROUPS:
            for rank in ranks:
                (model(**micro_batches[rank]).loss / WORLD).backward()
            groups.append({n: p.grad for n, p in model.named_parameters() if p.grad is not None})
            model.zero_grad(set_to_none=True)
        for name, param in model.named_parameters():
            if name in groups[0]:
                param.grad = groups[0][name] + groups[1][name]
        optimizer_step(model, optimizer, balancer)


def whole(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def assert_experts_step_without_communication(model) -> None:
    """A MixedOptimizer step over the routed experts alone calls no collective: each rank's experts are whole."""
    names = [name for name, _ in model.named_parameters() if ".ffn.experts." in name]
    groups = []
    for group in build_param_groups(model, lr=LR):
        members = [(n, p) for n, p in zip(group["param_names"], group["params"]) if n in names]
        if members:
            groups.append({**group, "param_names": [n for n, _ in members], "params": [p for _, p in members]})
    assert {g["kind"] for g in groups} == {"muon", "muon_headwise"}  # down_proj, gate_up_proj (w1 | w3 head-wise)
    assert sum(len(g["params"]) for g in groups) == len(names) == 4  # 2 layers × (gate_up_proj, down_proj)
    optimizer = MixedOptimizer(groups)
    for group in groups:
        for param in group["params"]:
            param.grad = torch.ones_like(param)
    calls = []
    collectives = (
        "all_to_all_single",
        "all_reduce",
        "all_gather",
        "all_gather_into_tensor",
        "reduce_scatter_tensor",
        "broadcast",
    )
    originals = {name: getattr(dist, name) for name in collectives}
    try:
        for name in collectives:
            setattr(dist, name, lambda *args, _name=name, **kwargs: calls.append(_name))
        optimizer.step()
    finally:
        for name, function in originals.items():
            setattr(dist, name, function)
    model.zero_grad(set_to_none=True)
    assert not calls, calls


# ----------------------------------------------------------------------------- workers


def _mesh_matches_one_process(rank: int, tmp: Path) -> None:
    from modeling_dsv41.training.fsdp import shard_model

    steps = step_batches()
    model = shard_model(tiny_model(), expert_parallel_size=EP_SIZE, offload_activations=True)
    assert all(layer._gradient_checkpointing_func.offloads_to_host for layer in model.model.layers)
    experts = model.model.layers[0].ffn.experts
    assert tuple(experts.gate_up_proj.shape) == (4, 64, 64)  # the whole tensor, as checkpoints hold it
    assert tuple(experts.gate_up_proj.to_local().shape) == (1, 64, 64)  # this rank's expert, whole
    optimizer = MixedOptimizer(build_param_groups(model, lr=LR))
    balancer = RouterBiasBalancer(model, SPEED)
    model.train()
    for step, micro_batches in enumerate(steps):
        loss = model(**micro_batches[rank]).loss
        loss.backward()
        optimizer_step(model, optimizer, balancer)
    parameters = {name: whole(p.detach()) for name, p in model.named_parameters()}  # collective: every rank
    biases = {name: b for name, b in model.named_buffers() if ".gate.bias" in name}
    for name, bias in biases.items():  # the balancer's buffers: identical on every rank
        gathered = [torch.empty_like(bias) for _ in range(WORLD)]
        dist.all_gather(gathered, bias)
        assert all(torch.equal(gathered[0], other) for other in gathered), name
    assert_experts_step_without_communication(model)
    if rank:
        return
    single = torch.load(tmp / "single.pt")
    kinds = single["kinds"]
    diff, norm = {}, {}
    for name, param in single["parameters"].items():
        kind = kinds[name]
        diff[kind] = diff.get(kind, 0.0) + (parameters[name] - param).pow(2).sum().item()
        norm[kind] = norm.get(kind, 0.0) + param.pow(2).sum().item()
    errors = {kind: (diff[kind] / norm[kind]) ** 0.5 for kind in diff if kind != "frozen"}
    (tmp / "errors.txt").write_text(repr(errors))
    assert set(errors) == {"muon", "muon_headwise", "sinkhorn", "adamw"}, errors
    differing = [name for name, param in single["parameters"].items() if not torch.equal(parameters[name], param)]
    assert not differing, f"{len(differing)} parameters differ from one process's, e.g. {differing[:5]}; {errors}"
    assert any(bias.any() for bias in biases.values())
    for name, bias in biases.items():
        assert torch.equal(bias, single["biases"][name]), name


def one_process_reference(path: Path) -> None:
    """Train one process on every rank's micro-batches (before any process group exists: its balancer counts
    alone) and save its parameters, biases and optimizer kinds."""
    single = tiny_model()
    single_optimizer = MixedOptimizer(build_param_groups(single, lr=LR))
    train_one_process(single, single_optimizer, RouterBiasBalancer(single, SPEED), step_batches())
    torch.save(
        {
            "parameters": {name: p.detach() for name, p in single.named_parameters()},
            "biases": {name: b for name, b in single.named_buffers() if ".gate.bias" in name},
            "kinds": assign_kinds(single),
        },
        path,
    )


def test_2x2_mesh_three_steps_equal_one_process_bit_for_bit(uninterrupted):
    """Relative difference 0 per optimizer kind (every parameter equal), biases identical everywhere and to one
    process's, on text and image batches, with gradient checkpointing (and activation offloading)."""
    failures = sorted(uninterrupted.glob("mesh_failure_*.txt"))
    assert not failures, "\n".join(f.read_text() for f in failures)
    print((uninterrupted / "errors.txt").read_text())


# ------------------------------------------------------------------------ DeepseekV41Trainer: checkpoints that reshard

TRAIN_STEPS, SAVE_STEPS, ROWS = 4, 2, 32  # 2 rows per process and micro-batch: 8 rows per step on 4 or 2 processes
TRAINER_SPEED = 2**-6  # small enough that the biases do not swing back to 0 every other step on the tiny model


class ImageRows(torch.utils.data.Dataset):
    """Rows of text around an image (every micro-batch runs the ViT on every process: FSDP2 reduces its gradients
    on all of them)."""

    def __init__(self, rows: int = ROWS):
        self.rows = [image_row(seed) for seed in range(rows)]

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return self.rows[index]


def image_row(seed: int) -> dict[str, torch.Tensor]:
    batch = micro_batch(10_000 + seed)
    return {key: value[1] for key, value in batch.items() if key not in ("pixel_values", "image_grid_hw")} | {
        "pixel_values": batch["pixel_values"],
        "image_grid_hw": batch["image_grid_hw"][0],
    }


def collate_rows(rows: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    batch = {key: torch.stack([row[key] for row in rows]) for key in rows[0] if key != "pixel_values"}
    return batch | {"pixel_values": torch.cat([row["pixel_values"] for row in rows])}


def launch_environment(rank: int, world: int) -> None:
    """What ``accelerate launch --config_file examples/accelerate/fsdp2_multinode.yaml`` hands every process (fp32
    here: no mixed precision, so that runs on 4 and on 2 processes can be compared bit for bit)."""
    import os

    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_WORLD_SIZE=str(world),
        ACCELERATE_USE_FSDP="true",
        FSDP_VERSION="2",
        FSDP_STATE_DICT_TYPE="SHARDED_STATE_DICT",
        FSDP_AUTO_WRAP_POLICY="TRANSFORMER_BASED_WRAP",
        FSDP_RESHARD_AFTER_FORWARD="true",
        FSDP_OFFLOAD_PARAMS="false",
        FSDP_CPU_RAM_EFFICIENT_LOADING="false",
        ACCELERATE_MIXED_PRECISION="no",
    )


def trainer_run(rank: int, world: int, output: Path, resume: Path | bool | None = None, offload: bool = False):
    """DeepseekV41Trainer on the (world / 2) × 2 mesh: 4 steps of 8 rows, checkpoints every 2 steps; on 2 processes
    two micro-batches per step (accumulated), so that every step sees the same 8 rows in the same micro-batches. The
    gradients are clipped (max_grad_norm 1; their norm is about 2). ``offload``: ``offload_activations``."""
    launch_environment(rank, world)
    args = DeepseekV41TrainingArguments(
        output_dir=str(output),
        max_steps=TRAIN_STEPS,
        save_steps=SAVE_STEPS,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=WORLD // world,
        learning_rate=LR,
        expert_parallel_size=EP_SIZE,
        activation_checkpointing=True,
        bias_update_speed=TRAINER_SPEED,
        logging_steps=1,
        report_to="none",
        remove_unused_columns=False,
        dataloader_num_workers=0,
        seed=0,
        offload_activations=offload,
    )
    model = tiny_training_model(num_hidden_layers=2, seed=0)
    trainer = ReferenceStepTrainer(model=model, args=args, train_dataset=ImageRows(), data_collator=collate_rows)
    trainer.train(resume_from_checkpoint=str(resume) if isinstance(resume, Path) else resume)
    return trainer


class ReferenceStepTrainer(DeepseekV41Trainer):
    """Steps the optimizer in reference numerics: Newton–Schulz then gives the same bits whichever process
    orthogonalizes a matrix and however many it batches, so that runs on 4 and on 2 processes can be compared."""

    def create_optimizer(self, model=None):
        optimizer = super().create_optimizer(model)
        if not getattr(optimizer, "reference_step", False):
            step = optimizer.step

            def reference_step(closure=None):
                with reference_numerics():
                    return step(closure)

            optimizer.step, optimizer.reference_step = reference_step, True
        return optimizer


def _mesh_then_train_on_4_then_killed(rank: int, tmp: Path) -> None:
    """The mesh against one process (its failures recorded for its test), the uninterrupted Trainer run, then the
    killed run (from a copy of its checkpoint-2)."""
    import shutil
    import traceback

    try:
        _mesh_matches_one_process(rank, tmp)
    except AssertionError:  # raised after the mesh's last collective: the other ranks go on to the Trainer run
        (tmp / f"mesh_failure_{rank}.txt").write_text(traceback.format_exc())
    trainer = trainer_run(rank, WORLD, tmp / "four")
    experts = trainer.model.model.layers[0].ffn.experts
    assert tuple(experts.gate_up_proj.to_local().shape) == (1, 64, 64)  # expert parallel: one whole expert each
    if rank == 0:
        shutil.copytree(tmp / "four" / f"checkpoint-{SAVE_STEPS}", tmp / "killed" / f"checkpoint-{SAVE_STEPS}")
    dist.barrier()
    _killed_while_saving(rank, tmp)


def _on_2(rank: int, tmp: Path) -> None:
    """A run on 2 processes (its activations offloaded), the 4-process checkpoint-2 resumed on 2, the refusals of
    ``shard_model``."""
    trainer = trainer_run(rank, 2, tmp / "two", offload=True)
    assert all(layer._gradient_checkpointing_func.offloads_to_host for layer in trainer.model.model.layers)
    trainer_run(rank, 2, tmp / "four-on-two", resume=tmp / "four" / f"checkpoint-{SAVE_STEPS}")
    _shard_model_refusals(rank, tmp)
    (tmp / f"refusals_{rank}.ok").touch()


def _resume_2_on_4_and_rerun_the_killed_save(rank: int, tmp: Path) -> None:
    trainer_run(rank, WORLD, tmp / "two-on-four", resume=tmp / "two" / f"checkpoint-{SAVE_STEPS}")
    trainer_run(rank, WORLD, tmp / "killed", resume=True)  # picks the newest complete checkpoint


def _killed_while_saving(rank: int, tmp: Path) -> None:
    """Resumes from checkpoint-2 and trains to step 4; process 1 dies while it writes the optimizer's shards of
    checkpoint-4 (the others wait for it until the launcher ends them)."""
    import os

    from torch.distributed.checkpoint import FileSystemWriter

    write_data = FileSystemWriter.write_data

    def dying_write_data(self, plan, planner):
        if rank == 1 and f"checkpoint-{TRAIN_STEPS}" in str(self.path) and "optimizer" in str(self.path):
            os._exit(1)
        return write_data(self, plan, planner)

    FileSystemWriter.write_data = dying_write_data
    trainer_run(rank, WORLD, tmp / "killed", resume=tmp / "killed" / f"checkpoint-{SAVE_STEPS}")


def spawn_until_killed(fn, tmp: Path, world_size: int, timeout_s: float) -> None:
    """Run ``fn`` as :func:`spawn` does, expecting a process to die: the others are then ended, as ``torchrun`` and
    ``accelerate launch`` end them."""
    import time

    import torch.multiprocessing as mp
    from gloo_processes import _worker, free_port

    context = mp.start_processes(
        _worker, args=(fn, free_port(), str(tmp), (), world_size), nprocs=world_size, join=False, start_method="spawn"
    )
    deadline = time.monotonic() + timeout_s
    try:
        with pytest.raises(mp.ProcessExitedException, match="exit code 1"):
            try:
                while not context.join(timeout=1):
                    if time.monotonic() > deadline:
                        pytest.fail(f"{fn.__name__} did not die within {timeout_s} s")
            except mp.ProcessRaisedException:  # failed before it was killed
                pytest.fail("\n".join(f.read_text() for f in sorted(tmp.glob("failure_*.txt"))) or "a worker failed")
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()


def checkpoint_state(checkpoint: Path, scratch: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a Trainer checkpoint that does not depend on the number of processes: the model's and the
    optimizer's (torch.distributed.checkpoint folders, read whole) and the scheduler's."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    tensors = {}
    for name in ("pytorch_model_fsdp_0", "optimizer_0"):
        whole = scratch / f"{checkpoint.parent.name}-{checkpoint.name}-{name}.pt"
        dcp_to_torch_save(checkpoint / name, whole)
        flatten(name, torch.load(whole, weights_only=False), tensors)
    flatten("scheduler", torch.load(checkpoint / "scheduler.pt", weights_only=False), tensors)
    return tensors


def flatten(prefix: str, value, into: dict) -> None:
    if isinstance(value, torch.Tensor):
        into[prefix] = value
    elif isinstance(value, dict):
        for key, item in value.items():
            flatten(f"{prefix}/{key}", item, into)
    elif isinstance(value, (list, tuple)):
        for key, item in enumerate(value):
            flatten(f"{prefix}/{key}", item, into)
    else:
        into[prefix] = torch.tensor(float(value)) if isinstance(value, (int, float)) else value


def assert_same_state(actual: Path, expected: Path, scratch: Path) -> None:
    tensors, reference = checkpoint_state(actual, scratch), checkpoint_state(expected, scratch)
    assert tensors.keys() == reference.keys() and len(tensors) > 200
    differing = [key for key, value in reference.items() if not equal(tensors[key], value)]
    assert not differing, f"{actual} differs from {expected}: {differing[:5]}"


def equal(a, b) -> bool:
    return torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> Path:
    """One process's reference, then 4 processes: the mesh against it, a Trainer run with checkpoints at steps 2 and
    4, and the run killed while saving (in killed/, from a copy of checkpoint-2; process 1 dies)."""
    tmp = tmp_path_factory.mktemp("ep-trainer")
    one_process_reference(tmp / "single.pt")
    spawn_until_killed(_mesh_then_train_on_4_then_killed, tmp, world_size=WORLD, timeout_s=900)
    return tmp


@pytest.fixture(scope="module")
def on_two(uninterrupted) -> Path:
    """2 processes: a run, the resumed 4-process checkpoint-2, the refusals."""
    spawn(_on_2, uninterrupted, world_size=2, timeout_s=600)
    return uninterrupted


def test_trainer_checkpoint_of_4_processes_resumes_on_2_exactly(on_two, tmp_path):
    """The Trainer's sharded checkpoint (weights, Muon and Sinkhorn momentum, AdamW moments, balancing biases,
    scheduler) saved on 4 processes resumes on 2 and ends at step 4 bit-identical to the uninterrupted run; a run on
    2 processes (two micro-batches per step, activations offloaded) equals the run on 4 step for step. (4 → 4 and
    2 → 4: the next test.)"""
    tmp = on_two
    four, two = tmp / "four", tmp / "two"
    for checkpoint in (four / "checkpoint-2", four / "checkpoint-4"):
        assert len(list((checkpoint / "pytorch_model_fsdp_0").glob("*.distcp"))) == WORLD
    assert len(list((two / "checkpoint-2" / "pytorch_model_fsdp_0").glob("*.distcp"))) == 2
    for step in (2, 4):
        assert_same_state(two / f"checkpoint-{step}", four / f"checkpoint-{step}", tmp_path)
    assert_same_state(tmp / "four-on-two" / "checkpoint-4", four / "checkpoint-4", tmp_path)
    state = checkpoint_state(four / "checkpoint-4", tmp_path)
    biases = [key for key in state if key.endswith((".gate.bias", ".gate.bias_vl"))]
    assert biases and any(state[key].any() for key in biases)  # the balancing biases travel with the weights
    assert any(key.endswith("experts.gate_up_proj/momentum_buffer") for key in state)
    assert tuple(state["pytorch_model_fsdp_0/model/model.layers.0.ffn.experts.gate_up_proj"].shape) == (4, 64, 64)


def test_a_process_killed_while_saving_leaves_the_previous_checkpoint_the_rerun_resumes_and_2_resume_on_4(
    on_two, tmp_path
):
    """A process killed while the Trainer writes checkpoint-4 on 4 processes leaves checkpoint-2 whole; the rerun
    (``resume_from_checkpoint=True``, 4 → 4) resumes from it, and the 2-process checkpoint-2 resumes on 4: both end
    bit-identical to the uninterrupted run."""
    from modeling_dsv41.training.trainer import is_complete_checkpoint

    tmp = on_two
    killed = tmp / "killed"
    assert is_complete_checkpoint(killed / "checkpoint-2")
    assert not (killed / "checkpoint-4").exists()
    assert [path.name for path in killed.glob("tmp-*")] == ["tmp-checkpoint-4"]  # the interrupted save, set aside
    assert_same_state(killed / "checkpoint-2", tmp / "four" / "checkpoint-2", tmp_path)  # whole, untouched

    spawn(_resume_2_on_4_and_rerun_the_killed_save, tmp, world_size=WORLD, timeout_s=600)
    assert_same_state(tmp / "two-on-four" / "checkpoint-4", tmp / "four" / "checkpoint-4", tmp_path)
    assert_same_state(killed / "checkpoint-4", tmp / "four" / "checkpoint-4", tmp_path)
    assert not list(killed.glob("tmp-*"))


def test_accelerate_merge_weights_turns_the_sharded_checkpoint_into_one_file_that_loads(uninterrupted, tmp_path):
    import subprocess
    import sys

    from safetensors.torch import load_file

    from modeling_dsv41 import DeepseekV41ForCausalLM

    checkpoint = uninterrupted / "four" / "checkpoint-4"
    accelerate = Path(sys.executable).parent / "accelerate"
    result = subprocess.run(
        [str(accelerate), "merge-weights", str(checkpoint / "pytorch_model_fsdp_0"), str(tmp_path / "merged")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert [path.name for path in (tmp_path / "merged").iterdir()] == ["model.safetensors"]
    merged = load_file(tmp_path / "merged" / "model.safetensors")
    state = checkpoint_state(checkpoint, tmp_path)
    model_keys = {key.split("/", 2)[2]: value for key, value in state.items() if key.startswith("pytorch_model")}
    assert merged.keys() == model_keys.keys()
    assert all(torch.equal(merged[key], value) for key, value in model_keys.items())
    assert tuple(merged["model.layers.1.ffn.experts.down_proj"].shape) == (4, 64, 32)  # whole, every expert

    tiny_training_model(num_hidden_layers=2).config.save_pretrained(tmp_path / "merged")
    model = DeepseekV41ForCausalLM.from_pretrained(tmp_path / "merged")
    assert torch.equal(model.model.layers[1].ffn.experts.down_proj, merged["model.layers.1.ffn.experts.down_proj"])
    assert torch.equal(model.model.layers[0].ffn.gate.bias, merged["model.layers.0.ffn.gate.bias"])


# ----------------------------------------------------------------------------- the printed launches (docs/training.md)


def full_finetune_commands(prefix: str) -> list[list[str]]:
    """The docs' lines starting with ``prefix`` that run examples/full_finetune.py (argv), the shell's variables
    set as on node 3 of the many-node commands."""
    from documentation import command_lines

    variables = {"$NODE_RANK": "3", "$MASTER_ADDR": "10.0.0.1"}
    lines = [line for line in command_lines(prefix) if "examples/full_finetune.py" in line]
    return [[variables.get(arg, arg) for arg in shlex.split(line)] for line in lines]


def test_printed_expert_parallel_launch_trains_on_4_processes_and_saves_sharded_checkpoints(tmp_path, demo_model):
    """docs/training.md's one-machine command as printed, on 4 CPU processes: the model built on the meta device,
    sharded on the 2 × 2 mesh and read shard by shard from the demo folder, trained with checkpoints."""
    from test_trainer_distributed import flag, launch, workspace

    (argv,) = [argv for argv in full_finetune_commands("accelerate launch") if "--num_machines" not in argv]
    assert argv[3] == "examples/accelerate/fsdp2_ep.yaml" and flag(argv, "--expert_parallel_size") == "2"
    assert flag(argv, "--activation_checkpointing") == "true"
    cwd = workspace(tmp_path, demo_model)
    launch(argv, cwd)
    output = cwd / flag(argv, "--output_dir")
    steps = [int(flag(argv, "--save_steps")), int(flag(argv, "--max_steps"))]
    assert sorted(path.name for path in output.iterdir()) == sorted(f"checkpoint-{step}" for step in steps)
    for step in steps:
        shards = output / f"checkpoint-{step}" / "pytorch_model_fsdp_0"
        assert len(list(shards.glob("*.distcp"))) == WORLD
    state = checkpoint_state(output / f"checkpoint-{steps[-1]}", tmp_path)
    assert any(state[key].any() for key in state if key.endswith(".gate.bias"))  # balanced on the mesh
    experts = [key for key in state if key.startswith("pytorch_model") and key.endswith("experts.gate_up_proj")]
    assert experts and all(state[key].shape[0] == 4 for key in experts)  # whole tensors, every expert


def test_printed_multi_node_launches_parse(monkeypatch):
    """The many-node commands cannot run here: their launcher and script arguments parse, and ask for the FSDP2
    expert-parallel run they describe."""
    from accelerate.commands.launch import launch_command_parser
    from torch.distributed.run import get_args_parser
    from transformers import HfArgumentParser

    from documentation import REPO_ROOT

    monkeypatch.chdir(REPO_ROOT)
    monkeypatch.syspath_prepend(str(REPO_ROOT / "examples"))  # as when the script runs: its folder first on the path
    from full_finetune import FullScriptArguments

    (accelerate,) = [argv for argv in full_finetune_commands("accelerate launch") if "--num_machines" in argv]
    (torchrun,) = full_finetune_commands("torchrun")
    launched = launch_command_parser().parse_args(accelerate[2:])
    assert (launched.num_machines, launched.num_processes, launched.config_file) == (
        16,
        128,
        "examples/accelerate/fsdp2_ep.yaml",
    )
    script = accelerate[accelerate.index("examples/full_finetune.py") + 1 :]
    run = get_args_parser().parse_args(torchrun[1:])
    assert (run.nnodes, run.nproc_per_node) == ("16", "8")
    for flags in (script, torchrun[torchrun.index("examples/full_finetune.py") + 1 :]):
        parsed, args = HfArgumentParser(
            (FullScriptArguments, DeepseekV41TrainingArguments)
        ).parse_args_into_dataclasses([*flags, "--report_to", "none"])
        assert parsed.model == "converted" and args.expert_parallel_size == 64 and args.activation_checkpointing
        assert 128 % args.expert_parallel_size == 0 and 384 % args.expert_parallel_size == 0
    assert args.fsdp_plugin_args["fsdp_version"] == 2 and "SHARDED" in str(args.fsdp_plugin_args["state_dict_type"])


# ----------------------------------------------------------------------------- what does not combine


def test_expert_parallel_arguments_refuse_what_does_not_combine():
    with pytest.raises(ValueError, match="expert_parallel_size must be an integer >= 1"):
        DeepseekV41TrainingArguments(output_dir="x", expert_parallel_size=0, report_to="none")
    with pytest.raises(ValueError, match="train_dspark_head trains the DSpark draft head alone"):
        DeepseekV41TrainingArguments(output_dir="x", expert_parallel_size=2, train_dspark_head=True, report_to="none")
    no_sync = {"gradient_accumulation_kwargs": {"sync_each_batch": False}}
    with pytest.raises(ValueError, match="reduce-scatters the gradients after every micro-batch"):
        DeepseekV41TrainingArguments(
            output_dir="x", expert_parallel_size=2, accelerator_config=no_sync, report_to="none"
        )
    args = DeepseekV41TrainingArguments(output_dir="x", expert_parallel_size=2, report_to="none")
    assert args.accelerator_config.gradient_accumulation_kwargs == {"sync_each_batch": True}


def test_expert_parallel_without_fsdp2_is_an_error_naming_the_config(tmp_path):
    args = DeepseekV41TrainingArguments(output_dir=str(tmp_path), expert_parallel_size=2, report_to="none")
    with pytest.raises(ValueError, match=r"runs under FSDP2.*fsdp_version: 2.*fsdp2_ep.yaml"):
        DeepseekV41Trainer(model=tiny_training_model(num_hidden_layers=2), args=args)


def test_expert_parallelism_refuses_routed_experts_it_cannot_split():
    """Only bf16 (plain) or natively loaded FP4 experts are split by expert; others (bitsandbytes' here) are an error
    naming the module, never left whole on every rank."""
    from modeling_dsv41.bnb_experts import Bnb4bitExperts
    from modeling_dsv41.training.expert_parallel import expert_modules

    model = tiny_training_model(num_hidden_layers=2)
    assert [name for name, _ in expert_modules(model)] == ["model.layers.0.ffn.experts", "model.layers.1.ffn.experts"]
    with torch.device("meta"):
        model.model.layers[1].ffn.experts = Bnb4bitExperts(model.config.get_text_config())
    with pytest.raises(
        ValueError, match=r"model\.layers\.1\.ffn\.experts is Bnb4bitExperts: shard with expert_parallel_size=1"
    ):
        list(expert_modules(model))


def _shard_model_refusals(rank: int, tmp: Path) -> None:
    from peft import LoraConfig, get_peft_model
    from torch.distributed.device_mesh import init_device_mesh

    from modeling_dsv41.training.fsdp import shard_model

    with pytest.raises(ValueError, match=r"expert_parallel_size=3 must divide the world size 2: use one of \[1, 2\]"):
        shard_model(tiny_training_model(num_hidden_layers=2), expert_parallel_size=3)
    with pytest.raises(ValueError, match="give expert_parallel_size or mesh, not both"):
        shard_model(
            tiny_training_model(num_hidden_layers=2), mesh=init_device_mesh("cpu", (2,)), expert_parallel_size=2
        )
    adapted = get_peft_model(tiny_training_model(num_hidden_layers=2), LoraConfig(r=2, target_modules=["wq_a"]))
    with pytest.raises(
        ValueError, match=r"LoRA adapters on the natively loaded release only.*shard_model\(model\) \(FSDP2 alone"
    ):
        shard_model(adapted, expert_parallel_size=2)
    kernels = tiny_training_model(num_hidden_layers=2)
    kernels.set_experts_implementation("batched_mm")
    with pytest.raises(ValueError, match="experts_implementation='eager'"):
        shard_model(kernels, expert_parallel_size=2)
    preset = DeepseekV41Config.from_preset("tiny")
    text = {**preset.text_config.to_dict(), "num_hidden_layers": 2, "n_routed_experts": 3}
    with pytest.raises(ValueError, match="needs whole experts per rank: 3 experts do not split 2 ways"):
        shard_model(
            DeepseekV41ForCausalLM(DeepseekV41Config.from_preset("tiny", text_config=text)), expert_parallel_size=2
        )


def test_shard_model_refuses_what_expert_parallelism_cannot_shard(on_two):
    """The refusals ran on the 2 processes of ``on_two`` (:func:`_shard_model_refusals`)."""
    assert sorted(path.name for path in on_two.glob("refusals_*.ok")) == ["refusals_0.ok", "refusals_1.ok"]
