"""DeepSeek-ViT, aligner and image merge against the reference captures of the tiny VL fixture."""

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from configuration.configuration_dsv41 import DeepseekV41Config
from modeling_dsv41.numerics import reference_numerics
from modeling_dsv41.vision import (
    DeepseekV41Aligner,
    DeepseekV41VisionRMSNorm,
    DeepseekV41VisionTransformer,
    merge_image_embeddings,
    unfold_token_grid,
)
from processing.image_tokens import token_grid

TEXT, START, IMAGE, NEWLINE, END = -1, 0, 1, 2, 3


@pytest.fixture(scope="module")
def tiny(fixtures_dir):
    root = fixtures_dir / "v41_tiny_vl"
    config = DeepseekV41Config.from_reference_dict(json.loads((root / "dense" / "config.json").read_text()))
    return {
        "config": config,
        "weights": load_file(root / "model.safetensors"),
        "inputs": load_file(root / "inputs.safetensors"),
        "captures": load_file(root / "dense" / "captures_noqdq.safetensors"),
        "expected": load_file(root / "dense" / "expected_noqdq.safetensors"),
    }


def _load_as_reference(module: torch.nn.Module, weights: dict, prefix: str) -> torch.nn.Module:
    """bf16 Linears and fp32 ViT norms, as the reference holds them under set_dtype(bf16)."""
    module.to(torch.bfloat16)
    for sub in module.modules():
        if isinstance(sub, DeepseekV41VisionRMSNorm):
            sub.float()
    module.load_state_dict({k.removeprefix(prefix): v for k, v in weights.items() if k.startswith(prefix)})
    for name, param in module.named_parameters():
        assert param.dtype == weights[prefix + name].dtype, name
    return module.eval()


@pytest.fixture(scope="module")
def vit(tiny):
    return _load_as_reference(DeepseekV41VisionTransformer(tiny["config"].vision_config), tiny["weights"], "vision.")


@pytest.fixture(scope="module")
def aligner(tiny):
    cfg = tiny["config"]
    module = DeepseekV41Aligner(cfg.vision_config, cfg.text_config.hidden_size)
    return _load_as_reference(module, tiny["weights"], "aligner.")


def _vit_captures(vit, aligner, pixel_values: torch.Tensor) -> dict[str, torch.Tensor]:
    """The ViT's patch embedding, block, final and aligner outputs on the fixture image, in reference numerics (its
    products, norms and fused attention round the same on every CPU), named as the reference's captures."""
    seen = {}
    hooks = [vit.patch_embed.register_forward_hook(lambda m, i, o: seen.__setitem__("vision.patch_embed_out", o))]
    for j, block in enumerate(vit.blocks):
        hooks.append(block.register_forward_hook(lambda m, i, o, j=j: seen.__setitem__(f"vision.blocks.{j}.out", o)))
    grid = torch.tensor([[9, 13]])
    try:
        with torch.no_grad(), reference_numerics():
            (features,) = vit(pixel_values, grid)
            (tokens,) = aligner([features], grid)
    finally:
        for hook in hooks:
            hook.remove()
    seen["vision.out"], seen["aligner.out"] = features, tokens
    assert len(seen) == 3 + len(vit.blocks)
    return seen


def test_vit_and_aligner_equal_the_reference_run_in_reference_numerics(tiny, vit, aligner):
    """DeepSeek's reference run in the mode on the same pixels (tests/data, make_goldens.py): the same bits."""
    golden = load_file(Path(__file__).parent / "data/reference_noqdq.safetensors")
    for key, actual in _vit_captures(vit, aligner, tiny["inputs"]["pixel_values"]).items():
        assert torch.equal(actual, golden[f"dense_fixture_{key}"]), key


def test_vit_and_aligner_match_the_shipped_captures(tiny, vit, aligner):
    """The shipped captures were made with native products outside the mode (fp32 accumulation); the mode
    accumulates in fp64, so some outputs round the other way. Measured max|Δ| in units of 2^-8 of the tensor's
    largest magnitude (a bf16 ulp there is 1-2 of them): patch embedding 0 (bit-identical), blocks 0.31 and 1.06,
    ViT output 1.34, aligner 0.89; the same on every emulated CPU (test_numerics). Bound: 2."""
    for key, actual in _vit_captures(vit, aligner, tiny["inputs"]["pixel_values"]).items():
        expected = tiny["captures"][key]
        assert actual.shape == expected.shape and actual.dtype == expected.dtype
        torch.testing.assert_close(actual, expected, rtol=0, atol=2 * 2**-8 * expected.abs().max().item())


def test_merge_matches_reference_inputs_embeds(tiny, aligner):
    weights, inputs, expected = tiny["weights"], tiny["inputs"], tiny["expected"]
    embeds = F.embedding(inputs["input_ids"], weights["embed.weight"])
    assert torch.equal(embeds[0], expected["embed_out"])
    with torch.no_grad():
        tokens = aligner([tiny["captures"]["vision.out"]], torch.tensor([[9, 13]]))
    merged = merge_image_embeddings(
        embeds,
        inputs["token_types"],
        tokens,
        weights["image_start"],
        weights["image_newline"],
        weights["image_end"],
        token_grids=[token_grid((9, 13), 3)],
    )
    assert torch.equal(merged[0], expected["inputs_embeds"])


def test_images_in_a_batch_are_encoded_exactly_as_alone(tiny, vit, aligner):
    gen = torch.Generator().manual_seed(0)
    fixture_image = tiny["inputs"]["pixel_values"]
    grids = [(4, 7), (9, 13), (1, 1), (5, 3), (4, 7)]
    images = [
        fixture_image if g == (9, 13) else (torch.rand(g[0] * g[1], 3, 14, 14, generator=gen) * 2 - 1).bfloat16()
        for g in grids
    ]
    with torch.no_grad():
        batch_features = vit(torch.cat(images), torch.tensor(grids))
        batch_tokens = aligner(batch_features, torch.tensor(grids))
        for x, g, features, tokens in zip(images, grids, batch_features, batch_tokens):
            (alone,) = vit(x, torch.tensor([g]))
            assert torch.equal(features, alone)
            assert torch.equal(tokens, aligner([alone], torch.tensor([g]))[0])
            assert tokens.shape == (token_grid(g, 3)[0] * token_grid(g, 3)[1], 64)
    # the two 4×7 images differ, so the outputs must too (guards against a broadcast mix-up)
    assert not torch.equal(batch_features[0], batch_features[4])


def test_unfold_token_grid_is_channel_major_like_f_unfold():
    h, w, c, r = 4, 5, 6, 3
    features = torch.randn(h * w, c)
    padded = F.pad(features.view(h, w, c).permute(2, 0, 1), (0, -w % r, 0, -h % r))
    expected = F.unfold(padded.unsqueeze(0), r, stride=r)[0].T
    assert torch.equal(unfold_token_grid(features, h, w, r), expected)
    # and it is a pixel-unshuffle of the padded grid
    unshuffled = F.pixel_unshuffle(padded.unsqueeze(0), r)[0]  # [c·r·r, h/r, w/r]
    assert torch.equal(unfold_token_grid(features, h, w, r), unshuffled.flatten(1).T)


@pytest.mark.parametrize(
    ("vit_grid", "expected"), [((9, 13), (3, 5)), ((93, 93), (31, 31)), ((1, 1), (1, 1)), ((3, 4), (1, 2))]
)
def test_image_token_grid_rounds_up(vit_grid, expected):
    assert token_grid(vit_grid, 3) == expected


def _span(h: int, w: int) -> list[int]:
    return [START] + ([IMAGE] * w + [NEWLINE]) * h + [END]


def _batch_types() -> tuple[torch.Tensor, list[tuple[int, int]]]:
    """Row 0: text, a 2×3 image, text, a 1×2 image. Row 1: text, a 3×1 image, text."""
    row0 = [TEXT] * 2 + _span(2, 3) + [TEXT] + _span(1, 2) + [TEXT]
    row1 = [TEXT] * 3 + _span(3, 1) + [TEXT] * 2
    row1 += [TEXT] * (len(row0) - len(row1))
    return torch.tensor([row0, row1]), [(2, 3), (1, 2), (3, 1)]


def _merge_args(dim: int = 8, dtype: torch.dtype = torch.float32):
    types, grids = _batch_types()
    gen = torch.Generator().manual_seed(1)
    embeds = torch.randn(*types.shape, dim, generator=gen).to(dtype)
    features = [torch.randn(h * w, dim, generator=gen) for h, w in grids]
    start, newline, end = torch.randn(3, dim, generator=gen)
    return embeds, types, features, start, newline, end, grids


def test_merge_fills_slots_in_reading_order_over_the_batch():
    embeds, types, features, start, newline, end, grids = _merge_args(dtype=torch.bfloat16)
    merged = merge_image_embeddings(embeds, types, features, start, newline, end, token_grids=grids)
    assert merged.dtype == torch.bfloat16
    rows = iter(torch.cat(features))  # image rows in order of appearance, row-major over the batch
    delimiters = {START: start, NEWLINE: newline, END: end}
    for b in range(types.shape[0]):
        for s in range(types.shape[1]):
            t = int(types[b, s])
            want = embeds[b, s] if t == TEXT else next(rows) if t == IMAGE else delimiters[t]
            assert torch.equal(merged[b, s], want.to(torch.bfloat16)), (b, s)
    assert next(rows, None) is None


def test_merge_is_differentiable_in_features_and_delimiters():
    embeds, types, features, start, newline, end, grids = _merge_args()
    leaves = [embeds, *features, start, newline, end]
    for leaf in leaves:
        leaf.requires_grad_(True)
    upstream = torch.randn(embeds.shape)
    (merge_image_embeddings(embeds, types, features, start, newline, end) * upstream).sum().backward()
    assert torch.equal(embeds.grad, upstream * (types == TEXT).unsqueeze(-1))
    assert torch.equal(torch.cat([f.grad for f in features]), upstream[types == IMAGE])
    torch.testing.assert_close(start.grad, upstream[types == START].sum(0))
    torch.testing.assert_close(newline.grad, upstream[types == NEWLINE].sum(0))


def test_merge_without_images_is_a_no_op():
    embeds = torch.randn(2, 5, 8)
    start = torch.zeros(8)
    assert merge_image_embeddings(embeds, torch.full((2, 5), TEXT), [], start, start, start) is embeds


def _types_with(row0: list[int]) -> torch.Tensor:
    return torch.tensor([row0 + [TEXT] * (16 - len(row0))])


@pytest.mark.parametrize(
    ("types", "n_features", "match"),
    [
        (_types_with(_span(1, 2)), 2, "found 1 image span but got 2 images"),
        (_types_with(_span(1, 2) + _span(1, 2)), 1, "found 2 image spans but got 1 image$"),
        (_types_with([START, IMAGE, IMAGE, NEWLINE]), 1, "malformed image span"),  # no end
        (_types_with([IMAGE, NEWLINE, END]), 1, "malformed image span"),  # no start
        (_types_with(_span(1, 2) + [IMAGE]), 1, "malformed image span"),  # image token outside a span
        (_types_with([START, IMAGE, TEXT, NEWLINE, END]), 1, "malformed image span"),  # text inside a span
        (_types_with([START, START, IMAGE, NEWLINE, END, END]), 1, "malformed image span"),  # nested
        (_types_with([4]), 0, "must hold -1"),
        (_types_with([START, IMAGE, IMAGE, NEWLINE, IMAGE, NEWLINE, END]), 1, "rows"),  # ragged rows
        (_types_with([START, IMAGE, IMAGE, END]), 1, "rows"),  # no newline
        (_types_with([START, IMAGE, NEWLINE, IMAGE, END]), 1, "rows"),  # last row without newline
        (_types_with([START, NEWLINE, END]), 1, "rows"),  # empty row
    ],
)
def test_merge_rejects_malformed_spans(types, n_features, match):
    embeds, z = torch.zeros(1, 16, 4), torch.zeros(4)
    with pytest.raises(ValueError, match=match):
        merge_image_embeddings(embeds, types, [torch.zeros(2, 4)] * n_features, z, z, z)


def test_merge_rejects_features_that_disagree_with_the_span():
    embeds, types, features, start, newline, end, grids = _merge_args()
    with pytest.raises(ValueError, match=r"image 1: .* 1×2 image tokens .* shape \(3, 8\)"):
        merge_image_embeddings(embeds, types, [features[0], torch.zeros(3, 8), features[2]], start, newline, end)
    with pytest.raises(ValueError, match="shape"):
        merge_image_embeddings(embeds, types, [features[0], features[1], features[2][:, :4]], start, newline, end)
    with pytest.raises(ValueError, match=r"image 0: .* 2×3 grid, but its token grid is \(3, 2\)"):
        merge_image_embeddings(embeds, types, features, start, newline, end, token_grids=[(3, 2), *grids[1:]])
    with pytest.raises(ValueError, match="must match inputs_embeds"):
        merge_image_embeddings(embeds[:, :-1], types, features, start, newline, end)


def test_vit_and_aligner_reject_inconsistent_grids(vit, aligner):
    patches = torch.zeros(12, 3, 14, 14, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="holds 12 patches but image_grid_hw"):
        vit(patches, torch.tensor([[3, 5]]))
    with pytest.raises(ValueError, match=r"must be \[total_patches, 3, 14, 14\]"):
        vit(patches.flatten(1), torch.tensor([[3, 4]]))
    with pytest.raises(ValueError, match="at least 1×1"):
        vit(patches, torch.tensor([[3, 4], [0, 2]]))
    with pytest.raises(ValueError, match="2 feature tensors for 1 image grids"):
        aligner([torch.zeros(12, 64)] * 2, torch.tensor([[3, 4]]))
    with pytest.raises(ValueError, match="do not fit a 4×4 patch grid"):
        aligner([torch.zeros(12, 64)], torch.tensor([[4, 4]]))
