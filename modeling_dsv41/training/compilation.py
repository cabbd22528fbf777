"""Per-block ``torch.compile``: each decoder layer and each DSpark draft block compiled whole (``fullgraph=True``), as
torchtitan and accelerate's regional compilation compile transformer blocks, with the model around them eager.

A block compiles as one graph, forward and backward: the regions :mod:`~modeling_dsv41.recompute` recomputes become
activation checkpoints the compiler traces, the routed experts run as grouped products over fixed shapes
(:func:`~modeling_dsv41.moe.grouped_experts_forward`), and the sparse attention's and mHC's custom backwards are
traced as they are. Gradient checkpointing of the layers stays on: the checkpoint is traced inside the block's graph.
Reference numerics stay eager (:func:`compile_blocks` refuses them).
"""

from __future__ import annotations

import torch
from torch import nn

from ..dspark import DeepseekV41DSparkBlock
from ..modeling_dsv41 import DeepseekV41DecoderLayer


def compiled_blocks(model: nn.Module) -> list[nn.Module]:
    """The blocks :func:`compile_blocks` compiles: every decoder layer and DSpark draft block of ``model``."""
    return [m for m in model.modules() if isinstance(m, DeepseekV41DecoderLayer | DeepseekV41DSparkBlock)]


def compile_blocks(
    model: nn.Module, backend: str | None = "inductor", mode: str | None = None, dynamic: bool | None = None
) -> nn.Module:
    """Compile every decoder layer and DSpark block of ``model`` in place (``module.compile``, so hooks installed
    later, FSDP2's included, stay on the call path), each as one graph (``fullgraph=True``: a graph break is an
    error). Returns ``model``.

    Blocks of the same class and shapes share their compiled code; a new sequence length compiles once more with
    dynamic shapes (``dynamic=None``, torch's automatic dynamic shapes), then no more. Layers of different kinds
    (compression ratio, Engram, the KV / index sources) compile their own graphs from the same code, in training
    and under ``no_grad`` each: dynamo's recompile limit (8 graphs a code object) is raised to 4 per block, the most
    they can need (two grad modes, static and dynamic shapes), so that it cannot stop a model that trains and
    evaluates (with ``fullgraph=True`` hitting it is an error). Under gradient checkpointing
    the routers' record of their last choices (``last_expert_indices``, which the bias-balancing rule reads after the
    forward) is a Python side effect inside the checkpoint: as accelerate's and torchtitan's per-block compilation
    do, this sets dynamo's ``skip_fwd_side_effects_in_bwd_under_checkpoint``, so that the recomputation in the
    backward does not write it again (eager writes the same values again).
    """
    config = getattr(model, "config", None)
    if getattr(config, "reference_numerics", False):
        raise ValueError(
            "config.reference_numerics runs the model eagerly, in fp64-widened ops, to reproduce DeepSeek's "
            "reference bit for bit; a compiled graph would fuse and reorder them: turn reference_numerics off to "
            "compile"
        )
    blocks = compiled_blocks(model)
    if not blocks:
        raise ValueError(f"{type(model).__name__} has no DeepSeek-V4.1 decoder layer or DSpark block to compile")
    torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint = True
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 4 * len(blocks))
    for block in blocks:
        block.compile(backend=backend, mode=mode, dynamic=dynamic, fullgraph=True)
    return model


__all__ = ["compile_blocks", "compiled_blocks"]
