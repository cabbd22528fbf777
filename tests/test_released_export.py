"""``dsv41 export --format released`` (modeling_dsv41/serving/released_export.py): a model folder of ours written in
DeepSeek's released checkpoint format, run as docs/serving.md prints it, read back by ``from_pretrained`` and
``dsv41 convert``."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys

import pytest
import torch
from safetensors import safe_open
from transformers import FineGrainedFP8Config

from documentation import REPO_ROOT, command_lines

from modeling_dsv41 import DeepseekV41ForCausalLM
from modeling_dsv41.cli import demo as demo_module
from modeling_dsv41.cli import main
from modeling_dsv41.cli.demo_data import build_demo_tokenizer
from modeling_dsv41.engram import build_compressed_token_map
from modeling_dsv41.released.writing import released_state_dict
from modeling_dsv41.serving.released_export import FORMAT, export_released_checkpoint

PUBLISHED = REPO_ROOT.parent / "shared" / "fixtures" / "released_config" / "config.json"


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """The demo-sized model saved as a fine-tune would be (our folder, bf16, its tokenizer beside it), exported
    with the command docs/serving.md prints, run in a fresh process from the folder holding it."""
    root = tmp_path_factory.mktemp("export")
    tokenizer = build_demo_tokenizer()
    torch.manual_seed(0)
    model = DeepseekV41ForCausalLM(demo_module.demo_config(tokenizer)).to(torch.bfloat16)
    lookup, _ = build_compressed_token_map(tokenizer)  # the map the release's loaders rebuild from the tokenizer
    model.model.engram_hasher.token_map.copy_(torch.tensor(lookup))
    (command,) = command_lines("dsv41 export --format released ")
    argv = shlex.split(command)
    model.save_pretrained(root / argv[-2])
    tokenizer.save_pretrained(root / argv[-2])
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1"}
    result = subprocess.run(
        [sys.executable, "-m", "modeling_dsv41.cli", *argv[1:]],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert FORMAT in result.stdout
    return {"model": model, "source": root / argv[-2], "folder": root / argv[-1]}


def test_the_folder_holds_the_published_config_keys_and_the_released_storage(exported):
    folder = exported["folder"]
    ours, published = (json.loads(p.read_text()) for p in (folder / "config.json", PUBLISHED))
    assert set(ours) <= set(published), set(ours) - set(published)
    assert ours["quantization_config"] == published["quantization_config"]
    assert (folder / "inference" / "config.json").is_file() and (folder / "tokenizer.json").is_file()
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    stored = {}
    for shard in set(index["weight_map"].values()):
        with safe_open(folder / shard, "pt") as f:
            stored |= {name: f.get_tensor(name) for name in f.keys()}
    assert stored.keys() == index["weight_map"].keys()
    # the quantized tensors are the release's writer's (FP8 blocks, FP4 rows, E8M0 scales) of the saved model
    expected = released_state_dict(DeepseekV41ForCausalLM.from_pretrained(exported["source"], dtype=torch.float32))
    for name, tensor in stored.items():
        if tensor.dtype in (torch.float8_e4m3fn, torch.float8_e8m0fnu, torch.int8):
            assert torch.equal(tensor.view(torch.uint8), expected[name].view(torch.uint8)), name
    assert any(t.dtype == torch.int8 for t in stored.values())  # the packed FP4 experts
    assert any(t.dtype == torch.float8_e4m3fn for t in stored.values())


def test_from_pretrained_and_convert_read_it_back(exported, tmp_path):
    """The exported folder loads (dequantized; natively too: FP8/FP4 as stored), and ``dsv41 convert`` of it gives the
    same weights; the logits are the fine-tune's up to the FP8/FP4 rounding of its weights (below, a loose bound: the
    storage moves each weight by up to half an FP8 step, 2^-4 relative, and an FP4 expert weight by up to a quarter of
    its row block's scale)."""
    dequantize = FineGrainedFP8Config(dequantize=True)
    loaded = DeepseekV41ForCausalLM.from_pretrained(
        exported["folder"], dtype=torch.bfloat16, quantization_config=dequantize
    )
    assert main(["convert", str(exported["folder"]), str(tmp_path / "back")]) == 0
    back = DeepseekV41ForCausalLM.from_pretrained(tmp_path / "back", dtype=torch.bfloat16)
    theirs = back.state_dict()
    for name, tensor in loaded.state_dict().items():
        assert torch.equal(tensor, theirs[name]), name
    ids = torch.randint(3, 200, (1, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        original, exported_logits = (m(input_ids=ids).logits.float() for m in (exported["model"], loaded))
    error = (exported_logits - original).norm() / original.norm()
    assert 0 < error < 0.25, error  # rounded (not equal), and still the same model


def test_bad_input_is_refused(exported, tmp_path):
    with pytest.raises(FileExistsError, match="not an empty folder"):
        export_released_checkpoint(exported["source"], exported["folder"])
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text("{}")
    with pytest.raises(Exception, match="(?i)adapter|merge"):
        export_released_checkpoint(adapter, tmp_path / "out")
