"""How an image sits in the LM sequence: the token type of each position of its span and the grid of its visual
tokens. The processor lays spans out by these; the model writes the image features into them.

A span is ``[START] + ([IMAGE] × w + [NEWLINE]) × h + [END]`` for an image whose LM token grid is h × w: its ViT patch
grid divided by the aligner's ``downsample_ratio``, rounded up. Every span position carries the image token id in
``input_ids``; ``image_token_types`` (``TEXT`` outside spans) tells them apart.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence


class ImageTokenType(enum.IntEnum):
    """Role of each position in ``input_ids``. In tensor code compare with ``.value``: ``torch.compile`` mistakes
    an enum member for a constant of its own."""

    TEXT = -1
    START = 0
    IMAGE = 1
    NEWLINE = 2
    END = 3


def token_grid(patch_grid: Sequence[int], downsample_ratio: int) -> tuple[int, int]:
    """LM grid of a ViT patch grid (h, w): the aligner pads the patches to a multiple of the ratio, so ceil(n /
    ratio)."""
    return tuple(-(-int(side) // downsample_ratio) for side in patch_grid)


def span_length(token_grid: tuple[int, int]) -> int:
    """Positions of an image span in the LM sequence: start + rows × (visual tokens + newline) + end."""
    rows, cols = token_grid
    return rows * (cols + 1) + 2


def image_span_token_types(token_grid: tuple[int, int]) -> list[int]:
    """START, then per row ``cols`` IMAGE and one NEWLINE, then END (the reference's default layout)."""
    rows, cols = token_grid
    row = [ImageTokenType.IMAGE.value] * cols + [ImageTokenType.NEWLINE.value]
    return [ImageTokenType.START.value, *(row * rows), ImageTokenType.END.value]


__all__ = ["ImageTokenType", "image_span_token_types", "span_length", "token_grid"]
