"""Evaluate a DeepSeek-V4.1 model with lm-evaluation-harness on a local task (no download).

The task, ``dsv41_shape_colour``, is written here as a JSON-lines file and a task YAML: each document is a short
caption of the demo's shapes (``"red circle top left"``) and the question is its colour, scored as a multiple choice
over the six colours by log-likelihood. The model runs through lm-evaluation-harness's ``HFLM`` (the
``"hf"`` model type), so any other harness task runs the same way::

    pip install lm_eval
    python examples/lm_eval_local.py --model dsv41-demo/model --output dsv41-eval

It prints the harness's results table and writes ``results.json`` next to the task files.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import lm_eval
from lm_eval.models.huggingface import HFLM
from lm_eval.tasks import TaskManager
from transformers import AutoModelForCausalLM, AutoTokenizer

import modeling_dsv41  # noqa: F401  registers the model classes with the Auto classes
from modeling_dsv41.cli.demo_data import COLORS, ShapesDataset

TASK = "dsv41_shape_colour"
TASK_YAML = f"""task: {TASK}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {{data}}
test_split: test
output_type: multiple_choice
doc_to_text: "Caption: {{{{caption}}}}. Colour:"
doc_to_choice: {json.dumps([f" {color}" for color in COLORS])}
doc_to_target: label
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""


def write_task(folder: Path, samples: int) -> Path:
    """The task's documents and YAML in ``folder``; returns the folder (the harness's ``include_path``)."""
    folder.mkdir(parents=True, exist_ok=True)
    data = folder / f"{TASK}.jsonl"
    with data.open("w") as f:
        for sample in ShapesDataset("eval", samples):
            f.write(json.dumps({"caption": sample.caption, "label": list(COLORS).index(sample.color)}) + "\n")
    (folder / f"{TASK}.yaml").write_text(TASK_YAML.format(data=data))
    return folder


def evaluate(model_path: str, output: Path, samples: int = 36, batch_size: int = 8) -> dict:
    """The harness's ``simple_evaluate`` results for the local task."""
    tasks = TaskManager(include_path=str(write_task(output, samples)))
    model = AutoModelForCausalLM.from_pretrained(model_path).eval()
    lm = HFLM(pretrained=model, tokenizer=AutoTokenizer.from_pretrained(model_path), batch_size=batch_size)
    results = lm_eval.simple_evaluate(model=lm, tasks=[TASK], task_manager=tasks, log_samples=True)
    (output / "results.json").write_text(json.dumps(results["results"], indent=2))
    return results


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="a folder with the model and its tokenizer")
    parser.add_argument("--output", type=Path, default=Path("dsv41-eval"), help="where the task and results go")
    parser.add_argument("--samples", type=int, default=36, help="documents in the task")
    parser.add_argument("--batch_size", type=int, default=8)
    args = parser.parse_args(argv)
    results = evaluate(args.model, args.output, args.samples, args.batch_size)
    print(lm_eval.utils.make_table(results))
    return results


if __name__ == "__main__":
    main(sys.argv[1:])
