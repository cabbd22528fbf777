"""Checks of user input that would otherwise fail deep inside the model (torch index errors, NaN logits) or name no
file (a truncated safetensors file). Each is one cheap pass, run once per forward.

A check that reads a tensor's values raises an exact error on the CPU, where reading them is free. On an
accelerator reading a value waits for every queued kernel (a host sync), so the forward's checks are device-side
assertions there instead (:func:`check_on_device`): the step runs on, and a bad input stops it at the next sync."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import torch

from processing.image_tokens import ImageTokenType

IGNORE_INDEX = -100  # labels' ignore index, a common mistake in input_ids


def reads_values_on_host(tensor: torch.Tensor) -> bool:
    """Whether a check of ``tensor``'s values raises here, exactly (on the CPU), or asserts on its device."""
    return tensor.device.type == "cpu"


def check_on_device(valid: torch.Tensor, message: str) -> None:
    """Assert the 0-d bool ``valid`` on its device, without waiting for it (``torch._assert_async``). CUDA reports
    a failure as a device-side assertion at the next synchronisation, without ``message``: rerun on the CPU for it."""
    torch._assert_async(valid, message)


def require(valid: torch.Tensor, message: str) -> None:
    """A ``ValueError`` with ``message`` unless the 0-d bool ``valid``, on the CPU; a device-side assertion
    elsewhere (:func:`check_on_device`)."""
    if not reads_values_on_host(valid):
        check_on_device(valid, message)
    elif not bool(valid):
        raise ValueError(message)


def check_input_ids(input_ids: torch.Tensor, vocab_size: int) -> None:
    """``input_ids`` must be non-empty and within ``[0, vocab_size)``."""
    if input_ids.numel() == 0:
        raise ValueError(f"input_ids is empty (shape {tuple(input_ids.shape)}): pass at least one token per row")
    if not reads_values_on_host(input_ids):
        in_vocabulary = ((input_ids >= 0) & (input_ids < vocab_size)).all()
        check_on_device(in_vocabulary, f"input_ids hold token ids outside [0, {vocab_size})")
        return
    low, high = torch.stack([input_ids.min(), input_ids.max()]).tolist()
    if low < 0:
        hint = (
            " (-100 is the labels' ignore index: it belongs in labels, not input_ids)" if low == IGNORE_INDEX else ""
        )
        raise ValueError(f"input_ids holds {low}: token ids must be in [0, {vocab_size}){hint}")
    if high >= vocab_size:
        raise ValueError(
            f"input_ids holds {high}, outside the vocabulary: token ids must be below vocab_size {vocab_size}"
        )


def check_attention_mask(attention_mask: torch.Tensor, batch_size: int, seq_len: int, past_length: int) -> None:
    """A [B, past + S] mask: one column per cached and per new position (``past_length`` is 0 without a cache)."""
    expected = (batch_size, past_length + seq_len)
    if tuple(attention_mask.shape) != expected:
        cached = f" ({past_length} cached + {seq_len} new)" if past_length else ""
        raise ValueError(
            f"attention_mask has shape {tuple(attention_mask.shape)}, expected {expected}{cached}: one column per "
            "position of input_ids"
        )


def check_text_inputs(
    input_ids: torch.Tensor | None,
    inputs_embeds: torch.Tensor | None,
    attention_mask: torch.Tensor | None,
    vocab_size: int,
    past_length: int = 0,
    max_positions: int | None = None,
) -> None:
    """The checks of :meth:`DeepseekV41Model.forward`'s token inputs, before anything is embedded; with
    ``max_positions``, the columns so far (``past_length`` cached and these) must not pass it."""
    if input_ids is not None:
        check_input_ids(input_ids, vocab_size)
        shape = input_ids.shape[:2]
    elif inputs_embeds is not None:
        shape = inputs_embeds.shape[:2]
        if inputs_embeds.numel() == 0:
            raise ValueError(f"inputs_embeds is empty (shape {tuple(inputs_embeds.shape)})")
    else:
        raise ValueError("pass input_ids or inputs_embeds")
    if input_ids is not None and inputs_embeds is not None and tuple(inputs_embeds.shape[:2]) != tuple(shape):
        raise ValueError(
            f"input_ids {tuple(shape)} and inputs_embeds {tuple(inputs_embeds.shape[:2])} must cover the same "
            "positions"
        )
    if attention_mask is not None:
        check_attention_mask(attention_mask, shape[0], shape[1], past_length)
    if max_positions is not None and past_length + shape[1] > max_positions:
        raise ValueError(
            f"the inputs reach position {past_length + shape[1]} ({past_length} cached and {shape[1]} "
            f"new), past max_position_embeddings ({max_positions}): {_POSITION_LIMIT}"
        )


# why the limit is one (the same words for forward and generate)
_POSITION_LIMIT = (
    "the rotary tables, YaRN's on the compressed layers included, are fit to that many positions; shorten the input"
)


def check_generation_length(max_length: int, input_length: int, max_positions: int) -> None:
    """``generate`` must not decode past ``max_positions``: said before the first step rather than at the step that
    reaches it."""
    if max_length > max_positions:
        raise ValueError(
            f"generating up to max_length={max_length} tokens (an input of {input_length}) passes "
            f"max_position_embeddings ({max_positions}): {_POSITION_LIMIT} or lower max_new_tokens"
        )


def check_pixel_values(pixel_values: torch.Tensor, image_grid_hw: torch.Tensor | None = None) -> None:
    """Every pixel must be finite: one NaN spreads to every logit, and in training to the weights."""
    finite = torch.isfinite(pixel_values)
    if bool(finite.all()):
        return
    bad = int((~finite).sum())
    where = ""
    if image_grid_hw is not None and pixel_values.ndim >= 2:  # the patches of all images, concatenated
        per_image = (~finite).flatten(1).any(-1).split(image_grid_hw.prod(-1).tolist())
        images = [i for i, rows in enumerate(per_image) if bool(rows.any())]
        where = f" (image {', '.join(map(str, images))})"
    raise ValueError(f"pixel_values holds {bad} NaN/inf values{where}: check the image files and the preprocessing")


def count(number: int, noun: str) -> str:
    """``"1 image"``, ``"2 images"``: a number with its noun, for messages."""
    return f"{number} {noun}{'' if number == 1 else 's'}"


def check_image_inputs(
    input_ids: torch.Tensor | None,
    inputs_embeds: torch.Tensor | None,
    pixel_values: torch.Tensor | None,
    image_grid_hw: torch.Tensor | None,
    image_token_types: torch.Tensor | None,
    image_token_id: int,
) -> None:
    """Images come with their placeholders and placeholders with their images (a full forward, not a decode step).

    Without ``pixel_values`` the placeholders would be embedded as the image token itself, and the model would answer
    about an image it never saw. ``image_token_types`` alone stays allowed next to ``inputs_embeds``: the caller
    merged the images into the embeddings (see :meth:`DeepseekV41Model.forward`).
    """
    fix = "pass everything the processor returns (input_ids, pixel_values, image_grid_hw, image_token_types)"
    if pixel_values is None:
        if inputs_embeds is not None:
            return
        if image_token_types is not None:
            spans = int((image_token_types == ImageTokenType.START.value).sum())  # one per image span
            if spans:
                raise ValueError(
                    f"image_token_types marks {count(spans, 'image span')} but no pixel_values were given: {fix}"
                )
        elif input_ids is not None and not reads_values_on_host(input_ids):
            check_on_device(
                ~(input_ids == image_token_id).any(), f"input_ids hold image placeholders but no pixel_values: {fix}"
            )
        elif input_ids is not None:
            placeholders = int((input_ids == image_token_id).sum())
            if placeholders:
                raise ValueError(
                    f"input_ids hold {count(placeholders, 'image position')} (image_token_id {image_token_id}) but no "
                    f"pixel_values were given: {fix}, e.g. model.generate(**inputs)"
                )
        return
    if image_token_types is None and input_ids is not None and not bool((input_ids == image_token_id).any()):
        images = "pixel_values" if image_grid_hw is None else f"pixel_values of {count(len(image_grid_hw), 'image')}"
        raise ValueError(
            f"{images} but input_ids hold no image placeholder (image_token_id {image_token_id}): {fix}; the "
            "processor expands one placeholder per image into its span"
        )


def check_safetensors_file(path: str | os.PathLike) -> None:
    """A ``ValueError`` naming ``path`` if it is not a whole safetensors file (a truncated download or copy):
    the header must parse and the file must hold every byte the header lists. Reads only the header."""
    path = Path(path)
    size = path.stat().st_size
    try:
        with path.open("rb") as file:
            (header_size,) = struct.unpack("<Q", file.read(8))
            if 8 + header_size > size:
                raise ValueError(f"header of {header_size} bytes")
            header = json.loads(file.read(header_size))
        data_end = max((entry["data_offsets"][1] for key, entry in header.items() if key != "__metadata__"), default=0)
    except (ValueError, KeyError, TypeError, IndexError, struct.error) as error:
        raise ValueError(f"{path} is not a valid safetensors file (truncated or corrupt: {error})") from None
    if 8 + header_size + data_end > size:
        raise ValueError(
            f"{path} is truncated: its header lists {8 + header_size + data_end:,} bytes, the file has {size:,}"
        )


def check_safetensors_folder(folder: str | os.PathLike) -> None:
    """:func:`check_safetensors_file` on every ``*.safetensors`` of a local folder (nothing for a Hub id)."""
    folder = Path(folder)
    if folder.is_dir():
        for path in sorted(folder.glob("*.safetensors")):
            check_safetensors_file(path)


__all__ = [
    "check_attention_mask",
    "check_generation_length",
    "check_image_inputs",
    "check_input_ids",
    "check_pixel_values",
    "check_safetensors_file",
    "check_safetensors_folder",
    "check_on_device",
    "check_text_inputs",
    "count",
    "reads_values_on_host",
    "require",
]
