"""The strategy ``accelerate launch`` was asked for is the one the Trainer runs, on CPU processes too.

``accelerate launch --config_file ...`` passes the config's strategy to every process through its environment
(``ACCELERATE_USE_FSDP``, ``ACCELERATE_USE_DEEPSPEED``), and ``Accelerator`` decides from it and the device. Some of
its decisions drop the strategy without a word:

- FSDP is enabled only on accelerator backends (``AcceleratorState`` turns the plugin into
  ``DistributedType.FSDP`` for multi-GPU-like backends, never for ``MULTI_CPU``): on CPU processes the run would be
  plain DDP. FSDP2 runs on CPU with gloo, so :func:`honour_launch_strategy` makes the decision accelerate makes for
  GPUs; FSDP1 (which accelerate wraps with device ids) is refused there instead.
- FSDP on a single process, and DeepSpeed on CPU, are dropped: clear errors here.
"""

from __future__ import annotations

import os

import torch
from accelerate.state import PartialState
from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

_TRUE = ("1", "true", "yes")


def _asked(variable: str) -> bool:
    return os.environ.get(variable, "false").lower() in _TRUE


def use_cpu_without_accelerator(use_cpu: bool) -> bool:
    """``use_cpu`` as ``TrainingArguments`` needs it: ``True`` on a machine without an accelerator.

    Without it, processes started by ``accelerate launch`` / ``torchrun`` on a CPU-only machine each open a process
    group but run as one process (``parallel_mode != DISTRIBUTED``): every one of them saves as the main process
    and they overwrite each other's checkpoints; bf16 training refuses to start.
    """
    return use_cpu or not torch.accelerator.is_available()


def fsdp_requested(args) -> bool:
    """Whether the Trainer built with ``args`` will run FSDP (``accelerate launch`` with an FSDP config, or
    ``TrainingArguments(fsdp=...)``), known before the Trainer exists: a script that builds its model on the meta
    device shards it and reads each process's shards only then. ``args.distributed_state`` cannot tell: on CPU
    processes it says ``MULTI_CPU`` until :func:`honour_launch_strategy` runs."""
    return _asked("ACCELERATE_USE_FSDP") or bool(args.fsdp_plugin_args)


def honour_launch_strategy(trainer) -> None:
    """After ``Trainer.create_accelerator_and_postprocess``: run FSDP2 on CPU processes as accelerate runs it on
    GPUs, and refuse a strategy accelerate dropped."""
    state = trainer.accelerator.state
    if (_asked("ACCELERATE_USE_DEEPSPEED") or trainer.args.deepspeed) and not trainer.is_deepspeed_enabled:
        raise ValueError(
            f"DeepSpeed was configured, but accelerate runs this as {state.distributed_type.value} on "
            f"{state.device.type} (it runs DeepSpeed on accelerators only); DeepseekV41Trainer trains with FSDP2 or "
            "DDP (examples/accelerate/fsdp2.yaml, ddp.yaml)"
        )
    if not fsdp_requested(trainer.args) or trainer.is_fsdp_enabled:
        return
    if state.distributed_type != DistributedType.MULTI_CPU:
        raise ValueError(
            f"FSDP was configured, but accelerate runs this as {state.distributed_type.value} with "
            f"{state.num_processes} process(es): FSDP needs several processes (num_processes in the accelerate "
            "config, or torchrun --nproc_per_node)"
        )
    plugin = FullyShardedDataParallelPlugin(**(trainer.args.fsdp_plugin_args or {}))  # the one accelerate dropped
    if plugin.fsdp_version != 2:
        raise ValueError(
            "FSDP1 runs on accelerators only; on CPU processes set fsdp_version: 2 (examples/accelerate/fsdp2.yaml)"
        )
    if state.mixed_precision != "no":
        plugin.set_mixed_precision(state.mixed_precision)
    state.distributed_type = DistributedType.FSDP  # AcceleratorState's own decision for GPUs (accelerate/state.py)
    state.fsdp_plugin = plugin
    PartialState._shared_state["distributed_type"] = DistributedType.FSDP  # as AcceleratorState.__init__ ends
    trainer.is_fsdp_enabled = True
    if trainer.args.save_only_model and "SHARDED_STATE_DICT" in str(plugin.state_dict_type):
        raise ValueError("save_only_model option is not compatible with FSDP state dict type 'SHARDED_STATE_DICT'")
