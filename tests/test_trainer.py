"""DeepseekV41Trainer: the mixed optimizer, per-modality router-bias balancing, and Trainer features around them.

The models are the tiny preset cut to 2 decoder layers (one plain window layer, one compressed layer with an
indexer and both Engram layers) with the QDQ emulation off, to keep these CPU training runs short.
"""

from __future__ import annotations

import json
import logging
import math
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch.utils.data import Dataset
from tiny_models import tiny_training_model
from transformers import TrainerCallback

from modeling_dsv41 import DeepseekV41ForCausalLM
from modeling_dsv41.optim import MixedOptimizer, assignment_table, build_param_groups
from modeling_dsv41.training.router_balancing import IMAGE, TEXT, RouterBiasBalancer, bias_update
from modeling_dsv41.training.trainer import (
    DeepseekV41Trainer,
    DeepseekV41TrainingArguments,
    RouterBiasBalancingCallback,
    last_complete_checkpoint,
)

SEQ = 16
TOP_K = 2  # experts per token in the tiny preset
SPEED = 0.25  # bias update speed: a power of two keeps every bias exact in fp32
IMAGE_TYPE = 1  # an image-span position (types >= 0); -1 is text
# Equivalence tests (accumulation, DDP) put every parameter in AdamW: Muon's Newton–Schulz runs in bf16, so
# gradients that differ only by fp32 summation order round to different bf16 inputs, and the iteration lifts
# those differences in weak directions to O(1) of the update. AdamW is continuous in the gradient.
ADAMW_ONLY = {".": "adamw"}


# ----------------------------------------------------------------------------- helpers


def tiny_model(seed: int = 0) -> DeepseekV41ForCausalLM:
    return tiny_training_model(num_hidden_layers=2, seed=seed)


def example(ids: torch.Tensor, image: tuple[int, int] | None = None, pad: int = 0, left: bool = False) -> dict:
    """One training row of SEQ positions: ``ids`` real tokens, an optional image span [start, end) among them,
    ``pad`` padding positions (right, or left) that the loss and the balancing must ignore."""
    real = SEQ - pad
    input_ids = ids[:real].clone()
    types = torch.full((real,), -1)
    if image is not None:
        types[image[0] : image[1]] = IMAGE_TYPE
        input_ids[image[0] : image[1]] = 510  # image_token_id
    labels = input_ids.masked_fill(types >= 0, -100)
    mask = torch.ones(real, dtype=torch.long)
    padding = {"input_ids": 0, "labels": -100, "attention_mask": 0, "image_token_types": -1}
    row = {"input_ids": input_ids, "labels": labels, "attention_mask": mask, "image_token_types": types}
    for key, value in padding.items():
        filler = torch.full((pad,), value, dtype=row[key].dtype)
        row[key] = torch.cat([filler, row[key]] if left else [row[key], filler])
    return row


class Rows(Dataset):
    """Random-token rows; every other row carries an image span, every third row is padded."""

    def __init__(self, n: int, seed: int = 1):
        ids = torch.randint(3, 500, (n, SEQ), generator=torch.Generator().manual_seed(seed))
        self.rows = [example(ids[i], image=(3, 9) if i % 2 else None, pad=4 if i % 3 == 2 else 0) for i in range(n)]

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict:
        return self.rows[i]


def training_args(output_dir: Path, **overrides) -> DeepseekV41TrainingArguments:
    values = dict(
        output_dir=str(output_dir),
        use_cpu=True,
        report_to="none",
        save_strategy="no",
        logging_strategy="no",
        disable_tqdm=True,
        seed=0,
        per_device_train_batch_size=2,
        learning_rate=3e-3,
        bias_update_speed=SPEED,
        dataloader_num_workers=0,
    )
    return DeepseekV41TrainingArguments(**{**values, **overrides})


def snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: t.detach().clone() for name, t in model.state_dict().items()}


def gate_biases(model) -> dict[str, torch.Tensor]:
    return {name: t.detach().clone() for name, t in model.state_dict().items() if ".gate.bias" in name}


def assert_same_training(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    """Biases bit-identical (same expert counts), weights equal up to float summation order."""
    for name, value in expected.items():
        if ".gate.bias" in name:
            assert torch.equal(actual[name], value), name
        else:  # AdamW moves a weight by ≈ lr·m/√v; float noise in near-zero gradients shows at ~1e-5 of lr 3e-3
            torch.testing.assert_close(actual[name], value, rtol=1e-4, atol=5e-5, msg=name)


class CountsPerStep(TrainerCallback):
    """Keeps the balancer's counts [L, modality, E] as they stand just before each optimizer step."""

    def __init__(self, trainer: DeepseekV41Trainer):
        self.trainer, self.counts = trainer, []

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self.counts.append(self.trainer.router_balancing.balancer.counts.clone())


def real_tokens(rows: list[dict]) -> tuple[int, int]:
    """(text, image) real-token totals of some rows."""
    types = torch.stack([r["image_token_types"] for r in rows])
    mask = torch.stack([r["attention_mask"] for r in rows]).bool()
    return int((mask & (types < 0)).sum()), int((mask & (types >= 0)).sum())


# ----------------------------------------------------------------------------- optimizer


def test_create_optimizer_builds_the_mixed_optimizer_and_logs_the_table_once(tmp_path, caplog):
    model = tiny_model()
    args = training_args(tmp_path, weight_decay=0.05)
    trainer = DeepseekV41Trainer(model=model, args=args)
    with caplog.at_level(logging.INFO, logger="modeling_dsv41.training.trainer"):
        optimizer = trainer.create_optimizer()
        assert trainer.create_optimizer() is optimizer

    assert isinstance(optimizer, MixedOptimizer)
    expected = build_param_groups(
        model,
        lr=args.learning_rate,
        weight_decay=0.05,
        adamw={"betas": (args.adam_beta1, args.adam_beta2), "eps": args.adam_epsilon},
    )
    assert [(g["kind"], g["param_names"]) for g in optimizer.param_groups] == [
        (g["kind"], g["param_names"]) for g in expected
    ]
    kinds = {g["kind"] for g in optimizer.param_groups}
    assert kinds == {"muon", "muon_headwise", "sinkhorn", "adamw"}
    muon = next(g for g in optimizer.param_groups if g["kind"] == "muon")
    assert muon["weight_decay"] == 0.05 and muon["lr"] == args.learning_rate

    # frozen at construction and left out of the optimizer: the indexer; the balancing biases are buffers
    optimized = {n for g in optimizer.param_groups for n in g["param_names"]}
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    assert any(".indexer." in n for n in frozen)
    assert not any(".gate.bias" in n for n, _ in model.named_parameters())
    assert any(n.endswith("gate.bias_vl") for n, _ in model.named_buffers())
    assert not optimized & frozen
    assert optimized | frozen == {n for n, _ in model.named_parameters()}

    logged = [r.getMessage() for r in caplog.records if r.name == "modeling_dsv41.training.trainer"]
    assert len(logged) == 1 and str(assignment_table(model)) in logged[0]
    assert trainer.assignment_table.kinds["frozen"].tensors == len(frozen)


def test_kind_kwargs_overrides_and_lora_factors(tmp_path):
    from peft import LoraConfig, get_peft_model

    args = training_args(
        tmp_path, optimizer_kind_kwargs='{"sinkhorn": {"lr": 0.5}}', optimizer_overrides={r"\.wo_b\.": "adamw"}
    )
    trainer = DeepseekV41Trainer(model=tiny_model(), args=args)
    groups = trainer.create_optimizer().param_groups
    assert next(g for g in groups if g["kind"] == "sinkhorn")["lr"] == 0.5  # JSON string parsed like Trainer's dicts
    adamw = next(g for g in groups if g["kind"] == "adamw")["param_names"]
    assert "model.layers.0.attn.wo_b.weight" in adamw

    model = get_peft_model(tiny_model(), LoraConfig(r=4, target_modules=["wq_a", "wo_b"]))
    trainer = DeepseekV41Trainer(model=model, args=training_args(tmp_path))
    kinds = {n: g["kind"] for g in trainer.create_optimizer().param_groups for n in g["param_names"]}
    assert set(kinds) == {n for n, p in model.named_parameters() if p.requires_grad}
    assert any(".lora_A." in n for n in kinds) and set(kinds.values()) == {"adamw"}
    with pytest.raises(ValueError, match="not saved with an adapter"):  # the biases belong to the frozen base
        RouterBiasBalancer(model, SPEED)

    with pytest.raises(ValueError, match="unknown kinds"):
        training_args(tmp_path, optimizer_kind_kwargs={"adam": {}})
    with pytest.raises(ValueError, match="MixedOptimizer"):
        training_args(tmp_path, optim="adafactor")
    with pytest.raises(ValueError, match="bias_update_speed"):
        training_args(tmp_path, bias_update_speed=-1.0)
    assert (
        DeepseekV41Trainer(model=tiny_model(), args=training_args(tmp_path, bias_update_speed=0)).router_balancing
        is None
    )


# ----------------------------------------------------------------------------- the balancing rule


def test_bias_update_is_speed_times_sign_of_mean_minus_load():
    load = torch.tensor([6, 2, 0, 4, 3])  # mean 3
    assert torch.equal(bias_update(load, 0.25), torch.tensor([-0.25, 0.25, 0.25, -0.25, 0.0]))
    assert torch.equal(bias_update(torch.zeros(5, dtype=torch.long), 0.25), torch.zeros(5))  # no tokens: no move


def test_each_bias_moves_only_from_its_own_modality_and_padding_is_ignored():
    """The model's training forward passes count the loads themselves; evaluation and no-grad forwards do not."""
    model = tiny_model()
    speed = SPEED
    for layer in model.model.layers:  # steer the choice: text tokens pick experts {0, 1}, image tokens {2, 3}
        layer.ffn.gate.bias.data = torch.tensor([64.0, 64.0, 0.0, 0.0])
        layer.ffn.gate.bias_vl.data = torch.tensor([0.0, 0.0, 64.0, 64.0])
    ids = torch.randint(3, 500, (3, SEQ), generator=torch.Generator().manual_seed(0))
    rows = [
        example(ids[0]),
        example(ids[1], image=(2, 6), pad=5),  # right padding
        example(ids[2], image=(5, 9), pad=3, left=True),  # left padding: the model moves it to the end
    ]
    batch = {k: torch.stack([r[k] for r in rows]) for k in rows[0] if k != "labels"}
    n_text, n_image = real_tokens(rows)  # padding positions are typed text: counted, they would inflate n_text

    balancer = RouterBiasBalancer(model, speed)
    model.train()
    for _ in range(2):  # two micro-batches of one step add up
        model(**batch, use_cache=False)
    with torch.no_grad():  # a reference / rollout forward
        model(**batch, use_cache=False)
    model.eval()
    model(**batch, use_cache=False)  # an evaluation forward
    model.train()
    expected = torch.zeros(2, 4, dtype=torch.long)
    expected[TEXT, :2], expected[IMAGE, 2:] = 2 * n_text, 2 * n_image
    for counts in balancer.counts:
        assert torch.equal(counts, expected)

    before = gate_biases(model)
    balancer.step()
    up, down = torch.tensor([-speed, -speed, speed, speed]), torch.tensor([speed, speed, -speed, -speed])
    for name, bias in gate_biases(model).items():
        assert torch.equal(bias, before[name] + (down if name.endswith("bias_vl") else up)), name
    assert not balancer.counts.any()

    # a text-only step (no image placeholders) leaves bias_vl where it is
    before = gate_biases(model)
    model(input_ids=ids, use_cache=False)
    balancer.step()
    for name, bias in gate_biases(model).items():
        assert torch.equal(bias, before[name]) == name.endswith("bias_vl"), name

    # a step that counted nothing is an error, not a silent no-op; once closed, forwards are not counted
    with pytest.raises(ValueError, match="counted no token"):
        balancer.step()
    balancer.close()
    model(input_ids=ids, use_cache=False)
    assert not balancer.counts.any()


def test_the_callback_alone_balances_under_a_plain_trainer(tmp_path):
    """No compute_loss of ours (DeepseekV41Trainer's only switches to the DSpark draft loss when asked):
    ``transformers.Trainer`` with the callback moves the biases exactly as DeepseekV41Trainer does (same counts,
    same rule), which itself uses nothing else."""
    from transformers import Trainer, TrainingArguments

    data = Rows(4)
    runs = []
    for plain in (True, False):
        model = tiny_model()
        values = dict(
            output_dir=str(tmp_path),
            use_cpu=True,
            report_to="none",
            save_strategy="no",
            logging_strategy="no",
            disable_tqdm=True,
            per_device_train_batch_size=2,
            max_steps=2,
            learning_rate=0.0,
            train_sampling_strategy="sequential",
        )
        if plain:
            callback = RouterBiasBalancingCallback(SPEED)
            trainer = Trainer(model=model, args=TrainingArguments(**values), train_dataset=data, callbacks=[callback])
        else:
            values.pop("output_dir")
            trainer = DeepseekV41Trainer(model=model, args=training_args(tmp_path, **values), train_dataset=data)
            callback = trainer.router_balancing
        trainer.train()
        runs.append(gate_biases(model))
        assert callback.balancer._hooks == []  # unbound when training ended
    assert any(bias.any() for bias in runs[0].values())
    for name, bias in runs[1].items():
        assert torch.equal(runs[0][name], bias), name


def test_a_skipped_optimizer_step_moves_no_bias():
    """fp16 loss scaling skips steps whose gradients overflow; the balancing must skip them too (and drop the
    counts, so the next step counts only its own tokens)."""
    model = tiny_model()
    callback = RouterBiasBalancingCallback(SPEED)
    callback.on_train_begin(None, None, None, model=model)
    ids = torch.randint(3, 500, (2, SEQ), generator=torch.Generator().manual_seed(0))
    before = gate_biases(model)
    model(input_ids=ids, use_cache=False)
    assert callback.balancer.counts.any()
    callback.on_optimizer_step(None, None, None, optimizer=SimpleNamespace(step_was_skipped=True))
    assert not callback.balancer.counts.any()
    assert all(torch.equal(bias, before[name]) for name, bias in gate_biases(model).items())

    model(input_ids=ids, use_cache=False)
    callback.on_optimizer_step(None, None, None, optimizer=SimpleNamespace(step_was_skipped=False))
    assert not torch.equal(model.model.layers[0].ffn.gate.bias, before["model.layers.0.ffn.gate.bias"])


def test_gradient_accumulation_counts_the_whole_step(tmp_path):
    data = Rows(4)
    runs = {}
    for batch_size, accumulation in ((2, 1), (1, 2)):
        model = tiny_model()
        args = training_args(
            tmp_path,
            per_device_train_batch_size=batch_size,
            gradient_accumulation_steps=accumulation,
            max_steps=2,
            train_sampling_strategy="sequential",
            optimizer_overrides=ADAMW_ONLY,
        )
        trainer = DeepseekV41Trainer(model=model, args=args, train_dataset=data)
        counts = CountsPerStep(trainer)
        trainer.add_callback(counts)
        trainer.train()
        runs[batch_size] = snapshot(model), counts.counts

    (whole, whole_counts), (micro, micro_counts) = runs[2], runs[1]
    for step, rows in enumerate((data.rows[:2], data.rows[2:])):
        n_text, n_image = real_tokens(rows)
        assert whole_counts[step][:, TEXT].sum(-1).tolist() == [TOP_K * n_text] * 2
        assert whole_counts[step][:, IMAGE].sum(-1).tolist() == [TOP_K * n_image] * 2
        assert torch.equal(micro_counts[step], whole_counts[step])
    assert_same_training(micro, whole)


# ----------------------------------------------------------------------------- Trainer features


def test_resume_from_checkpoint_is_bit_identical(tmp_path):
    data = Rows(12)
    straight = tiny_model()
    args = training_args(tmp_path / "run", max_steps=6, save_strategy="steps", save_steps=3)
    DeepseekV41Trainer(model=straight, args=args, train_dataset=data).train()
    checkpoint = tmp_path / "run" / "checkpoint-3"
    state = torch.load(checkpoint / "optimizer.pt", weights_only=True)
    assert {g["kind"] for g in state["param_groups"]} == {"muon", "muon_headwise", "sinkhorn", "adamw"}

    resumed = tiny_model()
    args = training_args(tmp_path / "resumed", max_steps=6, save_strategy="no")
    trainer = DeepseekV41Trainer(model=resumed, args=args, train_dataset=data)
    steps = CountsPerStep(trainer)
    trainer.add_callback(steps)
    trainer.train(resume_from_checkpoint=str(checkpoint))
    assert len(steps.counts) == 3  # it did resume: only steps 4..6 ran

    expected, actual = snapshot(straight), snapshot(resumed)
    assert any(v.abs().sum() > 0 for k, v in expected.items() if ".gate.bias" in k)
    for name, value in expected.items():
        assert torch.equal(actual[name], value), name


def test_gradient_checkpointing_and_bf16_autocast(tmp_path):
    data = Rows(4)
    model = tiny_model()
    before = snapshot(model)
    args = training_args(
        tmp_path,
        max_steps=2,
        bf16=True,
        activation_checkpointing=True,
        train_sampling_strategy="sequential",
        logging_strategy="steps",
        logging_steps=1,
    )
    trainer = DeepseekV41Trainer(model=model, args=args, train_dataset=data)
    counts = CountsPerStep(trainer)
    trainer.add_callback(counts)
    dtypes = set()
    model.model.layers[0].attn.wq_a.register_forward_hook(lambda module, inputs, output: dtypes.add(output.dtype))
    trainer.train()

    assert model.is_activation_checkpointing and dtypes == {torch.bfloat16}  # fp32 weights, bf16 autocast
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    assert len(losses) == 2 and all(math.isfinite(loss) for loss in losses)
    for step, rows in enumerate((data.rows[:2], data.rows[2:])):  # recomputation does not count twice
        n_text, n_image = real_tokens(rows)
        assert counts.counts[step][:, TEXT].sum(-1).tolist() == [TOP_K * n_text] * 2
        assert counts.counts[step][:, IMAGE].sum(-1).tolist() == [TOP_K * n_image] * 2
    after = snapshot(model)
    assert not torch.equal(after["model.layers.0.attn.wq_a.weight"], before["model.layers.0.attn.wq_a.weight"])
    for layer in range(2):  # each bias is the sum of the rule's steps over its own modality's counts
        for bias, modality in (("bias", TEXT), ("bias_vl", IMAGE)):
            moved = sum(bias_update(step_counts[layer, modality], SPEED) for step_counts in counts.counts)
            assert torch.equal(after[f"model.layers.{layer}.ffn.gate.{bias}"], moved)

    trainer.evaluate(eval_dataset=data)  # evaluation forwards are not counted
    assert not trainer.router_balancing.balancer.counts.any()


def test_a_nan_loss_is_logged_as_nan_not_zero(tmp_path):
    model = tiny_model()
    with torch.no_grad():
        model.lm_head.weight[0] = float("nan")  # every logit row holds a NaN: the loss is NaN from the first step
    args = training_args(tmp_path, max_steps=1, logging_strategy="steps", logging_steps=1, bias_update_speed=0)
    trainer = DeepseekV41Trainer(model=model, args=args, train_dataset=Rows(2))
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    assert len(losses) == 1 and math.isnan(losses[0])


# ----------------------------------------------------------------------------- atomic checkpoints


def test_an_incomplete_checkpoint_is_skipped_with_a_warning(tmp_path, caplog):
    """What a save killed before atomic checkpoints leaves (``checkpoint-2`` without ``trainer_state.json``), and a
    killed atomic save's staging folder: resuming picks the newest complete checkpoint."""
    run = tmp_path / "run"
    args = training_args(run, max_steps=1, save_strategy="steps", save_steps=1)
    DeepseekV41Trainer(model=tiny_model(), args=args, train_dataset=Rows(2)).train()
    assert sorted(p.name for p in run.iterdir()) == ["checkpoint-1"]  # no staging folder left behind
    partial = run / "checkpoint-2"
    shutil.copytree(run / "checkpoint-1", partial)
    (partial / "trainer_state.json").unlink()
    (run / "tmp-checkpoint-3" / "checkpoint-3").mkdir(parents=True)

    with caplog.at_level(logging.WARNING, logger="modeling_dsv41.training.trainer"):
        assert last_complete_checkpoint(run) == str(run / "checkpoint-1")
    warnings = " ".join(r.getMessage() for r in caplog.records)
    assert "incomplete checkpoint" in warnings and "checkpoint-2" in warnings and "tmp-checkpoint-3" in warnings

    args = training_args(run, max_steps=2, save_strategy="steps", save_steps=1)
    trainer = DeepseekV41Trainer(model=tiny_model(), args=args, train_dataset=Rows(4))
    with pytest.raises(ValueError, match="checkpoint-2.*trainer_state.json"):
        trainer.train(resume_from_checkpoint=str(partial))
    trainer.train(resume_from_checkpoint=True)
    assert trainer.state.global_step == 2
    # the step-2 save replaced the partial folder and removed the staging leftover
    assert (run / "checkpoint-2" / "trainer_state.json").is_file() and not (run / "tmp-checkpoint-3").exists()


def test_best_model_checkpoint_names_the_final_folder(tmp_path):
    """Trainer records the best checkpoint while the save runs in the staging folder: the state points to the
    renamed one."""
    run = tmp_path / "run"
    args = training_args(
        run,
        max_steps=2,
        save_strategy="steps",
        save_steps=1,
        eval_strategy="steps",
        eval_steps=1,
        load_best_model_at_end=True,
        metric_for_best_model="loss",
        save_total_limit=1,
    )
    trainer = DeepseekV41Trainer(model=tiny_model(), args=args, train_dataset=Rows(4), eval_dataset=Rows(2))
    trainer.train()
    best = Path(trainer.state.best_model_checkpoint)
    assert best.parent == run and best.name in ("checkpoint-1", "checkpoint-2") and best.is_dir()
    saved = json.loads((best / "trainer_state.json").read_text())
    assert saved["best_model_checkpoint"] == str(best)


KILLED_SAVE_STEP, FAULT_STEPS = 2, 3


def fault_injection_child(output: Path, kill_after_calls: int) -> None:
    """One training process of the fault-injection test (run by this file's ``__main__``).

    Trains ``FAULT_STEPS`` steps, saving a checkpoint after every step (keeping one), resuming from the newest
    complete checkpoint in ``output``. While the step-``KILLED_SAVE_STEP`` checkpoint is written, a profiler counts
    Python and C function calls; at call ``kill_after_calls`` the process SIGKILLs itself (0: never; then the
    count is written to ``save_calls.json``). The final weights go to ``final.safetensors``.
    """
    calls = 0

    def count(frame, event, arg) -> None:
        nonlocal calls
        if event in ("call", "c_call"):
            calls += 1
            if calls == kill_after_calls:
                os.kill(os.getpid(), signal.SIGKILL)

    original = DeepseekV41Trainer._save_checkpoint

    def save_checkpoint(self, model, trial):
        if self.state.global_step != KILLED_SAVE_STEP:
            return original(self, model, trial)
        sys.setprofile(count)
        try:
            original(self, model, trial)
        finally:
            sys.setprofile(None)
        (output / "save_calls.json").write_text(json.dumps(calls))

    DeepseekV41Trainer._save_checkpoint = save_checkpoint
    resume = last_complete_checkpoint(output)
    args = training_args(
        output,
        max_steps=FAULT_STEPS,
        save_strategy="steps",
        save_steps=1,
        save_total_limit=1,
        per_device_train_batch_size=1,
    )
    trainer = DeepseekV41Trainer(model=tiny_model(), args=args, train_dataset=Rows(FAULT_STEPS))
    trainer.train(resume_from_checkpoint=resume)
    (output / "resumed_from.json").write_text(json.dumps(resume and Path(resume).name))
    save_file(snapshot(trainer.model), output / "final.safetensors")


def run_fault_injection_child(output: Path, kill_after_calls: int) -> subprocess.CompletedProcess:
    command = [sys.executable, __file__, "fault-injection", str(output), str(kill_after_calls)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_sigkill_during_a_checkpoint_save_then_resume(tmp_path):
    """SIGKILL at a random point of the step-2 save (3 seeds): a rerun resumes from checkpoint-1 or -2 (losing at
    most the interrupted step) and ends with the weights of an uninterrupted run."""
    straight = tmp_path / "straight"
    result = run_fault_injection_child(straight, 0)
    assert result.returncode == 0, result.stderr[-4000:]
    save_calls = json.loads((straight / "save_calls.json").read_text())
    expected = load_file(straight / "final.safetensors")
    assert save_calls > 100  # the kill points spread over a real save (weights, optimizer, RNG, state, rename)

    for seed in range(3):
        output = tmp_path / f"seed{seed}"
        kill_at = random.Random(seed).randint(1, save_calls)
        killed = run_fault_injection_child(output, kill_at)
        assert killed.returncode == -signal.SIGKILL, (kill_at, killed.stderr[-4000:])
        assert not (output / "final.safetensors").exists()
        resumed = run_fault_injection_child(output, 0)
        assert resumed.returncode == 0, (kill_at, resumed.stderr[-4000:])
        assert json.loads((output / "resumed_from.json").read_text()) in ("checkpoint-1", "checkpoint-2"), kill_at
        actual = load_file(output / "final.safetensors")
        for name, value in expected.items():
            assert torch.equal(actual[name], value), (kill_at, name)
        assert sorted(p.name for p in output.glob("*checkpoint-*")) == [f"checkpoint-{FAULT_STEPS}"]


# ----------------------------------------------------------------------------- mixed optimizer vs AdamW

LM_STEPS = 30
# Each optimizer gets its best learning rate from a sweep on this task and budget (held-out loss, seed 0):
#   mixed  3e-3: 5.36  1e-2: 3.55  2e-2: 1.64  4e-2: 0.34  6e-2: 0.30  8e-2: 0.36
#   AdamW  1e-3: 5.08  3e-3: 3.81  5e-3: 3.11  7e-3: 2.44  1e-2: 1.68  1.4e-2: 1.67  2e-2: 1.73  4e-2: 3.46
MIXED_LR, ADAMW_LR = 6e-2, 1.4e-2


class Progressions(Dataset):
    """Rows ``(a + d·t) mod 64`` (+3, clear of the special ids) with a random start ``a`` and step ``d`` per row:
    every token after the second is predictable from the two before it."""

    def __init__(self, n: int, seed: int):
        g = torch.Generator().manual_seed(seed)
        start = torch.randint(0, 64, (n, 1), generator=g)
        step = torch.tensor([1, 2, 3, 5, 7])[torch.randint(0, 5, (n, 1), generator=g)]
        self.ids = (start + step * torch.arange(SEQ)) % 64 + 3

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def lm_eval_loss(output_dir: Path, learning_rate: float, overrides: dict | None) -> float:
    """Held-out loss of the tiny model after LM_STEPS steps of batch 8 (linear decay, no warmup)."""
    args = training_args(
        output_dir,
        learning_rate=learning_rate,
        max_steps=LM_STEPS,
        per_device_train_batch_size=8,
        per_device_eval_batch_size=32,
        optimizer_overrides=overrides,
    )
    trainer = DeepseekV41Trainer(
        model=tiny_model(),
        args=args,
        train_dataset=Progressions(8 * LM_STEPS, seed=3),
        eval_dataset=Progressions(32, seed=4),
    )
    trainer.train()
    return trainer.evaluate()["eval_loss"]


@pytest.mark.slow
def test_mixed_optimizer_trains_a_tiny_lm_as_well_as_adamw(tmp_path):
    mixed = lm_eval_loss(tmp_path / "mixed", MIXED_LR, None)
    adamw = lm_eval_loss(tmp_path / "adamw", ADAMW_LR, ADAMW_ONLY)
    assert mixed <= adamw + 0.02, (mixed, adamw)


# ----------------------------------------------------------------------------- DDP


def ddp_rows() -> list[dict]:
    """One global batch of 4: rank 0's two rows are text only, rank 1's carry images and padding, so a rank
    that balanced from its own counts alone would leave bias_vl still or move it differently."""
    ids = torch.randint(3, 500, (4, SEQ), generator=torch.Generator().manual_seed(2))
    return [example(ids[0]), example(ids[1]), example(ids[2], image=(2, 8), pad=3), example(ids[3], image=(6, 12))]


def ddp_training(output_dir: Path, per_device_batch: int, **overrides) -> DeepseekV41ForCausalLM:
    """3 optimizer steps, each over the same global batch of 4 rows (sequential sampling, 1 step per epoch).

    AdamW's eps is raised from 1e-8 to 1e-5 (the gradients' median is ~5e-5): with eps far below a gradient's
    summation noise, AdamW turns a near-zero gradient into a full ±lr step whose size hangs on that noise (a
    -5.7e-7 then +4.0e-7 gradient moved one weight 1.4e-4 differently under ATen's scalar kernels). With it, every
    weight of the two runs agrees within 1e-6 under the unlimited, avx2 and default ISAs."""
    model = tiny_model()
    args = training_args(
        output_dir,
        per_device_train_batch_size=per_device_batch,
        max_steps=3,
        train_sampling_strategy="sequential",
        optimizer_overrides=ADAMW_ONLY,
        optimizer_kind_kwargs={"adamw": {"eps": 1e-5}},
        **overrides,
    )
    DeepseekV41Trainer(model=model, args=args, train_dataset=ddp_rows()).train()
    return model


@pytest.mark.slow
def test_ddp_two_processes_match_one(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node=2",
        f"--master_port={port}",
        __file__,
        str(tmp_path),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]

    single = snapshot(ddp_training(tmp_path / "single", per_device_batch=4))
    ranks = [load_file(tmp_path / f"rank{rank}.safetensors") for rank in (0, 1)]
    for name, value in ranks[0].items():
        assert torch.equal(ranks[1][name], value), name  # replicas stay identical
    assert all(v.any() for k, v in single.items() if k.endswith("gate.bias_vl"))  # rank 1's image tokens moved it
    assert_same_training(ranks[0], single)


if __name__ == "__main__" and sys.argv[1] == "fault-injection":  # test_sigkill_during_a_checkpoint_save_then_resume
    torch.set_num_threads(1)
    fault_injection_child(Path(sys.argv[2]), int(sys.argv[3]))
elif __name__ == "__main__":  # one process of test_ddp_two_processes_match_one, started by torch.distributed.run
    torch.set_num_threads(1)
    output = Path(sys.argv[1])
    model = ddp_training(output / "ddp", per_device_batch=2, ddp_backend="gloo", ddp_find_unused_parameters=True)
    save_file(snapshot(model), output / f"rank{os.environ['RANK']}.safetensors")
