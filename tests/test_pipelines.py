"""transformers' pipelines on DeepSeek-V4.1 never show pad or other special tokens, even when the model emits them."""

from __future__ import annotations

import torch
from PIL import Image
from transformers import LogitsProcessor, LogitsProcessorList, pipeline

from modeling_dsv41.cli.demo import build_demo_model, build_demo_processor, demo_config
from modeling_dsv41.cli.demo_data import build_demo_tokenizer


class Emit(LogitsProcessor):
    """Forces the given token ids in turn (pad, the chat markers, a word): the model emits them, whatever it is."""

    def __init__(self, ids: list[int]):
        self.ids, self.step = ids, 0

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        forced = torch.full_like(scores, -float("inf"))
        forced[:, self.ids[self.step % len(self.ids)]] = 0.0
        self.step += 1
        return forced


def test_text_and_image_pipelines_skip_special_tokens():
    tokenizer = build_demo_tokenizer()
    config = demo_config(tokenizer)
    model = build_demo_model(config, tokenizer, seed=0).eval()
    processor = build_demo_processor(config, tokenizer)
    specials = [
        tokenizer.pad_token_id,
        *tokenizer.convert_tokens_to_ids(["<｜User｜>", "<｜Assistant｜>", "</think>"]),
    ]
    word = tokenizer.convert_tokens_to_ids("Ġcircle") if "Ġcircle" in tokenizer.get_vocab() else 300
    text = tokenizer.decode([word])

    generator = pipeline("text-generation", model=model, tokenizer=tokenizer)
    out = generator(
        "The", max_new_tokens=10, do_sample=False, logits_processor=LogitsProcessorList([Emit([*specials, word])])
    )
    assert out[0]["generated_text"] == "The" + text + text  # 10 steps: two rounds of 4 specials and the word

    captioner = pipeline("image-text-to-text", model=model, processor=processor)
    messages = [
        {
            "role": "user",
            "content": [
                {"type": "image", "image": Image.new("RGB", (84, 84), (200, 30, 30))},
                {"type": "text", "text": "Describe the image."},
            ],
        }
    ]
    out = captioner(
        text=messages,
        max_new_tokens=10,
        do_sample=False,
        return_full_text=False,
        generate_kwargs={"logits_processor": LogitsProcessorList([Emit([*specials, word])])},
    )
    assert out[0]["generated_text"] == text + text
