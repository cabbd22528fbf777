"""Runs ``examples/finetune.py`` under ``accelerate launch`` as it is, then reports what the processes hold, for the
tests:

  accelerate launch --config_file examples/accelerate/fsdp2.yaml tests/accelerate_cpu.py REPORT <finetune.py arguments>

After training, every process writes ``REPORT/rank<N>.pt``: its router biases, the dtypes in which a few modules'
weights reach their forward (FSDP2's mixed precision casts them just before), its mean training loss and the strategy
accelerate ran.
"""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

import torch

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "finetune.py"


def forward_dtypes(model: torch.nn.Module, batch: dict) -> dict[str, torch.dtype]:
    """The dtype of some weights as their module's forward sees them, in one forward of ``batch``."""
    base = model.module if hasattr(model, "module") else model  # DDP
    layer = base.model.layers[0]
    seen = {}
    probes = {
        "lm_head": (base.lm_head, "weight"),
        "wq_a": (layer.attn.wq_a, "weight"),
        "hc_attn_fn": (layer, "hc_attn_fn"),
        "attn_sink": (layer.attn, "attn_sink"),
    }

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
    torch.set_num_threads(1)
    report = Path(sys.argv[1])
    trainer = runpy.run_path(str(EXAMPLE), run_name="finetune")["main"](sys.argv[2:])
    batch = next(iter(trainer.get_train_dataloader()))
    rank = trainer.accelerator.process_index
    torch.save(
        {
            "biases": {n: b.clone() for n, b in trainer.model.named_buffers() if ".gate.bias" in n},
            "dtypes": forward_dtypes(trainer.model_wrapped, batch),
            "train_loss": trainer.state.log_history[-1]["train_loss"],
            "strategy": trainer.accelerator.distributed_type.value,
        },
        report / f"rank{rank}.pt",
    )
