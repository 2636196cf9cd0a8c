"""The project's environments besides .venv, and what changed in them against the lock.

    python3 requirements/envs.py test-latest    # newest versions the ranges allow: build
                                                # .venv-latest, run the dependency-sensitive
                                                # tests, name what moved if they fail
    python3 requirements/envs.py test-exports   # exports in environments holding only torch,
                                                # transformers and safetensors: the oldest and
                                                # the newest transformers the range admits
    python3 requirements/envs.py diff VENV      # VENV's versions that differ from the lock
    .venv/bin/python requirements/envs.py offline-wheels   # .whl/: what a GPU image lacks

Standard library only: it runs before any environment exists (`make test-latest`,
`make test-exports`, `.ci/run`). torch stays the CPU wheel of the lock's torch.txt in every
environment: a range open to a newer torch would pull a CUDA build of several GB on a CPU
machine (pyproject.toml).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LOCK = ROOT / "requirements" / "lock.txt"
BENCH = ROOT / "requirements" / "bench.txt"
TORCH = "torch==2.13.0"  # the CPU wheel on a CPU machine (requirements/torch.txt)

# The tests whose outcome depends on a dependency's version (README: "make test-latest"):
# export/import and the remote code (transformers, safetensors, tokenizers), the lm-eval
# harness, the DeepSpeed engine, megatron-core's datasets, the tokenizers.
LATEST_TESTS = [
    "tests/test_hf_export.py",
    "tests/test_hf_parity.py",
    "tests/test_model_stability.py",
    "tests/test_eval_harness.py",
    "tests/test_eval_tasks.py",
    "tests/test_tokenizer.py",
    "tests/test_data_dataset.py",
    "tests/test_data_cache_ranks.py",
    "tests/test_train_parallel.py",
    "tests/test_train_spikes.py::test_flagged_step_applies_no_update",
    "tests/test_train_checkpoint.py",
    "tests/test_train_deepspeed_adapter.py",  # each DeepSpeed private name we rely on
    "tests/test_train_golden.py",
    "tests/test_benchmark_peers.py",
    "tests/test_config_schema.py",  # pydantic's errors, worded as ours; jsonschema
    "tests/test_train_config.py",
]
LATEST_TIMEOUT = 1200  # seconds for those tests; CI's whole budget is 90 minutes


def run(cmd: list[str], **kw) -> None:
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, **kw)


def pip(venv: Path, *args: str) -> None:
    run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", *args])


def fresh_venv(venv: Path) -> None:
    shutil.rmtree(venv, ignore_errors=True)
    run([sys.executable, "-m", "venv", str(venv)])
    pip(venv, TORCH)  # first: nothing after it can pull another torch


def transformers_range() -> tuple[str, str]:
    """(lower, upper) bounds of transformers in pyproject.toml, e.g. ("5.0", "6")."""
    text = (ROOT / "pyproject.toml").read_text()
    m = re.search(r'"transformers>=([\d.]+),<([\d.]+)"', text)
    if not m:
        sys.exit("pyproject.toml: no 'transformers>=X,<Y' dependency to test the bounds of")
    return m.group(1), m.group(2)


def versions(venv: Path) -> dict[str, str]:
    out = subprocess.run(
        [str(venv / "bin" / "python"), "-m", "pip", "list", "--format=freeze"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return dict(_pin(line) for line in out.splitlines() if "==" in line)


def locked() -> dict[str, str]:
    """The exact versions `make venv` installs: the lock and requirements/bench.txt."""
    lines = LOCK.read_text().splitlines() + BENCH.read_text().splitlines()
    return dict(_pin(line) for line in lines if "==" in line and not line.startswith("#"))


def _pin(line: str) -> tuple[str, str]:
    name, _, version = line.split(";")[0].strip().partition("==")
    return re.sub(r"[-_.]+", "-", name).lower(), version.strip()


def diff(venv: Path) -> list[str]:
    """'package: lock X -> here Y' for every package whose version differs from the lock."""
    have, want = versions(venv), locked()
    out = [
        f"{name}: lock {want.get(name, '(absent)')} -> here {have.get(name, '(absent)')}"
        for name in sorted(set(have) | set(want))
        if name not in ("torch", "pip", "setuptools", "pretrain")
        and have.get(name) != want.get(name)
    ]
    return out


def test_latest(venv: Path, timeout: int) -> int:
    start = time.time()
    fresh_venv(venv)
    pip(venv, "-e", f"{ROOT}[dev]")  # the newest versions pyproject's ranges allow
    pip(venv, "--no-deps", "-r", str(BENCH))
    moved = diff(venv)
    print(f"{venv.name}: built in {time.time() - start:.0f} s; against the lock:")
    print("\n".join(f"  {line}" for line in moved) or "  the lock's versions exactly")
    env = {**os.environ, "CI": os.environ.get("CI", "true")}
    try:
        r = subprocess.run(
            [
                str(venv / "bin" / "python"),
                "-m",
                "pytest",
                "-q",
                "-p",
                "no:cacheprovider",
                *LATEST_TESTS,
            ],
            cwd=ROOT,
            env=env,
            timeout=timeout,
        )
        code = r.returncode
    except subprocess.TimeoutExpired:
        print(f"test-latest: the tests ran past {timeout} s")
        code = 124
    if code:
        print(
            "test-latest FAILED with the newest versions the ranges allow. These differ from "
            "the lock (requirements/lock.txt), one of them broke it:\n"
            + ("\n".join(f"  {line}" for line in moved) or "  none (the failure is not a version)")
        )
    else:
        print(f"test-latest passed in {time.time() - start:.0f} s")
    return code


def test_exports(prefix: Path) -> int:
    """Build one small environment per end of the transformers range and run the export
    tests' child (tests/test_hf_export.py) with each."""
    low, high = transformers_range()
    pythons = []
    for name, spec in (("oldest", f"transformers=={low}.*"), ("newest", f"transformers<{high}")):
        venv = prefix.with_name(f"{prefix.name}-{name}")
        fresh_venv(venv)
        pip(venv, spec, "safetensors>=0.4")
        have = versions(venv)
        print(
            f"{venv.name}: transformers {have['transformers']}, safetensors {have['safetensors']}"
        )
        pythons.append(str(venv / "bin" / "python"))
    env = {**os.environ, "PRETRAIN_HF_PYTHONS": ":".join(pythons)}
    python = ROOT / ".venv" / "bin" / "python"
    r = subprocess.run(
        [
            str(python),
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "tests/test_hf_export.py",
            "-k",
            "loads_in_plain",
        ],
        cwd=ROOT,
        env=env,
    )
    return r.returncode


# What `tools/gpu_check.py` needs that a GPU machine's image with torch, transformers,
# numpy, scipy, matplotlib, lightning and the like lacks (the H200 image of the first loan:
# docs/performance.md, "Measured on a GPU"), at the lock's versions; liger-kernel is no
# dependency (its GPU test skips without it, which the check counts as a failure); torchao
# for the fp8 stage (the H100 image of 2026-12-06 lacked it).
OFFLINE_PACKAGES = (
    "deepspeed",
    "hjson",
    "pydantic",
    "pydantic-core",
    "annotated-types",
    "typing-inspection",
    "typing-extensions",
    "megatron-core",
    "litgpt",
    "jsonargparse",
    "docstring-parser",
    "typeshed-client",
    "liger-kernel",
    "torchao",
)
OFFLINE_EXTRA = {"liger-kernel": "0.8.5"}
MANYLINUX = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64")


def offline_specs(names: list[str] | tuple[str, ...]) -> list[str]:
    """'name==version' of each package at the lock's (or OFFLINE_EXTRA's) version."""
    pins = {**locked(), **OFFLINE_EXTRA}
    missing = [n for n in names if _pin(n + "==")[0] not in pins]
    if missing:
        sys.exit(f"offline-wheels: {', '.join(missing)} not in requirements/lock.txt or bench.txt")
    return [f"{n}=={pins[_pin(n + '==')[0]]}" for n in names]


def offline_wheels(dest: Path, python: str, names: list[str]) -> int:
    """Wheels of `names` at the lock's versions into `dest`, for a Linux x86-64 machine with
    CPython `python` and no package index: `pip install --no-index --no-deps --target DIR
    dest/*.whl` there. DeepSpeed publishes no wheel: it is built here (its setup imports
    torch, so run this with the venv's python)."""
    specs = offline_specs(names)
    dest.mkdir(parents=True, exist_ok=True)
    built = [s for s in specs if s.startswith("deepspeed==")]
    platforms = [a for tag in MANYLINUX for a in ("--platform", tag)]
    pip_ = [sys.executable, "-m", "pip"]
    binary = [s for s in specs if s not in built]
    if binary:
        run(
            [
                *pip_,
                "download",
                "-q",
                "--no-deps",
                "--only-binary=:all:",
                "--implementation",
                "cp",
                "--python-version",
                python,
                *platforms,
                "-d",
                str(dest),
                *binary,
            ]
        )
    for spec in built:
        run([*pip_, "wheel", "-q", "--no-deps", "--no-build-isolation", spec, "-w", str(dest)])
    print(
        f"{len(specs)} wheels in {dest}; there: pip install --no-index --no-deps "
        f"--target DIR {dest}/*.whl, then PYTHONPATH=DIR:$PWD"
    )
    return 0


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = p.add_subparsers(dest="command", required=True)
    latest = sub.add_parser(
        "test-latest", help="build .venv-latest and run the dependency-sensitive tests"
    )
    latest.add_argument(
        "--venv", type=Path, default=ROOT / ".venv-latest", help="where (default .venv-latest)"
    )
    latest.add_argument(
        "--timeout",
        type=int,
        default=LATEST_TIMEOUT,
        help=f"seconds for the tests (default {LATEST_TIMEOUT})",
    )
    exports = sub.add_parser(
        "test-exports", help="the export tests under the oldest and newest transformers"
    )
    exports.add_argument(
        "--prefix",
        type=Path,
        default=ROOT / ".venv-hf",
        help="venv name prefix (default .venv-hf: .venv-hf-oldest, .venv-hf-newest)",
    )
    off = sub.add_parser(
        "offline-wheels",
        help="wheels for a machine without a package index whose image has torch (a GPU node)",
    )
    off.add_argument("--dest", type=Path, default=ROOT / ".whl", help="folder (default .whl)")
    off.add_argument("--python", default="3.12", help="that machine's Python (default 3.12)")
    off.add_argument(
        "packages", nargs="*", default=list(OFFLINE_PACKAGES), help="default: what gpu_check needs"
    )
    d = sub.add_parser("diff", help="a venv's versions that differ from requirements/lock.txt")
    d.add_argument("venv", type=Path, help="the venv folder")
    args = p.parse_args()
    if args.command == "test-latest":
        return test_latest(args.venv, args.timeout)
    if args.command == "test-exports":
        return test_exports(args.prefix)
    if args.command == "offline-wheels":
        return offline_wheels(args.dest, args.python, args.packages)
    print("\n".join(diff(args.venv)) or "the lock's versions exactly")
    return 0


if __name__ == "__main__":
    sys.exit(main())
