"""The decoder layer of DeepSeek-V4.1: [Engram] → attention → MoE on the ``hc_mult`` residual copies, both sub-layers
under mHC (:class:`~.hyper_connections.DeepseekV41HyperConnectedBlock`).

A layer is called as ``layer(*stream.tensors(), engram_rows, inputs=inputs)``: the residual stream
(:class:`~.residual_stream.ResidualStream`) and its Engram table rows as positional tensors, which reentrant gradient
checkpointing carries gradients through (to the layer that made the compressed K=V, to the Engram table), and
:class:`DeepseekV41LayerInputs`, what every layer of one forward reads and nothing differentiates. It returns a
:class:`DeepseekV41DecoderLayerOutput`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
from transformers.modeling_layers import GradientCheckpointingLayer

from .attention import CompressedContext, DeepseekV41Attention
from .engram import DeepseekV41Engram
from .generation.cache import DeepseekV41Cache
from .layer_cache import CacheStep
from .hyper_connections import DeepseekV41HyperConnectedBlock
from .moe import DeepseekV41MoE
from .norms import DeepseekV41RMSNorm
from .residual_stream import ResidualStream


@dataclass(frozen=True)
class DeepseekV41LayerInputs:
    """What every decoder layer of one forward reads beside the stream, none of it on a gradient path.

    rotations: the rotary tables of the tokens' positions, ``{compressed layer: table}``. image_mask [B, S] bool: the
    image positions (the routers take ``bias_vl`` there); engram_mask [B, S] bool: where Engram adds (its negation);
    engram_hash_ids [B, S, n_layers, n_cols]: the n-gram hashes, for an Engram layer whose rows were not gathered
    beforehand. cache / step: the decode state and this call's rows of it (see
    :class:`~.generation.cache.DeepseekV41Cache`). output_attentions: return each layer's attention map;
    dspark_targets: the layers whose stream after Engram the DSpark head reads.
    """

    rotations: dict[bool, torch.Tensor]
    image_mask: torch.Tensor | None = None
    engram_mask: torch.Tensor | None = None
    engram_hash_ids: torch.Tensor | None = None
    cache: DeepseekV41Cache | None = None
    step: CacheStep | None = None
    output_attentions: bool = False
    dspark_targets: tuple[int, ...] = ()


class DeepseekV41DecoderLayerOutput(NamedTuple):
    """A decoder layer's output: the stream it hands up (its :attr:`~.residual_stream.ResidualStream.TENSORS`, the
    FFN's ``pre`` as ``pre_mix``); with ``output_attentions`` its attention map [B, H, S, K] and slot index
    [B, S, K]; for a DSpark target layer the tap, the mean over the copies of the stream after Engram [B, S, D]."""

    hidden_states: torch.Tensor
    pre_mix: torch.Tensor
    compress_kv: torch.Tensor | None
    index_k: torch.Tensor | None
    selection: torch.Tensor | None
    candidates: torch.Tensor | None
    attentions: torch.Tensor | None
    attention_slots: torch.LongTensor | None
    dspark_tap: torch.Tensor | None

    @property
    def stream(self) -> ResidualStream:
        return ResidualStream.from_tensors(*self[: len(ResidualStream.TENSORS)])


class DeepseekV41DecoderLayer(GradientCheckpointingLayer, DeepseekV41HyperConnectedBlock):
    """One block: [Engram] → attention → MoE, the two sub-layers under mHC.

    Each sub-layer computes its mHC coefficients from its own input; its ``pre`` collapses the copies for the *next*
    sub-layer (single-pass mHC), so a layer takes the previous FFN's ``pre`` and hands on its own.
    """

    def __init__(self, config, layer_id: int, use_vision_bias: bool):
        super().__init__(config)
        self.layer_id = layer_id
        self.spec = config.layer_plan[layer_id]  # read on the forward path: a constant there, not a config lookup
        dim = config.hidden_size
        self.engram = DeepseekV41Engram(config, layer_id) if self.spec.has_engram else None
        self.attn = DeepseekV41Attention(config, layer_id)
        self.ffn = DeepseekV41MoE(config, use_vision_bias)
        self.attn_norm = DeepseekV41RMSNorm(dim, config.rms_norm_eps)
        self.ffn_norm = DeepseekV41RMSNorm(dim, config.rms_norm_eps)

    def forward(
        self,
        hidden_states: torch.Tensor,
        pre_mix: torch.Tensor,
        compress_kv: torch.Tensor | None,
        index_k: torch.Tensor | None,
        selection: torch.Tensor | None,
        candidates: torch.Tensor | None,
        engram_rows: torch.Tensor | None = None,
        *,
        inputs: DeepseekV41LayerInputs,
    ) -> DeepseekV41DecoderLayerOutput:
        """The stream the layer below handed up, tensor by tensor (hidden_states [B,S,hc,D], pre_mix [B,S,hc], the
        compressed context) → the stream this layer hands up, and what ``inputs`` asks for beside it.

        An Engram layer takes its table rows already gathered (``engram_rows``, see
        :meth:`~.modeling_dsv41.DeepseekV41Model.gather_engram_rows`) or gathers them from
        ``inputs.engram_hash_ids``. With ``inputs.cache``, attention reads and extends this layer's decode state.
        """
        x = hidden_states
        if self.engram is not None:
            hash_ids = None if inputs.engram_hash_ids is None else inputs.engram_hash_ids[:, :, self.engram.hash_index]
            x = self.engram(x, hash_ids, inputs.engram_mask, rows=engram_rows)
        tap = x.mean(dim=2) if self.layer_id in inputs.dspark_targets else None
        context = CompressedContext(compress_kv, index_k, selection, candidates)
        x, ffn_pre, (probs, slots) = self.hyper_connected(
            x,
            pre_mix,
            lambda h: self._attention(h, context, inputs),
            lambda h: self.ffn(h, inputs.image_mask),
        )
        handed_up = ResidualStream(x, ffn_pre, context).tensors()
        return DeepseekV41DecoderLayerOutput(*handed_up, probs, slots, tap)

    def _attention(
        self, h: torch.Tensor, context: CompressedContext, inputs: DeepseekV41LayerInputs
    ) -> tuple[torch.Tensor, tuple[torch.Tensor | None, torch.LongTensor | None]]:
        """Attention on its normed input h [B,S,D], reading and extending ``context`` → (its output [B,S,D], its
        attention map and slot index, or two None without ``inputs.output_attentions``)."""
        out = self.attn(
            h,
            inputs.rotations[self.spec.is_compressed],
            context,
            layer_cache=None if inputs.cache is None else inputs.cache.layers[self.layer_id],
            step=inputs.step,
            output_attentions=inputs.output_attentions,
        )
        return out if inputs.output_attentions else (out, (None, None))


__all__ = ["DeepseekV41DecoderLayer", "DeepseekV41DecoderLayerOutput", "DeepseekV41LayerInputs"]
