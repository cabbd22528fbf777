"""Small regions of the forward that keep only their inputs for the backward and run again inside it.

Several steps of DeepSeek-V4.1 compute in fp32 on bf16 activations (mHC's mixes and Sinkhorn, RMSNorm, the clamped
SwiGLU, Engram's gate): autograd keeps their fp32 copies and intermediates, several times the bytes of the bf16
inputs. They are cheap elementwise ops or thin products, so :func:`recomputed` keeps only the inputs and, in the
backward, runs the region again and differentiates it with autograd: the same ops on the same values, so the same
gradients as autograd of the region itself, in the numerics the forward ran in. The forward is the region's own ops,
so its result does not change by a bit.

Under ``torch.compile`` the region is a non-reentrant activation checkpoint instead, which dynamo traces into the
graph (``torch.autograd.grad`` inside a backward it cannot): the compiler then recomputes the region in the backward
it generates, keeping the same inputs.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.autograd.function import once_differentiable
from torch.utils.checkpoint import checkpoint

from .numerics import backward_in_forward_numerics, reference_numerics_active

Outputs = torch.Tensor | tuple[torch.Tensor, ...]


def recomputed(region: Callable[..., Outputs], *inputs: torch.Tensor | None) -> Outputs:
    """``region(*inputs)``, keeping only ``inputs`` (tensors or None; anything else goes into ``region``'s closure)
    for the backward, which runs ``region`` again. Without a gradient to track it is a plain call."""
    if not torch.is_grad_enabled() or not any(t is not None and t.requires_grad for t in inputs):
        return region(*inputs)
    if torch.compiler.is_compiling():
        return checkpoint(region, *inputs, use_reentrant=False)
    return _Recomputed.apply(region, *inputs)


class _Recomputed(torch.autograd.Function):
    @staticmethod
    def forward(ctx, region, *inputs):
        ctx.region, ctx.reference_numerics = region, reference_numerics_active()
        ctx.save_for_backward(*inputs)
        return region(*inputs)

    @staticmethod
    @once_differentiable
    @backward_in_forward_numerics
    def backward(ctx, *grads):
        wanted = ctx.needs_input_grad[1:]
        inputs = [None if t is None else t.detach().requires_grad_(need) for t, need in zip(ctx.saved_tensors, wanted)]
        with torch.enable_grad():
            outputs = ctx.region(*inputs)
        outputs = (outputs,) if isinstance(outputs, torch.Tensor) else outputs
        pairs = [(out, grad) for out, grad in zip(outputs, grads) if grad is not None and out.requires_grad]
        targets = [t for t, need in zip(inputs, wanted) if need]
        found = iter(
            torch.autograd.grad([out for out, _ in pairs], targets, [grad for _, grad in pairs], allow_unused=True)
            if pairs and targets
            else [None] * len(targets)
        )
        return None, *(next(found) if need else None for need in wanted)


__all__ = ["recomputed"]
