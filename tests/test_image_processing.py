"""DeepSeek-V4.1 image processors against the reference fixtures, PIL, and each other."""

import base64
import hashlib
import io
import json
import math
import random

import numpy as np
import pytest
import torch
from PIL import Image, ImageOps
from safetensors.torch import load_file
from transformers import AutoImageProcessor
from transformers.image_utils import PILImageResampling
from transformers.utils import is_torchvision_available

from processing import (
    DeepseekV41ImageProcessor,
    DeepseekV41ImageProcessorPil,
    ImageTokenType,
    image_span_token_types,
    plan_image_grid,
)
from processing.image_patches import patch_values, pixel_value_table
from processing.image_resampling import resize_like_pil

BACKENDS = [DeepseekV41ImageProcessor, DeepseekV41ImageProcessorPil]
TINY = {"min_pixels": 20000, "max_image_tokens": 64}  # the tiny preset's vision sizing: small, fast canvases


def sha256_bf16(tensor: torch.Tensor) -> str:
    return hashlib.sha256(tensor.contiguous().view(torch.int16).numpy().tobytes()).hexdigest()


def random_image(width: int, height: int, seed: int, mode: str = "RGB") -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)).convert(mode)


def reference_patches(image: Image.Image, **sizing) -> torch.Tensor:
    """The reference's load_image, step for step, for images it can take (for comparison only)."""
    plan = plan_image_grid(image.height, image.width, **sizing)
    height, width = plan.canvas_size
    padded = ImageOps.pad(image.convert("RGB"), (width, height), color=(127, 127, 127))
    x = torch.from_numpy(np.asarray(padded, dtype=np.float32)).permute(2, 0, 1) / 255
    x = ((x - 0.5) / 0.5).to(torch.bfloat16)
    rows, cols = plan.patch_grid
    return x.reshape(3, rows, 14, cols, 14).permute(1, 3, 0, 2, 4).reshape(rows * cols, 3, 14, 14)


# --- the plan -----------------------------------------------------------------------------------------------------


def test_plan_seed_facts():
    plan = plan_image_grid(1302, 1302)
    assert (plan.patch_grid, plan.token_grid, plan.num_positions) == ((93, 93), (31, 31), 994)
    assert plan.num_patches == 8649


def test_no_square_image_exceeds_961_visual_tokens():
    visual = [math.prod(plan_image_grid(side, side).token_grid) for side in range(1, 4001)]
    assert max(visual) == 961  # reached, never exceeded: the budget bounds positions, 31·32 + 2 = 994 ≤ 1024


@pytest.mark.parametrize("budget", [4, 5, 20, 64, 1024, 4096])
def test_token_budget_holds_for_any_size(budget):
    rng = random.Random(budget)
    sizes = [(rng.randint(1, 5000), rng.randint(1, 5000)) for _ in range(2000)]
    sizes += [(1, rng.randint(1, 10**6)) for _ in range(200)] + [(rng.randint(1, 10**6), 1) for _ in range(200)]
    sizes += [(1, 1), (10**6, 10**6), (14, 14), (15, 15)]
    for height, width in sizes:
        for max_wh_ratio in (None, 1.0, 2.5):
            plan = plan_image_grid(height, width, max_image_tokens=budget, max_wh_ratio=max_wh_ratio)
            assert plan.num_positions <= budget, (height, width, budget, max_wh_ratio)
            canvas_h, canvas_w = plan.canvas_size
            assert canvas_h % 14 == 0 and canvas_w % 14 == 0 and canvas_h >= 14 and canvas_w >= 14
            (top, left), (content_h, content_w) = plan.content_offset, plan.content_size
            assert 0 <= top and top + content_h <= canvas_h and 0 <= left and left + content_w <= canvas_w


def test_plan_matches_reference_fixture(fixtures_dir):
    expected = json.loads((fixtures_dir / "image_preproc" / "expected.json").read_text())
    args = expected["vision_args"]
    for case in expected["cases"]:
        width, height = case["source_wh"]
        plan = plan_image_grid(
            height,
            width,
            patch_size=args["vision_patch_size"],
            downsample_ratio=args["vision_downsample_ratio"],
            max_image_tokens=args["vision_max_n_token"],
            min_pixels=args["vision_min_pixels"],
            max_wh_ratio=args["vision_max_wh_ratio"],
        )
        (top, left), (content_h, content_w) = plan.content_offset, plan.content_size
        assert list(plan.canvas_size) == case["best_hw"], case["file"]
        assert [content_w, content_h] == case["content_resized_wh"], case["file"]
        assert [left, top, left + content_w, top + content_h] == case["content_box_xyxy"], case["file"]
        assert list(plan.patch_grid) == case["n_vit_hw"] and list(plan.token_grid) == case["n_llm_hw"]
        assert plan.num_positions == case["num_image_tokens"]
        types = image_span_token_types(plan.token_grid)
        assert types[: len(case["token_types_head"])] == case["token_types_head"]
        names = {"IMAGE_START": ImageTokenType.START, "IMAGE": ImageTokenType.IMAGE}
        names |= {"IMAGE_NEW_LINE": ImageTokenType.NEWLINE, "IMAGE_END": ImageTokenType.END}
        assert {name: types.count(kind) for name, kind in names.items()} == case["token_type_counts"]


def test_shrink_uses_the_reference_float_arithmetic():
    # 2000×1500 costs 1778 positions at full size; the reference's floors land on 1134×1512, not the exact optimum
    plan = plan_image_grid(1500, 2000)
    assert plan.canvas_size == (1134, 1512) and plan.num_positions == 1001


def test_max_wh_ratio_stretches_wide_images():
    plan = plan_image_grid(100, 1000, max_wh_ratio=2.0, min_pixels=0)
    assert plan.content_size == plan.canvas_size and plan.content_offset == (0, 0)
    assert plan.canvas_size == (112, 210)  # width clamped to 2 × 100 = 200, rounded up to 14s


# --- pixels: the reference fixtures ----------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_patches_match_reference_fixture(backend, fixtures_dir):
    directory = fixtures_dir / "image_preproc"
    expected = json.loads((directory / "expected.json").read_text())
    processor = backend()
    for case in expected["cases"]:
        outputs = processor(Image.open(directory / case["file"]))
        pixel_values, stats = outputs["pixel_values"], case["patches"]
        assert list(pixel_values.shape) == stats["shape"] and pixel_values.dtype == torch.bfloat16
        assert sha256_bf16(pixel_values) == stats["sha256_bf16_bytes"], case["file"]  # bit-exact
        assert outputs["image_grid_hw"].tolist() == [case["n_vit_hw"]]


@pytest.mark.parametrize("backend", BACKENDS)
def test_tiny_vl_fixture_image(backend, fixtures_dir):
    inputs = load_file(fixtures_dir / "v41_tiny_vl" / "inputs.safetensors")
    outputs = backend(**TINY)(str(fixtures_dir / "v41_tiny_vl" / "image.png"))
    assert torch.equal(outputs["pixel_values"].view(torch.int16), inputs["pixel_values"].view(torch.int16))
    assert outputs["image_grid_hw"].tolist() == [[9, 13]]
    plan = plan_image_grid(100, 150, **TINY)
    assert image_span_token_types(plan.token_grid) == inputs["image_token_types"].tolist()


# --- pixels: the two backends and the reference on other inputs ----------------------------------------------------


def test_backends_agree_with_reference_on_random_sizes():
    rng = random.Random(0)
    fast, pil = DeepseekV41ImageProcessor(**TINY), DeepseekV41ImageProcessorPil(**TINY)
    images = [random_image(rng.randint(1, 400), rng.randint(1, 400), seed) for seed in range(24)]
    images += [random_image(1, 1, 1), random_image(1, 3000, 2), random_image(3000, 1, 3), random_image(7, 900, 4)]
    fast_out, pil_out = fast(images), pil(images)
    assert torch.equal(fast_out["image_grid_hw"], pil_out["image_grid_hw"])
    assert sha256_bf16(fast_out["pixel_values"]) == sha256_bf16(pil_out["pixel_values"])
    expected = torch.cat([reference_patches(image, **TINY) for image in images])
    assert sha256_bf16(pil_out["pixel_values"]) == sha256_bf16(expected)


def test_extreme_aspect_respects_budget_and_can_collapse_content():
    processor = DeepseekV41ImageProcessor()
    outputs = processor(random_image(1, 100000, 0))
    rows, cols = outputs["image_grid_hw"][0].tolist()
    assert (rows, cols) == (1533, 3)  # a single LM column of 511 tokens: 511 · 2 + 2 = 1024 positions
    # PIL's contain() rounds a 1-pixel-high content to zero rows here; the canvas is pure padding, as in the reference
    assert plan_image_grid(1, 100000).content_size[0] == 0
    gray = ((torch.tensor(127.0) / 255 - 0.5) / 0.5).to(torch.bfloat16)
    assert bool((processor(random_image(100000, 1, 0))["pixel_values"] == gray).all())


@pytest.mark.parametrize("mode", ["L", "LA", "P", "PA", "RGBA", "CMYK", "I;16", "I", "F", "1", "YCbCr", "HSV"])
def test_modes_convert_like_pil(mode):
    image = random_image(37, 23, 5, "RGB").convert(mode) if mode not in ("I;16", "I", "F") else None
    if image is None:
        image = Image.fromarray(np.random.default_rng(5).integers(0, 300, (23, 37)).astype(np.uint16)).convert(mode)
    expected = DeepseekV41ImageProcessorPil(**TINY)(image.convert("RGB"))["pixel_values"]
    for backend in BACKENDS:
        assert torch.equal(backend(**TINY)(image)["pixel_values"], expected), (backend.__name__, mode)


def test_16_bit_png_keeps_the_reference_result_and_warns_once(tmp_path):
    """A 16-bit PNG clips to mostly white under the reference's convert("RGB"): same pixels, one warning."""
    import warnings

    from processing import image_intake

    values = np.random.default_rng(8).integers(0, 2**16, (23, 37)).astype(np.uint16)
    Image.fromarray(values).save(tmp_path / "deep.png")
    image = Image.open(tmp_path / "deep.png")
    assert image.mode == "I;16"
    expected = reference_patches(image, **TINY)
    image_intake._warn_high_bit_depth.cache_clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for backend in (*BACKENDS, *BACKENDS):
            assert torch.equal(backend(**TINY)(image)["pixel_values"], expected), backend.__name__
        DeepseekV41ImageProcessor(**TINY)(random_image(37, 23, 8))  # 8-bit: no warning
    messages = [str(w.message) for w in caught if issubclass(w.category, UserWarning)]
    assert len(messages) == 1 and "'I;16'" in messages[0] and "clips values above 255" in messages[0], messages


def test_alpha_and_palette_transparency_are_dropped_not_composited():
    rgba = random_image(30, 20, 6, "RGBA")
    rgba.putalpha(0)
    processor = DeepseekV41ImageProcessor(**TINY)
    assert torch.equal(processor(rgba)["pixel_values"], processor(rgba.convert("RGB"))["pixel_values"])
    palette = random_image(30, 20, 7, "P")
    palette.info["transparency"] = 0
    assert torch.equal(processor(palette)["pixel_values"], processor(palette.convert("RGB"))["pixel_values"])


def test_exif_orientation_is_ignored_like_the_reference_unless_asked():
    image = random_image(40, 20, 8)
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90° clockwise to display
    buffer = io.BytesIO()
    image.save(buffer, format="PNG", exif=exif)
    upright = image.transpose(Image.Transpose.ROTATE_270)
    for backend in BACKENDS:
        processor = backend(**TINY)
        stored = processor(buffer.getvalue())
        assert torch.equal(stored["pixel_values"], processor(image)["pixel_values"])
        assert stored["image_grid_hw"].tolist() == [list(processor.plan(20, 40).patch_grid)]
        rotated = processor(buffer.getvalue(), apply_exif_orientation=True)
        assert torch.equal(rotated["pixel_values"], processor(upright)["pixel_values"])
        assert torch.equal(
            backend(**TINY, apply_exif_orientation=True)(buffer.getvalue())["pixel_values"], rotated["pixel_values"]
        )


# --- inputs ------------------------------------------------------------------------------------------------------


def test_arrays_and_tensors():
    image = random_image(33, 21, 9)
    array = np.asarray(image)
    processor = DeepseekV41ImageProcessor(**TINY)
    expected = processor(image)["pixel_values"]
    same = [
        array,  # HWC numpy
        torch.from_numpy(array.copy()).permute(2, 0, 1),  # CHW tensor
        array.astype(np.float32) / 255,  # floats in [0, 1]
        np.concatenate([array, np.zeros_like(array[..., :1])], axis=-1),  # RGBA: alpha dropped
    ]
    for entry in same:
        assert torch.equal(processor(entry)["pixel_values"], expected)
    channels_first = processor(array.transpose(2, 0, 1), input_data_format="channels_first")
    assert torch.equal(channels_first["pixel_values"], expected)
    gray = array[..., 0]
    assert torch.equal(processor(gray)["pixel_values"], processor(Image.fromarray(gray))["pixel_values"])
    mask = gray > 127
    assert torch.equal(processor(mask)["pixel_values"], processor(Image.fromarray(mask))["pixel_values"])
    batch = processor(np.stack([array, array]))
    assert torch.equal(batch["pixel_values"], torch.cat([expected, expected]))


def test_encoded_sources(tmp_path):
    image = random_image(25, 19, 10)
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    data = buffer.getvalue()
    (tmp_path / "image.png").write_bytes(data)
    encoded = base64.b64encode(data).decode()
    processor = DeepseekV41ImageProcessor(**TINY)
    expected = processor(image)["pixel_values"]
    sources = [
        str(tmp_path / "image.png"),
        tmp_path / "image.png",
        data,
        f"data:image/png;base64,{encoded}",
        "data:image/png," + "".join(f"%{byte:02X}" for byte in data),
        encoded,
    ]
    outputs = processor(sources)
    assert torch.equal(outputs["pixel_values"], torch.cat([expected] * len(sources)))


@pytest.mark.parametrize("backend", BACKENDS)
def test_bad_inputs_name_the_image(backend, tmp_path):
    processor = backend(**TINY)
    good = random_image(20, 20, 11)
    buffer = io.BytesIO()
    good.save(buffer, format="PNG")  # random pixels: about 1.3 kB, so 200 bytes cut it short
    cases = [
        (b"not an image at all", "cannot decode"),
        (buffer.getvalue()[:200], "cannot decode"),  # truncated PNG
        (b"", "empty"),
        (np.zeros((0, 5, 3), np.uint8), "empty"),
        (Image.new("RGB", (0, 4)), "empty"),
        (str(tmp_path / "missing.png"), "image file .*missing.png' does not exist"),
        (tmp_path / "missing.png", "image file .*missing.png' does not exist"),
        (str(tmp_path), "is not a file"),
        ("https://example.com/cat.png", "no network"),
        (np.zeros((4, 4, 3), np.int32), "dtype"),
        (np.full((4, 4, 3), 2.0, np.float32), r"\[0, 1\]"),
        (np.zeros((5, 5, 7), np.uint8), "channel axis"),
        (np.zeros((2, 5, 5, 5, 3), np.uint8), "2-D or 3-D"),
    ]
    for bad, message in cases:
        with pytest.raises(ValueError, match=rf"image 1: .*{message}"):
            processor([good, bad, good])
    with pytest.raises(TypeError, match="image 1: unsupported image type"):
        processor([good, 42])


def test_threads_take_large_images_first_but_keep_order_and_the_first_error():
    """On CPU the torch backend hands the largest images out first; outputs and errors stay in input order."""
    processor = DeepseekV41ImageProcessor(**TINY)
    small_bad, large_bad = np.zeros((4, 4, 3), np.int32), np.zeros((90, 90, 3), np.int32)
    images = [random_image(30, 20, 1), random_image(300, 200, 2), random_image(5, 8, 3), random_image(120, 90, 4)]
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        together = processor(images)["pixel_values"]
        with pytest.raises(ValueError, match="image 1: .*dtype"):
            processor([images[0], small_bad, large_bad])
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(together, torch.cat([processor(image)["pixel_values"] for image in images]))


def test_empty_batch():
    outputs = DeepseekV41ImageProcessor()([])
    assert outputs["pixel_values"].shape == (0, 3, 14, 14) and outputs["image_grid_hw"].shape == (0, 2)


def test_patches_concatenate_in_image_order():
    processor = DeepseekV41ImageProcessor(**TINY)
    first, second = random_image(50, 90, 12), random_image(120, 40, 13)
    both = processor([first, second])
    n_first = int(both["image_grid_hw"][0].prod())
    assert torch.equal(both["pixel_values"][:n_first], processor(first)["pixel_values"])
    assert torch.equal(both["pixel_values"][n_first:], processor(second)["pixel_values"])


# --- the torch kernels, checked on CPU ---------------------------------------------------------------------------


@pytest.mark.parametrize("resample", [PILImageResampling.BICUBIC, PILImageResampling.BILINEAR, PILImageResampling.BOX])
def test_torch_resampling_is_pillow_bit_for_bit(resample):
    rng = np.random.default_rng(int(resample))
    shapes = [tuple(int(v) for v in rng.integers(1, 120, 4)) for _ in range(25)]
    shapes += [(40, 30, 40, 10), (40, 30, 41, 9), (30, 40, 20, 16), (30, 40, 20, 17), (5, 300, 90, 2)]
    for in_h, in_w, out_h, out_w in shapes:  # includes both pass orders and the boundary of Pillow 13's rule
        array = rng.integers(0, 256, (in_h, in_w, 3), dtype=np.uint8)
        expected = np.asarray(Image.fromarray(array).resize((out_w, out_h), resample))
        actual = resize_like_pil(torch.from_numpy(array), (out_h, out_w), resample).numpy()
        assert np.array_equal(actual, expected), (in_h, in_w, out_h, out_w)


def test_torch_letterbox_and_patches_match_cpu_path():
    processor = DeepseekV41ImageProcessor(**TINY)
    table = pixel_value_table(
        do_rescale=True, rescale_factor=1 / 255, do_normalize=True, image_mean=(0.1, 0.5, 0.7), image_std=(0.2, 0.5, 1)
    )
    for seed, (width, height) in enumerate([(150, 100), (30, 260), (400, 9), (154, 154)]):  # the last: no padding
        image = random_image(width, height, seed)
        plan = processor.plan(height, width)
        cpu = processor._letterbox(image, plan, PILImageResampling.BICUBIC)
        tensor = processor._letterbox(torch.from_numpy(np.array(image)), plan, PILImageResampling.BICUBIC)
        assert np.array_equal(tensor.numpy(), cpu)
        assert torch.equal(patch_values(tensor, 14, table), patch_values(np.asarray(cpu), 14, table))


def test_value_table_is_the_reference_arithmetic():
    levels = torch.arange(256, dtype=torch.float32)
    expected = ((levels / 255 - 0.5) / 0.5).to(torch.bfloat16)
    table = pixel_value_table(
        do_rescale=True, rescale_factor=1 / 255, do_normalize=True, image_mean=0.5, image_std=0.5
    )
    assert all(torch.equal(row.view(torch.int16), expected.view(torch.int16)) for row in table)


# --- configuration, saving, auto classes ---------------------------------------------------------------------------


def test_parameters_are_validated():
    with pytest.raises(ValueError, match="max_image_tokens"):
        DeepseekV41ImageProcessor(max_image_tokens=3)
    with pytest.raises(ValueError, match="max_wh_ratio"):
        DeepseekV41ImageProcessor(max_wh_ratio=0.5)
    with pytest.raises(ValueError, match="DeepseekV41ImageProcessorPil takes every PIL filter"):
        DeepseekV41ImageProcessor(resample=PILImageResampling.LANCZOS)
    assert DeepseekV41ImageProcessorPil(resample=PILImageResampling.LANCZOS).resample == PILImageResampling.LANCZOS
    with pytest.raises(ValueError, match="bfloat16"):
        DeepseekV41ImageProcessor()(random_image(8, 8, 0), return_tensors="np")


def test_from_vision_config_and_patch_count():
    from configuration import DeepseekV41Config

    vision = DeepseekV41Config.from_preset("tiny").vision_config
    processor = DeepseekV41ImageProcessorPil.from_vision_config(vision)
    assert (processor.min_pixels, processor.max_image_tokens) == (vision.min_pixels, vision.max_image_tokens)
    assert processor.get_number_of_image_patches(100, 150) == 117
    assert DeepseekV41ImageProcessor().get_number_of_image_patches(1302, 1302) == 8649


@pytest.mark.parametrize("backend", BACKENDS)
def test_save_load_round_trip(backend, tmp_path):
    processor = backend(max_image_tokens=256, min_pixels=1000, max_wh_ratio=3.0, image_mean=[0.4, 0.5, 0.6])
    processor.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "preprocessor_config.json").read_text())
    assert saved["image_processor_type"] == "DeepseekV41ImageProcessor"  # one config for both backends
    reloaded = backend.from_pretrained(tmp_path)
    image = random_image(300, 70, 14)
    assert torch.equal(reloaded(image)["pixel_values"], processor(image)["pixel_values"])
    assert (reloaded.max_image_tokens, reloaded.min_pixels, reloaded.max_wh_ratio) == (256, 1000, 3.0)
    default = DeepseekV41ImageProcessor if is_torchvision_available() else DeepseekV41ImageProcessorPil
    choices = ((None, default), ("pil", DeepseekV41ImageProcessorPil), ("torchvision", DeepseekV41ImageProcessor))
    for requested, expected in choices:
        auto = AutoImageProcessor.from_pretrained(tmp_path, backend=requested)
        assert type(auto) is expected and auto.max_image_tokens == 256


def test_repeated_lazy_image_is_decoded_once(fixtures_dir):
    lazy = Image.open(fixtures_dir / "v41_tiny_vl" / "image.png")  # not decoded yet: threads must not share it
    outputs = DeepseekV41ImageProcessor(**TINY)([lazy, lazy, lazy])
    single = outputs["pixel_values"].shape[0] // 3
    assert torch.equal(outputs["pixel_values"], outputs["pixel_values"][:single].repeat(3, 1, 1, 1))


def test_a_plan_that_shrinks_to_an_empty_canvas_is_a_clear_error():
    """With downsample_ratio 1 and a tight budget the reference's float arithmetic reaches a 0-pixel side."""
    with pytest.raises(ValueError, match="empty 0×140 canvas"):
        plan_image_grid(220, 2235, downsample_ratio=1, max_image_tokens=20, min_pixels=0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_size_is_transformers_view_of_min_pixels(backend):
    processor = backend(size={"shortest_edge": 3000}, max_image_tokens=64)
    assert processor.min_pixels == 3000 and processor.size == {"shortest_edge": 3000}
    processor.min_pixels = 20000
    assert processor.size == {"shortest_edge": 20000}
    assert backend.from_dict(processor.to_dict()).min_pixels == 20000
    with pytest.raises(ValueError, match="only 'shortest_edge'"):
        backend(size={"height": 28, "width": 28})
    image = random_image(40, 30, seed=0)
    smaller = processor(image, min_pixels=3000, return_tensors="pt").pixel_values
    assert smaller.shape[0] < processor(image, return_tensors="pt").pixel_values.shape[0]
    # a call's size is its min_pixels (transformers' processors pass it so), never silently ignored
    assert torch.equal(processor(image, size={"shortest_edge": 3000}, return_tensors="pt").pixel_values, smaller)
    assert processor.plan(40, 30, size={"shortest_edge": 3000}) == processor.plan(40, 30, min_pixels=3000)
    with pytest.raises(ValueError, match="disagree"):
        processor(image, size={"shortest_edge": 5000}, min_pixels=3000)
    with pytest.raises(ValueError, match="only 'shortest_edge'"):
        processor(image, size={"height": 28, "width": 28})


def test_kwargs_class_is_exposed_by_both_backend_modules():
    import processing.image_processing_pil_dsv41 as pil_module

    assert pil_module.DeepseekV41ImageProcessorKwargs is DeepseekV41ImageProcessorPil.valid_kwargs
