"""Shared test helpers: the golden fixtures are read in place from ``../shared/fixtures``."""

from pathlib import Path

import pytest
import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
FIXTURES = REPO_ROOT.parent / "shared" / "fixtures"


@pytest.fixture(scope="session")
def fixtures_dir() -> Path:
    if not FIXTURES.is_dir():
        pytest.fail(f"golden fixtures not found at {FIXTURES}; they must sit beside the repository")
    return FIXTURES


@pytest.fixture(autouse=True)
def _deterministic_threads():
    """Two threads like CI, so numerics and timings match what CI sees."""
    torch.set_num_threads(2)
    yield
