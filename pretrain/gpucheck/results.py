"""The results folder of a GPU check: one results.json (every stage's tables and checks, written
atomically after each stage, so a later call resumes where this one stopped), results.md (the
tables, for docs/gpu_check.md) and the schema both modes must fill.

    runs/gpu_check/<date>_<gpu>/results.json    {"meta": {...}, "stages": {NAME: result}}
    runs/gpu_check/<date>_<gpu>/results.md      the markdown tables and the flagged figures

A stage's result: {"status": "started" | "partial" | "ok" | "failed" | "interrupted",
"seconds", "budget_s", "tables": {TABLE: [row, ...]}, "checks": [check, ...], "notes": [...]}.
A check compares one measured figure with what the planner or the docs expect; it is flagged
when it is more than its tolerance off (5% unless the check says otherwise).
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pretrain.run_layout import atomic_write

RESULTS_JSON = "results.json"
RESULTS_MD = "results.md"
TOLERANCE = 0.05  # a figure more than 5% off what is expected is flagged
DONE = ("ok", "failed")  # a stage in one of these states is not run again unless asked

# Every row of a table has these fields (values may be null where a mode cannot measure them:
# the CPU smoke has no allocator statistics). --cpu-smoke asserts it (check_schema).
TABLES: dict[str, tuple[str, ...]] = {
    "tests": ("test", "outcome", "seconds"),
    "memory": (
        "run",
        "phase",
        "micro_batch",
        "recompute",
        "predicted_gib",
        "allocated_gib",
        "reserved_gib",
        "error_allocated",
        "error_reserved",
    ),
    "speed": (
        "run",
        "compile",
        "micro_batch",
        "recompute",
        "step_time_s",
        "tokens_per_s",
        "mfu_model",
        "mfu_executed",
        "planned_step_time_s",
    ),
    "scaling": (
        "run",
        "gpus",
        "mfu_model",
        "compute_s",
        "exposed_comm_ms",
        "step_s",
        "efficiency",
        "run_hours",
    ),
    "split": (
        "run",
        "step_ms",
        "forward_ms",
        "backward_ms",
        "optimizer_ms",
        "communication_ms",
        "other_ms",
    ),
    "peers": (
        "shape",
        "model",
        "compiled",
        "precision",
        "median_ms",
        "ratio_to_ours",
        "ratio_to_eager",
        "tokens_per_s",
        "mfu_model",
        "mfu_matmul_peak",
        "first_loss",
        "loss_rel_error",
    ),
    "kernels": (
        "shape",
        "configs",
        "head_dim",
        "heads",
        "seq_len",
        "dropout",
        "predicted",
        "measured",
        "kernel_names",
    ),
    "numerics": (
        "comparison",
        "loss_reference",
        "loss",
        "loss_rel_error",
        "grad_rel_error_max",
        "grad_rel_error_median",
        "worst_parameter",
    ),
    "science": ("theta", "seed", "steps", "best_valid_loss", "status"),
    "science_speed": ("theta", "ms_per_token", "ratio_to_default"),
    "positions": ("variant", "kernel", "median_ms", "ratio_to_causal", "tokens_per_s"),
    "fp8": (
        "recipe",
        "fp8_layers",
        "median_ms",
        "tokens_per_s",
        "speedup_vs_bf16",
        "loss",
        "loss_rel_error",
    ),
}
CHECK_FIELDS = ("name", "measured", "expected", "tolerance", "off", "flagged")


@dataclass(frozen=True)
class Stage:
    """One stage: its name, the tables it fills, and its time budget on a GPU in seconds
    (each fits in one 10-minute command; together they fit in 35 minutes)."""

    name: str
    tables: tuple[str, ...]
    budget_s: int
    what: str
    science: bool = False  # run only with --science


def check(
    name: str, measured: float | None, expected: float | None, tolerance: float = TOLERANCE
) -> dict[str, Any]:
    """A measured figure against the expected one: flagged when |measured / expected - 1| >
    tolerance. None or NaN on either side (a figure the mode cannot measure): not flagged."""
    off = None
    if _number(measured) and _number(expected) and expected != 0:
        off = measured / expected - 1
    return {
        "name": name,
        "measured": measured,
        "expected": expected,
        "tolerance": tolerance,
        "off": off,
        "flagged": off is not None and abs(off) > tolerance,
    }


def at_most(
    name: str, measured: float | None, limit: float, tolerance: float = TOLERANCE
) -> dict[str, Any]:
    """A figure that must not exceed `limit` by more than the tolerance (a bound, not a target:
    a speed ratio, an error)."""
    c = check(name, measured, limit, tolerance)
    c["flagged"] = c["off"] is not None and c["off"] > tolerance
    c["bound"] = "at most"
    return c


def _number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def relative_error(predicted: float | None, measured: float | None) -> float | None:
    """(predicted - measured) / measured, as the planner's validation reports it."""
    if not (_number(predicted) and _number(measured)) or measured == 0:
        return None
    return (predicted - measured) / measured


class ResultsFolder:
    """results.json of one GPU check, read at start and rewritten after every stage."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.file = self.path / RESULTS_JSON
        data = json.loads(self.file.read_text()) if self.file.is_file() else {}
        self.meta: dict[str, Any] = data.get("meta", {})
        self.stages: dict[str, dict[str, Any]] = data.get("stages", {})

    def save(self) -> None:
        self.path.mkdir(parents=True, exist_ok=True)
        text = json.dumps({"meta": self.meta, "stages": self.stages}, indent=1, default=str)
        atomic_write(self.file, text + "\n", fsync=False)

    def start(self, stage: Stage) -> None:
        previous = self.stages.get(stage.name, {})
        self.stages[stage.name] = {
            **previous,
            "status": "started",
            "started": time.strftime("%Y-%m-%d %H:%M:%S"),
            "budget_s": stage.budget_s,
        }
        self.save()

    def finish(self, stage: Stage, result: dict[str, Any], seconds: float) -> None:
        previous = self.stages.get(stage.name, {})
        result = {**result, "budget_s": stage.budget_s}
        # A chunked stage's seconds add up over the calls it took.
        result["seconds"] = seconds + (previous.get("seconds_before", 0.0) or 0.0)
        if result.get("status") == "partial":
            result["seconds_before"] = result["seconds"]
        self.stages[stage.name] = result
        self.save()


def check_schema(data: dict[str, Any], stages: list[Stage]) -> list[str]:
    """What is missing from a results.json: every stage present and done, every table the
    stage fills present with at least one row, every row with its fields, every check with
    its fields. Empty when the shape is right."""
    problems = []
    got = data.get("stages", {})
    for stage in stages:
        result = got.get(stage.name)
        if result is None:
            problems.append(f"stage {stage.name}: missing")
            continue
        if result.get("status") != "ok":
            problems.append(f"stage {stage.name}: status {result.get('status')!r}")
        tables = result.get("tables", {})
        for table in stage.tables:
            rows = tables.get(table)
            if not rows:
                problems.append(f"stage {stage.name}: table {table!r} has no rows")
                continue
            for i, row in enumerate(rows):
                missing = [f for f in TABLES[table] if f not in row]
                if missing:
                    problems.append(f"stage {stage.name}: {table}[{i}] lacks {missing}")
        for i, c in enumerate(result.get("checks", [])):
            missing = [f for f in CHECK_FIELDS if f not in c]
            if missing:
                problems.append(f"stage {stage.name}: checks[{i}] lacks {missing}")
        for field in ("seconds", "budget_s", "checks"):
            if field not in result:
                problems.append(f"stage {stage.name}: no {field!r}")
    return problems
