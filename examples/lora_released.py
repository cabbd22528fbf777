"""LoRA of DeepSeek-V4.1's release on one node: every process reads only its shards of the FP8 / FP4 weights, which
stay as stored (frozen), and trains LoRA adapters on the attention, the shared and the routed experts
(docs/released-model.md, "LoRA of the release on one node")::

    accelerate launch --config_file examples/accelerate/fsdp2_lora.yaml --num_processes 8 \\
        examples/lora_released.py --model DeepSeek-V4.1-Flash --data train.jsonl --output_dir lora-v41 \\
        --rank 16 --seq_len 4096 --max_steps 1000 --save_steps 100

``--data``: a JSON-lines file with a ``"text"`` field per line, tokenized with the ``tokenizer.json`` next to the
weights and packed into rows of ``--seq_len`` tokens, one row per process and step unless
``--per_device_train_batch_size`` says otherwise (``dsv41 inspect --train lora`` plans one). The model is built on the
meta device, sharded with FSDP2 (``training.fsdp.shard_model``, the policy of the accelerate config), then filled with
the rank's shards (``training.fsdp.load_sharded_weights``); the Engram tables are memory-mapped from the folder, one
page cache for the node. ``--expert_parallel_size 8`` splits the routed experts by expert over the processes instead
(each reads its experts only; tokens reach them by all-to-all). Every ``DeepseekV41TrainingArguments`` field is a flag
too (``--learning_rate``, ``--offload_activations``, ``--resume_from_checkpoint last``, ...). Checkpoints hold the
adapter (``adapter_model.safetensors``) and the sharded
optimizer state; ``--output_dir`` ends with the adapter, which loads on a natively loaded base::

    model = PeftModel.from_pretrained(DeepseekV41ForCausalLM.from_pretrained(folder), "lora-v41")

One process (``python examples/lora_released.py ...``) runs the same steps unsharded.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch
from peft import LoraConfig, get_peft_model
from tokenizers import Tokenizer
from torch.distributed.fsdp import FSDPModule
from torch.utils.data import Dataset
from transformers import HfArgumentParser

import modeling_dsv41  # noqa: F401  registers the model classes
from configuration import DeepseekV41Config
from modeling_dsv41 import DeepseekV41ForCausalLM, DeepseekV41Trainer, DeepseekV41TrainingArguments
from modeling_dsv41.released.loading import empty_native_model
from modeling_dsv41.training.fsdp import load_sharded_weights
from modeling_dsv41.training.launch import fsdp_requested

# README's targets: the attention and shared-expert Linears (FP8) and the routed experts (FP4, adapters of the
# logical per-expert shape)
TARGET_MODULES = [
    "attn.wq_a",
    "attn.wq_b",
    "attn.wkv",
    "attn.wo_b",
    "shared_experts.w1",
    "shared_experts.w2",
    "shared_experts.w3",
]
TARGET_PARAMETERS = ["experts.gate_up_proj", "experts.down_proj"]


@dataclass
class ScriptArguments:
    model: str = field(metadata={"help": "The released model's folder (hf download deepseek-ai/DeepSeek-V4.1-Flash)."})
    data: str = field(metadata={"help": 'A JSON-lines file, one {"text": ...} per line.'})
    rank: int = field(default=16, metadata={"help": "LoRA rank r (lora_alpha = 2r)."})
    seq_len: int = field(default=4096, metadata={"help": "Tokens per packed training row."})


class PackedText(Dataset):
    """The texts of a JSON-lines file, tokenized, joined and cut into rows of ``seq_len`` tokens (the tail dropped)."""

    def __init__(self, path: str, tokenizer: Tokenizer, seq_len: int):
        texts = [json.loads(line)["text"] for line in Path(path).read_text().splitlines() if line.strip()]
        ids = [token for encoding in tokenizer.encode_batch(texts) for token in encoding.ids]
        if len(ids) < seq_len:
            raise ValueError(f"{path} holds {len(ids)} tokens, fewer than one row of --seq_len {seq_len}")
        self.rows = torch.tensor(ids[: len(ids) // seq_len * seq_len]).view(-1, seq_len)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.rows[i], "labels": self.rows[i]}


def lora_model(script: ScriptArguments, args: DeepseekV41TrainingArguments):
    """The release with LoRA adapters, its weights still on the meta device; Engram tables kept FP8 (memory-mapped)."""
    config = DeepseekV41Config.from_pretrained(script.model)
    config.text_config.engram_table_dtype = "fp8"
    base = empty_native_model(DeepseekV41ForCausalLM, script.model, config=config, device=args.device)
    lora = LoraConfig(
        r=script.rank, lora_alpha=2 * script.rank, target_modules=TARGET_MODULES, target_parameters=TARGET_PARAMETERS
    )
    return get_peft_model(base, lora, low_cpu_mem_usage=True)  # adapters on the meta device too: none built on the CPU


def main(argv: list[str] | None = None) -> DeepseekV41Trainer:
    parser = HfArgumentParser((ScriptArguments, DeepseekV41TrainingArguments))
    # one row of --seq_len tokens per process and step, as `dsv41 inspect --train lora` plans it (--batch 1)
    parser.set_defaults(
        activation_checkpointing=True, per_device_train_batch_size=1, report_to="none", logging_steps=1
    )
    script, args = parser.parse_args_into_dataclasses(argv)
    tokenizer = Tokenizer.from_file(os.path.join(script.model, "tokenizer.json"))
    model = lora_model(script, args)
    sharded = fsdp_requested(args)
    if not sharded:  # one process (or DDP): every process reads the whole model
        load_sharded_weights(model, script.model, adapter_seed=args.seed)
    data = PackedText(script.data, tokenizer, script.seq_len)
    trainer = DeepseekV41Trainer(model=model, args=args, train_dataset=data)
    if sharded:  # FSDP2 as the accelerate config says, then each process reads its shards
        trainer.shard_model()
        if not isinstance(model, FSDPModule):
            raise RuntimeError(
                f"FSDP was asked for, but the Trainer runs {args.distributed_state.distributed_type}: "
                "the model was not sharded (examples/accelerate/fsdp2_lora.yaml sets fsdp_version: 2)"
            )
        load_sharded_weights(model, script.model, adapter_seed=args.seed)
    resume = args.resume_from_checkpoint
    trainer.train(resume_from_checkpoint=True if resume == "last" else resume)
    trainer.save_model()
    return trainer


if __name__ == "__main__":
    main(sys.argv[1:])
