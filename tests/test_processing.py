"""DeepSeek-V4.1 processor: placeholder expansion, token types, batching, chat template, saving, auto classes."""

import base64

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file
from transformers import AutoProcessor

from processing import (
    IMAGE_TOKEN,
    DeepseekV41ImageProcessor,
    DeepseekV41ImageProcessorPil,
    DeepseekV41Processor,
    build_tiny_tokenizer,
    image_span_token_types,
    plan_image_grid,
)
from tiny_models import tiny_model

TINY = {"min_pixels": 20000, "max_image_tokens": 64}


@pytest.fixture(scope="module")
def tokenizer():
    return build_tiny_tokenizer()


@pytest.fixture
def processor(tokenizer):
    return DeepseekV41Processor(DeepseekV41ImageProcessor(**TINY), tokenizer)


def image(width: int, height: int, seed: int = 0) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


def span_types(width: int, height: int) -> list[int]:
    return image_span_token_types(plan_image_grid(height, width, **TINY).token_grid)


# --- the tokenizer -------------------------------------------------------------------------------------------------


def test_tiny_tokenizer_layout(tokenizer):
    assert len(tokenizer) == 512
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id) == (0, 1, 2)
    assert tokenizer.convert_tokens_to_ids(IMAGE_TOKEN) == 510  # the tiny preset's image_token_id
    ids = tokenizer("Describe the image.").input_ids
    assert ids[0] == 0 and len(ids) < len("Describe the image.")  # BOS, then merges shorten the text
    assert tokenizer.decode(ids, skip_special_tokens=True) == "Describe the image."
    assert build_tiny_tokenizer().get_vocab() == tokenizer.get_vocab()  # deterministic


def test_tiny_tokenizer_sizes_and_corpus():
    small = build_tiny_tokenizer(["ab ab ab"], vocab_size=300)  # too few merges: placeholders fill the gap
    assert len(small) == 300 and small.convert_tokens_to_ids(IMAGE_TOKEN) == 298
    assert len(build_tiny_tokenizer(vocab_size=1000)) == 1000
    with pytest.raises(ValueError, match="at least 265"):
        build_tiny_tokenizer(vocab_size=264)


# --- expansion and token types ------------------------------------------------------------------------------------


def test_single_image_span(processor, tokenizer):
    outputs = processor(text=f"Look {IMAGE_TOKEN} here.", images=image(150, 100), return_tensors="pt")
    ids, types = outputs["input_ids"][0], outputs["image_token_types"][0]
    expected_types = span_types(150, 100)
    assert len(expected_types) == 20  # 9×13 patches → 3×5 tokens → 1 + 3·6 + 1
    before = tokenizer("Look ").input_ids
    after = tokenizer(" here.", add_special_tokens=False).input_ids
    assert ids.tolist() == before + [510] * 20 + after
    assert types.tolist() == [-1] * len(before) + expected_types + [-1] * len(after)
    assert outputs["pixel_values"].shape == (117, 3, 14, 14) and outputs["image_grid_hw"].tolist() == [[9, 13]]


def test_fixture_image_span(processor, fixtures_dir):
    inputs = load_file(fixtures_dir / "v41_tiny_vl" / "inputs.safetensors")
    outputs = processor(
        text=f"x{IMAGE_TOKEN}y", images=str(fixtures_dir / "v41_tiny_vl" / "image.png"), return_tensors="pt"
    )
    types = outputs["image_token_types"][0]
    assert types[types >= 0].tolist() == inputs["image_token_types"].tolist()
    assert torch.equal(outputs["pixel_values"].view(torch.int16), inputs["pixel_values"].view(torch.int16))


@pytest.mark.parametrize("side", ["right", "left"])
def test_batch_with_different_image_counts_and_padding(processor, tokenizer, side):
    previous, tokenizer.padding_side = tokenizer.padding_side, side
    try:
        texts = [f"one {IMAGE_TOKEN} image", "no image at all, just some longer text", f"{IMAGE_TOKEN}{IMAGE_TOKEN}!"]
        images = [[image(150, 100, 1)], [], [image(40, 300, 2), image(200, 200, 3)]]
        outputs = processor(text=texts, images=images, padding=True, return_tensors="pt")
        flat = processor(text=texts, images=[images[0][0], *images[2]], padding=True, return_tensors="pt")
    finally:
        tokenizer.padding_side = previous
    ids, types, mask = outputs["input_ids"], outputs["image_token_types"], outputs["attention_mask"]
    assert types.shape == ids.shape == mask.shape
    assert bool((types[mask == 0] == -1).all()) and bool((ids[mask == 0] == tokenizer.pad_token_id).all())
    assert bool(((ids == 510) == (types >= 0)).all())
    spans = [span_types(150, 100), [], span_types(40, 300) + span_types(200, 200)]
    for row, expected in enumerate(spans):
        assert types[row][types[row] >= 0].tolist() == expected
    first_real = int(mask[1].nonzero()[0])  # row 1 is short, so padded
    assert ids[1, first_real] == tokenizer.bos_token_id and (first_real > 0) == (side == "left")
    assert all(torch.equal(flat[key], outputs[key]) for key in outputs)
    assert outputs["pixel_values"].shape[0] == int(outputs["image_grid_hw"].prod(-1).sum())


def test_lists_without_return_tensors(processor):
    outputs = processor(text=[f"a {IMAGE_TOKEN}", "b"], images=[image(30, 30)])
    assert isinstance(outputs["input_ids"], list) and isinstance(outputs["image_token_types"], list)
    assert [len(row) for row in outputs["image_token_types"]] == [len(row) for row in outputs["input_ids"]]
    text_only = processor(text="plain text")
    assert text_only["image_token_types"] == [[-1] * len(text_only["input_ids"][0])]


def test_placeholder_image_mismatch_is_an_error(processor):
    with pytest.raises(ValueError, match="2 .* placeholders but 1 image was given"):
        processor(text=f"{IMAGE_TOKEN} and {IMAGE_TOKEN}", images=[image(20, 20)])
    with pytest.raises(ValueError, match="0 .* placeholders but 1 image was given"):
        processor(text="no placeholder", images=[image(20, 20)])
    with pytest.raises(ValueError, match=f"the text has 1 {IMAGE_TOKEN} placeholder but no images"):
        processor(text=f"{IMAGE_TOKEN}")
    with pytest.raises(ValueError, match=r"per prompt \[1, 0\] != images per prompt \[0, 1\]"):
        processor(text=[f"a {IMAGE_TOKEN}", "b"], images=[[], [image(20, 20)]])


def test_truncating_a_span_is_an_error(processor):
    with pytest.raises(ValueError, match="truncation"):
        processor(text=f"some words {IMAGE_TOKEN}", images=[image(150, 100)], truncation=True, max_length=8)


def test_downsample_ratio_is_not_a_per_call_setting(processor):
    with pytest.raises(ValueError, match="downsample_ratio"):
        processor(text=IMAGE_TOKEN, images=[image(20, 20)], downsample_ratio=2)


def test_image_kwargs_pass_through(processor):
    outputs = processor(text=IMAGE_TOKEN, images=[image(150, 100)], max_image_tokens=10, return_tensors="pt")
    assert outputs["image_grid_hw"].tolist() == [[3, 4]]  # 1×2 tokens: a 5-position span after BOS
    assert outputs["image_token_types"][0].tolist() == [-1, 0, 1, 1, 2, 3]


def test_multimodal_token_counts(processor):
    sizes = [[100, 150], [1, 1], [3000, 40]]
    counts = processor._get_num_multimodal_tokens(image_sizes=sizes)
    outputs = processor(text=IMAGE_TOKEN * 3, images=[image(w, h) for h, w in sizes], return_tensors="pt")
    assert counts.num_image_patches == outputs["image_grid_hw"].prod(-1).tolist()
    assert sum(counts.num_image_tokens) == int((outputs["image_token_types"] >= 0).sum())


# --- chat template ---------------------------------------------------------------------------------------------------


def test_chat_template(processor, tmp_path):
    picture = image(150, 100, 4)
    picture.save(tmp_path / "picture.png")
    encoded = base64.b64encode((tmp_path / "picture.png").read_bytes()).decode()
    conversation = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "image", "image": picture}, {"type": "text", "text": "What is it?"}]},
        {"role": "assistant", "content": "Noise."},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "And these?"},
                {"type": "image", "path": str(tmp_path / "picture.png")},
                {"type": "image", "base64": encoded},
            ],
        },
    ]
    prompt = processor.apply_chat_template(conversation, add_generation_prompt=True)
    assert prompt == (
        f"<｜begin▁of▁sentence｜>Be brief.<｜User｜>{IMAGE_TOKEN}What is it?<｜Assistant｜></think>Noise."
        f"<｜end▁of▁sentence｜><｜User｜>And these?{IMAGE_TOKEN}{IMAGE_TOKEN}<｜Assistant｜></think>"
    )
    outputs = processor.apply_chat_template(
        conversation, add_generation_prompt=True, tokenize=True, return_dict=True, return_tensors="pt"
    )
    assert outputs["image_grid_hw"].tolist() == [[9, 13]] * 3
    assert int((outputs["image_token_types"] == 0).sum()) == 3
    assert outputs["input_ids"][0, 0] == 0 and int((outputs["input_ids"] == 0).sum()) == 1  # one BOS


# --- saving and auto classes -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", [DeepseekV41ImageProcessor, DeepseekV41ImageProcessorPil])
def test_save_load_round_trip(tokenizer, backend, tmp_path):
    processor = DeepseekV41Processor(backend(**TINY), tokenizer)
    processor.save_pretrained(tmp_path)
    request = {"text": [f"a {IMAGE_TOKEN} b", "c"], "images": [image(90, 60, 5)], "padding": True}
    request["return_tensors"] = "pt"
    expected = processor(**request)
    for reloaded in (DeepseekV41Processor.from_pretrained(tmp_path), AutoProcessor.from_pretrained(tmp_path)):
        assert type(reloaded) is DeepseekV41Processor
        assert reloaded.image_token == IMAGE_TOKEN and reloaded.chat_template == processor.chat_template
        assert reloaded.image_processor.max_image_tokens == 64
        outputs = reloaded(**request)
        assert outputs.keys() == expected.keys() and all(torch.equal(outputs[k], expected[k]) for k in expected)


def test_auto_classes_know_the_model_type():
    from configuration import DeepseekV41Config
    from transformers.models.auto.image_processing_auto import IMAGE_PROCESSOR_MAPPING
    from transformers.models.auto.processing_auto import PROCESSOR_MAPPING

    assert PROCESSOR_MAPPING[DeepseekV41Config] is DeepseekV41Processor
    assert IMAGE_PROCESSOR_MAPPING[DeepseekV41Config] == {
        "torchvision": DeepseekV41ImageProcessor,
        "pil": DeepseekV41ImageProcessorPil,
    }


def test_custom_image_token_must_be_one_token(tokenizer):
    with pytest.raises(ValueError, match="as one token"):
        DeepseekV41Processor(DeepseekV41ImageProcessor(), tokenizer, image_token="<image>")


def test_tokenizer_pads_on_the_left_so_batched_generation_continues_every_row(tokenizer, tmp_path):
    """With right padding the shorter row's continuation would start after its padding."""
    from transformers import AutoTokenizer

    from modeling_dsv41.engram import build_compressed_token_map

    tokenizer.save_pretrained(tmp_path)
    assert tokenizer.padding_side == "left" and AutoTokenizer.from_pretrained(tmp_path).padding_side == "left"

    _, compressed = build_compressed_token_map(tokenizer)
    model = tiny_model(engram_map=None, num_hidden_layers=2, engram_compressed_vocab_size=compressed)
    model.model.engram_hasher.load_tokenizer(tokenizer)
    prompts = ["A cat", "The quick brown fox jumps over the lazy dog and"]
    batch = tokenizer(prompts, padding=True, return_tensors="pt")
    assert batch["attention_mask"][0, 0] == 0 and batch["attention_mask"][0, -1] == 1
    settings = {"max_new_tokens": 4, "do_sample": False, "pad_token_id": tokenizer.pad_token_id}
    with torch.no_grad():
        together = model.generate(**batch, **settings)[:, batch["input_ids"].shape[1] :]
        for row, prompt in enumerate(prompts):
            alone = tokenizer(prompt, return_tensors="pt")
            assert (
                together[row].tolist()
                == model.generate(**alone, **settings)[0, alone["input_ids"].shape[1] :].tolist()
            )


def test_chat_template_marks_the_assistant_tokens(processor):
    """``{% generation %}`` markers around each reply and its EOS: ``return_assistant_tokens_mask`` (and with it
    TRL's ``assistant_only_loss``) selects exactly the tokens the model is trained to write."""
    tokenizer = processor.tokenizer
    conversation = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is it?"},
        {"role": "assistant", "content": "A red circle."},
        {"role": "user", "content": [{"type": "text", "text": "And now?"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "Blue."}]},
    ]
    for template_owner in (tokenizer, processor):
        out = template_owner.apply_chat_template(
            conversation, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
        )
        ids, mask = out["input_ids"], out["assistant_masks"]
        ids, mask = (ids[0], mask[0]) if isinstance(ids[0], list) else (ids, mask)
        assert len(mask) == len(ids)
        marked = [token for token, keep in zip(ids, mask) if keep]
        replies = [
            tokenizer.encode(text, add_special_tokens=False) + [tokenizer.eos_token_id]
            for text in ("A red circle.", "Blue.")
        ]
        assert marked == replies[0] + replies[1]
        # the generation prompt before each reply is not the model's to write
        assistant = tokenizer.convert_tokens_to_ids("<｜Assistant｜>")
        assert all(not keep for token, keep in zip(ids, mask) if token == assistant)
