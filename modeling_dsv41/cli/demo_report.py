"""What a demo run reports beside its scores: the loss curves and their chart, and the machine its timings were
measured on (CPU model, CPU time, peak memory), with the thread count chosen from how busy its cores are.

Apart from :mod:`.demo` so that the demo reads as its stages (build, measure, train, export, reload) and this
generic plotting and CPU sampling (PIL, ``/proc``, ``resource``) does not sit between them; it imports nothing from
the project.
"""

from __future__ import annotations

import math
import os
import platform
import resource
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from PIL import Image, ImageDraw


def loss_curves(
    log_history: list[dict[str, Any]], prefix: str = "", offset: int = 0
) -> dict[str, list[tuple[int, float]]]:
    """``{"<prefix>train": [(step, loss)], "<prefix>eval": [(step, eval_loss)]}`` from ``trainer.state.log_history``,
    steps shifted by ``offset``."""
    curves = {f"{prefix}train": [], f"{prefix}eval": []}
    for entry in log_history:
        if "loss" in entry:
            curves[f"{prefix}train"].append((entry["step"] + offset, entry["loss"]))
        if "eval_loss" in entry:
            curves[f"{prefix}eval"].append((entry["step"] + offset, entry["eval_loss"]))
    return curves


def round_ticks(top: float, count: int = 6) -> list[float]:
    """Ticks from 0 in round steps (1, 2, 2.5 or 5 times a power of ten), about ``count`` of them, the last
    ≥ ``top``."""
    raw = max(top, 1e-12) / count
    power = 10 ** math.floor(math.log10(raw))
    step = next(m * power for m in (1, 2, 2.5, 5, 10) if m * power >= raw)
    return [step * k for k in range(math.ceil(top / step - 1e-9) + 1)]


def _tick_label(value: float) -> str:
    """A tick's text: ``%g`` down to 0.01, an exponent below (``5e-03``)."""
    return f"{value:g}" if value >= 0.01 or value == 0 else f"{value:.0e}"


def plot_losses(curves: dict[str, list[tuple[int, float]]], path: Path, size: tuple[int, int] = (640, 400)) -> None:
    """A line chart of the loss curves, drawn with PIL (no plotting dependency): x the training step, y the mean
    cross-entropy of the caption tokens (nats), both from 0 with round ticks."""
    width, height = size
    left, right, top, bottom = 70, 20, 30, 50
    image = Image.new("RGB", size, "white")
    draw = ImageDraw.Draw(image)
    points = [p for curve in curves.values() for p in curve]
    if not points:
        raise ValueError("no loss values to plot")
    step_ticks = round_ticks(max(1, max(s for s, _ in points)))
    loss_ticks = round_ticks(max(l for _, l in points) or 1.0)
    max_step, max_loss = step_ticks[-1], loss_ticks[-1]

    def xy(step: float, loss: float) -> tuple[float, float]:
        return (left + step / max_step * (width - left - right), top + (1 - loss / max_loss) * (height - top - bottom))

    draw.rectangle([left, top, width - right, height - bottom], outline="black")
    for loss in loss_ticks:
        y = xy(0, loss)[1]
        draw.line([left - 4, y, left, y], fill="black")
        label = _tick_label(loss)
        draw.text((left - 8 - draw.textlength(label), y - 6), label, fill="black")
    for step in step_ticks:
        x = xy(step, 0)[0]
        draw.line([x, height - bottom, x, height - bottom + 4], fill="black")
        label = _tick_label(step)
        draw.text((x - draw.textlength(label) / 2, height - bottom + 8), label, fill="black")
    x_title = "training step"
    draw.text(((left + width - right - draw.textlength(x_title)) / 2, height - 20), x_title, fill="black")
    y_title = "loss (caption tokens, nats)"
    title = Image.new("RGB", (int(draw.textlength(y_title)) + 2, 14), "white")
    ImageDraw.Draw(title).text((1, 1), y_title, fill="black")
    rotated = title.rotate(90, expand=True)
    image.paste(rotated, (6, int(top + (height - top - bottom - rotated.height) / 2)))
    for (name, curve), color in zip(curves.items(), ("#1f77b4", "#d62728", "#2ca02c", "#ff7f0e")):
        if len(curve) > 1:
            draw.line([xy(*p) for p in curve], fill=color, width=2)
        for p in curve:
            x, y = xy(*p)
            draw.ellipse([x - 2, y - 2, x + 2, y + 2], fill=color)
        legend_y = top + 8 + 16 * list(curves).index(name)
        draw.line([width - right - 140, legend_y + 6, width - right - 120, legend_y + 6], fill=color, width=2)
        draw.text((width - right - 115, legend_y), f"{name} loss", fill="black")
    draw.text((left, 8), "DeepSeek-V4.1 demo: caption loss", fill="black")
    image.save(path)


def cpu_seconds() -> float:
    """CPU time of this process and its finished children (the reload check): on a busy machine, the honest cost."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def cpu_name() -> str:
    """The CPU model, for the timings to say what they were measured on."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def peak_memory_bytes() -> int:
    """The most resident memory this process has held so far, in bytes."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if platform.system() == "Darwin" else peak * 1024  # bytes on macOS, KiB on Linux


def busy_cores(cores: set[int], seconds: float = 0.5) -> float | None:
    """How many of ``cores`` other processes keep busy now: their non-idle share over ``seconds`` of
    ``/proc/stat`` (this process sleeps meanwhile); None where there is no ``/proc/stat``."""

    def sample() -> tuple[int, int]:
        busy = total = 0
        for line in Path("/proc/stat").read_text().splitlines():
            name, *ticks = line.split()
            if name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in cores:
                values = [int(t) for t in ticks[:8]]  # user nice system idle iowait irq softirq steal
                total += sum(values)
                busy += sum(values) - values[3] - values[4]
        return busy, total

    try:
        busy, total = sample()
        time.sleep(seconds)
        busy_after, total_after = sample()
    except OSError:
        return None
    return len(cores) * (busy_after - busy) / max(1, total_after - total)


def choose_threads(print_fn: Callable[[str], Any] = print) -> int:
    """The threads this run computes with: torch's default (one per core), or as many as the cores other jobs leave
    free now (at least one): two threads per process on two cores shared with another job thrash (the whole demo
    took 8 times as long). ``OMP_NUM_THREADS``, when set, decides."""
    threads = torch.get_num_threads()
    if "OMP_NUM_THREADS" in os.environ or not hasattr(os, "sched_getaffinity"):
        return threads
    cores = os.sched_getaffinity(0)
    busy = busy_cores(cores)
    free = threads if busy is None else max(1, round(len(cores) - busy))
    if free < threads:
        threads = free
        torch.set_num_threads(threads)
        print_fn(
            f"The CPU is busy (other jobs keep {busy:.1f} of its {len(cores)} cores busy): the demo computes "
            f"with {threads} thread{'s' * (threads != 1)} (set OMP_NUM_THREADS to choose)"
        )
    return threads


__all__ = [
    "busy_cores",
    "choose_threads",
    "cpu_name",
    "cpu_seconds",
    "loss_curves",
    "peak_memory_bytes",
    "plot_losses",
    "round_ticks",
]
