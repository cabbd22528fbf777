"""Image intake: whatever a caller passes (files, bytes, ``data:`` URIs, base64 text, PIL images of any mode, numpy
arrays and torch tensors, single or nested in lists) turned into decoded RGB images, with one clear error per bad
input.

Apart from the processor because decoding and colour conversion are generic and meet untrusted input: they read on
their own, and both image processor backends and the processor share them. Nothing is fetched from a network.
"""

from __future__ import annotations

import base64
import binascii
import io
import os
import urllib.parse
import warnings
from functools import lru_cache
from typing import Any

import numpy as np
import torch
from PIL import ExifTags, Image, ImageOps
from transformers.image_utils import ChannelDimension

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


def is_image_batch(item: Any) -> bool:
    """Whether ``item`` is a 4-D array or tensor: a batch of images, not one."""
    return isinstance(item, (np.ndarray, torch.Tensor)) and item.ndim == 4


def flatten_images(images: Any) -> list[Any]:
    """One image, a list, a list of per-prompt lists, or 4-D arrays (batches) → a flat list, in order."""
    if isinstance(images, (list, tuple)):
        return [image for item in images for image in flatten_images(item)]
    if is_image_batch(images):
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


def array_to_rgb(image: np.ndarray | torch.Tensor, data_format: ChannelDimension | str | None = None) -> np.ndarray:
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


__all__ = [
    "HIGH_BIT_DEPTH_MODES",
    "EncodedImage",
    "array_to_rgb",
    "decode_image",
    "flatten_images",
    "is_image_batch",
    "pil_to_rgb",
]
