"""DeepSeek-V4.1 image preprocessing: plan the grid, letterbox, cut 14×14 patches.

This reproduces the released ``inference/image_processor.py`` (``plan_image_grid``, ``safe_resize``,
``load_image``) output for output:

1. convert to RGB with PIL ``convert("RGB")`` semantics (alpha and palette transparency are dropped, nothing is
   composited);
2. upscale the size to at least ``min_pixels`` and round each side *up* to a multiple of ``patch_size``;
3. if the image span (``rows × (cols + 1) + 2`` positions) exceeds ``max_image_tokens``, shrink to the largest
   aspect-preserving size that fits, with the reference's float arithmetic;
4. letterbox into that canvas like PIL ``ImageOps.pad`` (bicubic, centred, gray 127);
5. scale to [-1, 1] (``(x / 255 - 0.5) / 0.5``), round to bfloat16 and cut row-major 14×14 patches.

Like the reference, the EXIF Orientation tag is ignored by default; ``apply_exif_orientation=True`` turns camera
photos upright first (then plan from the upright size).

Both processors match the reference bit for bit. :class:`DeepseekV41ImageProcessorPil` makes the reference's own
PIL calls. :class:`DeepseekV41ImageProcessor` (the torch backend) works from the plan: on CPU it resamples with
Pillow's C kernel (no torch kernel beats it there) and processes images in parallel threads; on any other ``device`` it
runs everything in torch, with :func:`resize_like_pil`, an integer port of Pillow 13's resampling.
"""

from __future__ import annotations

import base64
import binascii
import io
import itertools
import math
import os
import urllib.parse
import warnings
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import numpy as np
import torch
from PIL import ExifTags, Image, ImageOps
from transformers.image_processing_utils import BaseImageProcessor, BatchFeature
from transformers.image_utils import ChannelDimension, PILImageResampling
from transformers.processing_utils import ImagesKwargs, Unpack

from .image_tokens import span_length, token_grid

LETTERBOX_FILL = 127  # gray of the padding band, as the reference's ImageOps.pad(color=(127, 127, 127))


# ----------------------------------------------------------------------------------------------------------------
# The plan: sizes and grids from (height, width) alone
# ----------------------------------------------------------------------------------------------------------------


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


def _letterbox_box(
    height: int, width: int, canvas_size: tuple[int, int]
) -> tuple[tuple[int, int], tuple[int, int]]:
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


# ----------------------------------------------------------------------------------------------------------------
# Input intake: files, bytes, data: URIs, PIL images, arrays
# ----------------------------------------------------------------------------------------------------------------

EncodedImage = str | bytes | bytearray | memoryview | os.PathLike


def _data_uri_bytes(uri: str) -> bytes:
    header, comma, payload = uri.partition(",")
    if not comma:
        raise ValueError("malformed data: URI (no comma)")
    if header.endswith(";base64"):
        try:
            return base64.b64decode(payload)
        except binascii.Error as error:
            raise ValueError(f"data: URI has invalid base64: {error}") from error
    return urllib.parse.unquote_to_bytes(payload)


def _encoded_bytes(source: EncodedImage) -> bytes:
    if isinstance(source, (bytes, bytearray, memoryview)):
        return bytes(source)
    path = os.fspath(source)
    if isinstance(source, str) and source.startswith("data:"):
        return _data_uri_bytes(source)
    if isinstance(source, str) and source.startswith(("http://", "https://")):
        raise ValueError("remote URLs are not fetched (no network); pass a path, bytes, a data: URI or the image")
    if os.path.isfile(path):
        with open(path, "rb") as file:
            return file.read()
    if os.path.exists(path):
        raise ValueError(f"{path!r} is not a file")
    if isinstance(source, str):  # transformers' load_image also takes bare base64
        try:
            return base64.b64decode(source, validate=True)
        except binascii.Error:
            pass
        raise ValueError(f"image file {path[:200]!r} does not exist (nor is the text a data: URI or base64)")
    raise ValueError(f"image file {path!r} does not exist")


def decode_image(source: EncodedImage) -> Image.Image:
    """Decode an encoded image (path, bytes, ``data:`` URI or base64 text) fully, so corrupt data fails here."""
    data = _encoded_bytes(source)
    if not data:
        raise ValueError("empty image data")
    try:
        image = Image.open(io.BytesIO(data))
        image.load()
    except Exception as error:  # PIL reports corrupt data as OSError, SyntaxError, ValueError, EOFError, ...
        raise ValueError(f"cannot decode image: {type(error).__name__}: {error}") from error
    return image


def _is_image_batch(item: Any) -> bool:
    return isinstance(item, (np.ndarray, torch.Tensor)) and item.ndim == 4


def flatten_images(images: Any) -> list[Any]:
    """One image, a list, a list of per-prompt lists, or 4-D arrays (batches) → a flat list, in order."""
    if isinstance(images, (list, tuple)):
        return [image for item in images for image in flatten_images(item)]
    if _is_image_batch(images):
        return list(images)
    return [images]


def _apply_exif_orientation(image: Image.Image) -> Image.Image:
    orientation = image.getexif().get(ExifTags.Base.Orientation, 1)
    return image if orientation in (1, None) else ImageOps.exif_transpose(image)


# PIL modes whose values exceed 0–255 (16-bit PNGs open as "I;16*"): `convert("RGB")` clips them, mostly to white
HIGH_BIT_DEPTH_MODES = ("I", "I;16", "I;16L", "I;16B", "I;16N", "F")


@lru_cache(maxsize=None)
def _warn_high_bit_depth(mode: str) -> None:
    """Warns once per mode: the reference's result is kept (bit-exactness), but it is rarely what the caller meant."""
    warnings.warn(
        f"an image of PIL mode {mode!r} (e.g. a 16-bit PNG) is converted like the reference, with "
        'convert("RGB"), which clips values above 255 (a 16-bit image turns mostly white); scale it to 8 bits '
        "first (e.g. Image.fromarray((np.asarray(image) >> 8).astype(np.uint8))) to keep its contrast",
        UserWarning,
        stacklevel=2,
    )


def pil_to_rgb(image: Image.Image, apply_exif_orientation: bool = False) -> Image.Image:
    """``convert("RGB")``: alpha is dropped and palette transparency ignored, like the reference; optionally
    EXIF-upright first. High-bit-depth modes are clipped, as in the reference, with a warning (once per mode)."""
    if image.width == 0 or image.height == 0:
        raise ValueError(f"empty image ({image.width}×{image.height})")
    if apply_exif_orientation:
        image = _apply_exif_orientation(image)
    if image.mode in HIGH_BIT_DEPTH_MODES:
        _warn_high_bit_depth(image.mode)
    return image if image.mode == "RGB" else image.convert("RGB")


def _channel_format(shape: tuple[int, ...], data_format: ChannelDimension | str | None, prefer_first: bool) -> str:
    if data_format is not None:
        return ChannelDimension(data_format).value
    first, last = shape[0] in (1, 2, 3, 4), shape[-1] in (1, 2, 3, 4)
    if first and (prefer_first or not last):
        return ChannelDimension.FIRST.value
    if last:
        return ChannelDimension.LAST.value
    raise ValueError(f"cannot tell the channel axis of an image of shape {tuple(shape)}; pass input_data_format")


def _as_uint8(array: np.ndarray) -> np.ndarray:
    if array.dtype == np.uint8:
        return array
    if array.dtype == np.bool_:  # like PIL mode "1": 0 or 255
        return array.astype(np.uint8) * 255
    if np.issubdtype(array.dtype, np.floating):
        if not np.isfinite(array).all() or array.min() < 0 or array.max() > 1:
            raise ValueError("floating-point images must hold intensities in [0, 1]")
        return np.rint(array.astype(np.float64) * 255).astype(np.uint8)
    raise ValueError(f"unsupported pixel dtype {array.dtype}; pass uint8, bool, or floats in [0, 1]")


def array_to_rgb(
    image: np.ndarray | torch.Tensor, data_format: ChannelDimension | str | None = None
) -> np.ndarray:
    """An HW / HWC / CHW array with 1–4 channels → uint8 HWC RGB, with the meaning PIL gives L, LA, RGB, RGBA.

    Without ``data_format``, a tensor is read channels-first and a numpy array channels-last when both would fit.
    Floats are intensities in [0, 1], quantized as round(x·255).
    """
    prefer_first = isinstance(image, torch.Tensor)
    if isinstance(image, torch.Tensor):
        image = image.detach().cpu()
        image = (image.float() if image.dtype in (torch.bfloat16, torch.float16) else image).numpy()
    if image.size == 0:
        raise ValueError(f"empty image (shape {image.shape})")
    if image.ndim == 2:
        image = image[:, :, None]
    elif image.ndim == 3:
        if _channel_format(image.shape, data_format, prefer_first) == ChannelDimension.FIRST.value:
            image = np.moveaxis(image, 0, -1)
    else:
        raise ValueError(f"an image array must be 2-D or 3-D, got shape {image.shape}")
    if image.shape[-1] not in (1, 2, 3, 4):
        raise ValueError(f"an image needs 1 to 4 channels, got {image.shape[-1]}")
    image = _as_uint8(image)
    gray = image.shape[-1] <= 2  # L, LA: replicate the gray channel; RGBA, LA: drop alpha
    return np.ascontiguousarray(np.repeat(image[:, :, :1], 3, axis=2) if gray else image[:, :, :3])


# ----------------------------------------------------------------------------------------------------------------
# Pillow's convolution resampling, in integer torch arithmetic (bit-exact)
# ----------------------------------------------------------------------------------------------------------------

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


# ----------------------------------------------------------------------------------------------------------------
# Patches
# ----------------------------------------------------------------------------------------------------------------


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


# ----------------------------------------------------------------------------------------------------------------
# The image processors
# ----------------------------------------------------------------------------------------------------------------


class DeepseekV41ImageProcessorKwargs(ImagesKwargs, total=False):
    """
    patch_size (`int`, defaults to 14): side of a ViT patch.
    downsample_ratio (`int`, defaults to 3): side of the aligner's pixel-unshuffle; LM grid = ceil(patches / ratio).
    max_image_tokens (`int`, defaults to 1024): bound on an image span's positions (start + rows·(cols+1) + end).
    min_pixels (`int`, defaults to 295936): smaller images are upscaled to at least this area first.
    max_wh_ratio (`float`, *optional*): wider images are stretched to this aspect instead of letterboxed.
    apply_exif_orientation (`bool`, defaults to `False`): turn images upright by their EXIF Orientation tag first.
        The reference ignores the tag, so the default keeps its output.
    """

    patch_size: int
    downsample_ratio: int
    max_image_tokens: int
    min_pixels: int
    max_wh_ratio: int | float | None
    apply_exif_orientation: bool


_PLAN_KEYS = ("patch_size", "downsample_ratio", "max_image_tokens", "min_pixels", "max_wh_ratio")


class DeepseekV41ImageProcessor(BaseImageProcessor):
    r"""DeepSeek-V4.1 image processor, torch backend (CPU or GPU, no torchvision needed).

    Outputs a [`BatchFeature`] with ``pixel_values`` (bfloat16 ``[total_patches, 3, 14, 14]``, the patches of all
    images concatenated in order) and ``image_grid_hw`` (int64 ``[n_images, 2]``, each image's ViT patch grid).
    Bit-identical to :class:`DeepseekV41ImageProcessorPil` and to the reference; see the module docstring.

    Accepts PIL images (any mode), uint8/bool/[0, 1]-float numpy arrays and torch tensors (HW, HWC, CHW, or 4-D
    batches), file paths, encoded bytes, ``data:`` URIs and base64 text; single, flat list, or per-prompt lists.
    Constructor parameters are named after :class:`DeepseekV41VisionConfig`'s attributes (see
    :meth:`from_vision_config`), plus the usual ``resample``, ``image_mean``, ``image_std``.
    """

    resample = PILImageResampling.BICUBIC
    image_mean = [0.5, 0.5, 0.5]
    image_std = [0.5, 0.5, 0.5]
    do_rescale = True
    do_normalize = True
    patch_size = 14
    downsample_ratio = 3
    max_image_tokens = 1024
    min_pixels = 295936
    max_wh_ratio = None
    apply_exif_orientation = False
    valid_kwargs = DeepseekV41ImageProcessorKwargs
    model_input_names = ["pixel_values", "image_grid_hw"]
    supported_resamples: tuple[int, ...] = tuple(_FILTERS)

    def __init__(self, **kwargs: Unpack[DeepseekV41ImageProcessorKwargs]) -> None:
        super().__init__(**kwargs)
        self._set_attributes(**kwargs)
        self._validate_preprocess_kwargs(**{key: getattr(self, key) for key in self._valid_kwargs_names})

    @property
    def backend(self) -> str:
        return "torch"

    @property
    def size(self) -> dict[str, int]:
        """transformers' place for pixel bounds: ``{"shortest_edge": min_pixels}`` (an area, as Qwen2-VL's). A view
        of ``min_pixels``, the name :class:`DeepseekV41VisionConfig` uses."""
        return {"shortest_edge": self.min_pixels}

    @size.setter
    def size(self, value: dict[str, int] | None) -> None:
        if value is None:
            return
        if set(dict(value)) - {"shortest_edge"}:
            raise ValueError(f"size takes only 'shortest_edge' (the min_pixels area), got {dict(value)}")
        self.min_pixels = dict(value)["shortest_edge"]

    @classmethod
    def from_vision_config(cls, vision_config: Any, **kwargs: Any) -> "DeepseekV41ImageProcessor":
        """Sized like the model: ``patch_size``, ``downsample_ratio``, ``max_image_tokens``, ``min_pixels``,
        ``max_wh_ratio`` from a :class:`DeepseekV41VisionConfig` (or anything with those attributes)."""
        return cls(**{key: getattr(vision_config, key) for key in _PLAN_KEYS}, **kwargs)

    def plan(self, height: int, width: int, **overrides: Any) -> ImageGridPlan:
        """:func:`plan_image_grid` with this processor's settings (``overrides`` take precedence; ``size`` is
        ``min_pixels``, as in a call)."""
        overrides = _size_as_min_pixels(overrides)
        settings = {key: overrides.get(key, getattr(self, key)) for key in _PLAN_KEYS}
        return plan_image_grid(height, width, **settings)

    def _merge_and_standardize_kwargs(self, **kwargs: Any) -> dict:
        """A call's settings over this processor's; a call's ``size`` is its ``min_pixels``."""
        kwargs = super()._merge_and_standardize_kwargs(**_size_as_min_pixels(kwargs))
        kwargs["size"] = {"shortest_edge": kwargs["min_pixels"]}
        return kwargs

    def get_number_of_image_patches(self, height: int, width: int, images_kwargs: dict | None = None) -> int:
        """Patches of an image of this size, without the image (the hook vLLM-style callers use)."""
        return self.plan(height, width, **(images_kwargs or {})).num_patches

    def fetch_images(self, images: Any) -> Any:
        """Decode paths, bytes, ``data:`` URIs and base64 into PIL images, keeping the nesting; never networks."""
        counter = itertools.count()

        def visit(item: Any) -> Any:
            if isinstance(item, (list, tuple)):
                return [visit(entry) for entry in item]
            index = next(counter)
            if _is_image_batch(item):
                for _ in range(len(item) - 1):
                    next(counter)
            elif isinstance(item, EncodedImage):
                try:
                    return decode_image(item)
                except ValueError as error:
                    raise ValueError(f"image {index}: {error}") from error
            return item

        return visit(images)

    def _validate_preprocess_kwargs(
        self,
        patch_size: int | None = None,
        downsample_ratio: int | None = None,
        max_image_tokens: int | None = None,
        min_pixels: int | None = None,
        max_wh_ratio: float | None = None,
        resample: int | None = None,
        do_rescale: bool | None = None,
        rescale_factor: float | None = None,
        do_normalize: bool | None = None,
        image_mean: float | tuple[float, ...] | None = None,
        image_std: float | tuple[float, ...] | None = None,
        return_tensors: str | None = None,
        size: dict[str, int] | None = None,
        **kwargs: Any,
    ) -> None:
        if size is not None and dict(size) != {"shortest_edge": min_pixels}:
            raise ValueError(f"size={dict(size)} must be {{'shortest_edge': min_pixels}} (min_pixels={min_pixels!r})")
        for name, value, least in (
            ("patch_size", patch_size, 1),
            ("downsample_ratio", downsample_ratio, 1),
            ("max_image_tokens", max_image_tokens, 4),  # a 1×1 image already takes 4 positions
            ("min_pixels", min_pixels, 0),
        ):
            if not isinstance(value, int) or isinstance(value, bool) or value < least:
                raise ValueError(f"{name} must be an integer ≥ {least}, got {value!r}")
        if max_wh_ratio is not None and not (math.isfinite(max_wh_ratio) and max_wh_ratio >= 1):
            raise ValueError(f"max_wh_ratio must be None or a finite number ≥ 1, got {max_wh_ratio!r}")
        if resample not in self.supported_resamples:
            names = [PILImageResampling(value).name for value in self.supported_resamples]
            raise ValueError(
                f"{type(self).__name__} resamples with {names}, got {resample!r}"
                + ("; DeepseekV41ImageProcessorPil takes every PIL filter" if self.backend == "torch" else "")
            )
        if do_rescale and not (isinstance(rescale_factor, (int, float)) and math.isfinite(rescale_factor) and rescale_factor):
            # a negative factor is plain arithmetic (transformers' processor tests flip images with -1)
            raise ValueError(f"rescale_factor must be a finite non-zero number, got {rescale_factor!r}")
        if do_normalize:
            for name, value in (("image_mean", image_mean), ("image_std", image_std)):
                if len(np.atleast_1d(value)) not in (1, 3):
                    raise ValueError(f"{name} must have 1 or 3 values, got {value!r}")
            if not np.all(np.atleast_1d(image_std)):
                raise ValueError(f"image_std must be non-zero, got {image_std!r}")
        if return_tensors not in (None, "pt"):
            raise ValueError(f"pixel_values are bfloat16, which only torch holds; return_tensors={return_tensors!r}")

    def _preprocess_image_like_inputs(self, images: Any, **kwargs: Any) -> BatchFeature:
        plan_settings = {key: kwargs[key] for key in _PLAN_KEYS}
        patch_size, device = plan_settings["patch_size"], kwargs.get("device")
        table = pixel_value_table(
            do_rescale=kwargs["do_rescale"],
            rescale_factor=kwargs["rescale_factor"],
            do_normalize=kwargs["do_normalize"],
            image_mean=kwargs["image_mean"],
            image_std=kwargs["image_std"],
        )

        def process(index: int, image: Any) -> tuple[torch.Tensor, tuple[int, int]]:
            try:
                if isinstance(image, EncodedImage):
                    image = decode_image(image)
                image = self._to_rgb(image, kwargs.get("input_data_format"), device, kwargs["apply_exif_orientation"])
                plan = plan_image_grid(*self._image_size(image), **plan_settings)
                canvas = self._letterbox(image, plan, kwargs["resample"])
            except (ValueError, TypeError) as error:
                raise type(error)(f"image {index}: {error}") from error
            except OSError as error:  # a lazily opened PIL image that turns out to be corrupt
                raise ValueError(f"image {index}: cannot decode image: {error}") from error
            return patch_values(canvas, patch_size, table), plan.patch_grid

        images = flatten_images(images)
        # the same object twice is processed once (and a lazily opened PIL image is never decoded by two threads)
        first_seen = {}
        for index, image in enumerate(images):
            first_seen.setdefault(id(image), index)
        unique = sorted(set(first_seen.values()))
        done = dict(zip(unique, self._map(process, [(index, images[index]) for index in unique], device)))
        results = [done[first_seen[id(image)]] for image in images]
        empty = torch.empty(0, 3, patch_size, patch_size, dtype=torch.bfloat16)
        pixel_values = torch.cat([values for values, _ in results]) if results else empty
        image_grid_hw = torch.tensor([grid for _, grid in results], dtype=torch.int64).reshape(-1, 2)
        if device is not None:
            pixel_values, image_grid_hw = pixel_values.to(device), image_grid_hw.to(device)
        return BatchFeature({"pixel_values": pixel_values, "image_grid_hw": image_grid_hw})

    # backend-specific steps -------------------------------------------------------------------------------------

    @staticmethod
    def _map(process: Callable[[int, Any], Any], items: list[tuple[int, Any]], device: Any) -> list[Any]:
        """``process(index, image)`` for each item, in order. CPU images are independent and Pillow and numpy
        release the GIL, so they run in one thread per torch thread, largest first: the threads then finish
        together instead of one resizing a big image alone at the end. An error is the first failing item's."""
        workers = min(len(items), torch.get_num_threads())
        if workers <= 1 or not _on_cpu(device):
            return [process(index, image) for index, image in items]
        with ThreadPoolExecutor(workers) as pool:
            futures = {
                index: pool.submit(process, index, image)
                for index, image in sorted(items, key=lambda item: -_input_values(item[1]))
            }
            return [futures[index].result() for index, _ in items]

    def _to_rgb(
        self, image: Any, data_format: Any, device: Any, apply_exif_orientation: bool
    ) -> Image.Image | torch.Tensor:
        """A PIL RGB image to resample on CPU, else a uint8 [H, W, 3] tensor on ``device``."""
        if isinstance(image, Image.Image):
            image = pil_to_rgb(image, apply_exif_orientation)
            return image if _on_cpu(device) else torch.from_numpy(np.array(image)).to(device)
        if isinstance(image, (np.ndarray, torch.Tensor)):
            rgb = array_to_rgb(image, data_format)
            return Image.fromarray(rgb) if _on_cpu(device) else torch.from_numpy(rgb).to(device)
        raise TypeError(f"unsupported image type {type(image).__name__}")

    @staticmethod
    def _image_size(image: Image.Image | torch.Tensor) -> tuple[int, int]:
        return (image.height, image.width) if isinstance(image, Image.Image) else tuple(image.shape[:2])

    def _letterbox(
        self, image: Image.Image | torch.Tensor, plan: ImageGridPlan, resample: int
    ) -> np.ndarray | torch.Tensor:
        """The canvas: the image resized to the plan's content box, on gray."""
        if plan.content_size == plan.canvas_size:
            return _resize(image, plan.canvas_size, resample)
        if isinstance(image, Image.Image):
            canvas = np.full((*plan.canvas_size, 3), LETTERBOX_FILL, dtype=np.uint8)
        else:
            canvas = torch.full((*plan.canvas_size, 3), LETTERBOX_FILL, dtype=torch.uint8, device=image.device)
        (top, left), (height, width) = plan.content_offset, plan.content_size
        if height and width:  # an extreme aspect can round the content away entirely, as in PIL
            canvas[top : top + height, left : left + width] = _resize(image, plan.content_size, resample)
        return canvas


def _size_as_min_pixels(kwargs: dict[str, Any]) -> dict[str, Any]:
    """``kwargs`` with a ``size`` (transformers' name for the pixel bound, ``{"shortest_edge": area}``: see
    :attr:`DeepseekV41ImageProcessor.size`) given as ``min_pixels``; both given must agree."""
    if kwargs.get("size") is None:
        return {key: value for key, value in kwargs.items() if key != "size"}
    kwargs = dict(kwargs)
    size = {key: value for key, value in dict(kwargs.pop("size")).items() if value is not None}
    if set(size) != {"shortest_edge"}:
        raise ValueError(f"size takes only 'shortest_edge' (the min_pixels area), got {size}")
    if kwargs.get("min_pixels") not in (None, size["shortest_edge"]):
        raise ValueError(f"size={size} and min_pixels={kwargs['min_pixels']} disagree: pass one of them")
    kwargs["min_pixels"] = size["shortest_edge"]
    return kwargs


def _resize(image: Image.Image | torch.Tensor, size: tuple[int, int], resample: int) -> np.ndarray | torch.Tensor:
    """On CPU, Pillow's own C kernel (the fastest exact one there); elsewhere :func:`resize_like_pil`, same bits."""
    if isinstance(image, torch.Tensor):
        return resize_like_pil(image, size, resample)
    if image.size != size[::-1]:
        image = image.resize(size[::-1], resample)
    return np.asarray(image)


def _input_values(image: Any) -> float:
    """Values in an image as given: how long it takes to process, roughly (unknown for encoded data)."""
    if isinstance(image, Image.Image):
        return image.width * image.height * len(image.getbands())
    if isinstance(image, np.ndarray):
        return image.size
    if isinstance(image, torch.Tensor):
        return image.numel()
    return math.inf


def _on_cpu(device: Any) -> bool:
    return device is None or torch.device(device).type == "cpu"


__all__ = [
    "DeepseekV41ImageProcessor",
    "ImageGridPlan",
    "ImageTokenType",
    "image_span_token_types",
    "plan_image_grid",
    "span_length",
    "token_grid",
]
