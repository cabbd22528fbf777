"""Caption images with a saved DeepSeek-V4.1 through transformers' Auto classes alone.

``dsv41 demo`` also runs this file as a script in a fresh, isolated interpreter (``python -I``: the project is not
on ``sys.path``) to prove that the exported folder stands on its own — remote code, processor, tokenizer and
generation config — and captions exactly as the in-process model does. So it imports nothing from this project.

Usage: ``python -I demo_reload.py FOLDER PROMPT IMAGE...`` prints a JSON list of captions.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from typing import Any

import torch
from PIL import Image
from transformers import AutoModelForCausalLM, AutoProcessor

MAX_NEW_TOKENS = 12


def caption_inputs(processor: Any, images: Sequence[Image.Image], prompt: str) -> dict[str, torch.Tensor]:
    """The model inputs of a one-turn chat ``[image] prompt`` per image (a left-padded batch)."""
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": prompt}]}]
    text = processor.apply_chat_template(messages, add_generation_prompt=True)
    return processor(
        images=list(images),
        text=[text] * len(images),
        padding=True,
        padding_side="left",
        add_special_tokens=False,  # the chat template already starts with BOS
        return_tensors="pt",
    )


@torch.no_grad()
def caption_images(model: Any, processor: Any, images: Sequence[Image.Image], prompt: str) -> list[str]:
    """Greedy captions, one per image, for a one-turn chat ``[image] prompt`` (left-padded batch)."""
    inputs = caption_inputs(processor, images, prompt)
    output = model.generate(**inputs, max_new_tokens=MAX_NEW_TOKENS, do_sample=False)
    captions = processor.batch_decode(output[:, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    return [caption.strip() for caption in captions]


def main(argv: Sequence[str]) -> None:
    if len(argv) < 3:
        raise SystemExit("usage: python -I demo_reload.py FOLDER PROMPT IMAGE...")
    folder, prompt, *paths = argv
    model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True).eval()
    processor = AutoProcessor.from_pretrained(folder, trust_remote_code=True)
    images = [Image.open(path) for path in paths]
    print(
        json.dumps(
            {
                "model_class": type(model).__module__ + "." + type(model).__name__,
                "captions": caption_images(model, processor, images, prompt),
            }
        )
    )


if __name__ == "__main__":
    main(sys.argv[1:])
