"""Canvas → model input: uint8 pixels to the reference's bfloat16 values, cut into row-major ViT patches.

Apart from the processor because it is the hot loop of preprocessing (a per-level lookup table instead of float
arithmetic per pixel, numpy gathers on CPU) and both image processor backends end with it.
"""

from __future__ import annotations

import numpy as np
import torch


def pixel_value_table(
    *,
    do_rescale: bool,
    rescale_factor: float,
    do_normalize: bool,
    image_mean: float | tuple[float, ...],
    image_std: float | tuple[float, ...],
) -> torch.Tensor:
    """bfloat16 value of each uint8 level, per channel [3, 256], in the reference's float32 order.

    The reference computes ``((x / 255) - 0.5) / 0.5`` in float32 and rounds to bfloat16; applying the same ops to
    the 256 levels and looking pixels up gives the same bits at a fraction of the cost.
    """
    values = torch.arange(256, dtype=torch.float32).expand(3, 256)
    if do_rescale:
        # divide, don't multiply: x * (1/255) differs from x / 255 in one of the 256 levels after bf16 rounding
        values = values / (1.0 / rescale_factor)
    if do_normalize:
        values = values - torch.tensor(image_mean, dtype=torch.float32).reshape(-1, 1)
        values = values / torch.tensor(image_std, dtype=torch.float32).reshape(-1, 1)
    return values.to(torch.bfloat16)


_TAKE_CHUNK = 1 << 16  # indices per np.take call: its int64 copy of them stays in cache


def _take(table: np.ndarray, indices: np.ndarray, out: np.ndarray) -> np.ndarray:
    """``out[...] = table[indices]`` for flat arrays, in chunks. np.take converts the indices to int64 first;
    in one call that is a buffer 4-8× the image (page faults included, several times slower than the lookup)."""
    for start in range(0, indices.size, _TAKE_CHUNK):
        chunk = slice(start, start + _TAKE_CHUNK)
        np.take(table, indices[chunk], out=out[chunk], mode="wrap")  # in range anyway; "raise" buffers ``out``
    return out


def _lookup(levels: np.ndarray, table: torch.Tensor) -> np.ndarray:
    """Contiguous uint8 levels [..., 3, p, p] → bfloat16 bits (int16) through the per-channel ``table``."""
    bits = table.view(torch.int16).numpy()
    if (bits == bits[:1]).all() and levels.size % 2 == 0:
        # one table for all channels (the usual case): look levels up two at a time in a table of value pairs,
        # half as many gathers; explicit little-endian views keep [first, second] order on any host
        value = bits[0].astype("<u2").astype("<u4")
        pair_table = (value[:, None] << 16 | value[None, :]).reshape(-1)  # index: second level · 256 + first
        pairs = levels.reshape(-1).view("<u2")
        values = _take(pair_table, pairs, np.empty(pairs.shape, "<u4")).view("<i2")
        return values.astype(np.int16, copy=False).reshape(levels.shape)
    # a table per channel: one flat table of 3 × 256 values, each level offset by 256 × its channel
    offsets = np.arange(levels.shape[-3], dtype=np.uint16).reshape(-1, 1, 1) * 256
    indices = (levels + offsets).reshape(-1)
    return _take(bits.reshape(-1), indices, np.empty(indices.shape, np.int16)).reshape(levels.shape)


def patch_values(canvas: np.ndarray | torch.Tensor, patch_size: int, table: torch.Tensor) -> torch.Tensor:
    """uint8 canvas [H, W, 3] → bfloat16 patches [H/p · W/p, 3, p, p] in row-major order (the reference's layout),
    each level replaced by its ``table`` value. A numpy canvas is gathered with numpy (several times faster than
    torch indexing on CPU), a tensor on its own device."""
    height, width, channels = canvas.shape
    shape = (height // patch_size, patch_size, width // patch_size, patch_size, channels)
    if isinstance(canvas, torch.Tensor):
        levels = canvas.reshape(shape).permute(0, 2, 4, 1, 3)  # [rows, cols, 3, p, p]
        channel = torch.arange(channels, device=canvas.device).view(channels, 1, 1)
        values = table.to(canvas.device)[channel, levels.long()]
    else:
        levels = np.ascontiguousarray(canvas.reshape(shape).transpose(0, 2, 4, 1, 3))
        values = torch.from_numpy(_lookup(levels, table)).view(torch.bfloat16)
    return values.reshape(-1, channels, patch_size, patch_size)


__all__ = ["patch_values", "pixel_value_table"]
