"""``examples/lm_eval_local.py``: lm-evaluation-harness on a local task, through the harness's own ``HFLM``."""

from __future__ import annotations

import runpy
import shlex
from pathlib import Path

import pytest
from documentation import REPO_ROOT, command_lines

from modeling_dsv41.cli.demo import build_demo_model, demo_config
from modeling_dsv41.cli.demo_data import COLORS, build_demo_tokenizer


def loglikelihoods(results: dict, task: str) -> list[float]:
    return [float(resp[0]) for sample in results["samples"][task] for resp in sample["filtered_resps"]]


def test_printed_command_runs_and_scores_do_not_depend_on_the_batch_size(tmp_path, monkeypatch, capsys):
    """docs/training.md's command as printed, in a folder holding dsv41-demo/model (untrained: the scores only need
    to be log-likelihoods); then the same task at batch size 1."""
    tokenizer = build_demo_tokenizer()
    model = build_demo_model(demo_config(tokenizer), tokenizer, seed=0)
    model.save_pretrained(tmp_path / "dsv41-demo" / "model")
    tokenizer.save_pretrained(tmp_path / "dsv41-demo" / "model")
    (command,) = command_lines("python examples/lm_eval_local.py")
    argv = shlex.split(command)
    monkeypatch.chdir(tmp_path)
    example = runpy.run_path(str(REPO_ROOT / argv[1]))
    task = example["TASK"]

    results = example["main"](argv[2:])
    output = Path(argv[argv.index("--output") + 1])
    assert f"|{task}" in capsys.readouterr().out and (output / "results.json").is_file()
    accuracy = results["results"][task]["acc,none"]
    samples = len(results["samples"][task])
    assert 0.0 <= accuracy <= 1.0 and samples > 0
    scores = loglikelihoods(results, task)
    assert len(scores) == samples * len(COLORS) and all(score < 0 for score in scores)

    one = example["evaluate"]("dsv41-demo/model", tmp_path / "eval-1", samples=samples, batch_size=1)
    # a padded batch changes the GEMM shapes, not the real tokens' computation: fp32 summation noise only
    assert loglikelihoods(one, task) == pytest.approx(scores, abs=1e-4)
    assert one["results"][task]["acc,none"] == accuracy
