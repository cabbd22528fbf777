"""The residual stream between two decoder layers: what one layer hands the next, and one pipeline stage the next.

DeepSeek-V4.1 carries more than one [B, S, D] tensor from block to block: the ``hc_mult`` residual copies, the mHC
weights the next layer's attention collapses them with (single-pass mHC: each sub-block's ``pre`` collapses the copies
for the sub-block after it), and the compressed context that compressed layers hand up to the layers above them
(:class:`~.attention.CompressedContext`: compressed K=V, index keys, top-k selection, candidate blocks; any may be
None). :class:`ResidualStream` names these once, for the decoder layer's inputs and outputs, the pipeline plan and the
transfer between pipeline stages.

A decoder layer takes the stream as separate positional tensors (``layer(*stream, ...)``) and returns them first in a
flat tuple: reentrant gradient checkpointing tracks tensor arguments and outputs only, so that is how gradients reach
the layer that made the compressed K=V.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .attention import CompressedContext
from .hyper_connections import identity_pre_mix


class ResidualStream(NamedTuple):
    """hidden_states [B, S, hc, D]: the residual copies. pre_mix [B, S, hc] (fp32): how the next layer's attention
    collapses them. compress_kv [B, T, D], index_k [B, T, Di], selection [B, S, k] and candidates [B, S, n]: the
    :class:`~.attention.CompressedContext` handed up the stack."""

    hidden_states: torch.Tensor
    pre_mix: torch.Tensor
    compress_kv: torch.Tensor | None = None
    index_k: torch.Tensor | None = None
    selection: torch.Tensor | None = None
    candidates: torch.Tensor | None = None

    @classmethod
    def from_embeddings(cls, embeds: torch.Tensor, hc_mult: int) -> ResidualStream:
        """The stream entering layer 0: ``hc_mult`` copies of the embeddings [B, S, D], all weight on copy 0, no
        compressed context yet."""
        hidden = embeds.unsqueeze(2).repeat(1, 1, hc_mult, 1)  # [B, S, hc, D]
        return cls(hidden, identity_pre_mix(hidden, hc_mult))

    @classmethod
    def handed_up(
        cls, hidden_states: torch.Tensor, pre_mix: torch.Tensor, context: CompressedContext
    ) -> ResidualStream:
        """What a layer hands the next: its output copies, its FFN's ``pre`` and the compressed context."""
        return cls(hidden_states, pre_mix, context.compress_kv, context.index_k, context.selection, context.candidates)

    @property
    def context(self) -> CompressedContext:
        """The compressed context the layers below handed up."""
        return CompressedContext(self.compress_kv, self.index_k, self.selection, self.candidates)


__all__ = ["ResidualStream"]
