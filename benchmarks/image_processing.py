"""Images per second of the DeepSeek-V4.1 image processors against transformers' Pixtral and Qwen2-VL ones.

Two sets, the same decoded PIL images for every processor: 16 images of 1302×1302 (no resize for us) and 16 of
mixed sizes (upscales, shrinks, extreme aspects). Processors run interleaved, round after round, and each figure
is the median over rounds, so the ratios come from one run under the same machine load.

    python benchmarks/image_processing.py [--rounds 5] [--threads 2]

transformers' Pixtral / Qwen2-VL default to their torchvision backend, the baseline to beat; where torchvision is not
installed they fall back to their PIL backend, and the output says which one ran. torchvision has no build for the
project's torch 2.13 CPU, so measure against it from a separate virtual environment (torch and torchvision from
the same release, run with this repository on ``PYTHONPATH``):

    python3 -m venv /tmp/tv
    /tmp/tv/bin/pip install torch==2.14.1 torchvision==0.29.1 transformers==5.24.0 pillow
    PYTHONPATH=. /tmp/tv/bin/python benchmarks/image_processing.py
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings

import numpy as np
import torch
from PIL import Image
from transformers.utils import is_torchvision_available
from transformers.utils import logging as hf_logging

from processing.image_processing_dsv41 import DeepseekV41ImageProcessor
from processing.image_processing_pil_dsv41 import DeepseekV41ImageProcessorPil

MIXED_SIZES = [  # (width, height)
    (640, 480),
    (480, 640),
    (100, 2000),
    (2000, 100),
    (2000, 1500),
    (1500, 2000),
    (1920, 1080),
    (1080, 1920),
    (800, 800),
    (224, 224),
    (1024, 768),
    (3000, 2000),
    (320, 240),
    (1302, 1302),
    (1, 1),
    (4000, 3000),
]


def synthetic_image(width: int, height: int, seed: int) -> Image.Image:
    """A smooth colour field with noise: something a resampler cannot shortcut."""
    rng = np.random.default_rng(seed)
    ys, xs = np.mgrid[0:height, 0:width].astype(np.float32)
    phase = rng.uniform(0, 2 * np.pi, 3).astype(np.float32)
    field = np.stack([np.sin(xs / 37 + ys / 53 + p) for p in phase], axis=-1) * 100 + 128
    field += rng.normal(0, 12, field.shape).astype(np.float32)
    return Image.fromarray(np.clip(field, 0, 255).astype(np.uint8))


def competitor_processors() -> dict[str, object]:
    if is_torchvision_available():
        from transformers import PixtralImageProcessor, Qwen2VLImageProcessor

        return {"pixtral (torchvision)": PixtralImageProcessor(), "qwen2_vl (torchvision)": Qwen2VLImageProcessor()}
    from transformers import PixtralImageProcessorPil, Qwen2VLImageProcessorPil

    print("torchvision is not installed: the baselines are Pixtral's and Qwen2-VL's PIL backends (see the docstring)")
    return {"pixtral (pil)": PixtralImageProcessorPil(), "qwen2_vl (pil)": Qwen2VLImageProcessorPil()}


def images_per_second(processors: dict[str, object], images: list[Image.Image], rounds: int) -> dict[str, float]:
    timings = {name: [] for name in processors}
    names = list(processors)
    for name in names:  # warm-up: caches, lazy imports, allocator
        processors[name](images[:2], return_tensors="pt")
    for round_index in range(rounds):
        for name in names[round_index % len(names) :] + names[: round_index % len(names)]:
            start = time.perf_counter()
            processors[name](images, return_tensors="pt")
            timings[name].append(time.perf_counter() - start)
    return {name: len(images) / statistics.median(times) for name, times in timings.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")
    hf_logging.set_verbosity_error()  # Pixtral's "channel dimension is ambiguous" for the 1×1 image, every round

    ours = {"dsv41 torch": DeepseekV41ImageProcessor(), "dsv41 pil": DeepseekV41ImageProcessorPil()}
    theirs = competitor_processors()
    sets = {
        "16 × 1302×1302": [synthetic_image(1302, 1302, seed) for seed in range(16)],
        "16 mixed sizes": [synthetic_image(w, h, seed) for seed, (w, h) in enumerate(MIXED_SIZES)],
    }
    print(f"torch {torch.__version__}, {args.threads} threads, median of {args.rounds} rounds; images/s")
    for set_name, images in sets.items():
        rates = images_per_second({**ours, **theirs}, images, args.rounds)
        best_name = max(theirs, key=rates.get)
        print(f"\n{set_name}")
        for name, rate in rates.items():
            print(f"  {name:24s} {rate:8.2f}")
        for name in ours:
            print(f"  {name} / {best_name}: {rates[name] / rates[best_name]:.2f}×")


if __name__ == "__main__":
    main()
