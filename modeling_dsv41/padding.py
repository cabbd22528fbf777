"""Left padding: DeepSeek-V4.1 counts positions (compression groups, n-gram look-back) from each row's first real
token, so the model rolls left-padded rows to start at 0 and rolls its outputs back; router balancing reads the
masks in that same rolled order."""

from __future__ import annotations

import torch


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
