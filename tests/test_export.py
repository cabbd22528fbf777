"""Hub export: a flat remote-code folder that loads with transformers alone, our classes first where the package is
installed, a rendered model card whose usage snippets run, and push_to_hub into a local stand-in for the Hub."""

from __future__ import annotations

import ast
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import transformers
from huggingface_hub import CommitInfo, HfApi, ModelCard, RepoUrl
from peft import LoraConfig, get_peft_model
from PIL import Image
from transformers import AutoConfig, AutoModelForCausalLM, AutoProcessor

from configuration import DeepseekV41Config
from modeling_dsv41 import DeepseekV41ForCausalLM
from modeling_dsv41.engram import build_compressed_token_map
from configuration.remote_code import flatten_module_source
from modeling_dsv41.hub.export import EXPORT_MANIFEST, export_for_hub, push_to_hub
from processing import DeepseekV41ImageProcessor, DeepseekV41Processor, build_tiny_tokenizer  # (registers them)
from tiny_models import tiny_model

PROJECT_PACKAGES = {"configuration", "processing", "modeling_dsv41"}
RESULTS = {"MMMU (val)": {"accuracy": 0.5123}, "DocVQA": {"ANLS": 0.9}}
CARD_DATA = {"datasets": ["HuggingFaceM4/the_cauldron"], "tags": ["lora-ready"], "language": ["en", "zh"]}


@pytest.fixture(scope="module")
def tiny():
    """A tiny model and processor that belong together (the Engram map is built from this tokenizer)."""
    tokenizer = build_tiny_tokenizer()
    _, compressed = build_compressed_token_map(tokenizer)
    model = tiny_model(engram_map=None, engram_compressed_vocab_size=compressed)
    model.model.engram_hasher.load_tokenizer(tokenizer)
    processor = DeepseekV41Processor(
        DeepseekV41ImageProcessor.from_vision_config(model.config.vision_config), tokenizer
    )
    return model, processor


@pytest.fixture(scope="module")
def exported(tiny, tmp_path_factory):
    model, processor = tiny
    return export_for_hub(
        model, tmp_path_factory.mktemp("hub") / "dsv41-tiny", processor, card_data=CARD_DATA, results=RESULTS
    )


def sample_image() -> Image.Image:
    return Image.new("RGB", (60, 40), (200, 30, 30))


def chat_prompt(processor) -> str:
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Describe this image."}]}]
    return processor.apply_chat_template(messages, add_generation_prompt=True)


def sample_inputs(processor) -> dict[str, torch.Tensor]:
    return dict(processor(images=[sample_image()], text=chat_prompt(processor), return_tensors="pt"))


def usage_snippets(readme: str) -> list[str]:
    usage = readme.split("\n## Usage", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```python\n(.*?)```", usage, flags=re.DOTALL)


# ---------------------------------------------------------------------------------------------------------------
# flattening
# ---------------------------------------------------------------------------------------------------------------
def test_flatten_rewrites_project_imports_into_sibling_imports():
    source = textwrap.dedent(
        """\
        from __future__ import annotations
        import torch
        from torch import nn
        from configuration.configuration_dsv41 import DeepseekV41Config
        from .moe import (
            DeepseekV41MoE,
        )

        def load():
            from processing.image_processing_dsv41 import plan_image_grid
            return plan_image_grid
        """
    )
    flat, needed = flatten_module_source(source, "modeling_dsv41.modeling_dsv41")
    assert flat == source.replace(
        "from configuration.configuration_dsv41 import", "from .configuration_dsv41 import"
    ).replace("from processing.image_processing_dsv41 import", "from .image_processing_dsv41 import")
    assert needed == {"configuration.configuration_dsv41", "modeling_dsv41.moe", "processing.image_processing_dsv41"}


@pytest.mark.parametrize(
    "statement, message",
    [
        ("from configuration import DeepseekV41Config", "imports from the package 'configuration'"),
        ("from . import moe", "imports from the package 'modeling_dsv41'"),
        ("import modeling_dsv41.moe", "cannot be flattened"),
    ],
)
def test_flatten_refuses_imports_it_cannot_express_flat(statement, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        flatten_module_source(statement + "\n", "modeling_dsv41.modeling_dsv41")


# ---------------------------------------------------------------------------------------------------------------
# the exported folder
# ---------------------------------------------------------------------------------------------------------------
def test_export_is_a_flat_self_contained_repo(exported):
    modules = {path.stem for path in exported.glob("*.py")}
    for path in exported.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level:  # only siblings that were written
                assert node.level == 1 and node.module in modules, f"{path.name}: {ast.unparse(node)}"
            elif isinstance(node, ast.ImportFrom):
                assert node.module.split(".")[0] not in PROJECT_PACKAGES, f"{path.name}: {ast.unparse(node)}"
            elif isinstance(node, ast.Import):
                assert not {a.name.split(".")[0] for a in node.names} & PROJECT_PACKAGES, path.name

    def defined(reference: str) -> bool:
        module, name = reference.split(".")
        tree = ast.parse((exported / f"{module}.py").read_text())
        return any(isinstance(n, ast.ClassDef) and n.name == name for n in tree.body)

    config = json.loads((exported / "config.json").read_text())
    assert config["auto_map"] == {
        "AutoConfig": "configuration_dsv41.DeepseekV41Config",
        "AutoModel": "modeling_dsv41.DeepseekV41Model",
        "AutoModelForCausalLM": "modeling_dsv41.DeepseekV41ForCausalLM",
        "AutoModelForImageTextToText": "modeling_dsv41.DeepseekV41ForCausalLM",
    }
    saved = json.loads((exported / "processor_config.json").read_text())
    assert saved["auto_map"] == {"AutoProcessor": "processing_dsv41.DeepseekV41Processor"}
    assert saved["image_processor"]["auto_map"] == {
        "AutoImageProcessor": {
            "torchvision": "image_processing_dsv41.DeepseekV41ImageProcessor",
            "pil": "image_processing_pil_dsv41.DeepseekV41ImageProcessorPil",
        }
    }
    references = [
        *config["auto_map"].values(),
        *saved["auto_map"].values(),
        *saved["image_processor"]["auto_map"]["AutoImageProcessor"].values(),
    ]
    assert all(defined(reference) for reference in references)


def test_model_card_metadata_architecture_and_results(exported, tiny):
    card = ModelCard.load(exported / "README.md")
    data = card.data
    assert (data.library_name, data.pipeline_tag, data.license) == ("transformers", "image-text-to-text", "mit")
    assert data.base_model == "deepseek-ai/DeepSeek-V4.1-Flash"
    assert {"custom_code", "lora-ready"} <= set(data.tags)
    assert data.datasets == CARD_DATA["datasets"] and data.language == CARD_DATA["language"]
    text = card.text
    assert f"| Parameters | {tiny[0].num_parameters():,} |" in text
    assert "| MMMU (val) | accuracy | 0.5123 |" in text and "| DocVQA | ANLS | 0.9 |" in text
    for kind in ("Muon", "Head-wise Muon", "Sinkhorn-balanced", "AdamW"):
        assert f"| {kind}" in text
    assert "{{" not in text and "{%" not in text
    assert len(usage_snippets(text)) == 2  # text chat, and image chat with the processor


def test_card_image_snippet_starts_with_one_bos(exported, tiny, tmp_path, monkeypatch):
    """The chat template writes BOS; the snippet's processor call must not add a second one (as the README's)."""
    _, processor = tiny
    image_snippet = usage_snippets((exported / "README.md").read_text())[1]
    monkeypatch.chdir(tmp_path)
    sample_image().save(tmp_path / "photo.jpg")
    namespace = {}
    exec(compile(image_snippet.split("output = model.generate")[0], "README.md", "exec"), namespace)
    ids = namespace["inputs"]["input_ids"][0].tolist()
    assert ids[0] == processor.tokenizer.bos_token_id and ids.count(processor.tokenizer.bos_token_id) == 1


def test_model_only_export_has_a_runnable_snippet_and_no_results(tiny, tmp_path):
    model, _ = tiny
    text = (export_for_hub(model, tmp_path / "repo") / "README.md").read_text()
    assert "No evaluation results have been reported" in text
    [snippet] = usage_snippets(text)  # no tokenizer or processor saved: token ids straight into the model
    namespace = {}
    exec(compile(snippet, "README.md", "exec"), namespace)
    assert type(namespace["model"]) is DeepseekV41ForCausalLM
    assert 0 <= int(namespace["next_token"]) < model.config.text_config.vocab_size


def test_export_refuses_what_it_cannot_publish(tiny, tmp_path):
    model, processor = tiny
    peft_model = get_peft_model(DeepseekV41ForCausalLM(model.config), LoraConfig(r=2, target_modules=["wq_a"]))
    with pytest.raises(ValueError, match="merge the adapters"):
        export_for_hub(peft_model, tmp_path / "peft")
    with pytest.raises(ValueError, match="not both"):
        export_for_hub(model, tmp_path / "both", processor, processor.tokenizer)


def test_export_refuses_a_folder_holding_other_files(tiny, tmp_path):
    """An old LoRA adapter left in the folder would be published with the model (and make it load as an adapter)."""
    model, processor = tiny
    folder = tmp_path / "repo"
    get_peft_model(DeepseekV41ForCausalLM(model.config), LoraConfig(r=2, target_modules=["wq_a"])).save_pretrained(
        folder
    )
    before = sorted(p.name for p in folder.iterdir())
    with pytest.raises(
        ValueError,
        match=rf"{folder} is not empty and holds files no export wrote \(README.md, "
        r"adapter_config.json, adapter_model.safetensors\)",
    ):
        export_for_hub(model, folder, processor)
    assert sorted(p.name for p in folder.iterdir()) == before  # nothing removed nor written

    export_for_hub(model, tmp_path / "export", processor)
    (tmp_path / "export" / "notes.txt").write_text("mine")  # a previous export plus a file of the user's
    with pytest.raises(ValueError, match=r"holds files no export wrote \(notes.txt\)"):
        export_for_hub(model, tmp_path / "export", processor)


def test_export_over_a_previous_export_replaces_its_files(tiny, tmp_path):
    """The first export is sharded, the second is not: no stale shard survives, and the folder loads."""
    model, processor = tiny
    folder = tmp_path / "repo"
    export_for_hub(model, folder, processor, max_shard_size="300KB")
    assert len(list(folder.glob("model-*-of-*.safetensors"))) > 1
    (folder / ".git").mkdir()
    (folder / ".git" / "HEAD").write_text("ref: refs/heads/main")  # a clone of the Hub repo: not ours, kept

    export_for_hub(model, folder, processor)
    fresh = export_for_hub(model, tmp_path / "fresh", processor)
    assert sorted(p.name for p in folder.iterdir()) == sorted([*(p.name for p in fresh.iterdir()), ".git"])
    assert not list(folder.glob("model-*-of-*.safetensors")) and (folder / ".git" / "HEAD").is_file()
    reloaded = DeepseekV41ForCausalLM.from_pretrained(folder)
    for name, value in model.state_dict().items():
        assert torch.equal(reloaded.state_dict()[name], value), name


# ---------------------------------------------------------------------------------------------------------------
# loading
# ---------------------------------------------------------------------------------------------------------------
REMOTE_SCRIPT = """
import builtins, json, sys
def no_prompt(prompt=""):
    raise AssertionError("transformers asked whether to trust remote code: " + prompt[:200])
builtins.input = no_prompt
for package in ("configuration", "processing", "modeling_dsv41"):
    try:
        __import__(package)
    except ImportError:
        continue
    raise AssertionError(f"{package} is importable: the check would not show that remote code suffices")

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText, AutoProcessor

from PIL import Image

repo, expected, case = sys.argv[1], torch.load("expected.pt"), json.load(open("case.json"))
config = AutoConfig.from_pretrained(repo, trust_remote_code=True)
processor = AutoProcessor.from_pretrained(repo, trust_remote_code=True)
model = AutoModelForCausalLM.from_pretrained(repo, trust_remote_code=True).eval()
inputs = dict(processor(images=[Image.open("image.png")], text=case["prompt"], return_tensors="pt"))
for key, value in expected["inputs"].items():
    assert torch.equal(inputs[key], value), key
with torch.no_grad():
    logits = model(**inputs).logits
# 1e-5: the same fp32 computation, only BLAS blocking may differ between the two processes
assert torch.allclose(logits, expected["logits"], rtol=0, atol=1e-5), (logits - expected["logits"]).abs().max()
image_model = AutoModelForImageTextToText.from_pretrained(repo, trust_remote_code=True)
for snippet in case["snippets"]:
    exec(compile(snippet, "README.md", "exec"), {})
print(json.dumps({name: type(obj).__module__ for name, obj in [("config", config), ("processor", processor),
      ("image_processor", processor.image_processor), ("model", model), ("image_model", image_model)]}))
"""


def test_remote_code_loads_with_transformers_alone(exported, tiny, tmp_path):
    model, processor = tiny
    sample_image().save(tmp_path / "image.png")
    sample_image().save(tmp_path / "photo.jpg")  # what the card's image snippet opens
    inputs = sample_inputs(processor)
    with torch.no_grad():
        logits = model(**inputs).logits
    torch.save({"inputs": inputs, "logits": logits}, tmp_path / "expected.pt")
    snippets = usage_snippets((exported / "README.md").read_text())
    (tmp_path / "case.json").write_text(json.dumps({"prompt": chat_prompt(processor), "snippets": snippets}))
    (tmp_path / "check.py").write_text(REMOTE_SCRIPT)

    # -S: no site hooks, so neither the editable install's path finder nor any .pth puts the project on sys.path;
    # PYTHONPATH: only the environment's site-packages (transformers, torch, …)
    site_packages = Path(transformers.__file__).resolve().parents[1]
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "PYTHONPATH": str(site_packages),
        "HOME": str(tmp_path),
        "HF_HOME": str(tmp_path / "hf"),
        "HF_HUB_OFFLINE": "1",
        "OMP_NUM_THREADS": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }
    run = subprocess.run(
        [sys.executable, "-S", "check.py", str(exported)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-4000:]
    modules = json.loads(run.stdout.strip().splitlines()[-1])
    assert all(module.startswith("transformers_modules.") for module in modules.values()), modules


COEXIST_SCRIPT = """
import json, sys
from transformers import AutoModelForCausalLM
from transformers.dynamic_module_utils import get_class_from_dynamic_module
from transformers.quantizers.auto import AUTO_QUANTIZATION_CONFIG_MAPPING, AUTO_QUANTIZER_MAPPING

order, folder = sys.argv[1:]
loaded = []
if order == "remote-first":  # the repo's code registers its copy of our quantizer, then the package its own
    loaded.append(type(AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)).__module__)
    import modeling_dsv41
    loaded.append(type(AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)).__module__)
else:  # the package first, then the repo's code imported explicitly
    import modeling_dsv41
    loaded.append(type(AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)).__module__)
    remote = get_class_from_dynamic_module("modeling_dsv41.DeepseekV41ForCausalLM", folder)
    loaded.append(type(remote.from_pretrained(folder)).__module__)
quantizer = [m[k].__module__ for m, k in ((AUTO_QUANTIZATION_CONFIG_MAPPING, "deepseek_v41_fp8"),
                                          (AUTO_QUANTIZER_MAPPING, "deepseek_v41_fp8"))]
print(json.dumps({"loaded": loaded, "quantizer": quantizer}))
"""


@pytest.mark.parametrize("order", ["remote-first", "package-first"])
def test_package_and_remote_code_coexist_in_one_process(exported, tmp_path, order):
    """Registration is process-wide: the two copies of the code must not refuse each other (transformers raises
    "already registered" for a second quantizer of one name); the package's classes hold the names."""
    (tmp_path / "coexist.py").write_text(COEXIST_SCRIPT)
    env = {
        **os.environ,
        "HF_HOME": str(tmp_path / "hf"),
        "HF_HUB_OFFLINE": "1",
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": str(Path(__file__).resolve().parents[1]),
    }
    run = subprocess.run(
        [sys.executable, "coexist.py", order, str(exported)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-4000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    remote, package = "transformers_modules.", "modeling_dsv41.modeling_dsv41"
    if order == "remote-first":
        assert result["loaded"][0].startswith(remote) and result["loaded"][1] == package
    else:
        assert result["loaded"][0] == package and result["loaded"][1].startswith(remote)
    assert result["quantizer"] == ["modeling_dsv41.released.native_precision"] * 2


@pytest.mark.parametrize("trust_remote_code", [True, None])
def test_installed_package_takes_precedence_over_the_repo_code(exported, trust_remote_code):
    config = AutoConfig.from_pretrained(exported, trust_remote_code=trust_remote_code)
    model = AutoModelForCausalLM.from_pretrained(exported, trust_remote_code=trust_remote_code)
    processor = AutoProcessor.from_pretrained(exported, trust_remote_code=trust_remote_code)
    assert type(config) is DeepseekV41Config
    assert type(model) is DeepseekV41ForCausalLM
    assert type(processor) is DeepseekV41Processor
    assert type(processor.image_processor).__module__.startswith("processing.")


# ---------------------------------------------------------------------------------------------------------------
# push_to_hub
# ---------------------------------------------------------------------------------------------------------------
class LocalHub:
    """Stands in for the Hub: ``create_repo`` records the call, ``create_commit`` writes the files under ``root``."""

    def __init__(self, root: Path):
        self.root, self.repos, self.commits = root, [], []

    def create_repo(self, api, repo_id, **kwargs):
        self.repos.append((repo_id, kwargs))
        return RepoUrl(f"https://huggingface.co/{repo_id}")

    def create_commit(self, api, repo_id, operations, **kwargs):
        self.commits.append((repo_id, kwargs))
        for op in operations:
            target = self.root / repo_id / op.path_in_repo
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(op.path_or_fileobj, target)
        url = f"https://huggingface.co/{repo_id}/commit/{'0' * 40}"
        return CommitInfo(commit_url=url, commit_message=kwargs["commit_message"], commit_description="", oid="0" * 40)

    def upload_folder(
        self, api, repo_id, folder_path, path_in_repo="", ignore_patterns=None, run_as_future=False, **kwargs
    ):
        """``HfApi.upload_folder`` (the Trainer's pushes): the folder's files, less ``ignore_patterns``, into the repo
        (done at once, also when asked to run as a future)."""
        from concurrent.futures import Future

        from huggingface_hub.utils import filter_repo_objects

        folder = Path(folder_path)
        files = [p.relative_to(folder).as_posix() for p in sorted(folder.rglob("*")) if p.is_file()]
        for name in filter_repo_objects(files, ignore_patterns=ignore_patterns):
            target = self.root / repo_id / path_in_repo / name
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(folder / name, target)
        self.commits.append((repo_id, kwargs))
        if not run_as_future:
            return None
        done = Future()
        done.set_result(None)
        return done


def test_push_to_hub_commits_the_export(tiny, exported, tmp_path, monkeypatch):
    hub = LocalHub(tmp_path / "hub")
    monkeypatch.setattr(HfApi, "create_repo", lambda api, repo_id, **kw: hub.create_repo(api, repo_id, **kw))
    monkeypatch.setattr(
        HfApi, "create_commit", lambda api, repo_id, ops, **kw: hub.create_commit(api, repo_id, ops, **kw)
    )
    model, processor = tiny

    info = push_to_hub("someone/dsv41-tiny", model, processor, results=RESULTS, private=True, commit_message="tiny")

    assert info.commit_message == "tiny"
    assert hub.repos == [("someone/dsv41-tiny", {"private": True, "token": None, "exist_ok": True})]
    pushed = tmp_path / "hub" / "someone" / "dsv41-tiny"
    assert sorted(p.name for p in pushed.iterdir()) == sorted(
        p.name for p in exported.iterdir() if p.name != EXPORT_MANIFEST
    )
    assert 'repo_id = "someone/dsv41-tiny"' in (pushed / "README.md").read_text()
    reloaded = AutoModelForCausalLM.from_pretrained(pushed, trust_remote_code=True).eval()
    inputs = sample_inputs(AutoProcessor.from_pretrained(pushed, trust_remote_code=True))
    with torch.no_grad():
        torch.testing.assert_close(reloaded(**inputs).logits, model(**inputs).logits, rtol=0, atol=0)


def test_push_to_a_branch_creates_it_first(tiny, tmp_path, monkeypatch):
    hub, branches = LocalHub(tmp_path / "hub"), []
    monkeypatch.setattr(HfApi, "create_repo", lambda api, repo_id, **kw: hub.create_repo(api, repo_id, **kw))
    monkeypatch.setattr(HfApi, "create_branch", lambda api, repo_id, **kw: branches.append((repo_id, kw)))
    monkeypatch.setattr(
        HfApi, "create_commit", lambda api, repo_id, ops, **kw: hub.create_commit(api, repo_id, ops, **kw)
    )

    push_to_hub("someone/dsv41-tiny", tiny[0], revision="dev")

    assert branches == [("someone/dsv41-tiny", {"branch": "dev", "token": None, "exist_ok": True})]
    assert hub.commits[0][1]["revision"] == "dev"


def test_the_exported_modules_import_one_way():
    """The modules the remote code holds (every project module the model imports, transitively, function-level
    imports included) form no import circle: each depends on the others one way."""
    import importlib

    graph, pending = {}, [DeepseekV41ForCausalLM.__module__]
    while pending:
        module = pending.pop()
        if module in graph:
            continue
        source = Path(importlib.import_module(module).__file__).read_text(encoding="utf-8")
        graph[module] = flatten_module_source(source, module)[1] - {module}
        pending.extend(graph[module])
    assert {"modeling_dsv41.released.loading", "modeling_dsv41.placement"} <= graph.keys()

    def reaches(start: str, target: str, seen: set) -> bool:
        return any(
            dep == target or (dep not in seen and not seen.add(dep) and reaches(dep, target, seen))
            for dep in graph[start]
        )

    circles = sorted(module for module in graph if reaches(module, module, set()))
    assert not circles, f"modules on an import circle: {circles}"
