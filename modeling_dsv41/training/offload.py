"""Activation offloading: the inputs that gradient checkpointing keeps for each decoder layer live in host memory
between the forward and the layer's backward.

With every layer checkpointed, a layer keeps only its inputs for the backward (its mHC stream, the compressed context
handed up the stack, the rotations, its Engram rows) and runs its forward again there. Those inputs add up over the
layers: 6.4 GiB per device for the released model at 4096 tokens. :func:`offload_checkpointed_inputs` moves them to
host memory as the forward saves them and back to the device when the layer's backward needs them, as
``torch.autograd.graph.save_on_cpu`` does, with two differences: a tensor that several layers take (the rotations,
the compressed context, the top-k selection) is copied to the host once per forward, not once per layer, and a
tensor already in host memory (a CPU run) stays where it is. The host copies are pinned where an accelerator is
present, so the copies run asynchronously.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary


class HostOffload(torch.autograd.graph.saved_tensors_hooks):
    """Saved-tensor hooks that keep accelerator tensors in (pinned) host memory until the backward unpacks them; one
    host copy per tensor (and version), however many times it is saved while it lives."""

    def __init__(self) -> None:
        self._copies: WeakIdKeyDictionary = WeakIdKeyDictionary()  # device tensor → (its version, host copy)
        super().__init__(self._pack, self._unpack)

    @staticmethod
    def in_host_memory(tensor: torch.Tensor) -> bool:
        return tensor.device.type == "cpu"

    def _pack(self, tensor: torch.Tensor) -> tuple[torch.device, torch.Tensor]:
        if self.in_host_memory(tensor):
            return tensor.device, tensor
        cached = self._copies.get(tensor)
        if cached is not None and cached[0] == tensor._version:
            return tensor.device, cached[1]
        pinned = torch.accelerator.is_available()
        host = torch.empty(tensor.size(), dtype=tensor.dtype, layout=tensor.layout, pin_memory=pinned)
        host.copy_(tensor, non_blocking=pinned)
        self._copies[tensor] = (tensor._version, host)
        return tensor.device, host

    @staticmethod
    def _unpack(packed: tuple[torch.device, torch.Tensor]) -> torch.Tensor:
        device, tensor = packed
        return tensor.to(device, non_blocking=tensor.is_pinned())


def offload_checkpointed_inputs(model: nn.Module) -> nn.Module:
    """Keep the inputs of every checkpointed decoder layer of ``model`` (a DeepSeek-V4.1 model, or a PEFT or FSDP2
    wrapper around one, with gradient checkpointing enabled) in host memory (see the module docstring); returns
    ``model``. Idempotent. Gradients are unchanged: the same values come back."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    layers = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer) and m.gradient_checkpointing]
    if not layers:
        raise ValueError(
            "offloading activations keeps the checkpointed layers' inputs in host memory, and no layer is "
            "checkpointed: enable gradient checkpointing first (model.activation_checkpointing_enable(), or "
            "activation_checkpointing=True in the training arguments)"
        )
    hooks = HostOffload()  # one cache for the whole model: a tensor shared by the layers is copied once
    for layer in layers:
        if not getattr(layer._gradient_checkpointing_func, "offloads_to_host", False):
            layer._gradient_checkpointing_func = _offloading(layer._gradient_checkpointing_func, hooks)
    return model


def _offloading(checkpoint: Callable, hooks: HostOffload) -> Callable:
    @functools.wraps(checkpoint)
    def offloaded(*args, **kwargs):
        with hooks:
            return checkpoint(*args, **kwargs)

    offloaded.offloads_to_host = True
    return offloaded


__all__ = ["HostOffload", "offload_checkpointed_inputs"]
