"""Publishing DeepSeek-V4.1 on the Hub as remote code, with a model card.

:func:`export_for_hub` saves the model (and its processor or tokenizer), whose ``save_pretrained`` writes the flat
remote code and ``auto_map`` (:mod:`configuration.remote_code`), and renders the model card (``model_card.md`` at the
repository root) into ``README.md``; :func:`push_to_hub` publishes that folder in one commit.
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from huggingface_hub import CommitInfo, CommitOperationAdd, HfApi, ModelCard, ModelCardData
from transformers import PreTrainedModel

from configuration.remote_code import is_project_class

DEFAULT_CARD_TEMPLATE = Path(__file__).resolve().parents[2] / "model_card.md"
BASE_MODEL = "deepseek-ai/DeepSeek-V4.1-Flash"
DEFAULT_TAGS = ("custom_code", "deepseek", "deepseek_v41", "moe", "engram", "vision-language", "image-text-to-text")

# the files an export wrote, kept next to them (and not published): a later export into the same folder removes
# exactly those, so nothing stale (old shards, an adapter) is published with the new weights
EXPORT_MANIFEST = ".dsv41-export.json"
_NOT_EXPORTED = (".git", ".cache")  # a git clone of the repo, huggingface_hub's local-dir metadata


# ----------------------------------------------------------------------------------------------------------------
# Model card
# ----------------------------------------------------------------------------------------------------------------
def build_card_data(card_data: ModelCardData | Mapping[str, Any] | None = None) -> ModelCardData:
    """Our defaults (transformers, image-text-to-text, MIT, base model, ``custom_code`` …) under the caller's fields;
    tags are merged."""
    given = card_data.to_dict() if isinstance(card_data, ModelCardData) else dict(card_data or {})
    tags = list(DEFAULT_TAGS) + [t for t in given.pop("tags", None) or [] if t not in DEFAULT_TAGS]
    defaults = {
        "library_name": "transformers",
        "pipeline_tag": "image-text-to-text",
        "license": "mit",
        "base_model": BASE_MODEL,
    }
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
    ratios = [spec.compress_ratio for spec in text.layer_plan]
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
        path.relative_to(directory).as_posix()
        for path in directory.rglob("*")
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
    if not isinstance(model, PreTrainedModel) or not is_project_class(type(model)):
        raise ValueError(
            f"export_for_hub takes a dsv41 model, got {type(model).__name__}; for a PEFT model, merge the adapters "
            "(merge_and_unload) or publish the adapter alone with its own push_to_hub"
        )
    if processor is not None and tokenizer is not None:
        raise ValueError("pass either a processor (it saves its own tokenizer) or a tokenizer, not both")
    directory = Path(save_directory)
    _prepare_export_directory(directory)
    model.save_pretrained(directory, **save_kwargs)  # with the flat remote code and auto_map
    if processor is not None:
        processor.save_pretrained(directory)
    elif tokenizer is not None:
        tokenizer.save_pretrained(directory)
    card = render_model_card(
        model,
        repo_id or str(directory),
        card_data,
        results,
        card_template,
        has_tokenizer=processor is not None or tokenizer is not None,
        has_processor=processor is not None,
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
            model,
            tmp,
            processor,
            tokenizer,
            repo_id=repo_id,
            card_data=card_data,
            results=results,
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
]
