"""Runs ``examples/finetune.py`` under ``accelerate launch`` on CPU processes (gloo), for the tests.

accelerate enables its FSDP plugin only on accelerator devices (``AcceleratorState`` turns ``ACCELERATE_USE_FSDP``
into ``DistributedType.FSDP`` for multi-GPU-like backends, never for ``MULTI_CPU``), while FSDP2 itself runs on
CPU with gloo. This launcher script makes that one decision for CPU as accelerate makes it for GPUs, then runs the
example unchanged, with ``--use_cpu`` added:

    accelerate launch --config_file examples/accelerate/fsdp2.yaml tests/accelerate_cpu.py REPORT <finetune.py arguments>

After training, every process writes ``REPORT/rank<N>.pt``: its router biases, and the dtypes in which a few
modules' weights reach their forward (FSDP2's mixed precision casts them just before).
"""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

import torch
from accelerate.state import AcceleratorState
from accelerate.utils import DistributedType

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "finetune.py"
_init = AcceleratorState.__init__


def _init_with_fsdp_on_cpu(self, *args, fsdp_plugin=None, **kwargs):
    _init(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
    if fsdp_plugin is not None and self.distributed_type == DistributedType.MULTI_CPU:
        self.distributed_type = DistributedType.FSDP  # what accelerate does for MULTI_GPU (accelerate/state.py)
        if self._mixed_precision != "no":
            fsdp_plugin.set_mixed_precision(self._mixed_precision)
        self.fsdp_plugin = fsdp_plugin


def forward_dtypes(model: torch.nn.Module, batch: dict) -> dict[str, torch.dtype]:
    """The dtype of some weights as their module's forward sees them, in one forward of ``batch``."""
    base = model.module if hasattr(model, "module") else model  # DDP
    layer = base.model.layers[0]
    seen = {}
    probes = {"lm_head": (base.lm_head, "weight"), "wq_a": (layer.attn.wq_a, "weight"),
              "hc_attn_fn": (layer, "hc_attn_fn"), "attn_sink": (layer.attn, "attn_sink")}

    def probe(key: str, name: str):
        def hook(module, args) -> None:
            seen.setdefault(key, getattr(module, name).dtype)

        return hook

    hooks = [module.register_forward_pre_hook(probe(key, name)) for key, (module, name) in probes.items()]
    with torch.no_grad():
        model(**batch)
    for hook in hooks:
        hook.remove()
    return seen


if __name__ == "__main__":
    AcceleratorState.__init__ = _init_with_fsdp_on_cpu
    torch.set_num_threads(1)
    report = Path(sys.argv[1])
    trainer = runpy.run_path(str(EXAMPLE), run_name="finetune")["main"]([*sys.argv[2:], "--use_cpu"])
    batch = next(iter(trainer.get_train_dataloader()))
    rank = trainer.accelerator.process_index
    torch.save(
        {
            "biases": {n: b.clone() for n, b in trainer.model.named_buffers() if ".gate.bias" in n},
            "dtypes": forward_dtypes(trainer.model_wrapped, batch),
            "losses": [entry["loss"] for entry in trainer.state.log_history if "loss" in entry],
        },
        report / f"rank{rank}.pt",
    )
