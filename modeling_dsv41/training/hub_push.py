"""Pushes to the Hub during training that load with ``trust_remote_code=True``.

``Trainer(push_to_hub=True)`` uploads ``output_dir`` after each checkpoint, having copied into it only the checkpoint's
weights and ``config.json``, and saved the processor there. Our ``config.json`` names the model's flat remote code in
``auto_map`` (:mod:`configuration.remote_code`), which that copy leaves behind: the pushed repo would name files it
does not hold. :class:`RemoteCodeCallback` writes them into ``output_dir`` when a push begins.
:class:`~.trainer.DeepseekV41Trainer` adds it with ``push_to_hub=True``; another ``Trainer`` (TRL's) takes it in
``callbacks=[...]``. The final ``trainer.push_to_hub()`` saves the model itself, code included.
"""

from __future__ import annotations

from torch import nn
from transformers import TrainerCallback

from configuration.remote_code import is_project_class, model_auto_map, save_remote_code


class RemoteCodeCallback(TrainerCallback):
    """Before each push from a checkpoint, the model's flat remote code goes into ``output_dir`` (an adapter's push,
    whose repo loads on its base model, needs none)."""

    def on_push_begin(self, args, state, control, model: nn.Module | None = None, **kwargs):
        if model is not None and is_project_class(type(model)):
            save_remote_code(args.output_dir, {("config.json", None): model_auto_map(model)})


__all__ = ["RemoteCodeCallback"]
