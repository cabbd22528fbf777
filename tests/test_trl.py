"""TRL's trainers on DeepSeek-V4.1: the recipes of ``examples/trl_*.py`` (SFT on text and on images, DPO, GRPO) with
the mixed optimizer and router balancing, each a few steps on the demo-size model, and TRL starting from every kind
of folder this package writes."""

from __future__ import annotations

import runpy
from pathlib import Path

import pytest
import torch

from modeling_dsv41 import export_for_hub
from modeling_dsv41.cli import main as dsv41
from modeling_dsv41.cli.demo import build_demo_model, build_demo_processor, demo_config
from modeling_dsv41.cli.demo_data import build_demo_tokenizer
from modeling_dsv41.released.writing import save_released_checkpoint
from modeling_dsv41.optim import MixedOptimizer

trl = pytest.importorskip("trl")  # in the `test` extra: a missing trl fails the suite's set-up, not silently here

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
FEW_STEPS = ["--max_steps", "2", "--per_device_train_batch_size", "2", "--train_samples", "8", "--use_cpu",
             "--save_strategy", "no", "--logging_steps", "1", "--disable_tqdm", "true", "--seed", "0"]


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


def run_example(name: str, folder: Path, output_dir: Path, *flags: str):
    main = runpy.run_path(str(EXAMPLES / f"trl_{name}.py"))["main"]
    return main(["--model", str(folder), "--output_dir", str(output_dir), *FEW_STEPS, *flags])


def assert_mixed_optimizer_and_balancing(trainer, image_tokens: bool = False) -> None:
    optimizer = getattr(trainer.optimizer, "optimizer", trainer.optimizer)  # accelerate's wrapper
    assert isinstance(optimizer, MixedOptimizer)
    assert {g["kind"] for g in optimizer.param_groups} >= {"muon", "muon_headwise", "sinkhorn", "adamw"}
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    assert len(losses) == 2 and all(torch.isfinite(torch.tensor(losses)))
    biases = {n: b for n, b in trainer.model.named_buffers() if n.endswith((".gate.bias", ".gate.bias_vl"))}
    # the demo model starts with zero biases: each moved by the rule, every step ±speed per expert or 0 (the backbone's:
    # the DSpark draft head's routers do not run in the backbone's forward)
    biases = {n: b for n, b in biases.items() if ".mtp." not in n and not n.startswith("mtp.")}
    assert biases and all(b.any() for n, b in biases.items() if n.endswith(".gate.bias"))
    assert all(b.any() == image_tokens for n, b in biases.items() if n.endswith(".gate.bias_vl"))


def test_sft_on_chat_text_with_assistant_only_loss(folders, tmp_path):
    trainer = run_example("sft", folders["saved"], tmp_path, "--assistant_only_loss", "true")
    assert_mixed_optimizer_and_balancing(trainer)
    row = trainer.train_dataset[0]  # labels: the assistant's reply and EOS (the template's generation markers)
    ids, labels = row["input_ids"], row["labels"]
    tokenizer = trainer.processing_class
    trained = [t for t in labels if t != -100]
    assert 0 < len(trained) < len(ids) and labels[-1] == ids[-1] == tokenizer.eos_token_id
    assert tokenizer.decode(trained, skip_special_tokens=True).startswith("a ")


def test_sft_on_images(folders, tmp_path):
    trainer = run_example("sft", folders["saved"], tmp_path, "--images", "true")
    assert_mixed_optimizer_and_balancing(trainer, image_tokens=True)


def test_dpo(folders, tmp_path):
    assert_mixed_optimizer_and_balancing(run_example("dpo", folders["saved"], tmp_path))


def test_grpo(folders, tmp_path):
    assert_mixed_optimizer_and_balancing(run_example("grpo", folders["saved"], tmp_path))


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
    args = DPOConfig(output_dir=str(tmp_path), max_steps=1, per_device_train_batch_size=2, use_cpu=True,
                     report_to="none", save_strategy="no", disable_tqdm=True)
    from transformers import AutoTokenizer

    trainer = DPOTrainer(model=str(folders["saved"]), args=args, train_dataset=pairs,
                         processing_class=AutoTokenizer.from_pretrained(folders["saved"]))
    trainer.train()
    assert trainer.state.global_step == 1


def test_grpo_rollouts_with_dspark_are_the_plain_ones(folders, tmp_path, monkeypatch):
    """``use_mtp=True`` in GRPO's ``generation_kwargs`` (TRL's transformers-generate path, no vLLM): under greedy
    decoding its rollouts, a batch of left-padded chat prompts each decoded until EOS or ``max_completion_length``,
    every row at its own accepted length, are the completions plain decoding gives."""
    from transformers import AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from modeling_dsv41 import modeling_dsv41

    prompts = runpy.run_path(str(EXAMPLES / "trl_grpo.py"))["caption_prompts"](4)
    speculative = []  # DSpark decoding loops run
    decoding = modeling_dsv41.dspark_decoding
    monkeypatch.setattr(modeling_dsv41, "dspark_decoding", lambda *a, **k: (speculative.append(1), decoding(*a, **k))[1])
    completions = {}
    for use_mtp in (False, True):
        seen: list[str] = []

        def record(completions, **kwargs):  # the reward function sees every rollout
            seen.extend(completion[0]["content"] for completion in completions)
            return [0.0] * len(completions)

        args = GRPOConfig(
            output_dir=str(tmp_path / str(use_mtp)), max_steps=1, per_device_train_batch_size=4, num_generations=2,
            max_completion_length=12, generation_kwargs={"do_sample": False, "use_mtp": use_mtp}, use_cpu=True,
            report_to="none", save_strategy="no", disable_tqdm=True, seed=0,
        )
        trainer = GRPOTrainer(model=str(folders["saved"]), reward_funcs=record, args=args, train_dataset=prompts,
                              processing_class=AutoTokenizer.from_pretrained(folders["saved"]))
        trainer.train()
        completions[use_mtp] = seen
    assert speculative  # the use_mtp run decoded speculatively
    assert len(completions[True]) == 4 and completions[True] == completions[False]
