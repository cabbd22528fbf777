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


@pytest.fixture(scope="session", autouse=True)
def _offline_hub():
    """No network: the Hub's offline mode for every test and the processes they spawn. Without it, each
    ``push_to_hub`` to the tests' stand-in Hub first tries to download the repository's model card
    (``create_and_tag_model_card``), and with no network that request retries with back-off for ~23 s before
    transformers falls back to a fresh card."""
    import huggingface_hub.constants

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HF_HUB_OFFLINE", "1")
        patch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
        yield


@pytest.fixture(autouse=True)
def _deterministic_threads():
    """One torch thread in every test (a test that needs more sets them itself), as the spawned processes use: the
    tiny models' ops are too small to gain from a second thread, and two threads on 2 loaded cores spin and thrash
    (tests/test_generation.py on this 2-core machine under load: 63 CPU-s and 715 s for all 12 tests with one thread;
    with two, 141 CPU-s in 1200 s, when the timeout stopped it after 1 of the 12). The goldens are bit-exact with
    1 and 2 threads (tests/data)."""
    torch.set_num_threads(1)
    yield
