"""Shared fixtures. Data from ../shared/data: tests fail under CI=true when it is missing,
and skip with a message elsewhere."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# The suite's time budget: the slow-test guard and the time per file (tests/suite_budget.py).
pytest_plugins = ["suite_budget"]

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = Path(os.environ.get("PRETRAIN_SHARED_DATA", REPO.parent / "shared" / "data"))

# Keep library threads to the machine's size and away from the network.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _no_tqdm_monitor() -> None:
    """No tqdm monitor thread in the pytest process. The first progress bar a test shows
    in-process (the peers benchmark's, lm-eval's) starts it, and it takes tqdm's lock every
    10 s: a test that forks this process (the prepare_data signal tests, the cache ranks)
    while it holds the lock gives a child whose first progress bar waits for that lock
    forever (seen once: a forked prepare_data that never exited on SIGINT). The monitor only
    refreshes bars that stall, which tests do not watch."""
    import tqdm

    tqdm.tqdm.monitor_interval = 0


_no_tqdm_monitor()


def missing(msg: str) -> None:
    """A prerequisite is missing: fail under CI=true (CI skips nothing silently), else skip."""
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail(f"{msg} (CI=true: a missing prerequisite fails)")
    pytest.skip(msg)


def shared_path(*parts: str) -> Path:
    """Path under ../shared/data; fails under CI=true, skips elsewhere, when missing."""
    path = SHARED_DATA.joinpath(*parts)
    if not path.exists():
        missing(
            f"shared test data missing: {path} "
            "(set PRETRAIN_SHARED_DATA or put ../shared beside the repo)"
        )
    return path


@pytest.fixture
def shared_data() -> Path:
    return shared_path()


@pytest.fixture(scope="session")
def paragraphs(tmp_path_factory) -> Path:
    """Tiny Shakespeare by paragraph, byte-level, with a valid split: documents of a few dozen
    bytes, so that every short sample holds several (prepared once per session; read only)."""
    from pretrain.data.prepare import prepare

    out = tmp_path_factory.mktemp("paragraphs") / "data"
    prepare(
        out,
        "bytes",
        inputs=[str(shared_path("tinyshakespeare.txt"))],
        txt_mode="paragraph",
        valid_fraction=0.1,
        shard_tokens=250_000,
        workers=1,
        progress=False,
    )
    return out


def pytest_collection_modifyitems(config, items):
    import torch

    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU; this machine has none")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
