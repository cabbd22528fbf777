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

This module holds the torch backend's class and its kwargs; the steps it composes are siblings of it and of the PIL
backend (:mod:`.image_processing_pil_dsv41`): :mod:`.image_intake` (decoding, RGB), :mod:`.image_planning` (step
2–3 and the letterbox box), :mod:`.image_resampling` (the Pillow port) and :mod:`.image_patches` (step 5).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import torch
from PIL import Image
from transformers.image_processing_utils import BaseImageProcessor, BatchFeature
from transformers.image_utils import PILImageResampling
from transformers.processing_utils import ImagesKwargs, Unpack

from .image_intake import EncodedImage, array_to_rgb, decode_image, flatten_images, is_image_batch, pil_to_rgb
from .image_patches import patch_values, pixel_value_table
from .image_planning import LETTERBOX_FILL, ImageGridPlan, plan_image_grid
from .image_resampling import SUPPORTED_RESAMPLES, resize_like_pil


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
    supported_resamples: tuple[int, ...] = SUPPORTED_RESAMPLES

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

    def preprocess(self, images: Any, *args: Any, **kwargs: Any) -> BatchFeature:
        """:meth:`BaseImageProcessor.preprocess`; a call's ``size`` is its ``min_pixels``."""
        return super().preprocess(images, *args, **_size_as_min_pixels(kwargs))

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
            if is_image_batch(item):
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
        **kwargs: Any,
    ) -> None:
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
        if do_rescale and not (
            isinstance(rescale_factor, (int, float)) and math.isfinite(rescale_factor) and rescale_factor
        ):
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


# ImageGridPlan and plan_image_grid are re-exported: the processor's plan, which callers size images with
__all__ = ["DeepseekV41ImageProcessor", "DeepseekV41ImageProcessorKwargs", "ImageGridPlan", "plan_image_grid"]
