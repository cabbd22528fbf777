"""Reinforcement learning of DeepSeek-V4.1 with TRL's ``GRPOTrainer``, the mixed optimizer and router balancing.

The reward counts the words of a completion that belong to the prompt's caption (colour, shape, position), minus
the others: the model learns to repeat the caption it is asked for. Generation runs in the model itself (no vLLM);
the rollouts and the old-policy log-probabilities are computed without gradients and are not counted by the
balancing, the training forward passes are::

    python examples/trl_grpo.py --model dsv41-demo/model --output_dir dsv41-grpo --max_steps 10

Every ``GRPOConfig`` field is a flag. ``GRPOTrainer`` takes the optimizer ready-made (``optimizers``):
``MixedOptimizer(model, ...)`` builds the policy's groups from the model.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer, HfArgumentParser
from trl import GRPOConfig, GRPOTrainer

import modeling_dsv41  # noqa: F401  registers the model classes with the Auto classes
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
    """Per completion: (words of its caption − other words) / words of the caption."""
    rewards = []
    for completion, expected in zip(completions, caption):
        words, wanted = completion[0]["content"].split(), set(expected.split())
        rewards.append((sum(w in wanted for w in words) - sum(w not in wanted for w in words)) / len(wanted))
    return rewards


def main(argv: list[str] | None = None) -> GRPOTrainer:
    parser = HfArgumentParser((ScriptArguments, GRPOConfig))
    parser.set_defaults(report_to="none", max_completion_length=8, num_generations=2, per_device_train_batch_size=2)
    script, args = parser.parse_args_into_dataclasses(argv)
    model = AutoModelForCausalLM.from_pretrained(script.model)
    freeze_default_parameters(model)  # the indexer: its top-k passes no gradient
    optimizer = MixedOptimizer(model, lr=args.learning_rate, weight_decay=args.weight_decay)
    callbacks = [RouterBiasBalancingCallback(script.bias_update_speed)] if script.bias_update_speed > 0 else []
    trainer = GRPOTrainer(
        model=model, reward_funcs=caption_reward, args=args, train_dataset=caption_prompts(script.train_samples),
        processing_class=AutoTokenizer.from_pretrained(script.model), optimizers=(optimizer, None), callbacks=callbacks,
    )
    trainer.train()
    return trainer


if __name__ == "__main__":
    main(sys.argv[1:])
