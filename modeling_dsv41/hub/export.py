"""Publishing DeepSeek-V4.1 on the Hub as remote code, with a model card.

``trust_remote_code`` loading copies a repo's code as one flat folder in which modules may import each other only
as siblings (``from .moe import …``). Our source spans three packages (``configuration``, ``processing``,
``modeling_dsv41``), so :func:`export_for_hub` writes every module the saved classes need side by side, rewrites
the project imports into sibling imports (``from configuration.configuration_dsv41 import X`` →
``from .configuration_dsv41 import X``), points ``auto_map`` at them and renders the model card (``model_card.md``
at the repository root) into ``README.md``. The result loads with only transformers installed::

    AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True)
    AutoProcessor.from_pretrained(path, trust_remote_code=True)

Where this package is installed, its registered classes take precedence over the repo's code: transformers loads
remote code only for a config or processor it has no registered (non-transformers) class for, even with
``trust_remote_code=True``.

We write ``auto_map`` into the saved JSON files instead of calling ``register_for_auto_class``: that sets a class
attribute for the whole process (every later ``save_pretrained`` would copy code) and copies only the class's own
package, with its absolute imports left as they are.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import json
import re
import tempfile
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from huggingface_hub import CommitInfo, CommitOperationAdd, HfApi, ModelCard, ModelCardData
from transformers import AutoModel, AutoModelForCausalLM, AutoModelForImageTextToText, PreTrainedModel

PROJECT_PACKAGES = ("configuration", "processing", "modeling_dsv41")
# the Auto classes a model's config.json maps, as far as this package registered a class for them
MODEL_AUTO_CLASSES = (AutoModel, AutoModelForCausalLM, AutoModelForImageTextToText)
DEFAULT_CARD_TEMPLATE = Path(__file__).resolve().parents[2] / "model_card.md"
BASE_MODEL = "deepseek-ai/DeepSeek-V4.1-Flash"
DEFAULT_TAGS = ("custom_code", "deepseek", "deepseek_v41", "moe", "engram", "vision-language", "image-text-to-text")

_IMPORT_HEAD = re.compile(r"from\s+\.*[\w.]*\s+import\b")
# the files an export wrote, kept next to them (and not published): a later export into the same folder removes
# exactly those, so nothing stale (old shards, an adapter) is published with the new weights
EXPORT_MANIFEST = ".dsv41-export.json"
_NOT_EXPORTED = (".git", ".cache")  # a git clone of the repo, huggingface_hub's local-dir metadata


# ----------------------------------------------------------------------------------------------------------------
# Flat remote code
# ----------------------------------------------------------------------------------------------------------------
def _is_project_module(name: str) -> bool:
    return name.split(".")[0] in PROJECT_PACKAGES


def _flat_name(module: str) -> str:
    return module.rsplit(".", 1)[-1]


def class_reference(cls: type) -> str:
    """``auto_map`` entry of a project class: ``"<flat module>.<class>"``."""
    if not _is_project_module(cls.__module__):
        raise ValueError(
            f"{cls.__module__}.{cls.__qualname__} is not part of the dsv41 packages {PROJECT_PACKAGES}: only their "
            "classes can be exported as remote code"
        )
    return f"{_flat_name(cls.__module__)}.{cls.__name__}"


def _project_imports(tree: ast.Module, module: str) -> list[tuple[ast.ImportFrom, str]]:
    """Every ``from … import`` of a project module in ``tree``, with the absolute name of the module it reads."""
    package = module.rsplit(".", 1)[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if _is_project_module(alias.name):
                    raise ValueError(
                        f"{module}: `import {alias.name}` cannot be flattened into remote code; "
                        f"write `from {alias.name} import ...`"
                    )
        elif isinstance(node, ast.ImportFrom):
            target = importlib.util.resolve_name("." * node.level + (node.module or ""), package)
            if not _is_project_module(target):
                continue
            spec = importlib.util.find_spec(target)
            if node.module is None or spec is None or spec.submodule_search_locations is not None:
                raise ValueError(
                    f"{module} line {node.lineno}: imports from the package {target!r}; remote code is one flat "
                    "folder, so import from the module that defines the name (e.g. `from .moe import X`)"
                )
            found.append((node, target))
    return found


def flatten_module_source(source: str, module: str) -> tuple[str, set[str]]:
    """Rewrite ``module``'s project imports as sibling imports; returns the new source and the modules it imports."""
    tree = ast.parse(source)
    lines = source.splitlines(keepends=True)
    needed = set()
    # right to left, so that two imports on one line keep their offsets
    for node, target in sorted(_project_imports(tree, module), key=lambda f: (f[0].lineno, f[0].col_offset), reverse=True):
        line = lines[node.lineno - 1]
        head = _IMPORT_HEAD.match(line, node.col_offset)
        if head is None:
            raise ValueError(f"{module} line {node.lineno}: cannot parse the import statement {line.strip()!r}")
        lines[node.lineno - 1] = f"{line[: head.start()]}from .{_flat_name(target)} import{line[head.end():]}"
        needed.add(target)
    return "".join(lines), needed


def remote_code_sources(classes: Iterable[type]) -> dict[str, str]:
    """``{file name: flattened source}`` of the modules defining ``classes`` and of every project module they
    import, transitively."""
    pending = [cls.__module__ for cls in classes]
    for module in pending:
        if not _is_project_module(module):
            raise ValueError(f"{module} is not a dsv41 module; only project classes can be exported as remote code")
    sources: dict[str, str] = {}
    origin: dict[str, str] = {}
    while pending:
        module = pending.pop()
        file_name = f"{_flat_name(module)}.py"
        if origin.get(file_name) == module:
            continue
        if file_name in origin:
            raise ValueError(f"{module} and {origin[file_name]} would both be written as {file_name}: rename one")
        source = Path(importlib.import_module(module).__file__).read_text(encoding="utf-8")
        sources[file_name], needed = flatten_module_source(source, module)
        origin[file_name] = module
        pending.extend(sorted(needed))
    return sources


# ----------------------------------------------------------------------------------------------------------------
# auto_map
# ----------------------------------------------------------------------------------------------------------------
AutoMap = dict[str, "type | dict[str, type]"]  # Auto class name → class, or {backend: class} for image processors


def model_auto_map(model: Any) -> AutoMap:
    """``config.json``'s ``auto_map``: the config class, and the model class this package registered for each of
    :data:`MODEL_AUTO_CLASSES`."""
    config_class = type(model.config)
    auto_map: AutoMap = {"AutoConfig": config_class}
    for auto_class in MODEL_AUTO_CLASSES:
        if config_class in auto_class._model_mapping:
            auto_map[auto_class.__name__] = auto_class._model_mapping[config_class]
    return auto_map


def image_processor_auto_map(image_processor: Any) -> AutoMap:
    """``{"AutoImageProcessor": class}``, or ``{backend: class}`` when the processing package registered several
    backends for the class of ``image_processor``."""
    from transformers.models.auto.image_processing_auto import IMAGE_PROCESSOR_MAPPING

    for registered in IMAGE_PROCESSOR_MAPPING._extra_content.values():
        if isinstance(registered, Mapping) and type(image_processor) in registered.values():
            return {"AutoImageProcessor": {backend: cls for backend, cls in registered.items() if cls is not None}}
    return {"AutoImageProcessor": type(image_processor)}


def processor_auto_maps(processor: Any) -> dict[tuple[str, str | None], AutoMap]:
    """``{(saved JSON file, key inside it or None): auto_map}`` for a processor: ``AutoProcessor`` in
    ``processor_config.json`` (and ``tokenizer_config.json``, as transformers does), ``AutoImageProcessor`` in the
    image processor's entry of ``processor_config.json``."""
    processor_map: AutoMap = {"AutoProcessor": type(processor)}
    maps = {("processor_config.json", None): processor_map, ("tokenizer_config.json", None): processor_map}
    image_processor = getattr(processor, "image_processor", None)
    if image_processor is not None:
        maps[("processor_config.json", "image_processor")] = image_processor_auto_map(image_processor)
    return maps


def _classes(auto_map: AutoMap) -> list[type]:
    return [c for value in auto_map.values() for c in (value.values() if isinstance(value, Mapping) else [value])]


def _references(auto_map: AutoMap) -> dict[str, Any]:
    return {
        name: {k: class_reference(c) for k, c in value.items()} if isinstance(value, Mapping) else class_reference(value)
        for name, value in auto_map.items()
    }


def _write_auto_map(path: Path, auto_map: AutoMap, nested_key: str | None = None) -> None:
    """Merge ``auto_map`` into the JSON file at ``path`` (into its ``nested_key`` entry when given)."""
    data = json.loads(path.read_text(encoding="utf-8"))
    target = data if nested_key is None else data[nested_key]
    target["auto_map"] = {**target.get("auto_map", {}), **_references(auto_map)}
    path.write_text(json.dumps(data, indent=2, sort_keys=True, ensure_ascii=False) + "\n", encoding="utf-8")


# ----------------------------------------------------------------------------------------------------------------
# Model card
# ----------------------------------------------------------------------------------------------------------------
def build_card_data(card_data: ModelCardData | Mapping[str, Any] | None = None) -> ModelCardData:
    """Our defaults (transformers, image-text-to-text, MIT, base model, ``custom_code`` …) under the caller's fields;
    tags are merged."""
    given = card_data.to_dict() if isinstance(card_data, ModelCardData) else dict(card_data or {})
    tags = list(DEFAULT_TAGS) + [t for t in given.pop("tags", None) or [] if t not in DEFAULT_TAGS]
    defaults = {"library_name": "transformers", "pipeline_tag": "image-text-to-text", "license": "mit",
                "base_model": BASE_MODEL}
    return ModelCardData(**{**defaults, **given, "tags": tags})


def _results_rows(results: Mapping[str, Any] | None) -> list[tuple[str, str, str]]:
    """``{benchmark: {metric: value}}`` (or ``{benchmark: value}``) → table rows."""
    rows = []
    for benchmark, metrics in (results or {}).items():
        if not isinstance(metrics, Mapping):
            metrics = {"score": metrics}
        for metric, value in metrics.items():
            rows.append((str(benchmark), str(metric), f"{value:.4g}" if isinstance(value, float) else str(value)))
    return rows


def _architecture(model: Any) -> dict[str, Any]:
    text = model.config.text_config
    vision = model.config.vision_config
    ratios = text.compress_ratios[: text.num_hidden_layers]
    return {
        "num_parameters": model.num_parameters(),
        "text": text,
        "vision": vision,
        "window_layers": sum(r == 0 for r in ratios),
        "ratio2_layers": sum(r == 2 for r in ratios),
        "ratio1_layers": sum(r == 1 for r in ratios),
    }


def render_model_card(
    model: Any,
    repo_id: str,
    card_data: ModelCardData | Mapping[str, Any] | None = None,
    results: Mapping[str, Any] | None = None,
    template_path: str | Path | None = None,
    has_tokenizer: bool = True,
    has_processor: bool = False,
) -> ModelCard:
    """The ``README.md`` of an exported repo: ``model_card.md`` rendered with the card metadata, the architecture
    read from ``model.config``, usage snippets for ``repo_id`` (for what the repo holds: a tokenizer, a processor)
    and a results table from ``results``."""
    template = Path(template_path or DEFAULT_CARD_TEMPLATE)
    if not template.is_file():
        raise FileNotFoundError(f"model card template not found at {template}")
    data = build_card_data(card_data)
    return ModelCard.from_template(
        data,
        template_path=str(template),
        repo_id=repo_id,
        model_name=data.model_name or repo_id.rstrip("/").rsplit("/", 1)[-1],
        arch=_architecture(model),
        results=_results_rows(results),
        has_tokenizer=has_tokenizer,
        has_processor=has_processor,
    )


# ----------------------------------------------------------------------------------------------------------------
# Export and push
# ----------------------------------------------------------------------------------------------------------------
def _files_in(directory: Path) -> set[str]:
    return {
        path.relative_to(directory).as_posix() for path in directory.rglob("*")
        if not path.is_dir() and path.relative_to(directory).parts[0] not in _NOT_EXPORTED
    }


def _prepare_export_directory(directory: Path) -> None:
    """Create ``directory``, or remove a previous export's files from it. A folder holding anything else is
    refused: ``save_pretrained`` would leave it there, and the published repo would carry it (an old adapter makes
    the repo load as a PEFT adapter)."""
    directory.mkdir(parents=True, exist_ok=True)
    present = _files_in(directory)
    manifest = directory / EXPORT_MANIFEST
    owned = set(json.loads(manifest.read_text())) if manifest.is_file() else set()
    foreign = sorted(present - owned - {EXPORT_MANIFEST})
    if foreign:
        shown = ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
        raise ValueError(
            f"{directory} is not empty and holds files no export wrote ({shown}): export into an empty folder "
            "(or a previous export's), or remove them"
        )
    for name in sorted(owned & present):
        (directory / name).unlink()
    manifest.unlink(missing_ok=True)


def export_for_hub(
    model: Any,
    save_directory: str | Path,
    processor: Any | None = None,
    tokenizer: Any | None = None,
    *,
    repo_id: str | None = None,
    card_data: ModelCardData | Mapping[str, Any] | None = None,
    results: Mapping[str, Any] | None = None,
    card_template: str | Path | None = None,
    **save_kwargs: Any,
) -> Path:
    """Save a self-contained Hub repo: weights, config, processor / tokenizer, flat remote code, ``auto_map`` and a
    ``README.md`` model card.

    Args:
        model: a :class:`DeepseekV41PreTrainedModel` (not a PEFT wrapper: ``merge_and_unload()`` first, or publish
            the adapter with PEFT's own ``push_to_hub``).
        processor: optional :class:`DeepseekV41Processor` (saved with its image processor and tokenizer).
        tokenizer: optional tokenizer, for a repo without a processor.
        repo_id: the name the card's usage snippets load from (defaults to ``save_directory``).
        card_data: card metadata overriding our defaults (``datasets``, ``language``, extra ``tags`` …).
        results: ``{benchmark: {metric: value}}`` for the card's results table.
        save_kwargs: passed to ``model.save_pretrained`` (``max_shard_size`` …).

    ``save_directory`` must be new, empty or a previous export (whose files are replaced); a folder holding other
    files is refused with a ``ValueError`` naming them.
    """
    if not isinstance(model, PreTrainedModel) or not _is_project_module(type(model).__module__):
        raise ValueError(
            f"export_for_hub takes a dsv41 model, got {type(model).__name__}; for a PEFT model, merge the adapters "
            "(merge_and_unload) or publish the adapter alone with its own push_to_hub"
        )
    if processor is not None and tokenizer is not None:
        raise ValueError("pass either a processor (it saves its own tokenizer) or a tokenizer, not both")
    directory = Path(save_directory)
    _prepare_export_directory(directory)
    model.save_pretrained(directory, **save_kwargs)
    auto_maps = {("config.json", None): model_auto_map(model)}
    if processor is not None:
        processor.save_pretrained(directory)
        auto_maps.update(processor_auto_maps(processor))
    elif tokenizer is not None:
        tokenizer.save_pretrained(directory)

    classes = set()
    for (file_name, key), auto_map in auto_maps.items():
        if (directory / file_name).is_file():
            _write_auto_map(directory / file_name, auto_map, key)
            classes.update(_classes(auto_map))
    for file_name, source in remote_code_sources(sorted(classes, key=lambda c: (c.__module__, c.__name__))).items():
        (directory / file_name).write_text(source, encoding="utf-8")
    card = render_model_card(
        model, repo_id or str(directory), card_data, results, card_template,
        has_tokenizer=processor is not None or tokenizer is not None, has_processor=processor is not None,
    )
    card.save(directory / "README.md")
    (directory / EXPORT_MANIFEST).write_text(json.dumps(sorted(_files_in(directory)), indent=1))
    return directory


def push_to_hub(
    repo_id: str,
    model: Any,
    processor: Any | None = None,
    tokenizer: Any | None = None,
    *,
    card_data: ModelCardData | Mapping[str, Any] | None = None,
    results: Mapping[str, Any] | None = None,
    commit_message: str = "Upload DeepSeek-V4.1 with remote code",
    private: bool | None = None,
    token: str | bool | None = None,
    revision: str | None = None,
    create_pr: bool = False,
    max_shard_size: int | str = "50GB",
) -> CommitInfo:
    """:func:`export_for_hub` into a temporary folder, then one commit of all of it to ``repo_id`` (created if
    needed), as transformers' own ``push_to_hub`` does (``create_repo`` then ``create_commit``)."""
    api = HfApi()
    repo_id = api.create_repo(repo_id, private=private, token=token, exist_ok=True).repo_id
    if revision is not None and not create_pr:
        api.create_branch(repo_id, branch=revision, token=token, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        export_for_hub(
            model, tmp, processor, tokenizer, repo_id=repo_id, card_data=card_data, results=results,
            max_shard_size=max_shard_size,
        )
        operations = [
            CommitOperationAdd(path_in_repo=path.relative_to(tmp).as_posix(), path_or_fileobj=str(path))
            for path in sorted(Path(tmp).rglob("*"))
            if path.is_file() and path.name != EXPORT_MANIFEST
        ]
        return api.create_commit(
            repo_id, operations, commit_message=commit_message, token=token, revision=revision, create_pr=create_pr
        )


__all__ = [
    "EXPORT_MANIFEST",
    "export_for_hub",
    "push_to_hub",
    "render_model_card",
    "build_card_data",
    "remote_code_sources",
    "flatten_module_source",
    "model_auto_map",
    "class_reference",
]
