"""The ``dsv41`` command: demo (reduced steps, Ctrl-C and resume), inspect, convert, and one-line errors."""

from __future__ import annotations

import functools
import importlib.metadata
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections import namedtuple
from pathlib import Path

import pytest
import torch
from PIL import Image
from safetensors import safe_open
from transformers import FineGrainedFP8Config

from configuration import DeepseekV41Config
from modeling_dsv41 import DeepseekV41ForCausalLM
from modeling_dsv41.cli import demo as demo_module
from modeling_dsv41.cli import demo_report
from modeling_dsv41.released.writing import save_released_checkpoint
from modeling_dsv41.cli import main
from modeling_dsv41.cli.demo_data import CAPTIONS, ShapesDataset, build_demo_tokenizer
from modeling_dsv41.cli.inspection import format_inspection, inspect_config
from modeling_dsv41.optim import assignment_table

DiskUsage = namedtuple("DiskUsage", "total used free")


def _one_line_error(stderr: str, command: str) -> str:
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1, stderr
    assert lines[0].startswith(f"dsv41 {command}: error: "), lines[0]
    return lines[0]


# ---------------------------------------------------------------------------------------------------------------
# demo
# ---------------------------------------------------------------------------------------------------------------


def test_demo_interrupts_resumes_and_writes_every_output(tmp_path, monkeypatch, capsys):
    """``dsv41 demo --steps 4`` with Ctrl-C at step 2, then the same command again: it resumes and finishes.
    Batches and the eval split are made small so that the whole flow takes seconds."""
    monkeypatch.setattr(
        demo_module,
        "DemoSettings",
        functools.partial(demo_module.DemoSettings, batch_size=4, num_eval=8, num_train=64),
    )
    out = tmp_path / "demo"
    original_step_end = demo_module._LossOnProgressBar.on_step_end

    def ctrl_c_at_step_2(self, args, state, control, **kwargs):
        original_step_end(self, args, state, control, **kwargs)
        if state.global_step == 2:
            os.kill(os.getpid(), signal.SIGINT)  # what Ctrl-C sends

    monkeypatch.setattr(demo_module._LossOnProgressBar, "on_step_end", ctrl_c_at_step_2)
    assert main(["demo", "--output", str(out), "--steps", "4"]) == 130
    captured = capsys.readouterr()
    assert f"Resume with: dsv41 demo --output {out} --steps 4" in captured.err
    assert [p.name for p in (out / "checkpoints" / "full").iterdir()] == ["checkpoint-2"]
    assert "Optimizer assignment" in captured.out and "muon_headwise" in captured.out
    baseline = json.loads((out / "run.json").read_text())["before"]

    # what a kill during a later save leaves: a staging folder, or (saves before they were atomic) a checkpoint
    # without trainer_state.json; the rerun must resume from checkpoint-2 all the same
    checkpoints = out / "checkpoints" / "full"
    shutil.copytree(checkpoints / "checkpoint-2", checkpoints / "checkpoint-3")
    (checkpoints / "checkpoint-3" / "trainer_state.json").unlink()
    (checkpoints / "tmp-checkpoint-4" / "checkpoint-4").mkdir(parents=True)

    monkeypatch.setattr(demo_module._LossOnProgressBar, "on_step_end", original_step_end)
    assert main(["demo", "--output", str(out), "--steps", "4"]) == 0
    captured = capsys.readouterr()
    assert f"Resuming from {checkpoints / 'checkpoint-2'}" in captured.out
    assert "caption exact match" in captured.out and "generations equal" in captured.out
    stages = re.search(
        r"Wall time per stage: build \+ baseline [\d.]+ s, fine-tuning [\d.]+ s, DSpark head [\d.]+ s, "
        r"export [\d.]+ s, reload check [\d.]+ s",
        captured.out,
    )
    assert stages, captured.out
    assert re.search(
        rf"CPU time [\d.]+ min\), .*, (1 thread|\d+ threads) on {re.escape(demo_report.cpu_name())}\n", captured.out
    )

    report = json.loads((out / "report.json").read_text())
    assert report["before"] == baseline  # measured once, before any training
    assert report["settings"] == {
        "steps": 4,
        "lora": False,
        "seed": 0,
        "batch_size": 4,
        "learning_rate": 1e-2,
        "num_train": 64,
        "num_eval": 8,
        "output": str(out),
    }
    assert [step for step, _ in report["loss_curves"]["train"]][-1] == 4
    assert report["loss_curves"]["eval"][0][0] == 0  # evaluated before the first step too
    assert report["chance_exact_match"] == pytest.approx(1 / len(CAPTIONS))
    assert 0 <= report["after"]["exact_match"] <= 1
    assert report["reloaded_generations_equal"] is True
    assert report["reloaded_model_class"].startswith("transformers_modules.")  # the folder's own code, not ours
    assert len(report["samples"]) == 8 and all(Path(s["image"]).is_file() for s in report["samples"])
    assert (out / "checkpoints" / "full" / "checkpoint-4").is_dir()  # the last step is saved: a rerun trains no more
    assert report["lora"] is None
    # the draft head trained on the backbone's own predictions, then DSpark decoding measured against plain decoding
    dspark = report["dspark"]
    assert [p.name for p in (out / "checkpoints" / "dspark").iterdir()] == ["checkpoint-4"]
    assert dspark["captions_identical"] is True and dspark["images"] == 8 and dspark["train_steps"] == 4
    assert dspark["plain_tokens_per_s"] > 0 and dspark["speedup"] == pytest.approx(
        dspark["dspark_tokens_per_s"] / dspark["plain_tokens_per_s"]
    )
    assert 1 <= dspark["mean_accepted_length"] <= 1 + demo_module.DEMO_DSPARK["dspark_block_size"]
    assert re.search(
        r"DSpark [\d.]+ tokens/s \([\d.]+x\), [\d.]+ tokens per verification, captions identical", captured.out
    )

    with Image.open(out / "loss.png") as image:
        assert image.format == "PNG" and image.size == (640, 400)
    exported = out / "model"
    config = json.loads((exported / "config.json").read_text())
    assert "AutoModelForCausalLM" in config["auto_map"]
    assert (exported / "model.safetensors").is_file() and (exported / "tokenizer.json").is_file()
    card = (exported / "README.md").read_text()
    assert "caption exact match, fine-tuned" in card
    assert "mean accepted length" in card and "captions identical to plain decoding | yes" in card
    assert config["text_config"]["dspark_block_size"] == demo_module.DEMO_DSPARK["dspark_block_size"]

    assert main(["demo", "--output", str(out), "--steps", "4", "--seed", "1"]) == 2
    assert "other settings (seed)" in _one_line_error(capsys.readouterr().err, "demo")


def test_caption_collator_learns_only_the_caption():
    tokenizer = build_demo_tokenizer()
    config = demo_module.demo_config(tokenizer)
    processor = demo_module.build_demo_processor(config, tokenizer)
    samples = [ShapesDataset("train", 2)[i] for i in range(2)]
    batch = demo_module.CaptionCollator(processor)(samples)
    for row, sample in enumerate(samples):
        learned = batch["labels"][row][batch["labels"][row] != -100].tolist()
        assert tokenizer.decode(learned) == sample.caption + tokenizer.eos_token
    assert batch["pixel_values"].shape[0] == 2 * 36 and batch["image_token_types"].shape == batch["input_ids"].shape


def test_loss_plot_ticks_are_round():
    assert demo_report.round_ticks(120) == [0, 20, 40, 60, 80, 100, 120]
    assert demo_report.round_ticks(6.26) == [0, 2, 4, 6, 8]
    assert demo_report.round_ticks(0.9) == pytest.approx([0, 0.2, 0.4, 0.6, 0.8, 1.0])
    assert demo_report.round_ticks(240) == [0, 50, 100, 150, 200, 250]


def test_demo_computes_with_the_cores_other_jobs_leave_free(monkeypatch, capsys):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(demo_report.os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    monkeypatch.setattr(demo_report, "busy_cores", lambda cores: 1.8)  # another job on both cores
    torch.set_num_threads(2)
    assert demo_report.choose_threads() == 1 == torch.get_num_threads()
    assert "other jobs keep 1.8 of its 2 cores busy): the demo computes with 1 thread " in capsys.readouterr().out
    torch.set_num_threads(2)
    monkeypatch.setattr(demo_report, "busy_cores", lambda cores: 0.1)
    assert demo_report.choose_threads() == 2 == torch.get_num_threads()
    monkeypatch.setenv("OMP_NUM_THREADS", "2")  # the user's choice stands
    monkeypatch.setattr(demo_report, "busy_cores", lambda cores: 2.0)
    assert demo_report.choose_threads() == 2


def test_busy_cores_counts_what_other_processes_compute():
    cores = os.sched_getaffinity(0)
    spinner = subprocess.Popen(
        [sys.executable, "-c", "import time\nend = time.time() + 3\nwhile time.time() < end: pass"]
    )
    try:
        time.sleep(0.3)  # started
        busy = demo_report.busy_cores(cores, seconds=0.5)
    finally:
        spinner.kill()
        spinner.wait()
    assert 0.5 <= busy <= len(cores) + 1e-9  # at least the spinner's core (all of them on a loaded machine)


def test_demo_lora_stage_teaches_a_new_wording_and_publishes_the_merged_model(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(
        demo_module,
        "DemoSettings",
        functools.partial(demo_module.DemoSettings, batch_size=4, num_eval=8, num_train=64),
    )
    monkeypatch.chdir(tmp_path)
    out = Path("demo")  # relative, as the default output is
    assert main(["demo", "--output", str(out), "--steps", "2", "--lora"]) == 0
    assert "+ LoRA" in capsys.readouterr().out
    report = json.loads((out / "report.json").read_text())
    lora = report["lora"]
    assert 0 < lora["trainable_parameters"] < report["num_parameters"]
    assert set(lora) == {"before", "after", "trainable_parameters", "adapter_dir"}
    assert json.loads((out / "lora-adapter" / "adapter_config.json").read_text())["r"] == 8
    assert (out / "checkpoints" / "lora" / "checkpoint-2").is_dir()
    assert all(s["truth"].startswith("a ") and " in the " in s["truth"] for s in report["samples"])
    assert report["reloaded_generations_equal"] is True
    assert {name for name, _ in report["loss_curves"].items()} == {"train", "eval", "LoRA train", "LoRA eval"}
    assert min(step for step, _ in report["loss_curves"]["LoRA train"]) > 2  # drawn after the full stage
    card = (out / "model" / "README.md").read_text()
    assert "caption exact match, + LoRA" in card
    state = json.loads((out / "model" / "config.json").read_text())
    assert "peft" not in json.dumps(state).lower()  # merged: a plain DeepSeek-V4.1 checkpoint


@pytest.mark.parametrize(
    "argv, message",
    [
        (["demo", "--steps", "0"], "--steps: expected an integer ≥ 1, got '0'"),
        (["demo", "--seed", "x"], "--seed: expected an integer ≥ 0, got 'x'"),
        (["demo", "--unknown"], "unrecognized arguments: --unknown"),
        (["convert", "only-one"], "the following arguments are required: DST"),
    ],
)
def test_bad_arguments_are_one_line_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and message in lines[0]


def test_demo_refuses_unwritable_output_and_full_disk(tmp_path, monkeypatch, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    assert main(["demo", "--output", str(blocker / "demo")]) == 2
    assert "cannot write to output folder" in _one_line_error(capsys.readouterr().err, "demo")

    monkeypatch.setattr(demo_module.shutil, "disk_usage", lambda path: DiskUsage(2**40, 2**40, 5 * 2**20))
    assert main(["demo", "--output", str(tmp_path / "demo")]) == 2
    assert "only 5 MiB free" in _one_line_error(capsys.readouterr().err, "demo")


# ---------------------------------------------------------------------------------------------------------------
# inspect
# ---------------------------------------------------------------------------------------------------------------


def test_inspect_counts_match_a_real_model():
    """The meta-device counts equal a real model's."""
    config = DeepseekV41Config.from_preset("tiny")
    result = inspect_config(config, dtype=torch.float32)
    model = DeepseekV41ForCausalLM(config)
    assert result.num_parameters == model.num_parameters()
    real = assignment_table(model)
    summary = lambda table: {k: (v.tensors, v.parameters, v.state_bytes) for k, v in table.kinds.items()}  # noqa: E731
    assert summary(result.assignment) == summary(real)
    trainable = [p for n, p in model.named_parameters() if real.names[n] != "frozen"]
    assert result.adamw_state_bytes == sum(2 * 4 * p.numel() + 4 for p in trainable)  # two fp32 moments + step
    assert 0 < result.mixed_state_bytes < result.adamw_state_bytes
    assert result.components["MoE: routed experts"] == sum(
        p.numel() for n, p in model.named_parameters() if ".ffn.experts." in n
    )
    plan = result.image_plans[(1302, 1302)]
    assert plan.num_positions <= config.vision_config.max_image_tokens


def test_inspect_released_size_on_the_meta_device(capsys):
    assert main(["inspect"]) == 0
    out = capsys.readouterr().out
    assert "SPEC" not in out  # users have the docs/ pages, not the design note they were written from
    # independent of the model code: docs/design.md §2's sizes
    experts = 40 * 384 * 3 * 5120 * 2304
    engram_tables = (384006168 + 384016682) * 256
    assert re.search(rf"MoE: routed experts\s+{experts:,}\s", out)
    assert re.search(rf"Engram: tables\s+{engram_tables:,}\s", out)
    assert re.search(r"1302×1302\s+1302×1302\s+8,649\s+31×31\s+994", out)  # the design note's example
    assert "MixedOptimizer" in out and "of AdamW" in out


def test_inspect_reads_the_reference_config(fixtures_dir, capsys):
    weights = fixtures_dir / "v41_tiny_vl" / "model.safetensors"
    with safe_open(weights, "pt") as f:
        # parameters only: not the FP8 tables' scales, nor the router biases (buffers, moved by the balancing rule)
        stored = sum(
            math.prod(f.get_slice(k).get_shape())
            for k in f.keys()
            if not k.endswith((".scale", ".gate.bias", ".gate.bias_vl"))
        )
    assert main(["inspect", str(fixtures_dir / "v41_tiny_vl" / "sparse" / "config.json")]) == 0
    assert f"Parameters: {stored:,} " in capsys.readouterr().out


def test_inspect_errors_are_one_line(tmp_path, capsys):
    assert main(["inspect", "no-such-preset"]) == 2
    assert "neither a preset" in _one_line_error(capsys.readouterr().err, "inspect")
    (tmp_path / "config.json").write_text("{not json")
    assert main(["inspect", str(tmp_path)]) == 2
    assert "not valid JSON" in _one_line_error(capsys.readouterr().err, "inspect")
    assert main(["inspect", str(tmp_path / "config.json" / "x")]) == 2
    _one_line_error(capsys.readouterr().err, "inspect")


def test_inspect_storage_compares_the_load_paths(capsys):
    """``--storage nf4`` / ``int8``: each load path's weights and bytes per parameter (their sums are tested against a
    loaded model in tests/test_bitsandbytes.py)."""
    assert main(["inspect", "tiny", "--storage", "nf4"]) == 0
    out = capsys.readouterr().out
    for path in (
        "bf16 (fp32 where kept)",
        "native FP8 / FP4 (released storage)",
        "bitsandbytes int8",
        "bitsandbytes NF4 ",
        "bitsandbytes NF4, double quantization",
    ):
        assert re.search(
            rf"^{re.escape(path)}\s+[\d.]+ [KMG]iB\s+\d\.\d{{3}}\s+[\d.]+ [KMG]iB\s+\d\.\d{{3}}$", out, re.M
        ), path
    assert main(["inspect", "tiny", "--storage", "int8", "--devices", "8x80GiB"]) == 2
    assert "drop --devices" in _one_line_error(capsys.readouterr().err, "inspect")


def test_inspect_storage_without_bitsandbytes_is_a_one_line_error(monkeypatch, capsys):
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "bitsandbytes" else find_spec(name, *a)
    )
    assert main(["inspect", "tiny", "--storage", "nf4"]) == 2
    assert 'pip install -e ".[quant]"' in _one_line_error(capsys.readouterr().err, "inspect")


@pytest.mark.parametrize(
    "content, message",
    [
        (b"[1, 2, 3]", "is not a DeepSeek-V4.1 config: a DeepSeek-V4.1 config must be a JSON object, got list"),
        (
            b'{"model_type": "llama", "hidden_size": 4096}',
            "is not a DeepSeek-V4.1 config: the config is missing 'text_config'",
        ),
        (
            b'{"text_config": {"vocab_size": 100}}',
            "is not a DeepSeek-V4.1 config: the config's text_config is missing 'hidden_size'",
        ),
        (b'{"a": 1', "is not valid JSON"),
        (b"\xff\xfe{}", "is not valid JSON"),
    ],
)
def test_inspect_of_a_json_that_is_not_a_config_is_a_one_line_error(tmp_path, capsys, content, message):
    """No "748B" report for someone else's JSON: exit 2 naming the file."""
    path = tmp_path / "other.json"
    path.write_bytes(content)
    assert main(["inspect", str(path)]) == 2
    assert f"{path} {message}" in _one_line_error(capsys.readouterr().err, "inspect")


def test_format_inspection_of_a_text_only_config():
    text_only = DeepseekV41Config.from_preset("tiny", vision_config=None)
    report = format_inspection(inspect_config(text_only))
    assert "Text-only configuration" in report and "vision: ViT" not in report


# ---------------------------------------------------------------------------------------------------------------
# convert
# ---------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def released_checkpoint(tmp_path_factory):
    """A tiny model written in the released storage (FP8 / packed FP4 + E8M0 scales), in several shards, with its
    tokenizer next to the weights (as the release ships it)."""
    tokenizer = build_demo_tokenizer()
    torch.manual_seed(0)
    model = DeepseekV41ForCausalLM(demo_module.demo_config(tokenizer)).to(torch.bfloat16)
    folder = tmp_path_factory.mktemp("released")
    save_released_checkpoint(model, folder, max_shard_bytes=300_000)
    tokenizer.save_pretrained(folder)
    return folder


def test_convert_dequantizes_to_what_from_pretrained_loads(released_checkpoint, tmp_path, capsys):
    destination = tmp_path / "converted"
    assert main(["convert", str(released_checkpoint), str(destination)]) == 0
    assert "Wrote" in capsys.readouterr().out
    with safe_open(next(destination.glob("model-*.safetensors")), "pt") as f:
        assert not any(k.endswith(".scale") and "hc_" not in k for k in f.keys())
    assert (destination / "tokenizer.json").is_file()
    assert "quantization_config" not in json.loads((destination / "config.json").read_text())

    dequantize = FineGrainedFP8Config(dequantize=True)
    direct = DeepseekV41ForCausalLM.from_pretrained(
        released_checkpoint, dtype=torch.bfloat16, quantization_config=dequantize
    )
    direct = direct.state_dict()
    converted = DeepseekV41ForCausalLM.from_pretrained(destination, dtype=torch.bfloat16).state_dict()
    assert direct.keys() == converted.keys()
    for name, tensor in direct.items():
        assert torch.equal(tensor, converted[name]), name


def test_convert_errors_are_one_line(released_checkpoint, tmp_path, monkeypatch, capsys):
    assert main(["convert", str(tmp_path / "missing"), str(tmp_path / "out")]) == 2
    assert "does not exist" in _one_line_error(capsys.readouterr().err, "convert")

    occupied = tmp_path / "occupied"
    occupied.mkdir()
    (occupied / "keep.txt").write_text("")
    assert main(["convert", str(released_checkpoint), str(occupied)]) == 2
    assert "not an empty folder" in _one_line_error(capsys.readouterr().err, "convert")

    from modeling_dsv41.released import convert

    monkeypatch.setattr(convert.shutil, "disk_usage", lambda path: DiskUsage(2**40, 2**40, 1000))
    assert main(["convert", str(released_checkpoint), str(tmp_path / "full")]) == 2
    assert "not enough disk space" in _one_line_error(capsys.readouterr().err, "convert")


def _read_only_empty_folder(tmp_path: Path) -> Path:
    """An empty folder this process cannot write to: a 0o555 one, or, for root (who writes anyway), an empty
    sysfs folder."""
    folder = tmp_path / "read-only"
    folder.mkdir()
    folder.chmod(0o555)
    candidates = [folder, *sorted(Path("/sys/kernel").iterdir())] if Path("/sys/kernel").is_dir() else [folder]
    for candidate in candidates:
        try:
            if candidate.is_dir() and not any(candidate.iterdir()):
                (candidate / ".probe").write_bytes(b"")
                (candidate / ".probe").unlink()
        except OSError:
            return candidate
    pytest.fail("found no read-only folder to convert into")


def test_convert_to_a_read_only_destination_is_a_one_line_error(released_checkpoint, tmp_path, capsys):
    destination = _read_only_empty_folder(tmp_path)
    assert main(["convert", str(released_checkpoint), str(destination)]) == 2
    assert f"cannot write to {destination}" in _one_line_error(capsys.readouterr().err, "convert")


def test_convert_of_a_truncated_shard_is_a_one_line_error(released_checkpoint, tmp_path, capsys):
    source = tmp_path / "source"
    shutil.copytree(released_checkpoint, source)
    shard = sorted(source.glob("*.safetensors"))[-1]
    shard.write_bytes(shard.read_bytes()[:-10])
    destination = tmp_path / "out"
    assert main(["convert", str(source), str(destination)]) == 2
    assert f"{shard} is truncated" in _one_line_error(capsys.readouterr().err, "convert")
    assert not destination.exists()  # nothing was written


# ---------------------------------------------------------------------------------------------------------------
# the installed command
# ---------------------------------------------------------------------------------------------------------------


def test_console_script_is_declared_and_runs():
    scripts = importlib.metadata.entry_points(group="console_scripts")
    assert [ep.value for ep in scripts if ep.name == "dsv41"] == ["modeling_dsv41.cli:main"]
    result = subprocess.run(
        [sys.executable, "-m", "modeling_dsv41.cli", "inspect", "--help"], capture_output=True, text=True
    )
    assert result.returncode == 0 and "without allocating the weights" in result.stdout


@pytest.mark.parametrize("how", ["console script", "python -m"])
@pytest.mark.parametrize("argv", [["--help"], ["demo", "--steps", "0"]])
def test_help_and_usage_errors_import_neither_torch_nor_the_model(tmp_path, how, argv):
    """``dsv41 --help`` must answer at once: importing torch, transformers and the model takes seconds (tens on a
    slow disk). -X importtime lists every module the process imported."""
    if how == "console script":  # what pip writes into bin/dsv41
        script = tmp_path / "dsv41"
        script.write_text("import sys\nfrom modeling_dsv41.cli import main\nsys.exit(main())\n")
        command = [sys.executable, "-X", "importtime", str(script), *argv]
    else:
        command = [sys.executable, "-X", "importtime", "-m", "modeling_dsv41.cli", *argv]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == (0 if argv == ["--help"] else 2), result.stderr[-2000:]
    assert "usage: dsv41" in result.stdout or "dsv41 demo: error: argument --steps" in result.stderr
    imported = {
        line.rsplit("|", 1)[-1].strip().split(".")[0]
        for line in result.stderr.splitlines()
        if line.startswith("import time:")
    }
    assert "argparse" in imported  # the listing works
    assert not imported & {"torch", "transformers", "numpy", "PIL", "configuration", "processing"}, imported


def test_the_package_still_registers_the_auto_classes_on_import():
    code = (
        "import modeling_dsv41\nfrom transformers import AutoConfig, AutoModelForCausalLM\n"
        "config = AutoConfig.for_model('deepseek_v41')\n"
        "print(AutoModelForCausalLM._model_mapping[type(config)].__name__, modeling_dsv41.DeepseekV41Trainer.__name__)"
    )
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split() == ["DeepseekV41ForCausalLM", "DeepseekV41Trainer"]


@pytest.mark.slow
def test_full_demo_meets_the_acceptance_criteria(tmp_path):
    """The README's first command, in process: exact match ≥ 0.5 and ≥ 3× the untrained model's, and the reloaded
    model generates the same captions."""
    report = demo_module.run_demo(demo_module.DemoSettings(output=tmp_path / "demo"))
    before, after = report["before"]["exact_match"], report["after"]["exact_match"]
    assert after >= 0.5 and after >= 3 * before
    assert report["reloaded_generations_equal"] is True
    assert report["dspark"]["captions_identical"] is True
