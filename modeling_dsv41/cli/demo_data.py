"""The demo's data: coloured shapes at grid positions, captioned, generated on the fly (no downloads).

Every image shows one shape — a ``circle``, ``square`` or ``triangle`` — in ``red``, ``green`` or ``blue`` in one
quadrant of a noisy, tinted background; its caption names the three, e.g. ``"red circle top left"``. Size, exact
place, hues, background and noise vary per image, so the 36 captions are never drawn the same way twice and the
eval split holds unseen images of every caption. A model must read colour, shape *and* position from the pixels
to get a caption exactly right: guessing scores 1/36.

A second caption style, ``"sentence"`` (``"a red circle in the top left"``), is the new task the demo teaches a
fine-tuned model with a LoRA adapter.

Generation is deterministic: the same ``seed`` gives the same images, byte for byte, on any machine.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

import numpy as np
from PIL import Image, ImageDraw
from torch.utils.data import Dataset
from transformers import PreTrainedTokenizerFast

from processing.tokenizer_dsv41 import DEFAULT_CORPUS, build_tiny_tokenizer

COLORS: dict[str, tuple[int, int, int]] = {"red": (210, 45, 40), "green": (40, 160, 60), "blue": (45, 75, 215)}
SHAPES = ("circle", "square", "triangle")
POSITIONS = ("top left", "top right", "bottom left", "bottom right")
PROMPT = "Describe the image."
IMAGE_SIZE = 84  # 6×6 ViT patches → 2×2 visual tokens: an 8-position image span
CAPTION_STYLES = {"short": "{color} {shape} {position}", "sentence": "a {color} {shape} in the {position}"}
CAPTIONS = tuple(f"{color} {shape} {position}" for color in COLORS for shape in SHAPES for position in POSITIONS)
TOKENIZER_VOCAB_SIZE = 512


@dataclass(frozen=True)
class ShapeSample:
    image: Image.Image
    color: str
    shape: str
    position: str
    style: str = "short"

    @property
    def caption(self) -> str:
        return CAPTION_STYLES[self.style].format(color=self.color, shape=self.shape, position=self.position)


def _jitter(rgb: tuple[int, int, int], rng: random.Random, amount: int) -> tuple[int, int, int]:
    return tuple(min(255, max(0, c + rng.randint(-amount, amount))) for c in rgb)


def _shape_outline(shape: str, cx: float, cy: float, r: float, angle: float) -> list[tuple[float, float]]:
    if shape == "circle":
        return [(cx + r * math.cos(t), cy + r * math.sin(t)) for t in np.linspace(0, 2 * math.pi, 32, endpoint=False)]
    corners = 4 if shape == "square" else 3
    radius = r * (1.2 if shape == "square" else 1.3)  # similar areas for the three shapes
    turns = [angle + 2 * math.pi * k / corners for k in range(corners)]
    return [(cx + radius * math.cos(t), cy + radius * math.sin(t)) for t in turns]


def render_sample(rng: random.Random, size: int = IMAGE_SIZE, style: str = "short") -> ShapeSample:
    """One image and what it shows, every choice drawn from ``rng``; ``style`` picks the caption's wording."""
    color, shape, position = rng.choice(list(COLORS)), rng.choice(SHAPES), rng.choice(POSITIONS)
    background = _jitter((rng.randint(150, 235),) * 3, rng, 20)
    pixels = np.asarray(background, dtype=np.int16) + np.asarray(
        np.random.default_rng(rng.getrandbits(32)).integers(-12, 13, (size, size, 3)), dtype=np.int16
    )
    image = Image.fromarray(pixels.clip(0, 255).astype(np.uint8))

    half = size / 2
    r = rng.uniform(0.30, 0.40) * half
    cx = (position.endswith("right") + rng.uniform(0.45, 0.55)) * half
    cy = (position.startswith("bottom") + rng.uniform(0.45, 0.55)) * half
    angle = rng.uniform(-0.3, 0.3) + (math.pi / 4 if shape == "square" else -math.pi / 2)
    ImageDraw.Draw(image).polygon(_shape_outline(shape, cx, cy, r, angle), fill=_jitter(COLORS[color], rng, 30))
    return ShapeSample(image=image, color=color, shape=shape, position=position, style=style)


class ShapesDataset(Dataset):
    """``size`` samples of one split, each rendered on access from its own seeded stream (so any subset, order or
    worker sees the same images). The train and eval streams never share a seed; ``style`` changes the captions,
    not the images."""

    def __init__(self, split: str, size: int, seed: int = 0, style: str = "short"):
        if split not in ("train", "eval"):
            raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
        if size < 1:
            raise ValueError(f"a split needs at least one sample, got size={size}")
        if style not in CAPTION_STYLES:
            raise ValueError(f"style must be one of {list(CAPTION_STYLES)}, got {style!r}")
        self.split, self.size, self.seed, self.style = split, size, seed, style

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> ShapeSample:
        if not 0 <= index < self.size:
            raise IndexError(f"index {index} out of range for {self.size} samples")
        return render_sample(random.Random(f"shapes-{self.split}-{self.seed}-{index}"), style=self.style)


def build_demo_tokenizer() -> PreTrainedTokenizerFast:
    """A 512-id byte-level BPE tokenizer trained here on the captions (both styles), the prompt and general text."""
    captions = [
        template.format(color=color, shape=shape, position=position)
        for template in CAPTION_STYLES.values()
        for color in COLORS
        for shape in SHAPES
        for position in POSITIONS
    ]
    return build_tiny_tokenizer([*captions, PROMPT, *DEFAULT_CORPUS], vocab_size=TOKENIZER_VOCAB_SIZE)


__all__ = [
    "CAPTIONS",
    "CAPTION_STYLES",
    "COLORS",
    "IMAGE_SIZE",
    "POSITIONS",
    "PROMPT",
    "SHAPES",
    "ShapeSample",
    "ShapesDataset",
    "build_demo_tokenizer",
    "render_sample",
]
