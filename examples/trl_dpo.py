"""Preference tuning of DeepSeek-V4.1 with TRL's ``DPOTrainer``, the mixed optimizer and router balancing.

The preference: a caption in the short style (``"red circle top left"``) over the sentence style, for the same
shape. The reference model is a frozen copy TRL makes; its forward passes run without gradients and are not counted
by the balancing::

    python examples/trl_dpo.py --model dsv41-demo/model --output_dir dsv41-dpo --max_steps 10

What to expect on the model ``dsv41 demo`` trains: ``rewards/margins`` grows from 0 to about 5 in the 10 steps,
``rewards/accuracies`` reaches 1 after the first and the loss falls from 0.693 (log 2) towards 0.

Every ``DPOConfig`` field is a flag; the defaults here suit the demo model (``learning_rate`` 1e-2, a log line per
step) and pick the CPU when there is no accelerator. ``DPOTrainer`` takes the optimizer ready-made
(``optimizers``): ``MixedOptimizer(model, ...)`` builds the policy's groups from the model.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer, HfArgumentParser
from trl import DPOConfig, DPOTrainer

import modeling_dsv41  # noqa: F401  registers the model classes with the Auto classes
from modeling_dsv41.cli.demo_data import CAPTION_STYLES, ShapesDataset
from modeling_dsv41.optim import MixedOptimizer, freeze_default_parameters
from modeling_dsv41.training.trainer import RouterBiasBalancingCallback


@dataclass
class ScriptArguments:
    model: str = field(metadata={"help": "A folder with the model and its tokenizer, e.g. dsv41-demo/model."})
    train_samples: int = field(default=64, metadata={"help": "Number of preference pairs."})
    bias_update_speed: float = field(default=1e-3, metadata={"help": "Router balancing speed (0: none)."})


def preference_pairs(n: int) -> Dataset:
    """Conversational ``prompt`` / ``chosen`` / ``rejected``: the short caption preferred over the sentence."""
    rows = []
    for sample in ShapesDataset("train", n):
        words = {"color": sample.color, "shape": sample.shape, "position": sample.position}
        rows.append(
            {
                "prompt": [{"role": "user", "content": f"Caption: {sample.color} {sample.shape}, {sample.position}."}],
                "chosen": [{"role": "assistant", "content": CAPTION_STYLES["short"].format(**words)}],
                "rejected": [{"role": "assistant", "content": CAPTION_STYLES["sentence"].format(**words)}],
            }
        )
    return Dataset.from_list(rows)


def main(argv: list[str] | None = None) -> DPOTrainer:
    parser = HfArgumentParser((ScriptArguments, DPOConfig))
    # activation_checkpointing: TRL's default (its configs set the name transformers 5.25 deprecates)
    parser.set_defaults(
        report_to="none",
        max_length=64,
        learning_rate=1e-2,
        logging_steps=1,
        use_cpu=not torch.accelerator.is_available(),
        activation_checkpointing=True,
    )
    script, args = parser.parse_args_into_dataclasses(argv)
    model = AutoModelForCausalLM.from_pretrained(script.model)
    freeze_default_parameters(model)  # the indexer: its top-k passes no gradient
    optimizer = MixedOptimizer(model, lr=args.learning_rate, weight_decay=args.weight_decay)
    callbacks = [RouterBiasBalancingCallback(script.bias_update_speed)] if script.bias_update_speed > 0 else []
    trainer = DPOTrainer(
        model=model,
        args=args,
        train_dataset=preference_pairs(script.train_samples),
        processing_class=AutoTokenizer.from_pretrained(script.model),
        optimizers=(optimizer, None),
        callbacks=callbacks,
    )
    trainer.train()
    return trainer


if __name__ == "__main__":
    main(sys.argv[1:])
