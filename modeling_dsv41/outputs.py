"""The outputs of the DeepSeek-V4.1 backbone and causal LM, and what the decoder layers' outputs collect for them."""

from dataclasses import dataclass

import torch
from transformers.modeling_outputs import (
    BaseModelOutputWithPooling,
    MultimodalBaseModelOutputWithPast,
    MultimodalCausalLMOutputWithPast,
)

from .decoder_layer import DeepseekV41DecoderLayerOutput
from .generation.cache import DeepseekV41Cache
from .hyper_connections import DeepseekV41HyperConnection


@dataclass
class DeepseekV41ModelOutputWithPast(MultimodalBaseModelOutputWithPast):
    """The backbone's output (``cache`` is a :class:`DeepseekV41Cache`). Beyond transformers' fields:

    hidden_states: ``num_hidden_layers + 1`` tensors [B, S, D]: the embeddings, then each layer's output collapsed
        from its ``hc_mult`` residual copies with the mHC weights the next layer's attention (or the final ``norm``)
        collapses them with, i.e. what that attention takes in (unless that layer's Engram first adds to the
        copies). The copies themselves are the decoder layers' first output (a forward hook on
        :class:`DeepseekV41DecoderLayer` reads them).
    attentions: one tensor [B, H, S, K] per layer, the CSA2 attention map. A query attends over its own K slots
        rather than over all keys: an entry is one head's softmax probability on one slot (an empty slot gets 0;
        a row sums to less than one, the rest going to the attention sink).
    attention_slots: one tensor [B, S, K] per layer saying what each slot of ``attentions`` is: the first
        ``min(S, sliding_window)`` slots (``sliding_window`` when decoding) are key positions of the sliding window,
        oldest first; on compressed layers the rest are the selected compressed rows, ascending (row t pools
        positions t·r … t·r + r - 1 for ``r = compress_ratios[layer]``); -1 is an empty slot.
    router_logits: one tensor [B·S, n_routed_experts] per layer (``output_router_logits=True``): the router's
        logits before its scoring function (the experts are chosen from the scores plus the balancing bias).
    dspark_hidden_states: [B, S, D·n_targets] (``output_dspark_hidden_states=True``): what the DSpark draft head
        reads, the mean over the ``hc_mult`` copies of the stream entering each ``dspark_target_layer_ids`` layer
        (after its Engram), concatenated in layer order (the reference's ``main_hidden``).
    image_outputs: what :meth:`DeepseekV41Model.get_image_features` returned for this call's images.
    """

    attention_slots: tuple[torch.LongTensor, ...] | None = None
    router_logits: tuple[torch.FloatTensor, ...] | None = None
    dspark_hidden_states: torch.Tensor | None = None


@dataclass
class DeepseekV41CausalLMOutputWithPast(MultimodalCausalLMOutputWithPast):
    """``loss``, fp32 ``logits`` and the backbone's outputs (see :class:`DeepseekV41ModelOutputWithPast`)."""

    attention_slots: tuple[torch.LongTensor, ...] | None = None
    router_logits: tuple[torch.FloatTensor, ...] | None = None
    dspark_hidden_states: torch.Tensor | None = None

    @classmethod
    def from_backbone(
        cls, outputs: DeepseekV41ModelOutputWithPast, loss: torch.Tensor | None, logits: torch.Tensor
    ) -> "DeepseekV41CausalLMOutputWithPast":
        """``loss`` and ``logits`` with what the backbone returned beside its last hidden state."""
        return cls(
            loss=loss,
            logits=logits,
            cache=outputs.cache,
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
            image_outputs=outputs.image_outputs,
            attention_slots=outputs.attention_slots,
            router_logits=outputs.router_logits,
            dspark_hidden_states=outputs.dspark_hidden_states,
        )


@dataclass
class CollectedOutputs:
    """What the decoder layers' outputs collect for the caller, each list None unless asked for: the stream after
    each layer collapsed to [B, S, D] (the embeddings first), the attention maps and their slots; and the DSpark taps
    (of the layers that hand one)."""

    hidden_states: list[torch.Tensor] | None
    attentions: list[torch.Tensor] | None
    attention_slots: list[torch.LongTensor] | None
    taps: list[torch.Tensor]

    @classmethod
    def asked(
        cls, embeds: torch.Tensor | None, output_hidden_states: bool, output_attentions: bool
    ) -> "CollectedOutputs":
        """Empty lists for the outputs asked for; the hidden states open with ``embeds`` (the embedding copies
        collapsed onto copy 0)."""
        return cls(
            hidden_states=[embeds] if output_hidden_states else None,
            attentions=[] if output_attentions else None,
            attention_slots=[] if output_attentions else None,
            taps=[],
        )

    def add(self, out: DeepseekV41DecoderLayerOutput) -> None:
        """One layer's output: the stream it handed up, its attention map and slots, its DSpark tap."""
        if out.dspark_tap is not None:
            self.taps.append(out.dspark_tap)
        if self.hidden_states is not None:
            self.hidden_states.append(DeepseekV41HyperConnection.collapse(out.hidden_states, out.pre_mix))
        if self.attentions is not None:
            self.attentions.append(out.attentions)
            self.attention_slots.append(out.attention_slots)

    def outputs(
        self,
        last_hidden_state: torch.Tensor,
        cache: DeepseekV41Cache | None,
        image_outputs: BaseModelOutputWithPooling | None,
    ) -> DeepseekV41ModelOutputWithPast:
        """The backbone's output: ``last_hidden_state`` and ``cache``, with what was collected."""
        return DeepseekV41ModelOutputWithPast(
            last_hidden_state=last_hidden_state,
            cache=cache,
            hidden_states=None if self.hidden_states is None else tuple(self.hidden_states),
            attentions=None if self.attentions is None else tuple(self.attentions),
            attention_slots=None if self.attention_slots is None else tuple(self.attention_slots),
            dspark_hidden_states=torch.cat(self.taps, dim=-1) if self.taps else None,
            image_outputs=image_outputs,
        )


__all__ = ["CollectedOutputs", "DeepseekV41CausalLMOutputWithPast", "DeepseekV41ModelOutputWithPast"]
