"""Every snippet of README.md and the docs pages runs, on tiny models: each page's Python blocks in order in one
namespace (as a reader would paste them), the ``dsv41`` command lines through the CLI, and the benchmark scripts up to
their argument parsing. The two set-up commands are what CI itself runs; here we only check they are still there,
unchanged. The longer commands (examples, launches) are run by the tests of what they run."""

from __future__ import annotations

import argparse
import re
import runpy
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from documentation import README, REPO_ROOT, code_blocks, command_lines, pages

from modeling_dsv41 import export_for_hub
from modeling_dsv41.released.writing import save_released_checkpoint
from modeling_dsv41.cli import main
from modeling_dsv41.cli.demo import build_demo_model, build_demo_processor, demo_config
from modeling_dsv41.cli.demo_data import ShapesDataset, build_demo_tokenizer

SETUP_COMMANDS = [
    "python3 -m venv .venv && .venv/bin/pip install -q torch==2.13.0 -e . && .venv/bin/dsv41 demo",
    'python3 -m venv .venv && .venv/bin/pip install -q torch==2.13.0 -e ".[test]" && '
    ".venv/bin/python -m pytest -q -n 2 "
    "--dist loadfile",
]
RELEASED_REPO = "deepseek-ai/DeepSeek-V4.1-Flash"


@pytest.fixture(scope="module")
def workspace(tmp_path_factory) -> Path:
    """A folder laid out as after ``dsv41 demo`` (an untrained demo model is enough for the snippets to run), and
    a tiny checkpoint in the released storage format standing in for DeepSeek-V4.1-Flash."""
    root = tmp_path_factory.mktemp("readme")
    tokenizer = build_demo_tokenizer()
    config = demo_config(tokenizer)
    model = build_demo_model(config, tokenizer, seed=0)
    export_for_hub(model, root / "dsv41-demo" / "model", build_demo_processor(config, tokenizer))
    (root / "dsv41-demo" / "samples").mkdir()
    samples = ShapesDataset("eval", 4)  # README captions eval-0.png, then a batch of four
    for i in range(len(samples)):
        samples[i].image.save(root / "dsv41-demo" / "samples" / f"eval-{i}.png")

    released = root / "released-tiny"
    save_released_checkpoint(model.to(torch.bfloat16), released, max_shard_bytes=500_000)
    tokenizer.save_pretrained(released)
    return root


def test_setup_commands_are_unchanged():
    assert code_blocks(README, "bash")[:2] == [command + "\n" for command in SETUP_COMMANDS]


def run_page_snippets(page: Path, workspace: Path) -> None:
    """The page's Python blocks in order in one namespace, the released repository id pointing at the stand-in."""
    namespace: dict = {"__name__": "__readme__"}
    for index, code in enumerate(code_blocks(page, "python")):
        code = code.replace(f'"{RELEASED_REPO}"', repr(str(workspace / "released-tiny")))
        try:
            exec(compile(code, f"{page.name} python block {index}", "exec"), namespace)
        except Exception as error:  # name the failing block
            raise AssertionError(f"{page.name} python block {index} failed: {error!r}\n{code}") from error


def test_readme_is_short_and_links_existing_pages():
    text = README.read_text()
    assert len(text.splitlines()) <= 200
    linked = set(re.findall(r"\]\((docs/[\w-]+\.md)", text))
    assert linked == {str(page.relative_to(REPO_ROOT)) for page in pages()[1:]}  # every page, none missing


def assert_new_entries_are_ignored(workspace: Path, before: set[str]) -> None:
    """What the snippets or commands just wrote in the user's folder (anything new at its top) is in .gitignore."""
    for name in sorted({p.name for p in workspace.iterdir()} - before):
        entry = f"{name}/" if (workspace / name).is_dir() else name
        ignored = subprocess.run(["git", "check-ignore", "--no-index", "-q", entry], cwd=REPO_ROOT).returncode == 0
        assert ignored, f"{entry} (written by a documented snippet or command) is not in .gitignore"


def test_readme_python_snippets_run_in_order(workspace, monkeypatch, capsys):
    monkeypatch.chdir(workspace)
    assert len(code_blocks(README, "python")) >= 4
    before = {p.name for p in workspace.iterdir()}
    run_page_snippets(README, workspace)
    assert_new_entries_are_ignored(workspace, before)
    out = capsys.readouterr().out
    assert "muon_headwise" in out  # the Trainer's assignment table was printed
    assert "trainable params" in out  # PEFT's summary
    assert "model.safetensors" in out and "README.md" in out  # the published folder
    assert (workspace / "dsv41-lora" / "adapter" / "adapter_config.json").is_file()


@pytest.mark.parametrize("name", [page.name for page in pages()[1:] if code_blocks(page, "python")])
def test_docs_python_snippets_run_in_order(name, workspace, monkeypatch):
    monkeypatch.chdir(workspace)
    before = {p.name for p in workspace.iterdir()}
    run_page_snippets(REPO_ROOT / "docs" / name, workspace)
    assert_new_entries_are_ignored(workspace, before)


def test_command_lines_run(workspace, monkeypatch, capsys):
    monkeypatch.chdir(workspace)
    # the demo is run by test_cli, export (of the README's adapter) by test_adapter_export
    commands = [c for c in command_lines("dsv41 ") if not c.startswith("dsv41 export ")]
    assert {shlex.split(c)[1] for c in commands} == {"inspect", "convert"}
    before = {p.name for p in workspace.iterdir()}
    for command in commands:
        argv = shlex.split(command)[1:]
        argv = [str(workspace / "released-tiny") if a == "released/" else a for a in argv]  # the released weights
        assert main(argv) == 0, command
    assert "Parameters:" in capsys.readouterr().out
    assert_new_entries_are_ignored(workspace, before)


def test_benchmark_commands_exist_and_parse_their_arguments(monkeypatch, capsys):
    """The benchmark scripts are run up to their argument parsing (``--help``), in this process: a full run takes
    minutes and prints timings, which no test can check."""
    commands = [line.split() for line in command_lines("python benchmarks/")]
    assert len(commands) >= 3
    monkeypatch.chdir(REPO_ROOT)
    monkeypatch.syspath_prepend(str(REPO_ROOT))
    for command in commands:
        script = REPO_ROOT / command[1]
        assert script.is_file(), script
        monkeypatch.setattr(sys, "argv", [str(script), *command[2:], "--help"])
        with pytest.raises(SystemExit) as exit_info:
            runpy.run_path(str(script), run_name="__main__")
        assert exit_info.value.code == 0, command
        assert "usage:" in capsys.readouterr().out


class ArgumentsParsed(Exception):
    """Raised in place of running a benchmark once its command line parsed."""


def test_gpu_script_commands_parse_their_arguments(monkeypatch):
    """benchmarks/gpu.sh runs only on a GPU machine (scarce device time): each of its benchmark command lines is run
    here up to a successful ``parse_args`` (an unknown or misspelt option fails, which ``--help`` would not catch)."""
    text = (REPO_ROOT / "benchmarks" / "gpu.sh").read_text().replace("\\\n", " ")
    commands = [shlex.split(line)[2:] for line in text.splitlines() if line.lstrip().startswith("step ")]
    scripts = ("forward", "compile", "generate", "memory", "loading", "finetune", "speculative")
    assert {c[1] for c in commands} == {f"benchmarks/{n}.py" for n in scripts}
    for interpreter, script, *args in commands:
        assert interpreter == "$PYTHON" and "--device" in args and "cuda" in args, args
        run_until_parsed(monkeypatch, script, args)


def run_until_parsed(monkeypatch, script: str, args: list[str]) -> None:
    """Run ``script`` with ``args`` in this process, stopping right after its arguments parsed without error
    (``argparse``'s ``parse_args`` or ``HfArgumentParser.parse_args_into_dataclasses``, unknown flags included)."""
    from transformers import HfArgumentParser

    def then_stop(parse):
        def parse_then_stop(self, *args, **kwargs):
            parse(self, *args, **kwargs)
            raise ArgumentsParsed

        return parse_then_stop

    with monkeypatch.context() as patch:
        patch.setattr(argparse.ArgumentParser, "parse_args", then_stop(argparse.ArgumentParser.parse_args))
        patch.setattr(
            HfArgumentParser, "parse_args_into_dataclasses", then_stop(HfArgumentParser.parse_args_into_dataclasses)
        )
        patch.chdir(REPO_ROOT)
        patch.syspath_prepend(str(REPO_ROOT))
        patch.syspath_prepend(str((REPO_ROOT / script).parent))  # as `python script` puts its folder first
        patch.setattr(sys, "argv", [str(REPO_ROOT / script), *args])
        with pytest.raises(ArgumentsParsed):
            runpy.run_path(str(REPO_ROOT / script), run_name="__main__")


def test_torchrun_commands_parse_their_arguments(monkeypatch):
    """The docs' ``torchrun`` lines need GPUs, several nodes or the released weights: each is parsed by torchrun's
    own parser, and its script runs here up to a successful ``parse_args`` with the printed arguments."""
    from torch.distributed.run import get_args_parser

    node = {"NODE_RANK": "0", "MASTER_ADDR": "127.0.0.1"}  # what the many-node lines ask each node to set
    commands = [shlex.split(line) for line in command_lines("torchrun ")]
    assert commands
    for _, *launch in commands:
        launch = [node.get(word[1:], word) if word.startswith("$") else word for word in launch]
        run = get_args_parser().parse_args(launch)
        assert int(run.nproc_per_node) > 1, launch
        run_until_parsed(monkeypatch, run.training_script, run.training_script_args)


# the first words of each kind of command the pages print → the test that runs it as printed
COMMAND_TESTS = {
    "python3 -m venv .venv": "CI (.ci/run) and the set-up itself; test_setup_commands_are_unchanged",
    "dsv41 ": "test_command_lines_run",
    "python benchmarks/": "test_benchmark_commands_exist_and_parse_their_arguments",
    "torchrun ": "test_torchrun_commands_parse_their_arguments",
    "python examples/trl_": "tests/test_trl.py",
    "python examples/lm_eval_local.py": "tests/test_lm_eval.py",
    "accelerate launch ": "tests/test_trainer_distributed.py, test_expert_parallel.py, test_lora_released_launch.py",
}


def test_every_documented_command_is_run_by_a_test():
    lines = [line.strip() for page in pages() for block in code_blocks(page, "bash") for line in block.splitlines()]
    unrun = [line for line in lines if line and not line.startswith("#") and not line.startswith(tuple(COMMAND_TESTS))]
    assert not unrun, f"commands no test runs: {unrun}"
