"""The flat remote code of this project's classes, next to every saved file that names them in ``auto_map``.

``trust_remote_code`` loading copies a repo's code as one flat folder in which modules may import each other only
as siblings (``from .moe import …``). Our source spans three packages (``configuration``, ``processing``,
``modeling_dsv41``), so :func:`save_remote_code` writes every module the saved classes need side by side, rewrites
the project imports into sibling imports (``from configuration.configuration_dsv41 import X`` →
``from .configuration_dsv41 import X``) and points ``auto_map`` at them. The models' and the processor's
``save_pretrained`` call it, so every folder they write (a Trainer checkpoint, ``push_to_hub``) loads with only
transformers installed::

    AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True)
    AutoProcessor.from_pretrained(path, trust_remote_code=True)

Where this package is installed and imported, its registered classes take precedence over the folder's code:
transformers loads remote code only for a config or processor it has no registered (non-transformers) class for.
Code that runs as remote code itself (its modules are not this project's) is saved by transformers' own
``custom_object_save``, and :func:`save_remote_code` leaves it to it.

We write ``auto_map`` into the saved JSON files instead of calling ``register_for_auto_class``: that sets a class
attribute for the whole process and copies only the class's own package, with its absolute imports left as they
are. It lives in the lowest package, as the configuration, the processor and the model all save with it.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import json
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from huggingface_hub import CommitInfo, CommitOperationAdd, HfApi
from transformers import AutoModel, AutoModelForCausalLM, AutoModelForImageTextToText

PROJECT_PACKAGES = ("configuration", "processing", "modeling_dsv41")
# the Auto classes a model's config.json maps, as far as this package registered a class for them
MODEL_AUTO_CLASSES = (AutoModel, AutoModelForCausalLM, AutoModelForImageTextToText)

_IMPORT_HEAD = re.compile(r"from\s+\.*[\w.]*\s+import\b")


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
    for node, target in sorted(
        _project_imports(tree, module), key=lambda f: (f[0].lineno, f[0].col_offset), reverse=True
    ):
        line = lines[node.lineno - 1]
        head = _IMPORT_HEAD.match(line, node.col_offset)
        if head is None:
            raise ValueError(f"{module} line {node.lineno}: cannot parse the import statement {line.strip()!r}")
        lines[node.lineno - 1] = f"{line[: head.start()]}from .{_flat_name(target)} import{line[head.end() :]}"
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
        name: {k: class_reference(c) for k, c in value.items()}
        if isinstance(value, Mapping)
        else class_reference(value)
        for name, value in auto_map.items()
    }


def _write_auto_map(path: Path, auto_map: AutoMap, nested_key: str | None = None) -> None:
    """Merge ``auto_map`` into the JSON file at ``path`` (into its ``nested_key`` entry when given)."""
    data = json.loads(path.read_text(encoding="utf-8"))
    target = data if nested_key is None else data[nested_key]
    target["auto_map"] = {**target.get("auto_map", {}), **_references(auto_map)}
    path.write_text(json.dumps(data, indent=2, sort_keys=True, ensure_ascii=False) + "\n", encoding="utf-8")


def is_project_class(cls: type) -> bool:
    """Whether ``cls`` is defined in this project's packages (not in a remote-code copy of them)."""
    return _is_project_module(cls.__module__)


def save_remote_code(directory: str | Path, auto_maps: Mapping[tuple[str, str | None], AutoMap]) -> None:
    """Write ``auto_maps`` (``{(saved JSON file, key inside it or None): auto_map}``) into the files of ``directory``
    that exist, and the flat modules their classes need beside them."""
    directory = Path(directory)
    classes = set()
    for (file_name, key), auto_map in auto_maps.items():
        if (directory / file_name).is_file():
            _write_auto_map(directory / file_name, auto_map, key)
        classes.update(_classes(auto_map))
    for file_name, source in remote_code_sources(sorted(classes, key=lambda c: (c.__module__, c.__name__))).items():
        (directory / file_name).write_text(source, encoding="utf-8")


# what `save_pretrained(..., push_to_hub=True, **kwargs)` passes on to the upload
_PUSH_ARGUMENTS = ("commit_message", "private", "token", "create_pr", "revision")


def pop_push_arguments(save_directory: str | Path, kwargs: dict[str, Any]) -> dict[str, Any]:
    """The upload's arguments of a ``save_pretrained(save_directory, push_to_hub=True, **kwargs)`` call, taken out of
    ``kwargs``; ``repo_id`` defaults to the folder's name, as in transformers."""
    push = {key: kwargs.pop(key) for key in _PUSH_ARGUMENTS if key in kwargs}
    push["repo_id"] = kwargs.pop("repo_id", Path(save_directory).name)
    return push


def push_saved_folder(
    directory: str | Path,
    repo_id: str,
    commit_message: str | None = None,
    private: bool | None = None,
    token: str | bool | None = None,
    create_pr: bool = False,
    revision: str | None = None,
) -> CommitInfo:
    """Upload a folder ``save_pretrained`` wrote, remote code included, to ``repo_id`` (created if needed) in one
    commit, as transformers' own push does (which uploads before the code is written)."""
    api = HfApi(token=token)
    repo_id = api.create_repo(repo_id, private=private, exist_ok=True).repo_id
    directory = Path(directory)
    operations = [
        CommitOperationAdd(path_in_repo=path.relative_to(directory).as_posix(), path_or_fileobj=str(path))
        for path in sorted(directory.rglob("*"))
        if path.is_file() and not path.relative_to(directory).parts[0].startswith(".")
    ]
    return api.create_commit(
        repo_id,
        operations,
        commit_message=commit_message or "Upload DeepSeek-V4.1 with remote code",
        revision=revision,
        create_pr=create_pr,
    )


__all__ = [
    "PROJECT_PACKAGES",
    "class_reference",
    "flatten_module_source",
    "image_processor_auto_map",
    "is_project_class",
    "model_auto_map",
    "pop_push_arguments",
    "processor_auto_maps",
    "push_saved_folder",
    "remote_code_sources",
    "save_remote_code",
]
