"""The stages, in the order a check runs them, with their time budgets on one GPU.

The order is what a GPU window most needs measured first: the cheap confirmations of the
device (numerics, the attention kernel), the GPU tests, the headline speed (llama1b eager
and compiled: MFU), our step against its peers, then the memory plan's checks. Budgets are
about 1.5x the longest time each stage took on the H100 and H200 loans (docs/performance.md,
"Measured on a GPU"): 880 s in all against the 503 s that every default stage took in one
call on an H100, so a 15-minute window (two 10-minute commands) runs them all. A stage that
overruns its budget is reported.
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
from pretrain.gpucheck.fp8 import fp8_stage
from pretrain.gpucheck.kernels import kernels_stage
from pretrain.gpucheck.memory import compile_stage, memory_stage
from pretrain.gpucheck.numerics import numerics_stage
from pretrain.gpucheck.positions import positions_stage
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


# Seconds each stage may take: ~1.5x the longest measured (H100 2026-11-27, H200 2026-11-26).
BUDGETS = {
    "numerics": 20,  # 0.6 s
    "kernels": 30,  # 6-9 s
    "tests": 130,  # 52-84 s
    "compile-llama1b": 210,  # 82-139 s (eager and compiled, back to back)
    "peers": 130,  # 81 s
    "memory-llama1b": 120,  # 74-80 s
    "compile-pythia1b": 150,  # 42-95 s
    "memory-pythia1b": 90,  # 53-55 s
    # Not measured yet: 7 models of 4 blocks, FlexAttention's first call compiles (~10-20 s
    # for each window / ALiBi variant), then 5 paired rounds of ~0.1 s steps.
    "positions": 150,
    # Not measured yet: 3 compiled 2-block 8B-width models (~30 s of compile each), 5 rounds.
    "fp8": 150,
}
ORDER = tuple(BUDGETS)


def all_stages() -> list[tuple[Stage, StageFn]]:
    """Every stage in running order (ORDER, then the science stage), with its function."""
    out: dict[str, tuple[Stage, StageFn]] = {
        "tests": (
            Stage("tests", ("tests",), BUDGETS["tests"], "pytest -m gpu: the GPU-marked tests"),
            tests_stage,
        ),
        "peers": (
            Stage(
                "peers", ("peers",), BUDGETS["peers"], "our step vs transformers' Llama and litgpt"
            ),
            peers_stage,
        ),
        "kernels": (
            Stage("kernels", ("kernels",), BUDGETS["kernels"], "SDPA kernel per attention shape"),
            kernels_stage,
        ),
        "numerics": (
            Stage("numerics", ("numerics",), BUDGETS["numerics"], "bf16 on GPU vs fp32 on CPU"),
            numerics_stage,
        ),
        "positions": (
            Stage(
                "positions",
                ("positions",),
                BUDGETS["positions"],
                "windows, ALiBi, NoPE layers, p-RoPE vs causal attention: step time, kernel",
            ),
            positions_stage,
        ),
        "fp8": (
            Stage(
                "fp8",
                ("fp8",),
                BUDGETS["fp8"],
                "train.fp8 tensorwise / rowwise vs bf16, compiled, Llama-8B's width: speed, loss",
            ),
            fp8_stage,
        ),
    }
    for name in MEMORY_CONFIGS:
        short = name.split("_")[0]
        out[f"memory-{short}"] = (
            Stage(
                f"memory-{short}",
                ("memory", "speed", "split"),
                BUDGETS[f"memory-{short}"],
                f"{name}: planned vs measured memory, speed, step split; "
                f"no recompute and full recompute",
            ),
            functools.partial(memory_stage, name=name),
        )
        out[f"compile-{short}"] = (
            Stage(
                f"compile-{short}",
                ("memory", "speed", "split"),
                BUDGETS[f"compile-{short}"],
                f"{name}: train.compile off and on, paired",
            ),
            functools.partial(compile_stage, name=name),
        )
    science = (
        Stage(
            "science",
            ("science", "science_speed"),
            540,
            "RoPE theta 5000 vs 10000 on Tiny Shakespeare, 3 seeds (chunked: one run a call)",
            science=True,
        ),
        science_stage,
    )
    return [out[name] for name in ORDER] + [science]


__all__ = [
    "BUDGETS",
    "GPU_MARK",
    "ORDER",
    "StageFn",
    "all_stages",
    "gpu_test_files",
    "peers_stage",
    "tests_stage",
]
