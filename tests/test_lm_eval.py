"""``examples/lm_eval_local.py``: lm-evaluation-harness on a local task, through the harness's own ``HFLM``."""

from __future__ import annotations

import runpy
from pathlib import Path

import pytest

from modeling_dsv41.cli.demo import build_demo_model, demo_config
from modeling_dsv41.cli.demo_data import COLORS, build_demo_tokenizer

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "lm_eval_local.py"


def loglikelihoods(results: dict, task: str) -> list[float]:
    return [float(resp[0]) for sample in results["samples"][task] for resp in sample["filtered_resps"]]


def test_lm_eval_on_a_local_task_batch_size_independent(tmp_path, capsys):
    tokenizer = build_demo_tokenizer()
    model = build_demo_model(demo_config(tokenizer), tokenizer, seed=0)
    model.save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    example = runpy.run_path(str(EXAMPLE))
    task = example["TASK"]

    results = example["main"](["--model", str(tmp_path / "model"), "--output", str(tmp_path / "eval"),
                               "--samples", "12", "--batch_size", "4"])
    assert f"|{task}" in capsys.readouterr().out and (tmp_path / "eval" / "results.json").is_file()
    accuracy = results["results"][task]["acc,none"]
    assert 0.0 <= accuracy <= 1.0 and len(results["samples"][task]) == 12
    scores = loglikelihoods(results, task)
    assert len(scores) == 12 * len(COLORS) and all(score < 0 for score in scores)

    one = example["evaluate"](str(tmp_path / "model"), tmp_path / "eval-1", samples=12, batch_size=1)
    # a padded batch changes the GEMM shapes, not the real tokens' computation: fp32 summation noise only
    assert loglikelihoods(one, task) == pytest.approx(scores, abs=1e-4)
    assert one["results"][task]["acc,none"] == accuracy
