"""DeepSeek-V4.1 image processor, PIL backend: the reference's own PIL calls, step for step."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
from PIL import Image, ImageOps
from transformers.image_utils import PILImageResampling

from .image_processing_dsv41 import (  # noqa: F401  (the kwargs class is exposed here too, as transformers expects)
    DeepseekV41ImageProcessor,
    DeepseekV41ImageProcessorKwargs,
)
from .image_planning import LETTERBOX_FILL, ImageGridPlan


class DeepseekV41ImageProcessorPil(DeepseekV41ImageProcessor):
    r"""Same inputs, parameters and outputs as :class:`DeepseekV41ImageProcessor`, computed the reference's way:
    ``Image.resize`` / ``ImageOps.pad`` on one image after another, on CPU. Takes every PIL filter.

    The reference fixtures were made with Pillow 13; the torch backend's off-CPU resampler follows Pillow 13 too.
    """

    supported_resamples = tuple(PILImageResampling)

    @property
    def backend(self) -> str:
        return "pil"

    def to_dict(self) -> dict[str, Any]:
        # one saved config for both backends: AutoImageProcessor picks the backend when loading
        output = super().to_dict()
        output["image_processor_type"] = DeepseekV41ImageProcessor.__name__
        return output

    @staticmethod
    def _map(process: Callable[[int, Any], Any], items: list[tuple[int, Any]], device: Any) -> list[Any]:
        return [process(index, image) for index, image in items]

    def _to_rgb(self, image: Any, data_format: Any, device: Any, apply_exif_orientation: bool) -> Image.Image:
        # a PIL image: all the work happens on CPU
        return super()._to_rgb(image, data_format, None, apply_exif_orientation)

    def _letterbox(self, image: Image.Image, plan: ImageGridPlan, resample: int) -> np.ndarray:
        height, width = plan.canvas_size
        if image.size != (width, height):
            if plan.content_size == plan.canvas_size:  # includes the reference's max_wh_ratio stretch
                image = image.resize((width, height), resample)
            else:
                image = ImageOps.pad(image, (width, height), method=resample, color=(LETTERBOX_FILL,) * 3)
        return np.asarray(image)


__all__ = ["DeepseekV41ImageProcessorKwargs", "DeepseekV41ImageProcessorPil"]
