"""The tiny DeepSeek-V4.1 under FSDP2: :func:`shard_model` with the mixed optimizer, and DeepseekV41Trainer under
accelerate's FSDP2 plugin. 2 gloo processes on CPU, spawned from pytest, each run bounded in time.

Models are the tiny preset cut to 4 decoder layers (KV sources 1 and 3, so layers 2 and 3 read compressed KV that
an earlier layer published, the case a finer FSDP wrapping gets wrong) with the QDQ emulation off.
"""

from __future__ import annotations

import math
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from documentation import DOCS, code_blocks, command_lines
from gloo_processes import WORLD, spawn
from tiny_models import tiny_training_model

from modeling_dsv41 import DeepseekV41ForCausalLM
from modeling_dsv41.numerics import reference_numerics
from modeling_dsv41.optim import MixedOptimizer, assign_kinds, build_param_groups, freeze_default_parameters
from modeling_dsv41.training.router_balancing import RouterBiasBalancer

REPO_ROOT = Path(__file__).resolve().parents[1]
STEPS = 3
SEQ = 16
LR = 1e-2
SPEED = 0.25  # a power of two: biases stay exact in fp32
# The bound on ‖Δ_fsdp − Δ_single‖ / ‖Δ_single‖ per kind. Each step starts from the same parameters (see
# lockstep) with bit-identical gradients, so what remains is Sinkhorn's column sums, all-reduced in another order
# (~3e-7); a shard-local update is off by 0.02-0.4 (tests/test_optim_distributed.py).
MAX_RELATIVE_ERROR = 0.02

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch built without torch.distributed")


def tiny_model(seed: int = 0) -> DeepseekV41ForCausalLM:
    model = tiny_training_model(num_hidden_layers=4, seed=seed)
    freeze_default_parameters(model)
    return model


def rows(n: int = 4, seed: int = 1) -> list[dict]:
    """Unpadded rows, every odd one with an image span (labels -100 there): each half of the batch has as many
    label tokens as the other, so the mean of the two half-batch losses is the full-batch loss."""
    ids = torch.randint(3, 500, (n, SEQ), generator=torch.Generator().manual_seed(seed))
    out = []
    for i in range(n):
        types = torch.full((SEQ,), -1)
        input_ids = ids[i].clone()
        if i % 2:
            types[3:9] = 1
            input_ids[3:9] = 510  # image_token_id
        labels = input_ids.masked_fill(types >= 0, -100)
        out.append(
            {
                "input_ids": input_ids,
                "labels": labels,
                "attention_mask": torch.ones(SEQ, dtype=torch.long),
                "image_token_types": types,
            }
        )
    return out


def collate(batch: list[dict]) -> dict[str, torch.Tensor]:
    return {key: torch.stack([row[key] for row in batch]) for key in batch[0]}


def train(model, optimizer, balancer, steps: list[list[dict]]) -> None:
    """One optimizer step per entry of ``steps``, accumulating the mean of its micro-batches' losses."""
    for micro_batches in steps:
        for batch in micro_batches:
            (model(**batch).loss / len(micro_batches)).backward()  # the forward counts the expert loads itself
        with reference_numerics():  # Newton–Schulz's bf16 products rounded once: the same bits at any batch size
            optimizer.step()
        optimizer.zero_grad()
        balancer.step()


def full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def local_state(model) -> dict[str, torch.Tensor]:
    """This rank's shard of every parameter and buffer, copied."""
    return {n: (t.to_local() if hasattr(t, "to_local") else t).detach().clone() for n, t in model.state_dict().items()}


@torch.no_grad()
def copy_into_shards(sharded, single) -> None:
    """Set the sharded model's parameters to the single-process model's (each rank its own shard)."""
    from torch.distributed.tensor import distribute_tensor

    source = dict(single.named_parameters())
    for name, param in sharded.named_parameters():
        if hasattr(param, "to_local"):
            shard = distribute_tensor(source[name].detach(), param.device_mesh, param.placements, src_data_rank=None)
            param.to_local().copy_(shard.to_local())
        else:
            param.copy_(source[name])


def lockstep(single, single_step, sharded, sharded_step, steps: int, after_step=None) -> dict[str, float]:
    """Per optimizer kind, ‖Δ_sharded − Δ_single‖ / ‖Δ_single‖ summed over ``steps`` steps, each taken from the
    same parameters: after every step the sharded model is set to the single-process parameters.

    Free-running runs cannot be compared at this model size: the two runs' Sinkhorn column sums are summed in
    another order (one ulp apart), and Muon's Newton–Schulz lifts any ulp in the near-null directions of a
    rank-deficient gradient to O(1) of the update (mHC's ``hc_*_fn`` have a 7-dimensional null space by
    construction, Sinkhorn's invariance to row and column scalings; a tiny batch leaves ``wkv``/Engram ``wkv``
    rank-deficient). Measured with the same code on one process, accumulating the same two half-batches vs one
    full batch, 3 free steps differ by 0.37 (muon), 0.05 (adamw) for that reason alone.
    """
    kinds = assign_kinds(single)
    diff, norm = {}, {}
    for step in range(steps):
        before = {n: p.detach().clone() for n, p in single.named_parameters()}
        single_step(step)
        sharded_step(step)
        for name, param in sharded.named_parameters():
            kind = kinds[name]
            if kind == "frozen":
                continue
            expected = dict(single.named_parameters())[name].detach()
            diff[kind] = diff.get(kind, 0.0) + (full(param.detach()) - expected).pow(2).sum().item()
            norm[kind] = norm.get(kind, 0.0) + (expected - before[name]).pow(2).sum().item()
        if after_step is not None:
            after_step(step)
        copy_into_shards(sharded, single)
    return {kind: (diff[kind] / norm[kind]) ** 0.5 for kind in diff if norm[kind] > 0}


# ----------------------------------------------------------------------------- workers


def _fsdp2_matches_one_process_and_resumes(rank: int, tmp: Path) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    from modeling_dsv41.training.fsdp import shard_model

    data = rows()
    halves = [collate(data[:2]), collate(data[2:])]  # FSDP2 averages the two ranks' gradients
    single = tiny_model()  # accumulates the same two halves
    single_optimizer = MixedOptimizer(build_param_groups(single, lr=LR))
    single_balancer = RouterBiasBalancer(single, SPEED)

    def sharded_run(seed: int):
        model = shard_model(tiny_model(seed))
        return model, MixedOptimizer(build_param_groups(model, lr=LR)), RouterBiasBalancer(model, SPEED)

    model, optimizer, balancer = sharded_run(0)
    with torch.no_grad():  # same forward before any step (the wrong wrapping differed here already); not counted
        loss = model(**halves[rank]).loss
        single_loss = single(**collate(data)).loss
    dist.all_reduce(loss)
    torch.testing.assert_close(loss / WORLD, single_loss, rtol=1e-5, atol=0)

    last = {}

    def save_or_snapshot(step: int) -> None:
        if step == STEPS - 2:  # a checkpoint of the state the third step starts from
            copy_into_shards(model, single)
            dcp.save(dict(zip(("model", "optim"), get_state_dict(model, optimizer))), checkpoint_id=tmp / "ckpt")
        if step == STEPS - 1:
            last.update(local_state(model))

    errors = lockstep(
        single,
        lambda step: train(single, single_optimizer, single_balancer, [halves]),
        model,
        lambda step: train(model, optimizer, balancer, [[halves[rank]]]),
        STEPS,
        after_step=save_or_snapshot,
    )
    assert set(errors) == {"muon", "muon_headwise", "sinkhorn", "adamw"}, errors
    assert all(error <= MAX_RELATIVE_ERROR for error in errors.values()), errors
    biases = {n: b for n, b in model.named_buffers() if ".gate.bias" in n}
    expected_biases = dict(single.named_buffers())
    assert any(b.any() for b in biases.values())
    for name, bias in biases.items():  # the balancer's buffers: identical on both ranks, and to one process's
        gathered = [torch.empty_like(bias) for _ in range(WORLD)]
        dist.all_gather(gathered, bias)
        assert torch.equal(gathered[0], gathered[1]), name
        assert torch.equal(bias, expected_biases[name]), name
    if rank == 0:
        (tmp / "errors.txt").write_text(repr(errors))

    resumed, resumed_optimizer, resumed_balancer = sharded_run(1)  # other weights: all must come from the checkpoint
    model_state, optim_state = get_state_dict(resumed, resumed_optimizer)
    state = {"model": model_state, "optim": optim_state}
    dcp.load(state, checkpoint_id=tmp / "ckpt")
    set_state_dict(resumed, resumed_optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    train(resumed, resumed_optimizer, resumed_balancer, [[halves[rank]]])
    for name, value in local_state(resumed).items():
        assert torch.equal(value, last[name]), f"{name} differs after resuming"


def _bf16_policy_keeps_fp32_modules_fp32(rank: int, tmp: Path) -> None:
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from modeling_dsv41.training.fsdp import fp32_parameters, shard_model

    model = tiny_model()
    kept = {id(p) for p in fp32_parameters(model)}
    names = {name for name, p in model.named_parameters() if id(p) in kept}
    assert {"lm_head.weight", "model.layers.1.hc_attn_fn", "model.layers.1.attn.attn_sink"} <= names
    assert "model.layers.1.attn.compressor.wkv.weight" in names  # a ratio-2 compressor
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    shard_model(model, mp_policy=policy)
    seen = {}  # parameter dtypes as the forward sees them
    layer = model.model.layers[1]
    modules = {"lm_head": model.lm_head, "wkv": layer.attn.compressor.wkv, "wq_a": layer.attn.wq_a}
    for key, module in modules.items():
        module.register_forward_pre_hook(lambda m, args, key=key: seen.__setitem__(key, m.weight.dtype))
    layer.register_forward_pre_hook(lambda m, args: seen.__setitem__("hc_attn_fn", m.hc_attn_fn.dtype))
    layer.attn.register_forward_pre_hook(lambda m, args: seen.__setitem__("attn_sink", m.attn_sink.dtype))

    data = rows()
    optimizer = MixedOptimizer(build_param_groups(model, lr=LR))
    train(model, optimizer, RouterBiasBalancer(model, SPEED), [[collate(data[2 * rank : 2 * rank + 2])]] * 2)
    assert seen == {
        "lm_head": torch.float32,
        "wkv": torch.float32,
        "wq_a": torch.bfloat16,
        "hc_attn_fn": torch.float32,
        "attn_sink": torch.float32,
    }, seen
    for name, param in model.named_parameters():  # stored fp32; replicated ones stayed equal on both ranks
        assert param.dtype == torch.float32, name
        if not hasattr(param, "to_local"):
            gathered = [torch.empty_like(param) for _ in range(WORLD)]
            dist.all_gather(gathered, param.detach())
            assert torch.equal(gathered[0], gathered[1]), f"replicated {name} differs across ranks"


def _fsdp_on_cpu_processes_runs_version_2_and_refuses_version_1(rank: int, tmp: Path) -> None:
    """What ``accelerate launch`` hands every process of an FSDP config, here on CPU processes (gloo)."""
    from modeling_dsv41 import DeepseekV41Trainer, DeepseekV41TrainingArguments

    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(WORLD),
        LOCAL_WORLD_SIZE=str(WORLD),
        ACCELERATE_USE_FSDP="true",
        ACCELERATE_MIXED_PRECISION="bf16",
    )

    def trainer(version: int) -> DeepseekV41Trainer:
        os.environ["FSDP_VERSION"] = str(version)
        args = DeepseekV41TrainingArguments(output_dir=str(tmp), report_to="none")
        return DeepseekV41Trainer(model=tiny_model(), args=args)

    with pytest.raises(ValueError, match="FSDP1 runs on accelerators only"):
        trainer(1)
    fsdp2 = trainer(2)
    assert fsdp2.args.use_cpu and fsdp2.args.world_size == WORLD
    assert fsdp2.is_fsdp_enabled and fsdp2.accelerator.is_fsdp2
    assert fsdp2.accelerator.state.fsdp_plugin.mixed_precision_policy.param_dtype == torch.bfloat16


def test_fsdp_config_on_cpu_processes_runs_fsdp2_and_refuses_fsdp1(tmp_path):
    """accelerate itself enables FSDP on accelerator backends only (the run would be DDP without a word)."""
    spawn(_fsdp_on_cpu_processes_runs_version_2_and_refuses_version_1, tmp_path)


def test_fsdp_config_on_one_process_is_an_error(tmp_path, monkeypatch):
    from modeling_dsv41 import DeepseekV41Trainer, DeepseekV41TrainingArguments

    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.setenv("FSDP_VERSION", "2")
    args = DeepseekV41TrainingArguments(output_dir=str(tmp_path), report_to="none")
    with pytest.raises(ValueError, match="FSDP needs several processes"):
        DeepseekV41Trainer(model=tiny_model(), args=args)


def test_fsdp2_three_steps_match_one_process_per_kind_biases_agree_and_resume_is_exact(tmp_path):
    spawn(_fsdp2_matches_one_process_and_resumes, tmp_path)
    print((tmp_path / "errors.txt").read_text())


def test_bf16_mixed_precision_keeps_fp32_modules_fp32(tmp_path):
    spawn(_bf16_policy_keeps_fp32_modules_fp32, tmp_path)


# ----------------------------------------------------------------------------- accelerate launch (docs/training.md)

LAUNCH_TIMEOUT_S = 600  # a printed launch takes ~30 s on 2 idle cores; a loaded machine is several times slower


def printed_launch_commands() -> dict[str, list[str]]:
    """The docs' ``accelerate launch`` lines of examples/finetune.py as printed (argv), by config file (the expert-
    parallel launches of examples/full_finetune.py are run by tests/test_expert_parallel.py)."""
    commands = {}
    for line in command_lines("accelerate launch"):
        argv = shlex.split(line)
        assert argv[:3] == ["accelerate", "launch", "--config_file"], argv
        if argv[4] == "examples/finetune.py":
            commands[argv[3]] = argv
    return commands


def flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def launch(argv: list[str], cwd: Path) -> None:
    """Run ``argv`` (an ``accelerate launch`` command) in ``cwd`` with this environment's executables first on PATH."""
    path = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PATH": path}
    result = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S, cwd=cwd)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-6000:]
    assert "parallel_mode != ParallelMode.DISTRIBUTED" not in result.stderr  # processes that each ran alone


def workspace(tmp: Path, demo: Path) -> Path:
    """A folder laid out as the docs' commands expect: the repository's ``examples/`` and ``dsv41-demo/model``."""
    (tmp / "examples").symlink_to(REPO_ROOT / "examples")
    (tmp / "dsv41-demo").mkdir()
    (tmp / "dsv41-demo" / "model").symlink_to(demo)
    return tmp


def checkpoint_tensors(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor a Trainer checkpoint holds (sharded DCP folders read whole), by file and key."""
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    tensors = {}

    def add(prefix: str, value) -> None:
        if isinstance(value, torch.Tensor):
            tensors[prefix] = value
        elif isinstance(value, dict):
            for key, item in value.items():
                add(f"{prefix}/{key}", item)
        elif isinstance(value, (list, tuple)):
            for key, item in enumerate(value):
                add(f"{prefix}/{key}", item)

    for path in sorted(folder.iterdir()):
        if path.is_dir():  # pytorch_model_fsdp_0/, optimizer_0/: torch.distributed.checkpoint shards
            dcp_to_torch_save(path, folder / f"{path.name}.whole.pt")
            add(path.name, torch.load(folder / f"{path.name}.whole.pt", weights_only=False))
        elif path.suffix == ".safetensors":
            add(path.name, load_file(path))
        elif path.name.startswith(("optimizer", "pytorch_model")) and path.suffix in (".pt", ".bin"):
            add(path.name, torch.load(path, weights_only=False))
    return tensors


@pytest.fixture(scope="module")
def demo_model(tmp_path_factory) -> Path:
    """An untrained demo model and its processor in a folder, as `dsv41 demo` leaves it (the docs' --model)."""
    from modeling_dsv41 import export_for_hub
    from modeling_dsv41.cli.demo import build_demo_model, build_demo_processor, demo_config
    from modeling_dsv41.cli.demo_data import build_demo_tokenizer

    folder = tmp_path_factory.mktemp("demo") / "model"
    tokenizer = build_demo_tokenizer()
    config = demo_config(tokenizer)
    export_for_hub(build_demo_model(config, tokenizer, seed=0), folder, build_demo_processor(config, tokenizer))
    return folder


def docs_config_matches_the_file(config: str) -> None:
    """docs/training.md's excerpt of the config file is in the file, line for line."""
    (excerpt,) = code_blocks(DOCS / "training.md", "yaml")
    lines = {line.rstrip() for line in (REPO_ROOT / config).read_text().splitlines()}
    assert all(line in lines for line in excerpt.splitlines()), excerpt


def run_printed_command_then_resume(config: str, tmp: Path, demo: Path) -> tuple[list[dict], Path, Path, Path]:
    """The docs' command for ``config`` as printed, in a workspace folder; then a second run resumed from its first
    checkpoint without gradient checkpointing, through tests/accelerate_cpu.py (which reports what each process
    holds). Returns the second run's per-rank reports, the first run's two checkpoints and the second run's last."""
    argv = printed_launch_commands()[config]
    assert flag(argv, "--activation_checkpointing") == "true"  # the printed run checkpoints activations
    cwd = workspace(tmp, demo)
    launch(argv, cwd)
    output, save_steps, max_steps = (
        cwd / flag(argv, "--output_dir"),
        int(flag(argv, "--save_steps")),
        int(flag(argv, "--max_steps")),
    )
    assert max_steps == 2 * save_steps, argv  # one checkpoint to resume from, one to compare with
    first, last = output / f"checkpoint-{save_steps}", output / f"checkpoint-{max_steps}"
    assert sorted(path.name for path in output.iterdir()) == sorted([first.name, last.name])  # nothing half-written
    for checkpoint in (first, last):  # every process wrote its RNG state: two processes, one run
        assert {f"rng_state_{rank}.pth" for rank in range(WORLD)} <= {path.name for path in checkpoint.iterdir()}

    flags = argv[5:]
    flags[flags.index("--output_dir") + 1] = "resumed"
    flags[flags.index("--activation_checkpointing") + 1] = "false"
    report = cwd / "report"
    report.mkdir()
    resume = [
        *argv[:4],
        str(REPO_ROOT / "tests" / "accelerate_cpu.py"),
        str(report),
        *flags,
        "--resume_from_checkpoint",
        str(first),
    ]
    launch(resume, cwd)
    reports = [torch.load(report / f"rank{rank}.pt") for rank in range(WORLD)]
    return reports, first, last, cwd / "resumed" / last.name


def assert_same_checkpoint(actual: Path, expected: Path) -> None:
    tensors, reference = checkpoint_tensors(actual), checkpoint_tensors(expected)
    assert tensors.keys() == reference.keys() and tensors
    for key, value in reference.items():
        assert torch.equal(tensors[key], value), f"{key} differs after resuming"


def assert_biases_moved_and_agree(reports: list[dict]) -> None:
    assert any(bias.any() for bias in reports[0]["biases"].values())
    for name, bias in reports[0]["biases"].items():
        assert torch.equal(bias, reports[1]["biases"][name]), name


def test_printed_fsdp2_launch_trains_on_two_processes_saves_sharded_checkpoints_and_resumes_exactly(
    tmp_path, demo_model
):
    """docs/training.md's FSDP2 command as printed, on CPU processes (gloo): accelerate's FSDP2 plugin with bf16 mixed
    precision, the Trainer's sharding keeping the fp32 modules fp32; checkpoints are sharded, and a run resumed from
    the first one (without gradient checkpointing) ends bit-identical to the run that went on (with it): both
    compute the same gradients, and every parameter, the ViT's included, resumes its state."""
    config = "examples/accelerate/fsdp2.yaml"
    docs_config_matches_the_file(config)
    reports, first, last, resumed = run_printed_command_then_resume(config, tmp_path, demo_model)

    for checkpoint in (first, last):  # sharded, never a plain model.safetensors (DDP's)
        assert {path.name for path in checkpoint.iterdir()} >= {"pytorch_model_fsdp_0", "optimizer_0"}
        assert not list(checkpoint.glob("*.safetensors"))
        assert len(list((checkpoint / "pytorch_model_fsdp_0").glob("*.distcp"))) == WORLD  # one shard file per process
    assert_same_checkpoint(resumed, last)
    for report in reports:
        assert report["strategy"] == "FSDP"
        assert report["dtypes"] == {
            "lm_head": torch.float32,
            "hc_attn_fn": torch.float32,
            "attn_sink": torch.float32,
            "wq_a": torch.bfloat16,
        }, report["dtypes"]
        assert math.isfinite(report["train_loss"])
    assert_biases_moved_and_agree(reports)


@pytest.mark.slow
def test_printed_ddp_launch_trains_on_two_processes_and_resumes_exactly(tmp_path, demo_model):
    """docs/training.md's DDP command as printed (bf16 autocast keeps every weight fp32), on CPU processes."""
    reports, first, last, resumed = run_printed_command_then_resume(
        "examples/accelerate/ddp.yaml", tmp_path, demo_model
    )
    for checkpoint in (first, last):
        assert (checkpoint / "model.safetensors").is_file()
    assert_same_checkpoint(resumed, last)
    assert all(report["strategy"] == "MULTI_CPU" for report in reports)
    assert_biases_moved_and_agree(reports)
