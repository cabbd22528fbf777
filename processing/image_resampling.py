"""Pillow's convolution resampling (bicubic, bilinear, box) in integer torch arithmetic, bit for bit.

Apart from the processor because it is a port of Pillow 13's C kernel (``precompute_coeffs``,
``normalize_coeffs_8bpc`` and the 8-bit passes), not DeepSeek-V4.1 logic: the torch backend resizes with it off
the CPU, where Pillow cannot run, and gets the reference's bits there too.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import lru_cache

import numpy as np
import torch
from transformers.image_utils import PILImageResampling

_PRECISION_BITS = 22  # Pillow's 8-bit fixed point: 32 bits − 8 for the pixel − 2 for overshoot


def _bicubic(x: np.ndarray) -> np.ndarray:
    a = -0.5  # Pillow's bicubic
    x = np.abs(x)
    near = ((a + 2.0) * x - (a + 3.0)) * x * x + 1
    far = (((x - 5) * x + 8) * x - 4) * a
    return np.where(x < 1.0, near, np.where(x < 2.0, far, 0.0))


def _bilinear(x: np.ndarray) -> np.ndarray:
    x = np.abs(x)
    return np.where(x < 1.0, 1.0 - x, 0.0)


def _box(x: np.ndarray) -> np.ndarray:
    return np.where((x > -0.5) & (x <= 0.5), 1.0, 0.0)


# filter → (kernel, support). Only these three: their kernels are plain IEEE arithmetic, so numpy reproduces
# Pillow's double-precision coefficients exactly (Hamming and Lanczos would depend on the C library's sin/cos).
_FILTERS: dict[int, tuple[Callable[[np.ndarray], np.ndarray], float]] = {
    PILImageResampling.BICUBIC: (_bicubic, 2.0),
    PILImageResampling.BILINEAR: (_bilinear, 1.0),
    PILImageResampling.BOX: (_box, 0.5),
}
SUPPORTED_RESAMPLES: tuple[int, ...] = tuple(_FILTERS)  # the filters :func:`resize_like_pil` reproduces


@lru_cache(maxsize=256)
def _resample_taps(in_size: int, out_size: int, resample: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Pillow's ``precompute_coeffs`` + ``normalize_coeffs_8bpc``: source index and int32 weight per (out, tap)."""
    kernel, support = _FILTERS[resample]
    scale = in_size / out_size
    filter_scale = max(scale, 1.0)
    support = support * filter_scale
    n_taps = math.ceil(support) * 2 + 1
    centers = (np.arange(out_size) + 0.5) * scale
    first = np.maximum(np.trunc(centers - support + 0.5), 0).astype(np.int64)
    count = np.minimum(np.trunc(centers + support + 0.5).astype(np.int64), in_size) - first
    taps = np.arange(n_taps)
    inside = taps[None, :] < count[:, None]
    weights = kernel(((first[:, None] + taps[None, :]) - centers[:, None] + 0.5) * (1.0 / filter_scale))
    weights = np.where(inside, weights, 0.0)
    total = np.zeros(out_size)
    for tap in range(n_taps):  # Pillow sums in tap order
        total = total + weights[:, tap]
    weights = np.where(total[:, None] != 0.0, weights / np.where(total == 0.0, 1.0, total)[:, None], weights)
    fixed = np.where(weights < 0, -0.5 + weights * (1 << _PRECISION_BITS), 0.5 + weights * (1 << _PRECISION_BITS))
    n_used = int(count.max())
    index = np.minimum(first[:, None] + taps[None, :n_used], in_size - 1)  # out-of-window taps have weight 0
    return torch.from_numpy(index), torch.from_numpy(np.trunc(fixed[:, :n_used]).astype(np.int32))


def _resample_axis(image: torch.Tensor, axis: int, out_size: int, resample: int) -> torch.Tensor:
    """Resample a uint8 image along one axis exactly as Pillow's 8-bit horizontal/vertical pass does."""
    index, weight = (t.to(image.device) for t in _resample_taps(image.shape[axis], out_size, resample))
    lines = image.movedim(axis, 0)
    rest = lines.shape[1:]
    lines = lines.reshape(lines.shape[0], -1)
    acc = torch.full((out_size, lines.shape[1]), 1 << (_PRECISION_BITS - 1), dtype=torch.int32, device=image.device)
    for tap in range(index.shape[1]):
        acc += lines.index_select(0, index[:, tap]).to(torch.int32).mul_(weight[:, tap, None])
    out = (acc >> _PRECISION_BITS).clamp_(0, 255).to(torch.uint8)
    return out.reshape(out_size, *rest).movedim(0, axis)


def resize_like_pil(image: torch.Tensor, size: tuple[int, int], resample: int) -> torch.Tensor:
    """``Image.resize(size[::-1], resample)`` of Pillow 13 for an RGB uint8 HWC tensor, bit for bit.

    Pillow 13 runs the vertical pass first when the height shrinks by more than twice what the width shrinks by,
    and rounds to uint8 between the passes, so the order matters.
    """
    (in_h, in_w), (out_h, out_w) = image.shape[:2], size
    vertical_first = out_h < in_h and in_h - out_h > 2 * (in_w - out_w)
    passes = ((0, out_h), (1, out_w)) if vertical_first else ((1, out_w), (0, out_h))
    for axis, out_size in passes:
        if image.shape[axis] != out_size:
            image = _resample_axis(image, axis, out_size, resample)
    return image


__all__ = ["SUPPORTED_RESAMPLES", "resize_like_pil"]
