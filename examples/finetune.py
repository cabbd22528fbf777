"""Fine-tune a DeepSeek-V4.1 model with ``DeepseekV41Trainer`` on the demo's captioning task; runs as it is on one
process (``python examples/finetune.py ...``) and on many under ``accelerate launch`` (DDP or FSDP2, with the
configs in ``examples/accelerate/``)::

    accelerate launch --config_file examples/accelerate/fsdp2.yaml examples/finetune.py \\
        --model dsv41-demo/model --output_dir dsv41-fsdp2 --max_steps 8 --save_steps 4 --activation_checkpointing true

Every ``TrainingArguments`` / ``DeepseekV41TrainingArguments`` field is a flag (``--learning_rate``,
``--activation_checkpointing``, ``--resume_from_checkpoint``, ``--bias_update_speed``, ...).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

from transformers import AutoModelForCausalLM, AutoProcessor, HfArgumentParser

import modeling_dsv41  # noqa: F401  registers the model classes with the Auto classes
import processing  # noqa: F401  registers the processor
from modeling_dsv41 import DeepseekV41Trainer, DeepseekV41TrainingArguments
from modeling_dsv41.cli.demo import CaptionCollator
from modeling_dsv41.cli.demo_data import ShapesDataset


@dataclass
class ScriptArguments:
    model: str = field(metadata={"help": "A folder with the model and its processor, e.g. dsv41-demo/model."})
    train_samples: int = field(default=200, metadata={"help": "Size of the synthetic captioning training set."})


def parse_arguments(argv: list[str] | None, script_arguments: type = ScriptArguments) -> tuple:
    """(script arguments, DeepseekV41TrainingArguments) from the command line."""
    parser = HfArgumentParser((script_arguments, DeepseekV41TrainingArguments))
    parser.set_defaults(remove_unused_columns=False, report_to="none")  # the collator reads the raw samples
    return parser.parse_args_into_dataclasses(argv)


def fine_tune(model, script: ScriptArguments, args: DeepseekV41TrainingArguments) -> DeepseekV41Trainer:
    """Train ``model`` on the captioning task with the processor of ``script.model``; ``--resume_from_checkpoint last``
    resumes from the newest complete checkpoint."""
    processor = AutoProcessor.from_pretrained(script.model)
    trainer = DeepseekV41Trainer(
        model=model,
        args=args,
        train_dataset=ShapesDataset("train", script.train_samples),
        data_collator=CaptionCollator(processor),
    )
    resume = args.resume_from_checkpoint
    trainer.train(resume_from_checkpoint=True if resume == "last" else resume)
    return trainer


def main(argv: list[str] | None = None) -> DeepseekV41Trainer:
    script, args = parse_arguments(argv)
    return fine_tune(AutoModelForCausalLM.from_pretrained(script.model), script, args)


if __name__ == "__main__":
    main(sys.argv[1:])
