"""requirements/envs.py's offline wheels: what a GPU image without a package index needs."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _envs():
    spec = importlib.util.spec_from_file_location("envs", ROOT / "requirements" / "envs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_offline_package_is_pinned_where_make_venv_pins_it():
    """`make gpu-wheels` takes each package's version from the lock (or bench.txt): the GPU
    machine then runs what the tests here ran. A package dropped from the lock is one line."""
    envs = _envs()
    specs = dict(s.split("==") for s in envs.offline_specs(envs.OFFLINE_PACKAGES))
    lines = (ROOT / "requirements" / "lock.txt").read_text().splitlines()
    lines += (ROOT / "requirements" / "bench.txt").read_text().splitlines()
    for name in ("deepspeed", "pydantic", "megatron-core", "litgpt"):
        assert f"{name}=={specs[name]}" in {line.split(";")[0].strip() for line in lines}
    assert specs["liger-kernel"] == envs.OFFLINE_EXTRA["liger-kernel"]
    with pytest.raises(SystemExit, match="no-such-package not in requirements/lock.txt"):
        envs.offline_specs(["no-such-package"])
