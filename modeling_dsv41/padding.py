"""Left padding: DeepSeek-V4.1 counts positions (compression groups, n-gram look-back) from each row's first real
token, so a prefill rolls left-padded rows to start at 0 and rolls the backbone's outputs back; router balancing
reads the masks in that same rolled order. A cache counts the real tokens each row adds (:func:`new_tokens_per_row`).
"""

from __future__ import annotations

from typing import TypeVar

import torch
from transformers.utils import ModelOutput

from .validation import require


def left_padding_shift(attention_mask: torch.Tensor | None) -> torch.Tensor | None:
    """Per-row count of leading padding [B] (zeros when no row is left-padded), or None without a [B, S] mask.

    Never asks whether any row is padded: that would read the mask on the host (a device sync, and a graph break
    under ``torch.compile``); rolling a row by 0 is an exact no-op.
    """
    if attention_mask is None or attention_mask.ndim != 2:
        return None
    return (~attention_mask.bool()).int().cumprod(dim=1).sum(dim=1)


def roll_rows(t: torch.Tensor | None, shift: torch.Tensor) -> torch.Tensor | None:
    """Roll each row of ``t`` [B, S, ...] along dim 1 by its own ``shift`` [B]."""
    if t is None:
        return None
    seq = t.shape[1]
    index = (torch.arange(seq, device=t.device).unsqueeze(0) - shift.unsqueeze(1)) % seq  # [B, S]
    index = index.view(*index.shape, *([1] * (t.ndim - 2))).expand_as(t)
    return t.gather(1, index)


def prefill_alignment(attention_mask: torch.Tensor | None, keep_outputs: bool) -> torch.Tensor | None:
    """How far to roll each left-padded row [B] of a prefill so that it starts at position 0 (None: no [B, S] mask).

    Rolling by 0 is an exact no-op; when intermediate outputs are asked for (``keep_outputs``), a mask without left
    padding is not rolled at all (one host read), so that hidden_states and attentions are the forward's own tensors
    (retain_grad works on them).
    """
    shift = left_padding_shift(attention_mask)
    if shift is not None and keep_outputs and not bool(shift.any()):
        return None
    return shift


def align_rows(shift: torch.Tensor | None, *rows: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
    """Each of ``rows`` ([B, S, ...] or None) rolled left by ``shift`` [B] so its rows start at their first real
    token; unchanged when ``shift`` is None."""
    return rows if shift is None else tuple(roll_rows(t, -shift) for t in rows)


def new_tokens_per_row(attention_mask: torch.Tensor | None, hidden: torch.Tensor, prefill: bool) -> torch.Tensor:
    """Real tokens each row [B] adds to a cache with this call (hidden [B, S, ...]): a prefill's one run per row from
    position 0 (rows aligned), a later call's every token (only the prefill may be padded)."""
    bsz, seq_len = hidden.shape[:2]
    if attention_mask is None:
        return torch.full((bsz,), seq_len, dtype=torch.long, device=hidden.device)
    if not prefill:
        if not torch.compiler.is_compiling():
            require(
                attention_mask[:, -seq_len:].bool().all(),
                "with a non-empty cache the new tokens must all be real (attention_mask 1): only the first call "
                "(the prefill) may be padded",
            )
        return torch.full((bsz,), seq_len, dtype=torch.long, device=hidden.device)
    mask = attention_mask.bool()
    lengths = mask.sum(dim=1)
    require(
        (mask == (torch.arange(seq_len, device=mask.device) < lengths.unsqueeze(1))).all(),
        "with a cache, attention_mask must mark one run of real tokens per row (left or right padding only)",
    )
    return lengths


Outputs = TypeVar("Outputs", bound=ModelOutput)


def in_caller_layout(outputs: Outputs, shift: torch.Tensor | None) -> Outputs:
    """The backbone's outputs of aligned rows rolled back by ``shift`` [B] (unchanged when None): queries in the
    caller's layout (slots keep counting from the first real token)."""
    if shift is None:
        return outputs
    outputs.last_hidden_state = roll_rows(outputs.last_hidden_state, shift)
    if outputs.dspark_hidden_states is not None:
        outputs.dspark_hidden_states = roll_rows(outputs.dspark_hidden_states, shift)
    for name in ("hidden_states", "attention_slots"):
        if getattr(outputs, name) is not None:
            setattr(outputs, name, tuple(roll_rows(t, shift) for t in getattr(outputs, name)))
    if outputs.attentions is not None:  # [B, H, S, K]: queries on dim 2
        outputs.attentions = tuple(roll_rows(t.transpose(1, 2), shift).transpose(1, 2) for t in outputs.attentions)
    return outputs
