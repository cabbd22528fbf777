"""DeepSeek-V4.1 processor: a fast tokenizer plus the image processor, with image placeholders expanded in the text.

Each placeholder (``<｜deepseek_image｜>``, the token the released chat encoder emits per image) becomes the image's
span ``[START] + ([IMAGE] × w + [NEWLINE]) × h + [END]``, where (h, w) is the image's LM token grid. Every span
position carries the image token id in ``input_ids``; ``image_token_types`` tells them apart.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from transformers.feature_extraction_utils import BatchFeature
from transformers.processing_utils import MultiModalData, ProcessorMixin

from configuration.remote_code import (
    is_project_class,
    pop_push_arguments,
    processor_auto_maps,
    push_saved_folder,
    save_remote_code,
)

from .image_intake import flatten_images
from .image_tokens import ImageTokenType, image_span_token_types, span_length, token_grid
from .tokenizer_dsv41 import CHAT_TEMPLATE, IMAGE_TOKEN


class DeepseekV41Processor(ProcessorMixin):
    r"""Tokenizer + :class:`DeepseekV41ImageProcessor` (either backend) for DeepSeek-V4.1.

    ``processor(text=..., images=...)`` returns ``input_ids``, ``attention_mask``, ``image_token_types`` (same shape
    as ``input_ids``: −1 text and padding, 0 start, 1 image, 2 newline, 3 end), ``pixel_values`` and
    ``image_grid_hw``. ``images`` is a flat list matched to the placeholders in reading order across the batch, or
    one list per prompt. Padding follows the tokenizer's ``padding_side``.

    Args:
        image_processor: a :class:`DeepseekV41ImageProcessor` or :class:`DeepseekV41ImageProcessorPil`.
        tokenizer: a fast tokenizer that has ``image_token`` as a single token.
        chat_template: Jinja template; defaults to DeepSeek's user/assistant format with image blocks.
        image_token: the placeholder in the text and the token every span position carries.
    """

    def __init__(
        self,
        image_processor: Any = None,
        tokenizer: Any = None,
        chat_template: str | None = None,
        image_token: str = IMAGE_TOKEN,
        **kwargs: Any,
    ) -> None:
        ids = tokenizer.encode(image_token, add_special_tokens=False)
        if len(ids) != 1 or ids[0] == tokenizer.unk_token_id:
            raise ValueError(f"the tokenizer must have {image_token!r} as one token, it encodes it as {ids}")
        self.image_token = image_token
        self.image_token_id = ids[0]
        super().__init__(image_processor, tokenizer, chat_template=chat_template or CHAT_TEMPLATE, **kwargs)

    def __call__(self, images: Any = None, text: Any = None, **kwargs: Any) -> BatchFeature:
        outputs = super().__call__(images=images, text=text, **kwargs)
        if text is not None:
            grids = outputs["image_grid_hw"].tolist() if "image_grid_hw" in outputs else []
            ratio = self.image_processor.downsample_ratio
            layouts = [image_span_token_types(token_grid(grid, ratio)) for grid in grids]
            outputs["image_token_types"] = self._image_token_types(outputs["input_ids"], layouts)
        return outputs

    def validate_inputs(self, images: Any = None, text: Any = None, **kwargs: Any) -> None:
        """Placeholders and images must match: in total, and per prompt when images come one list per prompt."""
        if images is None and text is None:
            raise ValueError(f"{type(self).__name__} needs text, images or both")
        if text is None:
            return
        text = [text] if isinstance(text, str) else text
        if not all(isinstance(sample, str) for sample in text):
            raise ValueError("text must be a string or a list of strings")
        placeholders = [sample.count(self.image_token) for sample in text]
        if images is None:
            if any(placeholders):
                raise ValueError(
                    f"the text has {_count(sum(placeholders), self.image_token + ' placeholder')} but no images"
                )
            return
        per_prompt = (
            isinstance(images, (list, tuple))
            and len(images) == len(text)
            and all(isinstance(entry, (list, tuple)) for entry in images)
        )
        if per_prompt:
            given = [len(flatten_images(entry)) for entry in images]
            if given != placeholders:
                raise ValueError(
                    f"{self.image_token} placeholders per prompt {placeholders} != images per prompt {given}"
                )
        elif sum(placeholders) != len(flatten_images(images)):
            given = len(flatten_images(images))
            raise ValueError(
                f"the text has {_count(sum(placeholders), self.image_token + ' placeholder')} but "
                f"{_count(given, 'image')} {'was' if given == 1 else 'were'} given"
            )

    def _process_images(self, images: Any, **kwargs: Any) -> tuple[BatchFeature, list[str]]:
        ratio = self.image_processor.downsample_ratio
        if kwargs.get("downsample_ratio", ratio) != ratio:  # the model's aligner fixes it
            raise ValueError("downsample_ratio belongs to the model: set it on the image processor, not per call")
        processed = self.image_processor(images, **kwargs)
        spans = [span_length(token_grid(grid, ratio)) for grid in processed["image_grid_hw"].tolist()]
        return processed, [self.image_token * length for length in spans]

    def _image_token_types(self, input_ids: Any, layouts: list[list[int]]) -> Any:
        """Walk each row; every run of image tokens is the next images' spans, back to back, in order."""
        rows = input_ids.tolist() if isinstance(input_ids, torch.Tensor) else input_ids
        pending = iter(layouts)
        all_types = []
        for row in rows:
            ids = np.asarray(row)
            types = np.full(len(ids), ImageTokenType.TEXT.value, dtype=np.int64)
            positions = np.flatnonzero(ids == self.image_token_id)
            k = 0
            while k < len(positions):
                layout, start = next(pending, None), positions[k]
                last = k + len(layout) - 1 if layout is not None else len(positions)
                if last >= len(positions) or positions[last] != start + len(layout) - 1:  # not one whole span
                    raise ValueError("image spans in input_ids do not match the images (cut by truncation?)")
                types[start : start + len(layout)] = layout
                k += len(layout)
            all_types.append(types.tolist())
        if next(pending, None) is not None:
            raise ValueError("some image spans are missing from input_ids (cut by truncation?)")
        return torch.tensor(all_types, dtype=torch.int64) if isinstance(input_ids, torch.Tensor) else all_types

    def _get_num_multimodal_tokens(self, image_sizes: list[list[int]] | None = None, **kwargs: Any) -> MultiModalData:
        """Span lengths and patch counts for images of these (height, width) sizes, without the images: what a call
        with the same image settings (flat, as ``min_pixels=``, or nested, as ``images_kwargs={...}``) gives."""
        if image_sizes is None:
            return MultiModalData()
        settings = {
            key: value for key, value in kwargs.items() if key in self.image_processor.valid_kwargs.__annotations__
        }
        settings.update(kwargs.get("images_kwargs") or {})
        plans = [self.image_processor.plan(height, width, **settings) for height, width in image_sizes]
        return MultiModalData(
            num_image_tokens=[plan.num_positions for plan in plans],
            num_image_patches=[plan.num_patches for plan in plans],
        )

    def save_pretrained(self, save_directory, push_to_hub: bool = False, **kwargs: Any) -> list[str]:
        """:meth:`ProcessorMixin.save_pretrained`, plus the flat remote code its ``auto_map`` names
        (:mod:`configuration.remote_code`): the folder loads with ``AutoProcessor.from_pretrained(folder,
        trust_remote_code=True)`` where this package is not installed."""
        push = pop_push_arguments(save_directory, kwargs) if push_to_hub else None
        saved = super().save_pretrained(save_directory, **kwargs)
        if is_project_class(type(self)):  # (remote code running as such is saved by transformers itself)
            save_remote_code(save_directory, processor_auto_maps(self))
        if push is not None:
            push_saved_folder(save_directory, **push)
        return saved

    @property
    def model_input_names(self) -> list[str]:
        return [*self.tokenizer.model_input_names, *self.image_processor.model_input_names, "image_token_types"]


def _count(number: int, noun: str) -> str:
    """``"1 image"``, ``"2 images"``."""
    return f"{number} {noun}{'' if number == 1 else 's'}"


__all__ = ["DeepseekV41Processor"]
