"""What a demo run reports: the loss curves and their chart, the machine its timings were measured on (CPU model,
CPU time, peak memory, with the thread count chosen from how busy its cores are), the model card's results table,
``report.json`` and the summary ``dsv41 demo`` prints.

Apart from :mod:`.demo` so that the demo reads as its stages (build, measure, train, export, reload) and this
formatting, plotting and CPU sampling (PIL, ``/proc``, ``resource``) does not sit between them; it imports nothing
from the project and reads the report as plain data.
"""

from __future__ import annotations

import json
import math
import os
import platform
import resource
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import transformers
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


# ---------------------------------------------------------------------------------------------------------------
# The report
# ---------------------------------------------------------------------------------------------------------------


def card_results(report: dict[str, Any], num_eval: int) -> dict[str, dict[str, str]]:
    """The model card's results table: the scores and DSpark figures of ``report`` (``before``, ``after``,
    ``lora``, ``dspark``), measured on ``num_eval`` held-out images."""

    def score(entry: dict[str, Any]) -> str:
        return f"{entry['exact_match']:.3f} ({round(entry['exact_match'] * num_eval)}/{num_eval})"

    results = {
        f"shape captions ({num_eval} held-out images)": {
            "caption exact match, untrained": score(report["before"]),
            "caption exact match, fine-tuned": score(report["after"]),
        }
    }
    if report["lora"]:
        results[f"sentence captions ({num_eval} held-out images)"] = {
            "caption exact match, fine-tuned": score(report["lora"]["before"]),
            "caption exact match, + LoRA": score(report["lora"]["after"]),
        }
    dspark = report["dspark"]
    results[
        f"DSpark speculative decoding (greedy captions of {dspark['images']} held-out images in one batch, CPU)"
    ] = {
        "tokens/s, plain decoding": f"{dspark['plain_tokens_per_s']:.1f}",
        "tokens/s, DSpark (use_mtp=True)": f"{dspark['dspark_tokens_per_s']:.1f}",
        "speedup": f"{dspark['speedup']:.2f}x",
        "mean accepted length (tokens per verification)": f"{dspark['mean_accepted_length']:.2f}",
        "captions identical to plain decoding": "yes" if dspark["captions_identical"] else "NO",
    }
    return results


def write_report(report: dict[str, Any], output: Path) -> dict[str, Any]:
    """``report`` (holding ``loss_curves``) with the final losses and the machine's facts added, written to
    ``<output>/report.json``, its loss chart to ``<output>/loss.png``; returns it."""
    curves = report["loss_curves"]
    plot_losses(curves, output / "loss.png")
    report = {
        **report,
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
        },
        "threads": torch.get_num_threads(),
        "cpu": cpu_name(),
        "final_train_loss": curves["train"][-1][1] if curves["train"] else None,
        "final_eval_loss": curves["eval"][-1][1] if curves["eval"] else None,
        "cpu_time_s": cpu_seconds(),
        "peak_memory_bytes": peak_memory_bytes(),
    }
    (output / "report.json").write_text(json.dumps(report, indent=2))
    return report


# `report["timings_s"]` keys → the stage names the summary prints
STAGE_NAMES = {
    "build_and_baseline_s": "build + baseline",
    "train_s": "fine-tuning",
    "lora_s": "LoRA",
    "dspark_s": "DSpark head",
    "export_s": "export",
    "reload_s": "reload check",
}


def _cell(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def format_demo_summary(report: dict[str, Any], seconds: float) -> str:
    """What ``dsv41 demo`` prints at the end: the scores before and after each stage, the DSpark figures, the sample
    captions in process and reloaded, where the outputs are, and the run's time, memory and machine."""
    settings = report["settings"]
    eval_losses = [loss for _, loss in report["loss_curves"]["eval"]]
    rows = [
        ("caption exact match", report["before"]["exact_match"], report["after"]["exact_match"]),
        ("eval loss (caption tokens)", *((eval_losses[0], eval_losses[-1]) if eval_losses else (None, None))),
    ]
    lines = [
        "",
        f"DeepSeek-V4.1 demo — {report['num_parameters']:,} parameters, {settings['steps']} training steps, "
        f"{settings['num_eval']} held-out images",
        f"{'':<28}{'untrained':>11}{'fine-tuned':>12}",
        *(f"{name:<28}{_cell(a):>11}{_cell(b):>12}" for name, a, b in rows),
        f"(a caption guesser scores {report['chance_exact_match']:.3f})",
    ]
    if report["lora"]:
        lora = report["lora"]
        before, after = lora["before"]["exact_match"], lora["after"]["exact_match"]
        lines += [
            "",
            f"LoRA ({lora['trainable_parameters']:,} trainable parameters), "
            f"new wording {report['samples'][0]['truth']!r}:",
            f"{'':<28}{'fine-tuned':>11}{'+ LoRA':>12}",
            f"{'caption exact match':<28}{_cell(before):>11}{_cell(after):>12}",
        ]
    dspark = report["dspark"]
    lines += [
        "",
        f"DSpark speculative decoding (draft head trained {dspark['train_steps']} steps on the backbone's own "
        f"predictions), greedy captions of {dspark['images']} held-out images in one batch:",
        f"  plain {dspark['plain_tokens_per_s']:.1f} tokens/s, DSpark {dspark['dspark_tokens_per_s']:.1f} tokens/s "
        f"({dspark['speedup']:.2f}x), {dspark['mean_accepted_length']:.2f} tokens per verification, captions "
        f"{'identical' if dspark['captions_identical'] else 'DIFFER'}",
    ]
    lines += ["", f"{'image':<16}{'truth':<34}{'generated':<34}reloaded"]
    for sample in report["samples"]:
        lines.append(
            f"{Path(sample['image']).name:<16}{sample['truth']:<34}{sample['in_process']:<34}"
            f"{'same' if sample['reloaded'] == sample['in_process'] else sample['reloaded']}"
        )
    same = report["reloaded_generations_equal"]
    lines += [
        "",
        f"Reloaded with AutoModelForCausalLM.from_pretrained(trust_remote_code=True) in a fresh process: "
        f"generations {'equal' if same else 'DIFFER'}",
        f"Hub-ready folder: {report['export_dir']}",
        f"Also written: {Path(settings['output']) / 'loss.png'}, {Path(settings['output']) / 'report.json'}",
        f"Time {seconds / 60:.1f} min (CPU time {report['cpu_time_s'] / 60:.1f} min), peak memory "
        f"{report['peak_memory_bytes'] / 2**20:.0f} MiB, {report['threads']} thread{'s' * (report['threads'] != 1)} "
        f"on {report['cpu']}",
        "Wall time per stage: "
        + ", ".join(f"{STAGE_NAMES.get(key, key)} {value:.1f} s" for key, value in report["timings_s"].items()),
    ]
    return "\n".join(lines)


__all__ = [
    "busy_cores",
    "card_results",
    "choose_threads",
    "cpu_name",
    "cpu_seconds",
    "format_demo_summary",
    "loss_curves",
    "peak_memory_bytes",
    "plot_losses",
    "round_ticks",
    "write_report",
]
