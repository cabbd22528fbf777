"""Supervised fine-tuning of DeepSeek-V4.1 with TRL's ``SFTTrainer``, the mixed optimizer and router balancing.

Text (the default): chat conversations asking for the sentence wording of a caption (``"red circle top left"`` ->
``"a red circle in the top left"``), trained on the assistant's tokens only (``--assistant_only_loss``, which the
chat template's ``{% generation %}`` markers make possible). Images (``--images``): the demo's images captioned in
that sentence wording, a new one for the demo model; TRL's vision collator runs our processor, which hands the model
``pixel_values``, ``image_grid_hw`` and ``image_token_types``::

  python examples/trl_sft.py --model dsv41-demo/model --output_dir dsv41-sft --max_steps 10 --assistant_only_loss true
  python examples/trl_sft.py --model dsv41-demo/model --output_dir dsv41-sft-vl --max_steps 10 --images true

What to expect on the model ``dsv41 demo`` trains: the logged ``loss`` falls by half or more in the 10 steps (text:
about 8.9 -> 2.9; images: about 9.5 -> 4.3) and ``mean_token_accuracy`` rises.

Every ``SFTConfig`` field is a flag; the defaults here suit the demo model (``learning_rate`` 1e-2 as in the demo's
fine-tuning, a log line per step) and pick the CPU when there is no accelerator. The optimizer is
:class:`~modeling_dsv41.optim.MixedOptimizer` with the policy's groups (``optimizer_cls_and_kwargs``);
:class:`RouterBiasBalancingCallback` moves the routers' biases after every step, counting the expert loads in the
model's own training forward passes.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

import torch
from datasets import Dataset
from transformers import AutoModelForImageTextToText, AutoProcessor, HfArgumentParser
from trl import SFTConfig, SFTTrainer

import modeling_dsv41  # noqa: F401  registers the model classes with the Auto classes
import processing  # noqa: F401  registers the processor
from modeling_dsv41.cli.demo_data import CAPTION_STYLES, PROMPT, ShapesDataset
from modeling_dsv41.optim import MixedOptimizer, freeze_default_parameters
from modeling_dsv41.training.trainer import RouterBiasBalancingCallback


@dataclass
class ScriptArguments:
    model: str = field(metadata={"help": "A folder with the model and its processor, e.g. dsv41-demo/model."})
    images: bool = field(default=False, metadata={"help": "Train on image + text conversations."})
    train_samples: int = field(default=64, metadata={"help": "Size of the synthetic training set."})
    bias_update_speed: float = field(default=1e-3, metadata={"help": "Router balancing speed (0: none)."})


def text_conversations(n: int) -> Dataset:
    """``messages``: the short caption in, its sentence wording out."""
    rows = []
    for sample in ShapesDataset("train", n):
        words = {"color": sample.color, "shape": sample.shape, "position": sample.position}
        rows.append(
            {
                "messages": [
                    {"role": "user", "content": f"Say it as a sentence: {sample.caption}"},
                    {"role": "assistant", "content": CAPTION_STYLES["sentence"].format(**words)},
                ]
            }
        )
    return Dataset.from_list(rows)


def image_conversations(n: int) -> Dataset:
    """``messages`` with an image block, and ``images``: the demo's images, captioned in the sentence wording."""
    rows = [
        {
            "messages": [
                {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": PROMPT}]},
                {"role": "assistant", "content": [{"type": "text", "text": sample.caption}]},
            ],
            "images": [sample.image],
        }
        for sample in ShapesDataset("train", n, style="sentence")
    ]
    return Dataset.from_list(rows)


def main(argv: list[str] | None = None) -> SFTTrainer:
    parser = HfArgumentParser((ScriptArguments, SFTConfig))
    # activation_checkpointing: TRL's default (its configs set the name transformers 5.25 deprecates)
    parser.set_defaults(
        report_to="none",
        max_length=128,
        learning_rate=1e-2,
        logging_steps=1,
        use_cpu=not torch.accelerator.is_available(),
        activation_checkpointing=True,
    )
    script, args = parser.parse_args_into_dataclasses(argv)
    model = AutoModelForImageTextToText.from_pretrained(script.model)
    processor = AutoProcessor.from_pretrained(script.model)
    freeze_default_parameters(model)  # the indexer: its top-k passes no gradient
    optimizer = (MixedOptimizer, {"model": model, "lr": args.learning_rate, "weight_decay": args.weight_decay})
    callbacks = [RouterBiasBalancingCallback(script.bias_update_speed)] if script.bias_update_speed > 0 else []
    dataset = image_conversations if script.images else text_conversations
    trainer = SFTTrainer(
        model=model,
        args=args,
        train_dataset=dataset(script.train_samples),
        processing_class=processor if script.images else processor.tokenizer,
        optimizer_cls_and_kwargs=optimizer,
        callbacks=callbacks,
    )
    trainer.train()
    return trainer


if __name__ == "__main__":
    main(sys.argv[1:])
