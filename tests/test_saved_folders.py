"""Every folder our classes save loads where this package is not installed: the model's and the processor's
``save_pretrained``, their ``push_to_hub`` and ``save_pretrained(push_to_hub=True)``, a Trainer checkpoint, the pushes
``Trainer(push_to_hub=True)`` makes during training and its final ``push_to_hub()`` (a local folder stands in for the
Hub). A fresh process with transformers alone (the project not importable) loads each with
``trust_remote_code=True`` and computes the logits the saved model computed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers
from huggingface_hub import HfApi
from torch.utils.data import Dataset
from transformers import Trainer, TrainingArguments

from modeling_dsv41 import DeepseekV41Trainer, DeepseekV41TrainingArguments
from test_export import LocalHub, sample_inputs, tiny  # noqa: F401  (tiny: the model and processor fixture)

LOAD_SCRIPT = """
import json, sys
for package in ("configuration", "processing", "modeling_dsv41"):
    try:
        __import__(package)
    except ImportError:
        continue
    raise AssertionError(f"{package} is importable: the check would not show that the saved code suffices")
import torch
from PIL import Image
from transformers import AutoModelForCausalLM, AutoProcessor

cases = torch.load("cases.pt")
image = Image.open("image.png")
modules = {}
for folder, case in cases.items():
    model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True).eval()
    processor = AutoProcessor.from_pretrained(folder, trust_remote_code=True)
    inputs = dict(processor(images=[image], text=case["prompt"], return_tensors="pt"))
    for key, value in case["inputs"].items():
        assert torch.equal(inputs[key], value), (folder, key)
    with torch.no_grad():
        logits = model(**inputs).logits
    # the same fp32 computation in another process: only BLAS blocking may differ
    assert torch.allclose(logits, case["logits"], rtol=0, atol=1e-5), (folder, (logits - case["logits"]).abs().max())
    modules[folder] = [type(model).__module__, type(processor).__module__]
print(json.dumps(modules))
"""


class TokenRows(Dataset):
    def __init__(self, n: int = 4, seq: int = 24):
        self.ids = torch.randint(3, 500, (n, seq), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


@pytest.fixture
def hub(tmp_path, monkeypatch) -> LocalHub:
    local = LocalHub(tmp_path / "hub")
    monkeypatch.setattr(HfApi, "create_repo", lambda api, repo_id, **kw: local.create_repo(api, repo_id, **kw))
    monkeypatch.setattr(
        HfApi,
        "create_commit",
        lambda api, repo_id, operations, **kw: local.create_commit(api, repo_id, operations, **kw),
    )
    monkeypatch.setattr(HfApi, "upload_folder", lambda api, **kw: local.upload_folder(api, **kw))
    return local


def case(model, processor) -> dict:
    from test_export import chat_prompt

    inputs = sample_inputs(processor)
    with torch.no_grad():
        logits = model.eval()(**inputs).logits
    return {"prompt": chat_prompt(processor), "inputs": inputs, "logits": logits}


def load_without_the_package(cases: dict[Path, dict], tmp_path: Path) -> dict[str, list[str]]:
    from test_export import sample_image

    torch.save({str(folder): value for folder, value in cases.items()}, tmp_path / "cases.pt")
    sample_image().save(tmp_path / "image.png")
    (tmp_path / "load.py").write_text(LOAD_SCRIPT)
    # -S: no site hooks, so neither the editable install's path finder nor any .pth puts the project on sys.path;
    # PYTHONPATH: only the environment's site-packages (transformers, torch, ...)
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": str(tmp_path),
        "HF_HOME": str(tmp_path / "hf"),
        "PYTHONPATH": str(Path(transformers.__file__).resolve().parents[1]),
        "HF_HUB_OFFLINE": "1",
        "OMP_NUM_THREADS": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }
    run = subprocess.run(
        [sys.executable, "-S", "load.py"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
    )
    assert run.returncode == 0, run.stderr[-4000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def test_saved_and_pushed_folders_load_with_transformers_alone(tiny, hub, tmp_path):  # noqa: F811
    model, processor = tiny
    saved = tmp_path / "saved"
    model.save_pretrained(saved)
    processor.save_pretrained(saved)
    model.push_to_hub("someone/pushed")
    processor.push_to_hub("someone/pushed")
    model.save_pretrained(tmp_path / "saved-and-pushed", push_to_hub=True, repo_id="someone/saved-and-pushed")
    processor.save_pretrained(tmp_path / "saved-and-pushed", push_to_hub=True, repo_id="someone/saved-and-pushed")
    expected = case(model, processor)
    folders = [saved, hub.root / "someone/pushed", hub.root / "someone/saved-and-pushed"]
    modules = load_without_the_package(dict.fromkeys(folders, expected), tmp_path)
    assert all(module.startswith("transformers_modules.") for pair in modules.values() for module in pair), modules


@pytest.mark.parametrize("trainer_class", [DeepseekV41Trainer, Trainer])
def test_trainer_checkpoints_and_pushes_load_with_transformers_alone(tiny, hub, tmp_path, trainer_class):  # noqa: F811
    """DeepseekV41Trainer: the checkpoint and the push made after it during training (its RemoteCodeCallback writes
    the code the push would leave behind; the stand-in uploads at once); transformers' Trainer: the checkpoint and
    the final push_to_hub()."""
    model, processor = tiny
    model = type(model)(model.config)  # a copy to train: the fixture's weights stay for the other tests
    model.load_state_dict(tiny[0].state_dict())
    arguments = dict(
        output_dir=str(tmp_path / "out"),
        max_steps=1,
        save_steps=1,
        per_device_train_batch_size=2,
        use_cpu=True,
        report_to="none",
        disable_tqdm=True,
        push_to_hub=True,
        hub_model_id="someone/trained",
    )
    if trainer_class is DeepseekV41Trainer:
        args = DeepseekV41TrainingArguments(**arguments, learning_rate=1e-3, bias_update_speed=0.0)
    else:
        args = TrainingArguments(**arguments, learning_rate=1e-3)
    trainer = trainer_class(model=model, args=args, train_dataset=TokenRows(), processing_class=processor)
    trainer.train()
    if trainer_class is Trainer:  # its pushes during training leave the code behind: the final push saves it
        trainer.push_to_hub()
    expected = case(model, processor)
    folders = [tmp_path / "out/checkpoint-1", hub.root / "someone/trained"]
    modules = load_without_the_package(dict.fromkeys(folders, expected), tmp_path)
    assert all(module.startswith("transformers_modules.") for pair in modules.values() for module in pair), modules
