"""Atomic Trainer checkpoints: an interrupted save never leaves a half-written ``checkpoint-N`` in its place.

A checkpoint is written under ``tmp-checkpoint-N/checkpoint-N`` and moved to ``checkpoint-N`` once complete.
transformers only considers folders named exactly ``checkpoint-N``, so a half-written one is never resumed from
nor rotated. ``trainer_state.json`` is the last file a save writes: a ``checkpoint-N`` without it (left by a save
that was not atomic, or copied partially) is incomplete, and resuming skips it.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

from transformers.trainer import TRAINER_STATE_NAME
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

logger = logging.getLogger(__name__)

STAGING_PREFIX = "tmp-"
_CHECKPOINT_NAME = re.compile(rf"^{PREFIX_CHECKPOINT_DIR}-(\d+)$")


def is_complete_checkpoint(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a finished Trainer checkpoint: ``trainer_state.json`` is the last file a save writes."""
    return (Path(path) / TRAINER_STATE_NAME).is_file()


def last_complete_checkpoint(folder: str | os.PathLike) -> str | None:
    """The newest complete ``checkpoint-N`` in ``folder`` (None if there is none).

    Incomplete ones (a save killed before atomic checkpoints, or copied partially) and staging leftovers are
    skipped with a warning, so a rerun resumes from the last checkpoint that can be resumed from.
    """
    folder = Path(folder)
    if not folder.is_dir():
        return None
    leftovers = sorted(p.name for p in folder.glob(f"{STAGING_PREFIX}{PREFIX_CHECKPOINT_DIR}-*") if p.is_dir())
    if leftovers:
        logger.warning("Skipping interrupted checkpoint saves in %s: %s", folder, ", ".join(leftovers))
    steps = {int(m.group(1)): p for p in folder.iterdir() if p.is_dir() and (m := _CHECKPOINT_NAME.match(p.name))}
    for step in sorted(steps, reverse=True):
        if is_complete_checkpoint(steps[step]):
            return str(steps[step])
        logger.warning(
            "Skipping incomplete checkpoint %s (no %s: its save was interrupted)", steps[step], TRAINER_STATE_NAME
        )
    return None


def remove_interrupted_saves(run_dir: Path) -> None:
    """Delete the staging folders that killed saves left in ``run_dir``."""
    for leftover in run_dir.glob(f"{STAGING_PREFIX}*{PREFIX_CHECKPOINT_DIR}-*"):
        shutil.rmtree(leftover)


@dataclass(frozen=True)
class StagedCheckpoint:
    """The folders of one atomic save of step ``step`` in ``run_dir``: Trainer writes :attr:`staged` (inside
    :attr:`staging`), and :meth:`publish` moves it to :attr:`final`."""

    run_dir: Path
    step: int

    @property
    def name(self) -> str:
        return f"{PREFIX_CHECKPOINT_DIR}-{self.step}"

    @property
    def staging(self) -> Path:
        """The run folder Trainer saves into while the checkpoint is incomplete."""
        return self.run_dir / f"{STAGING_PREFIX}{self.name}"

    @property
    def staged(self) -> Path:
        return self.staging / self.name

    @property
    def final(self) -> Path:
        return self.run_dir / self.name

    def publish(self) -> None:
        """Move the complete checkpoint to :attr:`final` and remove the staging folder."""
        _replace_folder(self.staged, self.final)
        self.staging.rmdir()


def _replace_folder(source: Path, destination: Path) -> None:
    """Move ``source`` to ``destination``; an existing ``destination`` (the same step saved again) is replaced."""
    if destination.exists():
        old = destination.with_name(f"{STAGING_PREFIX}old-{destination.name}")
        shutil.rmtree(old, ignore_errors=True)
        destination.rename(old)
        source.rename(destination)
        shutil.rmtree(old)
    else:
        source.rename(destination)


__all__ = [
    "STAGING_PREFIX",
    "StagedCheckpoint",
    "is_complete_checkpoint",
    "last_complete_checkpoint",
    "remove_interrupted_saves",
]
