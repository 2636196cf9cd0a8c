"""The stages, in the order a check runs them, with their time budgets on one GPU.

Every stage fits in one 10-minute command; the default ones add up to 30 minutes (the
loan's 35 with start-up to spare). Budgets were set from the work each does (see
docs/performance.md, "Measured on a GPU"); a stage that overruns its budget is reported.
"""

from __future__ import annotations

import argparse
import functools
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from collections.abc import Callable
from typing import Any

from pretrain.benchmarks import peers
from pretrain.gpucheck.kernels import kernels_stage
from pretrain.gpucheck.memory import compile_stage, memory_stage
from pretrain.gpucheck.numerics import numerics_stage
from pretrain.gpucheck.results import Stage, at_most
from pretrain.gpucheck.science import science_stage
from pretrain.gpucheck.sizes import MEMORY_CONFIGS, REPO, Context

GPU_MARK = "pytest.mark.gpu"


def gpu_test_files() -> list[str]:
    """The test files that mark GPU tests (`pytest.mark.gpu`, on a test or a module)."""
    return sorted(
        str(p.relative_to(REPO))
        for p in (REPO / "tests").glob("test_*.py")
        if GPU_MARK in p.read_text()
    )


def tests_stage(ctx: Context) -> dict[str, Any]:
    """`pytest -m gpu` over the files that hold GPU tests, in a child process; one row per
    test from its JUnit XML. On a GPU every test must pass; on CPU they skip (flagged only
    when one fails)."""
    xml = ctx.folder / "gpu_tests.xml"
    files = gpu_test_files()
    cmd = [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider"]
    cmd += ["-o", "addopts=", f"--junitxml={xml}", *files]
    timeout = max(30.0, ctx.seconds_left())
    proc = subprocess.run(
        cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout, env=dict(os.environ)
    )
    rows, checks = [], []
    for case in ET.parse(xml).getroot().iter("testcase"):
        outcome = "passed"
        for tag in ("failure", "error", "skipped"):
            if case.find(tag) is not None:
                outcome = {"failure": "failed"}.get(tag, tag)
        test = f"{case.get('classname')}::{case.get('name')}"
        rows.append({"test": test, "outcome": outcome, "seconds": float(case.get("time", 0))})
        bad = outcome != "passed" if ctx.cuda else outcome in ("failed", "error")
        checks.append(
            {
                "name": f"test {test}",
                "measured": outcome,
                "expected": "passed" if ctx.cuda else "passed or skipped",
                "tolerance": 0,
                "off": None,
                "flagged": bad,
            }
        )
    tail = (proc.stdout + proc.stderr).strip().splitlines()[-1:]
    return {"tables": {"tests": rows}, "checks": checks, "notes": [*tail, " ".join(files)]}


def peers_stage(ctx: Context) -> dict[str, Any]:
    """tools/benchmark.py peers on this device in bf16 autocast (pretrain/benchmarks/peers.py):
    our step, transformers' Llama, litgpt and our compiled model at the same weights, in
    paired rounds; MFU against the GPU's nominal peak (the benchmark's own, against its
    measured matmul peak, is in the JSON)."""
    if not peers.litgpt_available():
        raise RuntimeError("litgpt is not installed: `make venv` installs requirements/bench.txt")
    args = argparse.Namespace(
        **ctx.sizes.peers,
        precisions=["bf16"],
        threads=1,
        clock="wall",
        no_variants=True,
        compile_backend=ctx.sizes.compile_backend,
        seed=0,
        json=None,
        device=ctx.device.type,
    )
    result = peers.race(args, "bf16")
    tokens = result["batch"] * result["seq_len"]
    rows = [
        {
            "model": r["model"],
            "precision": "bf16 autocast",
            "median_ms": 1e3 * r["median_s"],
            "ratio_to_ours": r["ratio_to_ours"],
            "tokens_per_s": tokens / r["median_s"],
            "mfu_model": result["flops_per_step"] / r["median_s"] / ctx.gpu.peak_flops,
            "mfu_matmul_peak": r["mfu"],
            "first_loss": r["first_loss"],
        }
        for r in result["rows"]
    ]
    by = {r["model"]: r for r in rows}
    fastest = min(by[p]["ratio_to_ours"] for p in peers.PEERS)
    checks = [at_most("ours / fastest peer step time (paired)", 1 / fastest, 1.0)]
    if "ours, compiled" in by:
        compiled = by["ours, compiled"]["ratio_to_ours"]
        checks.append(at_most("ours compiled / ours eager step time (paired)", compiled, 1.0))
    notes = [
        f"{result['parameters']:,} parameters, batch {result['batch']} x "
        f"{result['seq_len']}, {result['rounds']} rounds; matmul peak measured "
        f"{result['peak_gflops'] / 1e3:.1f} TFLOP/s (F.linear {result['peak_shape']})"
    ]
    return {"tables": {"peers": rows}, "checks": checks, "notes": notes}


StageFn = Callable[[Context], dict[str, Any]]


def all_stages() -> list[tuple[Stage, StageFn]]:
    """Every stage in running order, with its function."""
    out: list[tuple[Stage, StageFn]] = [
        (Stage("tests", ("tests",), 300, "pytest -m gpu: the GPU-marked tests"), tests_stage)
    ]
    for name in MEMORY_CONFIGS:
        short = name.split("_")[0]
        out.append(
            (
                Stage(
                    f"memory-{short}",
                    ("memory", "speed", "split"),
                    300,
                    f"{name}: planned vs measured memory, speed, step split; "
                    f"no recompute and full recompute",
                ),
                functools.partial(memory_stage, name=name),
            )
        )
    for name in MEMORY_CONFIGS:
        short = name.split("_")[0]
        out.append(
            (
                Stage(
                    f"compile-{short}",
                    ("memory", "speed", "split"),
                    300,
                    f"{name}: train.compile off and on, paired",
                ),
                functools.partial(compile_stage, name=name),
            )
        )
    out += [
        (
            Stage("peers", ("peers",), 240, "our step vs transformers' Llama and litgpt"),
            peers_stage,
        ),
        (Stage("kernels", ("kernels",), 120, "SDPA kernel per attention shape"), kernels_stage),
        (Stage("numerics", ("numerics",), 60, "bf16 on GPU vs fp32 on CPU"), numerics_stage),
        (
            Stage(
                "science",
                ("science", "science_speed"),
                540,
                "RoPE theta 5000 vs 10000 on Tiny Shakespeare, 3 seeds (chunked: one run a call)",
                science=True,
            ),
            science_stage,
        ),
    ]
    return out


__all__ = ["GPU_MARK", "StageFn", "all_stages", "gpu_test_files", "peers_stage", "tests_stage"]
