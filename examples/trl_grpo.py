"""Reinforcement learning of DeepSeek-V4.1 with TRL's ``GRPOTrainer``, the mixed optimizer and router balancing.

The prompt asks the model to repeat a caption; the reward is the F1 score of the completion's words against it (1.0
for the caption itself). Generation runs in the model itself (no vLLM), 8 completions per prompt sampled at
temperature 2: the demo model is so sure of its captions that at temperature 1 the 8 are mostly identical, all
rewarded alike, and give GRPO no gradient. The rollouts and the old-policy log-probabilities are computed without
gradients and are not counted by the balancing, the training forward passes are::

    python examples/trl_grpo.py --model dsv41-demo/model --output_dir dsv41-grpo --max_steps 10

What to expect on the model ``dsv41 demo`` trains: ``grad_norm`` non-zero at every step, ``frac_reward_zero_std``
near 0 and the mean ``reward`` rising from about 0.1 to about 0.35 in the 10 steps.

Every ``GRPOConfig`` field is a flag; the defaults here suit the demo model (4 prompts × 8 completions a step,
``learning_rate`` 3e-3, a log line per step) and pick the CPU when there is no accelerator. ``GRPOTrainer`` takes the
optimizer ready-made (``optimizers``): ``MixedOptimizer(model, ...)`` builds the policy's groups from the model. The
processor is the processing class, so TRL never samples the image placeholder token (text prompts have no image).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoProcessor, HfArgumentParser
from trl import GRPOConfig, GRPOTrainer

import modeling_dsv41  # noqa: F401  registers the model classes with the Auto classes
import processing  # noqa: F401  registers the processor
from modeling_dsv41.cli.demo_data import ShapesDataset
from modeling_dsv41.optim import MixedOptimizer, freeze_default_parameters
from modeling_dsv41.training.trainer import RouterBiasBalancingCallback


@dataclass
class ScriptArguments:
    model: str = field(metadata={"help": "A folder with the model and its tokenizer, e.g. dsv41-demo/model."})
    train_samples: int = field(default=64, metadata={"help": "Number of prompts."})
    bias_update_speed: float = field(default=1e-3, metadata={"help": "Router balancing speed (0: none)."})


def caption_prompts(n: int) -> Dataset:
    """Conversational ``prompt`` and the ``caption`` the reward compares completions with."""
    rows = [
        {"prompt": [{"role": "user", "content": f"Repeat: {sample.caption}"}], "caption": sample.caption}
        for sample in ShapesDataset("train", n)
    ]
    return Dataset.from_list(rows)


def caption_reward(completions: list, caption: list[str], **kwargs) -> list[float]:
    """Per completion: the F1 score of its words against the caption's (1.0 for the caption itself; a shorter or a
    longer answer loses recall or precision, so no length is favoured on its own)."""
    rewards = []
    for completion, expected in zip(completions, caption):
        words, wanted = completion[0]["content"].split(), expected.split()
        hits = sum(word in wanted for word in set(words))
        rewards.append(2 * hits / (len(set(words)) + len(wanted)) if words else 0.0)
    return rewards


def main(argv: list[str] | None = None) -> GRPOTrainer:
    parser = HfArgumentParser((ScriptArguments, GRPOConfig))
    parser.set_defaults(
        report_to="none",
        max_completion_length=8,
        num_generations=8,
        per_device_train_batch_size=32,
        temperature=2.0,
        learning_rate=3e-3,
        logging_steps=1,
        use_cpu=not torch.accelerator.is_available(),
        activation_checkpointing=True,  # TRL's default (its configs set the name transformers 5.25 deprecates)
    )
    script, args = parser.parse_args_into_dataclasses(argv)
    model = AutoModelForCausalLM.from_pretrained(script.model)
    freeze_default_parameters(model)  # the indexer: its top-k passes no gradient
    optimizer = MixedOptimizer(model, lr=args.learning_rate, weight_decay=args.weight_decay)
    callbacks = [RouterBiasBalancingCallback(script.bias_update_speed)] if script.bias_update_speed > 0 else []
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=caption_reward,
        args=args,
        train_dataset=caption_prompts(script.train_samples),
        processing_class=AutoProcessor.from_pretrained(script.model),
        optimizers=(optimizer, None),
        callbacks=callbacks,
    )
    trainer.train()
    return trainer


if __name__ == "__main__":
    main(sys.argv[1:])
