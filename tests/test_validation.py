"""Bad input gives one clear ValueError before the model runs: token ids, masks, pixels, truncated weights."""

from __future__ import annotations

import pytest
import torch

from modeling_dsv41 import DeepseekV41ForCausalLM
from modeling_dsv41.generation.cache import DeepseekV41Cache
from tiny_models import tiny_model

SEQ = 24
VIT_GRID = (6, 6)  # a 2×2 token grid: span = start + 2 × (2 + newline) + end = 8 positions


@pytest.fixture(scope="module")
def model() -> DeepseekV41ForCausalLM:
    return tiny_model(engram_map="default", num_hidden_layers=2, emulate_quantization=False)


def ids(batch: int = 2, seq: int = SEQ) -> torch.Tensor:
    return torch.randint(3, 500, (batch, seq), generator=torch.Generator().manual_seed(0))


def image_inputs() -> dict[str, torch.Tensor]:
    span = [0] + ([1, 1] + [2]) * 2 + [3]
    types = torch.full((1, SEQ), -1)
    types[0, 4 : 4 + len(span)] = torch.tensor(span)
    input_ids = ids(1)
    input_ids[types >= 0] = 510  # the tiny preset's image_token_id
    pixels = torch.randn(VIT_GRID[0] * VIT_GRID[1], 3, 14, 14, generator=torch.Generator().manual_seed(1))
    return {
        "input_ids": input_ids,
        "pixel_values": pixels,
        "image_grid_hw": torch.tensor([VIT_GRID]),
        "image_token_types": types,
    }


@pytest.mark.parametrize(
    "value, message",
    [
        (512, r"input_ids holds 512, outside the vocabulary: token ids must be below vocab_size 512"),
        (10**6, r"input_ids holds 1000000, outside the vocabulary: token ids must be below vocab_size 512"),
        (-1, r"input_ids holds -1: token ids must be in \[0, 512\)$"),
        (-100, r"input_ids holds -100: token ids must be in \[0, 512\) \(-100 is the labels' ignore index"),
    ],
)
def test_out_of_range_input_ids(model, value, message):
    bad = ids()
    bad[1, 5] = value
    with pytest.raises(ValueError, match=message):
        model(input_ids=bad)


def test_ids_at_the_edges_of_the_vocabulary_run(model):
    edge = ids()
    edge[0, 0], edge[1, 3] = 0, model.config.text_config.vocab_size - 1
    with torch.no_grad():
        assert torch.isfinite(model(input_ids=edge).logits).all()


@pytest.mark.parametrize("shape", [(2, 0), (0, SEQ)])
def test_empty_input_ids(model, shape):
    with pytest.raises(ValueError, match=rf"input_ids is empty \(shape \({shape[0]}, {shape[1]}\)\)"):
        model(input_ids=torch.zeros(shape, dtype=torch.long))


@pytest.mark.parametrize("mask_len", [SEQ - 1, SEQ + 3])
def test_attention_mask_of_the_wrong_length(model, mask_len):
    with pytest.raises(ValueError, match=rf"attention_mask has shape \(2, {mask_len}\), expected \(2, {SEQ}\)"):
        model(input_ids=ids(), attention_mask=torch.ones(2, mask_len, dtype=torch.long))


def test_attention_mask_after_the_prefill_covers_cached_and_new_positions(model):
    cache = DeepseekV41Cache(model.config)
    with torch.no_grad():
        model(input_ids=ids(), attention_mask=torch.ones(2, SEQ, dtype=torch.long), cache=cache, use_cache=True)
        step = torch.tensor([[7], [8]])
        with pytest.raises(ValueError, match=rf"expected \(2, {SEQ + 1}\) \({SEQ} cached \+ 1 new\)"):
            model(input_ids=step, attention_mask=torch.ones(2, 1, dtype=torch.long), cache=cache)
        out = model(input_ids=step, attention_mask=torch.ones(2, SEQ + 1, dtype=torch.long), cache=cache)
    assert out.logits.shape[:2] == (2, 1)


@pytest.mark.parametrize(
    "drop, message",
    [
        (
            ("pixel_values", "image_grid_hw", "image_token_types"),
            r"input_ids hold 8 image positions \(image_token_id 510\) but no pixel_values were given",
        ),
        (("pixel_values", "image_grid_hw"), r"image_token_types marks 1 image span but no pixel_values were given"),
    ],
)
def test_image_placeholders_without_pixel_values_are_an_error_in_forward_and_generate(model, drop, message):
    """Embedded as the image token itself they would make the model describe an image it never saw."""
    inputs = {key: value for key, value in image_inputs().items() if key not in drop}
    with pytest.raises(ValueError, match=message):
        model(**inputs)
    with pytest.raises(ValueError, match=message):
        model.generate(**inputs, max_new_tokens=2, do_sample=False)


def test_pixel_values_without_placeholders_are_an_error(model):
    inputs = image_inputs()
    inputs["input_ids"] = ids(1)  # text only
    with pytest.raises(ValueError, match=r"pixel_values of 1 image but input_ids hold no image placeholder"):
        model(**{key: value for key, value in inputs.items() if key != "image_token_types"})
    inputs["image_token_types"] = torch.full((1, SEQ), -1)
    with pytest.raises(ValueError, match=r"found 0 image spans but got 1 image$"):
        model(**inputs)


def test_image_token_types_with_merged_inputs_embeds_need_no_pixel_values(model):
    """Callers who merge image embeddings themselves pass inputs_embeds and image_token_types alone."""
    inputs = image_inputs()
    embeds = model.get_input_embeddings()(inputs["input_ids"])
    with torch.no_grad():
        out = model(input_ids=inputs["input_ids"], inputs_embeds=embeds, image_token_types=inputs["image_token_types"])
    assert torch.isfinite(out.logits).all()


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_pixel_values_stop_before_the_vit(model, bad):
    inputs = image_inputs()
    inputs["pixel_values"][17, 1, 3, 4] = bad
    vit_calls = []
    handle = model.model.vision.register_forward_pre_hook(lambda module, args: vit_calls.append(1))
    try:
        with pytest.raises(ValueError, match=r"pixel_values holds 1 NaN/inf values \(image 0\)"):
            model(**inputs)
    finally:
        handle.remove()
    assert not vit_calls
    with torch.no_grad():  # the same inputs with finite pixels run
        inputs["pixel_values"][17, 1, 3, 4] = 0.0
        assert torch.isfinite(model(**inputs).logits).all()


def test_truncated_model_safetensors_names_the_file(model, tmp_path):
    model.save_pretrained(tmp_path)
    weights = tmp_path / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match=rf"{weights} is truncated: its header lists {len(data):,} bytes"):
        DeepseekV41ForCausalLM.from_pretrained(tmp_path)
    weights.write_bytes(data[:100])  # cut inside the header
    with pytest.raises(ValueError, match=rf"{weights} is not a valid safetensors file"):
        DeepseekV41ForCausalLM.from_pretrained(tmp_path)


def test_inputs_past_max_position_embeddings_are_an_error_in_forward_and_generate(model, monkeypatch):
    """The rotary tables are fit to max_position_embeddings positions: a prefill longer than that, a decode step that
    passes it, and a generate call asked to pass it are refused (generate before its first step), not run."""
    monkeypatch.setattr(model.config.text_config, "max_position_embeddings", SEQ + 2)
    with torch.no_grad():
        model(ids(seq=SEQ + 2))  # exactly at the limit runs
        with pytest.raises(
            ValueError, match=r"reach position 27 \(0 cached and 27 new\), past max_position_embeddings \(26\)"
        ):
            model(ids(seq=SEQ + 3))
        cache = DeepseekV41Cache(model.config)
        model(ids(seq=SEQ), cache=cache)
        model(ids(seq=2), cache=cache)
        with pytest.raises(ValueError, match=r"reach position 27 \(26 cached and 1 new\)"):
            model(ids(seq=1), cache=cache)
    with pytest.raises(
        ValueError, match=r"max_length=27 tokens \(an input of 24\) passes max_position_embeddings \(26\)"
    ):
        model.generate(ids(), max_new_tokens=3, do_sample=False)
    assert model.generate(ids(), max_new_tokens=2, do_sample=False).shape[1] == SEQ + 2


@torch.no_grad()
def test_a_cache_refuses_masks_it_cannot_align():
    """With a cache, a prefill mask must hold one run of real tokens per row and a decode step's tokens must be
    real: a ValueError names each on the CPU (a device-side assertion on accelerators)."""
    model = tiny_model()
    ids = torch.randint(3, 500, (2, 6), generator=torch.Generator().manual_seed(0))
    holed = torch.tensor([[1, 1, 0, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    with pytest.raises(ValueError, match="one run of real tokens per row"):
        model(input_ids=ids, attention_mask=holed, use_cache=True)
    cache = model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=True).cache
    with pytest.raises(ValueError, match="new tokens must all be real"):
        model(input_ids=ids[:, :1], attention_mask=torch.tensor([[1] * 6 + [0], [1] * 7]), cache=cache)
