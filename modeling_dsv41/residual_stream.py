"""The residual stream between two decoder layers: what one layer hands the next, and one pipeline stage the next.

DeepSeek-V4.1 carries more than one [B, S, D] tensor from block to block: the ``hc_mult`` residual copies, the mHC
weights the next layer's attention collapses them with (single-pass mHC: each sub-block's ``pre`` collapses the copies
for the sub-block after it), and the compressed context that compressed layers hand up to the layers above them
(:class:`~.attention.CompressedContext`: compressed K=V, index keys, top-k selection, candidate blocks; any may be
None). :class:`ResidualStream` names these once, for the model's loop over its layers, the pipeline plan and the
transfer between pipeline stages.

A decoder layer takes the stream as separate positional tensors (``layer(*stream.tensors(), ...)``) and hands them
back first in its output: reentrant gradient checkpointing tracks tensor arguments and outputs only, so that is how
gradients reach the layer that made the compressed K=V.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .attention import CompressedContext
from .hyper_connections import identity_pre_mix


@dataclass(frozen=True)
class ResidualStream:
    """hidden_states [B, S, hc, D]: the residual copies. pre_mix [B, S, hc] (fp32): how the next layer's attention
    collapses them. context: what the compressed layers below handed up (compress_kv [B, T, D], index_k [B, T, Di],
    selection [B, S, k], candidates [B, S, n])."""

    hidden_states: torch.Tensor
    pre_mix: torch.Tensor
    context: CompressedContext

    # the stream as separate tensors, in the order a decoder layer takes and hands them (and a stage sends them)
    TENSORS = ("hidden_states", "pre_mix", "compress_kv", "index_k", "selection", "candidates")

    @classmethod
    def from_embeddings(cls, embeds: torch.Tensor, hc_mult: int) -> ResidualStream:
        """The stream entering layer 0: ``hc_mult`` copies of the embeddings [B, S, D], all weight on copy 0, no
        compressed context yet."""
        hidden = embeds.unsqueeze(2).repeat(1, 1, hc_mult, 1)  # [B, S, hc, D]
        return cls.from_tensors(hidden, identity_pre_mix(hidden, hc_mult))

    @classmethod
    def from_tensors(
        cls,
        hidden_states: torch.Tensor,
        pre_mix: torch.Tensor,
        compress_kv: torch.Tensor | None = None,
        index_k: torch.Tensor | None = None,
        selection: torch.Tensor | None = None,
        candidates: torch.Tensor | None = None,
    ) -> ResidualStream:
        """The stream from its :attr:`TENSORS`."""
        return cls(hidden_states, pre_mix, CompressedContext(compress_kv, index_k, selection, candidates))

    def tensors(self) -> tuple[torch.Tensor | None, ...]:
        """The stream's :attr:`TENSORS` (the context's may be None)."""
        context = self.context
        return (
            self.hidden_states,
            self.pre_mix,
            context.compress_kv,
            context.index_k,
            context.selection,
            context.candidates,
        )


__all__ = ["ResidualStream"]
