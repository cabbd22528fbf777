"""TRL's trainers on DeepSeek-V4.1: the recipes of ``examples/trl_*.py`` (SFT on text and on images, DPO, GRPO) with
the mixed optimizer and router balancing, each a few steps on the demo-size model, and TRL starting from every kind
of folder this package writes."""

from __future__ import annotations

import json
import runpy
import shlex
from pathlib import Path

import pytest
import torch
from documentation import command_lines
from safetensors.torch import load_file

from modeling_dsv41 import export_for_hub
from modeling_dsv41.cli import main as dsv41
from modeling_dsv41.cli.demo import DemoSettings, build_demo_model, build_demo_processor, demo_config, fine_tune
from modeling_dsv41.cli.demo_data import build_demo_tokenizer
from modeling_dsv41.released.conversions import in_our_layout
from modeling_dsv41.released.writing import save_released_checkpoint
from modeling_dsv41.optim import MixedOptimizer

trl = pytest.importorskip("trl")  # in the `test` extra: a missing trl fails the suite's set-up, not silently here

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
CAPTIONER_STEPS, CAPTIONER_BATCH = 80, 16  # 80 s of CPU time (40 steps are too few: GRPO's reward stays ≈ 0.02)


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    """The demo-size model (untrained) as each writer leaves it: save_pretrained (+ processor), export_for_hub, and
    ``dsv41 convert`` of its released-format checkpoint."""
    root = tmp_path_factory.mktemp("trl")
    tokenizer = build_demo_tokenizer()
    config = demo_config(tokenizer)
    model = build_demo_model(config, tokenizer, seed=0)
    processor = build_demo_processor(config, tokenizer)
    model.save_pretrained(root / "saved")
    processor.save_pretrained(root / "saved")
    export_for_hub(model, root / "exported", processor)
    save_released_checkpoint(model.to(torch.bfloat16), root / "released")
    tokenizer.save_pretrained(root / "released")
    assert dsv41(["convert", str(root / "released"), str(root / "converted")]) == 0
    tokenizer.save_pretrained(root / "converted")
    return {"saved": root / "saved", "exported": root / "exported", "converted": root / "converted"}


@pytest.fixture(scope="module")
def untrained(folders, tmp_path_factory) -> Path:
    """A ``dsv41-demo`` folder as the docs' commands expect after ``dsv41 demo``, holding the untrained model: SFT's
    loss and DPO's margin move on it as on the trained one, and the stand-in costs no training."""
    root = tmp_path_factory.mktemp("untrained") / "dsv41-demo"
    root.mkdir()
    (root / "model").symlink_to(folders["exported"])
    return root


@pytest.fixture(scope="module")
def captioner(tmp_path_factory) -> Path:
    """``dsv41-demo/model`` as the docs' commands expect it after ``dsv41 demo``, trained for fewer steps: a model
    that answers in captions (GRPO needs completions its reward can tell apart; an untrained model's score ≈ 0 and
    its reward does not rise in 10 steps)."""
    root = tmp_path_factory.mktemp("captioner")
    tokenizer = build_demo_tokenizer()
    config = demo_config(tokenizer)
    model = build_demo_model(config, tokenizer, seed=0)
    processor = build_demo_processor(config, tokenizer)
    settings = DemoSettings(
        output=root / "training",
        steps=CAPTIONER_STEPS,
        batch_size=CAPTIONER_BATCH,
        num_train=CAPTIONER_STEPS * CAPTIONER_BATCH,
        num_eval=8,
    )
    fine_tune(model, processor, settings, stage="full", style="short", steps=settings.steps, print_fn=lambda *a: None)
    export_for_hub(model, root / "dsv41-demo" / "model", processor)
    return root / "dsv41-demo"


def printed_commands() -> dict[str, list[str]]:
    """The docs' ``python examples/trl_*.py`` lines (argv), by output folder."""
    commands = {}
    for line in command_lines("python examples/trl_"):
        argv = shlex.split(line)
        commands[argv[argv.index("--output_dir") + 1]] = argv
    return commands


def run_printed(output_dir: str, demo: Path, cwd: Path, monkeypatch):
    """The printed command writing ``output_dir``, in ``cwd`` next to ``demo`` (as ``dsv41-demo``): its script's
    ``main`` with the printed arguments (what ``python script ...`` runs); returns the trainer and the per-step log."""
    argv = printed_commands()[output_dir]
    assert argv[0] == "python"
    (cwd / "dsv41-demo").symlink_to(demo)
    monkeypatch.chdir(cwd)
    trainer = runpy.run_path(str(EXAMPLES.parent / argv[1]))["main"](argv[2:])
    steps = int(argv[argv.index("--max_steps") + 1])
    saved = json.loads((cwd / output_dir / f"checkpoint-{steps}" / "trainer_state.json").read_text())
    log = [entry for entry in saved["log_history"] if "loss" in entry]
    assert len(log) == steps  # a line per step
    return trainer, log


def assert_mixed_optimizer_and_balancing(trainer, demo: Path, image_tokens: bool = False) -> None:
    optimizer = getattr(trainer.optimizer, "optimizer", trainer.optimizer)  # accelerate's wrapper
    assert isinstance(optimizer, MixedOptimizer)
    assert {g["kind"] for g in optimizer.param_groups} >= {"muon", "muon_headwise", "sinkhorn", "adamw"}
    assert trainer.args.use_cpu == (not torch.accelerator.is_available())
    biases = {n: b for n, b in trainer.model.named_buffers() if n.endswith((".gate.bias", ".gate.bias_vl"))}
    # each moved by the rule from the loaded values (the backbone's: the DSpark draft head's routers do not run in
    # the backbone's forward)
    biases = {n: b for n, b in biases.items() if ".mtp." not in n and not n.startswith("mtp.")}
    loaded = in_our_layout(load_file(demo / "model" / "model.safetensors"), set(trainer.model.state_dict()))
    moved = {n: not torch.equal(b, loaded[n]) for n, b in biases.items()}
    assert biases and all(moved[n] for n in biases if n.endswith(".gate.bias"))
    assert all(moved[n] == image_tokens for n in biases if n.endswith(".gate.bias_vl"))


def test_printed_sft_on_chat_text_lowers_the_loss(untrained, tmp_path, monkeypatch):
    trainer, log = run_printed("dsv41-sft", untrained, tmp_path, monkeypatch)
    losses = [entry["loss"] for entry in log]
    assert losses[-1] < 0.8 * losses[0], losses  # untrained: 6.2 -> 4.7 in our run (the demo's model: 8.9 -> 2.9)
    assert_mixed_optimizer_and_balancing(trainer, untrained)
    row = trainer.train_dataset[0]  # labels: the assistant's reply and EOS (the template's generation markers)
    ids, labels = row["input_ids"], row["labels"]
    tokenizer = trainer.processing_class
    trained = [t for t in labels if t != -100]
    assert 0 < len(trained) < len(ids) and labels[-1] == ids[-1] == tokenizer.eos_token_id
    assert tokenizer.decode(trained, skip_special_tokens=True).startswith("a ")


def test_printed_sft_on_images_lowers_the_loss(untrained, tmp_path, monkeypatch):
    trainer, log = run_printed("dsv41-sft-vl", untrained, tmp_path, monkeypatch)
    losses = [entry["loss"] for entry in log]
    assert losses[-1] < 0.8 * losses[0], losses  # untrained: 6.3 -> 4.6 in our run
    assert_mixed_optimizer_and_balancing(trainer, untrained, image_tokens=True)


def test_printed_dpo_widens_the_reward_margin(untrained, tmp_path, monkeypatch):
    trainer, log = run_printed("dsv41-dpo", untrained, tmp_path, monkeypatch)
    margins = [entry["rewards/margins"] for entry in log]
    # the policy starts as the reference (the same weights: a margin of 0 up to summation order)
    assert abs(margins[0]) < 1e-3 and margins[-1] > 1 and margins[-1] == max(margins), margins  # untrained: 1.7
    assert_mixed_optimizer_and_balancing(trainer, untrained)


def test_printed_grpo_has_gradients_and_a_rising_reward(captioner, tmp_path, monkeypatch):
    trainer, log = run_printed("dsv41-grpo", captioner, tmp_path, monkeypatch)
    assert all(entry["grad_norm"] > 0 for entry in log), [entry["grad_norm"] for entry in log]
    rewards = [entry["reward"] for entry in log]
    half = len(rewards) // 2
    assert sum(rewards[half:]) / (len(rewards) - half) > sum(rewards[:half]) / half + 0.02, rewards
    assert_mixed_optimizer_and_balancing(trainer, captioner)


@pytest.mark.parametrize("kind", ["saved", "exported", "converted"])
def test_trl_loads_every_folder_we_write(folders, kind):
    """TRL's trainers given a path load the model with ``create_model_from_path`` (it reads ``config.auto_map``)."""
    from trl.trainer.utils import create_model_from_path

    model = create_model_from_path(str(folders[kind]), trust_remote_code=kind == "exported")
    assert type(model).__name__ == "DeepseekV41ForCausalLM"


def test_dpo_trainer_starts_from_a_save_pretrained_path(folders, tmp_path):
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer

    pairs = Dataset.from_list([{"prompt": "red circle", "chosen": " top left", "rejected": " bottom right"}] * 2)
    args = DPOConfig(
        output_dir=str(tmp_path),
        max_steps=1,
        per_device_train_batch_size=2,
        use_cpu=True,
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
        activation_checkpointing=True,
    )
    from transformers import AutoTokenizer

    trainer = DPOTrainer(
        model=str(folders["saved"]),
        args=args,
        train_dataset=pairs,
        processing_class=AutoTokenizer.from_pretrained(folders["saved"]),
    )
    trainer.train()
    assert trainer.state.global_step == 1


def test_grpo_rollouts_with_dspark_are_the_plain_ones(folders, tmp_path, monkeypatch):
    """``use_mtp=True`` in GRPO's ``generation_kwargs`` (TRL's transformers-generate path, no vLLM): under greedy
    decoding its rollouts, a batch of left-padded chat prompts each decoded until EOS or ``max_completion_length``,
    every row at its own accepted length, are the completions plain decoding gives."""
    from transformers import AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from modeling_dsv41.generation import generate

    prompts = runpy.run_path(str(EXAMPLES / "trl_grpo.py"))["caption_prompts"](4)
    speculative = []  # DSpark decoding loops run
    decoding = generate.dspark_decoding
    monkeypatch.setattr(generate, "dspark_decoding", lambda *a, **k: (speculative.append(1), decoding(*a, **k))[1])
    completions = {}
    for use_mtp in (False, True):
        seen: list[str] = []

        def record(completions, **kwargs):  # the reward function sees every rollout
            seen.extend(completion[0]["content"] for completion in completions)
            return [0.0] * len(completions)

        args = GRPOConfig(
            output_dir=str(tmp_path / str(use_mtp)),
            max_steps=1,
            per_device_train_batch_size=4,
            num_generations=2,
            max_completion_length=12,
            generation_kwargs={"do_sample": False, "use_mtp": use_mtp},
            use_cpu=True,
            report_to="none",
            save_strategy="no",
            disable_tqdm=True,
            seed=0,
            activation_checkpointing=True,
        )
        trainer = GRPOTrainer(
            model=str(folders["saved"]),
            reward_funcs=record,
            args=args,
            train_dataset=prompts,
            processing_class=AutoTokenizer.from_pretrained(folders["saved"]),
        )
        trainer.train()
        completions[use_mtp] = seen
    assert speculative  # the use_mtp run decoded speculatively
    assert len(completions[True]) == 4 and completions[True] == completions[False]
