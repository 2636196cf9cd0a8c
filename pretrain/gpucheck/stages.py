"""The stages, in the order a check runs them, with their time budgets on one GPU.

The order is what a GPU window most needs measured first: the cheap confirmations of the
device (numerics, the attention kernel), the GPU tests, the headline speed (llama1b eager
and compiled: MFU), our step against its peers at both paper shapes, then the memory plan's
checks. Budgets are about 1.5x the longest time each stage took on the H100 and H200 loans
(docs/gpu_check.md), or an estimate, derived beside it, for a stage
not yet measured in its present form. A stage that overruns its budget is reported.
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

from pretrain.gpucheck.fp8 import fp8_stage
from pretrain.gpucheck.kernels import kernels_stage
from pretrain.gpucheck.memory import compile_stage, memory_stage
from pretrain.gpucheck.numerics import numerics_stage
from pretrain.gpucheck.positions import positions_stage
from pretrain.gpucheck.results import Stage, at_most
from pretrain.gpucheck.science import science_stage
from pretrain.gpucheck.sizes import MEMORY_CONFIGS, REPO, Context
from pretrain.measure.peer_models import SHAPES, litgpt_available
from pretrain.measure.peer_race import LABEL, race

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


def peers_stage(ctx: Context, shape: str = "llama1b") -> dict[str, Any]:
    """tools/benchmark.py peers' race on this device at one of the paper's shapes
    (pretrain/measure/peer_race.py), in the path training takes: every model holds bf16
    weights as DeepSpeed's BF16 engine does (`sizes.peers["precision"]`; "autocast" runs
    the stage's old mode, bf16 autocast over fp32 weights). Our step, transformers' (Llama or
    GPT-NeoX) and litgpt's at the same weights, eager and, where the sizes say so, each under
    torch.compile, in the same paired rounds; MFU against the GPU's nominal peak (the
    benchmark's own, against its measured matmul peak, is in the JSON). Checks: ours at most
    the fastest peer's step, eager against eager and compiled against compiled; our compiled
    step at most our eager one."""
    if not litgpt_available():
        raise RuntimeError("litgpt is not installed: `make venv` installs requirements/bench.txt")
    sizes = dict(ctx.sizes.peers)
    precision = sizes.pop("precision", "bf16")
    args = argparse.Namespace(
        **sizes,
        precisions=[precision],
        threads=1,
        clock="wall",
        no_variants=True,
        compile_backend=ctx.sizes.compile_backend,
        seed=0,
        json=None,
        device=ctx.device.type,
    )
    return peers_result(race(args, precision, shape), ctx.gpu.peak_flops)


def peers_result(result: dict[str, Any], peak_flops: float) -> dict[str, Any]:
    """The stage's table, checks and notes from one `peer_race.race` result."""
    shape, label = result["shape"], LABEL[result["precision"]]
    tokens = result["batch"] * result["seq_len"]
    rows = [
        {
            "shape": shape,
            "model": r["model"],
            "compiled": r["compiled"],
            "precision": label,
            "median_ms": 1e3 * r["median_s"],
            "ratio_to_ours": r["ratio_to_ours"],
            "ratio_to_eager": r["ratio_to_eager"],
            "tokens_per_s": tokens / r["median_s"],
            "mfu_model": result["flops_per_step"] / r["median_s"] / peak_flops,
            "mfu_matmul_peak": r["mfu"],
            "first_loss": r["first_loss"],
            "loss_rel_error": r["loss_rel_error"],
        }
        for r in result["rows"]
    ]
    checks = []
    for mode in ("eager", "compiled"):
        v = result["ours_vs_fastest_peer"].get(mode)
        name = f"{shape}: ours / fastest peer step time, {mode} (paired)"
        checks.append(at_most(name, v["ratio"] if v else None, 1.0))
    ours_compiled = next((r for r in result["rows"] if r["model"] == "ours, compiled"), None)
    if ours_compiled is not None:
        checks.append(
            at_most(
                f"{shape}: ours compiled / ours eager step time (paired)",
                ours_compiled["ratio_to_eager"],
                1.0,
            )
        )
    notes = [
        f"{shape} ({result['description']}), {label}: {result['parameters']:,} parameters, "
        f"d {result['d_model']}, {result['layers']} blocks, {result['heads']}/"
        f"{result['kv_heads']} heads, batch {result['batch']} x {result['seq_len']}, "
        f"{result['rounds']} rounds; matmul peak measured "
        f"{result['peak_gflops'] / 1e3:.1f} TFLOP/s (F.linear {result['peak_shape']})"
    ]
    notes += [
        f"{mode}: fastest peer {v['fastest_peer']}"
        for mode, v in result["ours_vs_fastest_peer"].items()
    ]
    notes += [
        f"{n}: did not compile, left out ({why})" for n, why in result["not_compiled"].items()
    ]
    return {"tables": {"peers": rows}, "checks": checks, "notes": notes}


StageFn = Callable[[Context], dict[str, Any]]


# Seconds each stage may take: ~1.5x the longest measured (H100 2026-11-27, H200 2026-11-26),
# in the order the next window needs them: compile by default (its plan, and compiling by
# blocks), fp8 and the position encodings first (new, never measured), then the GPU tests
# and the peers as training runs, then what two windows measured already.
BUDGETS = {
    # 82-139 s for eager and compiled back to back; now a third run, compiled by blocks (its
    # compile about one block's): ~1.45x, so 300 s.
    "compile-llama1b": 300,
    "fp8": 110,  # H100 2026-12-06: 37-72 s with inductor's cache empty, 15-19 s warm
    "positions": 30,  # H100 2026-12-06: 15 s
    "tests": 130,  # 52-84 s
    # H100 2026-12-06: 138 s (three compiled models). pythia1b not measured in this form: it
    # compiled in about half llama1b's time in the compile stages (42 s against 82-139 s),
    # so ~20 + 3 x 35 = 125 s, 1.5x = 190, rounded up to 240 for the unknown.
    "peers-llama1b": 210,
    "numerics": 20,  # 0.6 s
    "kernels": 30,  # 6-9 s
    "compile-pythia1b": 220,  # 42-95 s for two runs; a third (compiled by blocks) ~1.45x
    "peers-pythia1b": 240,
    "memory-llama1b": 120,  # 74-80 s
    "memory-pythia1b": 90,  # 53-55 s
}
ORDER = tuple(BUDGETS)


def all_stages() -> list[tuple[Stage, StageFn]]:
    """Every stage in running order (ORDER, then the science stage), with its function."""
    out: dict[str, tuple[Stage, StageFn]] = {
        "tests": (
            Stage("tests", ("tests",), BUDGETS["tests"], "pytest -m gpu: the GPU-marked tests"),
            tests_stage,
        ),
        **{
            f"peers-{shape}": (
                Stage(
                    f"peers-{shape}",
                    ("peers",),
                    BUDGETS[f"peers-{shape}"],
                    f"{shape}: our step vs transformers' and litgpt's, bf16 weights, eager and "
                    "compiled, paired",
                ),
                functools.partial(peers_stage, shape=shape),
            )
            for shape in SHAPES
        },
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
                ("memory", "speed", "split", "scaling"),
                BUDGETS[f"compile-{short}"],
                f"{name}: train.compile off, on, and on by blocks, paired",
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
