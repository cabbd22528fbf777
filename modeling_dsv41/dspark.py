"""The DSpark draft head of DeepSeek-V4.1 (the release's ``mtp.*``): ``num_nextn_predict_layers`` extra mHC blocks
that draft ``dspark_block_size`` tokens in one pass, for speculative decoding.

What the head reads from the backbone is ``main_hidden`` [B, S, D·n_targets]: for each layer of
``dspark_target_layer_ids`` (in layer order), the mean over the ``hc_mult`` copies of the stream entering it (after
its Engram). Stage 0 projects it once, ``main_x = main_norm(main_proj(main_hidden))``, and every block turns each main
position's ``main_x`` into a window K=V (its own ``wkv`` → ``kv_norm`` → rope → FP8 QDQ), kept in a ring of
``sliding_window`` slots per block (:class:`~.generation.cache.DeepseekV41DSparkCache`; slot ``p % W`` holds
position ``p``).

A draft from main position ``t`` embeds ``[token for t+1, noise × (nb-1)]`` with the backbone's ``embed``, runs the
blocks at rope positions ``t+1 … t+nb`` (each block token attends to the ring and to every block token: no causal
mask inside the block), and the last block's ``norm`` and the backbone's LM head give logits; then, column by
column, the Markov bias of the previous token is added (``markov_head``) and the next token chosen. The confidence
head scores each column from the un-normed last stream and the previous token's Markov embedding.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers.utils import ModelOutput

from .attention import DeepseekV41Attention
from .generation.cache import DeepseekV41DSparkCache
from .hyper_connections import DeepseekV41HyperConnectedBlock, identity_pre_mix
from .linear import DeepseekV41Fp32Linear
from .moe import DeepseekV41MoE
from .norms import DeepseekV41RMSNorm
from .numerics import under_configured_numerics
from .rotary import DeepseekV41RotaryEmbedding, apply_rotary


def dspark_block_slots(ring_filled: torch.Tensor, window: int, block_size: int) -> torch.Tensor:
    """[B, nb, W + nb] slots of the concatenated [ring; block] K=V each block query attends to, in the reference's
    order: the ``ring_filled[b]`` written ring slots (slot order), then the block's tokens, then -1 (none)."""
    column = torch.arange(window + block_size, device=ring_filled.device)
    filled = ring_filled.unsqueeze(1)  # [B, 1]
    slots = torch.where(column < filled, column, window + column - filled)
    slots = slots.masked_fill(column >= filled + block_size, -1)
    return slots.unsqueeze(1).expand(-1, block_size, -1)


@dataclass
class DeepseekV41DSparkLossOutput(ModelOutput):
    """:meth:`DeepseekV41DSpark.loss` (``DeepseekV41ForCausalLM.dspark_loss``): ``loss`` = ``draft_loss`` +
    ``confidence_loss``, and the share of drafted tokens (teacher-forced) equal to the backbone's, ``accuracy``."""

    loss: torch.FloatTensor | None = None
    draft_loss: torch.FloatTensor | None = None
    confidence_loss: torch.FloatTensor | None = None
    accuracy: torch.FloatTensor | None = None


class DeepseekV41DSparkAttention(DeepseekV41Attention):
    """Window-only attention of a draft block: its queries attend over the ring of main positions' K=V and the
    whole block (bidirectional), with the sink. Same modules (and names) as a window-only backbone layer."""

    def main_kv(self, main_x: torch.Tensor, rotation: torch.Tensor) -> torch.Tensor:
        """The ring entries [B, S, D] of main positions from their ``main_x`` [B, S, D] (rotation [B, S, R])."""
        return self._window_kv(main_x, rotation)

    def forward(
        self, x: torch.Tensor, rotation: torch.Tensor, context: torch.Tensor, slots: torch.Tensor
    ) -> torch.Tensor:
        """Block tokens x [B, N, D] at rope rotation [B, N, R] → [B, N, D]. ``slots`` [B, N, K] index the rows of
        ``[context [B, C, D]; the block tokens' K=V]`` each query attends to (-1 none): a ring when decoding, every
        main position in training."""
        qr = self.q_norm(self.wq_a(x))
        q = apply_rotary(self.wq_b(qr).unflatten(-1, (self.n_heads, self.head_dim)), rotation)
        kv = torch.cat([context, self._window_kv(x, rotation)], dim=1)
        return self._attend(q, kv, slots, rotation)


class DeepseekV41DSparkMarkovHead(nn.Module):
    """``embed`` [V, rank] (the previous token) → ``head`` (fp32) → a logit bias [.., V] for the next token."""

    def __init__(self, vocab_size: int, rank: int):
        super().__init__()
        self.embed = nn.Embedding(vocab_size, rank)
        self.head = DeepseekV41Fp32Linear(rank, vocab_size, bias=False, dtype=torch.float32)

    def forward(self, token_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """token_ids [...] → (fp32 logit bias [..., V], Markov embedding [..., rank])."""
        embed = self.embed(token_ids)
        return self.head(embed), embed


class DeepseekV41DSparkConfidenceHead(nn.Module):
    """``proj`` (fp32): a raw logit per drafted column from [un-normed hidden; previous token's Markov embedding]."""

    def __init__(self, input_dim: int):
        super().__init__()
        self.proj = DeepseekV41Fp32Linear(input_dim, 1, bias=False, dtype=torch.float32)

    def forward(self, hidden: torch.Tensor, markov_embed: torch.Tensor) -> torch.Tensor:
        return self.proj(torch.cat([hidden, markov_embed], dim=-1)).squeeze(-1)


class DeepseekV41DSparkBlock(DeepseekV41HyperConnectedBlock):
    """One draft block ``mtp.{k}``: attention and MoE (its own expert counts) under mHC, as a backbone layer without
    Engram or compression. Stage 0 also holds ``main_proj`` / ``main_norm``; the last stage ``norm``, ``markov_head``
    and ``confidence_head``."""

    def __init__(self, config, stage: int):
        super().__init__(config)
        self.stage = stage
        dim = config.hidden_size
        self.attn = DeepseekV41DSparkAttention(config, config.num_hidden_layers + stage)
        self.ffn = DeepseekV41MoE(
            config,
            use_vision_bias=False,
            num_experts=config.dspark_num_routed_experts,
            top_k=config.dspark_top_k,
        )
        self.attn_norm = DeepseekV41RMSNorm(dim, config.rms_norm_eps)
        self.ffn_norm = DeepseekV41RMSNorm(dim, config.rms_norm_eps)
        if stage == 0:
            self.main_proj = nn.Linear(dim * len(config.dspark_target_layer_ids), dim, bias=False)
            self.main_norm = DeepseekV41RMSNorm(dim, config.rms_norm_eps)
        if stage == config.num_nextn_predict_layers - 1:
            self.norm = DeepseekV41RMSNorm(dim, config.rms_norm_eps)
            self.markov_head = DeepseekV41DSparkMarkovHead(config.vocab_size, config.dspark_markov_rank)
            self.confidence_head = DeepseekV41DSparkConfidenceHead(dim + config.dspark_markov_rank)

    def forward(
        self,
        x: torch.Tensor,
        pre_mix: torch.Tensor,
        rotation: torch.Tensor,
        context: torch.Tensor,
        slots: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x [B, N, hc, D], pre_mix [B, N, hc] → (x, this FFN's pre for the next block); see the attention for
        ``context`` and ``slots``."""
        x, ffn_pre, _ = self.hyper_connected(
            x, pre_mix, lambda h: (self.attn(h, rotation, context, slots), None), self.ffn
        )
        return x, ffn_pre


def greedy_choice(logits: torch.Tensor, column: int) -> torch.Tensor:
    """The default token choice of a draft column: argmax of its logits [B, V]."""
    return logits.argmax(dim=-1)


def block_plan(backbone_plan: dict[str, str] | None) -> dict[str, str]:
    """The backbone layers' rules of a TP / EP plan (``layers.*.X``) as the draft blocks' (``*.X``, under ``mtp``):
    a draft block's experts and Linears are split as a backbone layer's."""
    return {
        key.removeprefix("layers."): style for key, style in (backbone_plan or {}).items() if key.startswith("layers.")
    }


class DeepseekV41DSpark(nn.ModuleList):
    """The draft head: the blocks ``mtp.0 … mtp.{n-1}`` (a ``ModuleList``, so the names are the release's). The
    backbone's ``embed`` and LM head are shared, passed in by the caller rather than registered twice. ``config`` is
    the model's (its ``reference_numerics`` applies here as in the backbone). Under tensor and expert parallelism the
    blocks follow the backbone layers' plans (transformers reads a child's ``_tp_plan`` / ``_ep_plan``)."""

    def __init__(self, config):
        text = config.get_text_config()
        super().__init__(DeepseekV41DSparkBlock(text, k) for k in range(text.num_nextn_predict_layers))
        self._tp_plan = block_plan(config.base_model_tp_plan)
        self._ep_plan = block_plan(config.base_model_ep_plan)
        self.config = config
        self.block_size = text.dspark_block_size
        self.noise_token_id = text.dspark_noise_token_id
        self.hc_mult = text.hc_mult
        self.rope_dim, self.rope_theta = text.qk_rope_head_dim, text.rope_theta

    def _rotation(self, positions: torch.Tensor) -> torch.Tensor:
        # the window-only layers' rope: rope_theta, no YaRN
        return DeepseekV41RotaryEmbedding(self.rope_dim, self.rope_theta)(positions)

    def main_x(self, main_hidden: torch.Tensor) -> torch.Tensor:
        """``main_norm(main_proj(main_hidden))`` [B, S, D] from the taps [B, S, D·n_targets]."""
        return self[0].main_norm(self[0].main_proj(main_hidden))

    def _block_ids(self, first_ids: torch.Tensor) -> torch.Tensor:
        """[B, A] first tokens → [B, A·nb] block ids: each first token, then ``nb - 1`` noise tokens."""
        ids = first_ids.new_full((*first_ids.shape, self.block_size), self.noise_token_id)
        ids[..., 0] = first_ids
        return ids.flatten(1)

    def _run_blocks(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        contexts: list[torch.Tensor],
        slots: torch.Tensor,
        embed: nn.Module,
    ) -> torch.Tensor:
        """The blocks over block tokens ids [B, N] at rope positions [B, N] (``contexts``: each block's K=V rows the
        ``slots`` index first) → the last stream collapsed, un-normed [B, N, D]."""
        x = embed(ids).unsqueeze(2).repeat(1, 1, self.hc_mult, 1)  # [B, N, hc, D]
        pre_mix = identity_pre_mix(x, self.hc_mult)
        rotation = self._rotation(positions)
        for block, context in zip(self, contexts):
            x, pre_mix = block(x, pre_mix, rotation, context, slots)
        return self[-1].hc.collapse(x, pre_mix)

    @under_configured_numerics
    def teacher_forced(
        self,
        main_hidden: torch.Tensor,
        predictions: torch.Tensor,
        valid: torch.Tensor,
        embed: nn.Module,
        head: nn.Module,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Drafts from every main position of whole sequences at once, for training.

        main_hidden [B, S, ·] the taps, ``predictions`` [B, S] the backbone's next token at each position, ``valid``
        [B, S] the real positions (one run per row). The draft from position c starts with ``predictions[:, c]``,
        attends to the ``sliding_window`` main positions ending at c (the ring it would have when decoding), and
        column i gets the Markov bias of ``predictions[:, c + i]`` (the previous column's target): teacher forcing
        on the backbone's own tokens. Returns logits [B, S, nb, V] (fp32), confidence [B, S, nb] and the targets
        [B, S, nb] (``predictions[:, c + i + 1]``, -100 past the sequence).
        """
        bsz, seq_len = predictions.shape
        nb, window, device = self.block_size, self[0].attn.window, predictions.device
        positions = valid.long().cumsum(dim=1) - 1
        main_x = self.main_x(main_hidden)
        main_rotation = self._rotation(positions.clamp_min(0))
        contexts = [block.attn.main_kv(main_x, main_rotation) for block in self]
        column = torch.arange(seq_len, device=device)
        # query (c, i): main columns c-W+1 … c (real ones), then the block's nb rows after the S context rows
        context_cols = column.view(-1, 1) - window + 1 + torch.arange(window, device=device)  # [S, W]
        real = (context_cols >= 0) & valid.gather(1, context_cols.clamp_min(0).flatten().expand(bsz, -1)).view(
            bsz, seq_len, window
        )
        block_rows = seq_len + column.view(-1, 1) * nb + torch.arange(nb, device=device)  # [S, nb]
        slots = torch.cat([torch.where(real, context_cols, -1), block_rows.expand(bsz, -1, -1)], dim=-1)
        slots = slots.unsqueeze(2).expand(-1, -1, nb, -1).flatten(1, 2)  # [B, S·nb, W + nb]
        block_positions = (positions.unsqueeze(-1) + 1 + torch.arange(nb, device=device)).flatten(1)
        hidden = self._run_blocks(self._block_ids(predictions), block_positions, contexts, slots, embed)
        hidden = hidden.view(bsz, seq_len, nb, -1)
        last = self[-1]
        offsets = column.view(-1, 1) + torch.arange(nb + 1, device=device)  # [S, nb+1]: c … c + nb
        inside = offsets < seq_len
        shifted = predictions[:, offsets.clamp_max(seq_len - 1)]  # [B, S, nb+1]
        shifted_valid = valid[:, offsets.clamp_max(seq_len - 1)] & inside
        bias, markov_embed = last.markov_head(shifted[..., :-1])
        logits = head(last.norm(hidden)).float() + bias
        confidence = last.confidence_head(hidden, markov_embed)
        targets = shifted[..., 1:].masked_fill(~(shifted_valid[..., 1:] & valid.unsqueeze(-1)), -100)
        return logits, confidence, targets

    def loss(
        self,
        main_hidden: torch.Tensor,
        predictions: torch.Tensor,
        valid: torch.Tensor,
        embed: nn.Module,
        head: nn.Module,
    ) -> DeepseekV41DSparkLossOutput:
        """The training loss of :meth:`teacher_forced` drafts (same arguments): cross-entropy of each drafted column
        towards its target (``draft_loss``), and binary cross-entropy of the confidence head towards whether the
        drafted argmax equals it (``confidence_loss``: would greedy verification accept it)."""
        logits, confidence, targets = self.teacher_forced(main_hidden, predictions, valid, embed, head)
        keep = targets != -100
        logits, confidence, targets = logits[keep], confidence[keep], targets[keep]
        accepted = (logits.argmax(dim=-1) == targets).float()
        draft_loss = F.cross_entropy(logits, targets)
        confidence_loss = F.binary_cross_entropy_with_logits(confidence, accepted)
        return DeepseekV41DSparkLossOutput(
            loss=draft_loss + confidence_loss,
            draft_loss=draft_loss,
            confidence_loss=confidence_loss,
            accuracy=accepted.mean(),
        )

    @under_configured_numerics
    def write_ring(
        self,
        cache: DeepseekV41DSparkCache,
        main_hidden: torch.Tensor,
        positions: torch.Tensor,
        valid: torch.Tensor | None = None,
    ) -> None:
        """Write main positions into every block's ring: main_hidden [B, S, D·n_targets] at positions [B, S]
        (``valid`` [B, S] False for padding or rejected tokens, which are not written)."""
        main_x = self.main_x(main_hidden)
        rotation = self._rotation(positions.clamp_min(0))
        for k, block in enumerate(self):
            cache.write(k, block.attn.main_kv(main_x, rotation), positions, valid)

    @under_configured_numerics
    def draft(
        self,
        cache: DeepseekV41DSparkCache,
        first_ids: torch.Tensor,
        positions: torch.Tensor,
        embed: nn.Module,
        head: nn.Module,
        choose: Callable[[torch.Tensor, int], torch.Tensor] = greedy_choice,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One draft pass from main positions ``positions`` [B] (written to the rings), whose next token is
        ``first_ids`` [B].

        Returns ``(ids [B, nb+1], logits [B, nb, V] fp32, confidence [B, nb])``: ``ids[:, 0] = first_ids`` and
        ``ids[:, i+1] = choose(logits[:, i], i)``, the proposal for position ``positions + 2 + i``; ``logits`` include
        the Markov bias of ``ids[:, i]``; ``confidence`` is the raw logit of the confidence head.
        """
        nb = self.block_size
        block_positions = positions.unsqueeze(1) + 1 + torch.arange(nb, device=positions.device)
        slots = dspark_block_slots(cache.filled(), cache.window, nb)
        hidden = self._run_blocks(self._block_ids(first_ids.unsqueeze(1)), block_positions, cache.rings, slots, embed)
        last = self[-1]
        logits = head(last.norm(hidden)).float()
        out = first_ids.new_empty(first_ids.shape[0], nb + 1)
        out[:, 0] = first_ids
        markov_embeds, columns = [], []
        for i in range(nb):
            bias, markov_embed = last.markov_head(out[:, i])
            column = logits[:, i] + bias
            columns.append(column)
            markov_embeds.append(markov_embed)
            out[:, i + 1] = choose(column, i)
        confidence = last.confidence_head(hidden, torch.stack(markov_embeds, dim=1))
        return out, torch.stack(columns, dim=1), confidence


__all__ = [
    "DeepseekV41DSpark",
    "DeepseekV41DSparkAttention",
    "DeepseekV41DSparkBlock",
    "DeepseekV41DSparkConfidenceHead",
    "DeepseekV41DSparkLossOutput",
    "DeepseekV41DSparkMarkovHead",
]
