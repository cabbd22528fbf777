"""Where an image goes, from its (height, width) alone: the canvas the ViT sees, the letterboxed content box inside
it, and the patch and LM token grids (the released ``inference/image_processor.py``'s ``plan_image_grid``).

Apart from the pixels so that the processor, the model's span layout and ``dsv41 inspect`` can size an image without
decoding it; both image processor backends letterbox by this plan.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .image_tokens import span_length, token_grid

LETTERBOX_FILL = 127  # gray of the padding band, as the reference's ImageOps.pad(color=(127, 127, 127))


@dataclass(frozen=True)
class ImageGridPlan:
    """Where an image of a given size goes; every pair is (height, width).

    ``canvas_size`` is the padded image the ViT sees (multiples of the patch size); the source image is resized to
    ``content_size`` and pasted at ``content_offset`` (top, left); the rest of the canvas is gray.
    """

    canvas_size: tuple[int, int]
    content_size: tuple[int, int]
    content_offset: tuple[int, int]
    patch_grid: tuple[int, int]  # ViT patches: what ``image_grid_hw`` reports
    token_grid: tuple[int, int]  # LM visual tokens after the downsample_ratio² aligner: ceil(patch_grid / ratio)

    @property
    def num_patches(self) -> int:
        return self.patch_grid[0] * self.patch_grid[1]

    @property
    def num_positions(self) -> int:
        """Length of the image span in the LM sequence: start + rows × (visual tokens + newline) + end."""
        return span_length(self.token_grid)


def _canvas_token_grid(canvas_size: tuple[int, int], patch_size: int, downsample_ratio: int) -> tuple[int, int]:
    return token_grid((canvas_size[0] // patch_size, canvas_size[1] // patch_size), downsample_ratio)


def _shrink_to_budget(
    height: float, width: float, patch_size: int, downsample_ratio: int, max_image_tokens: int
) -> tuple[int, int]:
    """Largest aspect-preserving canvas whose span fits ``max_image_tokens``: the reference's float arithmetic.

    With r = h/w and w tokens per row, the span is r·w·(w + 1) + 2, so w ≤ √((budget − 2)/r + ¼) − ½. Floors of
    float products make the result, for some sizes, a little smaller than exact rationals would.
    """
    aspect = height / width
    max_cols = math.sqrt((max_image_tokens - 2) / aspect + 0.25) - 0.5
    max_rows = max_cols * aspect
    cell = patch_size * downsample_ratio
    if max_cols < 1.0:  # so tall that even one column is too wide: a single column of as many rows as fit
        return (max_image_tokens - 2) // 2 * cell, cell
    if max_rows < 1.0:  # so wide that even one row is too tall: a single row of as many columns as fit
        return cell, (max_image_tokens - 3) * cell
    scale = min(math.floor(max_cols) * cell / width, math.floor(max_rows) * cell / height)
    return (
        math.floor(height * scale / patch_size) * patch_size,
        math.floor(width * scale / patch_size) * patch_size,
    )


def _letterbox_box(height: int, width: int, canvas_size: tuple[int, int]) -> tuple[tuple[int, int], tuple[int, int]]:
    """(content_size, content_offset) as PIL ``ImageOps.contain`` + ``pad(centering=(0.5, 0.5))`` compute them."""
    canvas_h, canvas_w = canvas_size
    content_h, content_w = canvas_h, canvas_w
    image_ratio, canvas_ratio = width / height, canvas_w / canvas_h
    if image_ratio > canvas_ratio:
        content_h = round(height / width * canvas_w)
    elif image_ratio < canvas_ratio:
        content_w = round(width / height * canvas_h)
    return (content_h, content_w), (round((canvas_h - content_h) * 0.5), round((canvas_w - content_w) * 0.5))


def plan_image_grid(
    height: int,
    width: int,
    *,
    patch_size: int = 14,
    downsample_ratio: int = 3,
    max_image_tokens: int = 1024,
    min_pixels: int = 295936,
    max_wh_ratio: float | None = None,
) -> ImageGridPlan:
    """Plan an image of ``height × width`` pixels without touching pixels (the reference's ``plan_image_grid``).

    The keyword names are the vision config's attribute names. Example: 1302×1302 → 93×93 patches → 31×31 visual
    tokens → 994 positions.
    """
    if height < 1 or width < 1:
        raise ValueError(f"an image needs at least one pixel, got {height}×{width}")
    rows, cols = height, width  # may become floats, as in the reference
    if max_wh_ratio is not None and cols > rows * max_wh_ratio:
        cols = rows * max_wh_ratio
    if rows * cols < min_pixels:
        scale = (min_pixels / (cols * rows)) ** 0.5
        rows, cols = int(rows * scale), int(cols * scale)
    canvas = (math.ceil(rows / patch_size) * patch_size, math.ceil(cols / patch_size) * patch_size)
    if span_length(_canvas_token_grid(canvas, patch_size, downsample_ratio)) > max_image_tokens:
        canvas = _shrink_to_budget(rows, cols, patch_size, downsample_ratio, max_image_tokens)
        if 0 in canvas:  # the reference would go on with an empty canvas and an image of 0 patches
            raise ValueError(
                f"{height}×{width} shrinks to an empty {canvas[0]}×{canvas[1]} canvas under "
                f"max_image_tokens={max_image_tokens} with downsample_ratio={downsample_ratio}"
            )
    tokens = _canvas_token_grid(canvas, patch_size, downsample_ratio)
    if span_length(tokens) > max_image_tokens:  # the reference asserts this; no size is known to reach it
        raise ValueError(f"{height}×{width} does not fit max_image_tokens={max_image_tokens}")

    if max_wh_ratio is not None and width >= max_wh_ratio * height:  # the reference stretches these, no padding
        content_size, content_offset = canvas, (0, 0)
    else:
        content_size, content_offset = _letterbox_box(height, width, canvas)
    return ImageGridPlan(
        canvas_size=canvas,
        content_size=content_size,
        content_offset=content_offset,
        patch_grid=(canvas[0] // patch_size, canvas[1] // patch_size),
        token_grid=tokens,
    )


__all__ = ["LETTERBOX_FILL", "ImageGridPlan", "plan_image_grid"]
