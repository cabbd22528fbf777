"""Full fine-tuning of DeepSeek-V4.1 on the expert-parallel mesh with ``DeepseekV41Trainer``, from one node to many:
the routed experts split by expert over ``--expert_parallel_size`` processes (tokens sent to them by all-to-all),
everything else sharded by FSDP2 over all of them, with the mixed optimizer and router balancing. No process ever
holds the whole model: it is built on the meta device, sharded, and every process reads only its shards of the
checkpoint (``training.fsdp.load_sharded_weights``). The Engram tables stay frozen, memory-mapped from the folder.

``--model`` is a folder in our layout with its processor: the demo's (``dsv41 demo``), or the released model converted
once with ``dsv41 convert released/ converted/`` (bf16 safetensors). The data is the demo's captioning task
(``fine_tune`` of examples/finetune.py, beside this script); put your own dataset and collator there. One node,
4 processes (examples/accelerate/fsdp2_ep.yaml)::

    accelerate launch --config_file examples/accelerate/fsdp2_ep.yaml examples/full_finetune.py \\
        --model dsv41-demo/model --output_dir dsv41-full --expert_parallel_size 2 --max_steps 4 --save_steps 2

Many nodes: the same command on every node, with ``--num_machines``, ``--num_processes`` (all of them),
``--machine_rank`` and ``--main_process_ip`` (see docs/training.md), or under ``torchrun`` with
``--fsdp full_shard --fsdp_config '{"fsdp_version": 2}'``. Every ``DeepseekV41TrainingArguments`` field is a flag.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

import torch
from accelerate import init_empty_weights
from finetune import ScriptArguments, fine_tune, parse_arguments  # examples/finetune.py, beside this script
from transformers import AutoConfig, AutoModelForCausalLM

from modeling_dsv41 import DeepseekV41Trainer, DeepseekV41TrainingArguments
from modeling_dsv41.optim import freeze_default_parameters
from modeling_dsv41.placement import is_engram_table_tensor
from modeling_dsv41.training.fsdp import load_sharded_weights, shard_model


@dataclass
class FullScriptArguments(ScriptArguments):
    train_engram_tables: bool = field(
        default=False,
        metadata={
            "help": "Train the Engram tables (FSDP2 then gathers a whole table at each forward of its layer: "
            "fine for small models; the release's are memory-mapped and frozen by default)."
        },
    )


def build_sharded_model(folder: str, args: DeepseekV41TrainingArguments, train_engram_tables: bool) -> torch.nn.Module:
    """The model on the meta device, sharded on the expert-parallel mesh, then filled shard by shard from ``folder``.
    Under bf16 mixed precision (the accelerate config's ``mixed_precision: bf16`` or ``--bf16``) the weights,
    gradients and optimizer state are fp32 masters with bf16 compute, as the Trainer's FSDP2 sharding makes them;
    otherwise they keep the checkpoint's dtype. What does not train is frozen before sharding: the indexer, the
    DSpark draft head (``--train_dspark_head`` trains it alone, without expert parallelism) and the Engram tables."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    config = AutoConfig.from_pretrained(folder)
    mixed = args.mixed_precision == "bf16"
    dtype = torch.float32 if mixed else getattr(config, "dtype", None) or torch.float32
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    freeze_default_parameters(model)
    for name, param in model.named_parameters():
        if name.startswith("mtp.") or (is_engram_table_tensor(name) and not train_engram_tables):
            param.requires_grad_(False)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16) if mixed else None
    shard_model(model, mp_policy=policy, expert_parallel_size=args.expert_parallel_size)
    load_sharded_weights(model, folder)
    if args.activation_checkpointing:
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=args.activation_checkpointing_kwargs)
    return model


def main(argv: list[str] | None = None) -> DeepseekV41Trainer:
    script, args = parse_arguments(argv, FullScriptArguments)
    args.device  # noqa: B018  starts the process group (torchrun / accelerate launch) before sharding
    return fine_tune(build_sharded_model(script.model, args, script.train_engram_tables), script, args)


if __name__ == "__main__":
    main(sys.argv[1:])
