"""The training step in every setting it accepts, against every numeric fault: the cells,
what each must end as (docs/spikes.md, "Faults in every setting"), and a runner.

A cell is one setting (precision and accumulation dtype, ZeRO stage, gradient accumulation,
where in a logging window the fault falls, the spike mitigation, 1 or 2 ranks) and one fault
(`spikes.faults`: a NaN loss, infinite gradients with a finite loss, a loss spike, a NaN loss
on one rank only). Each cell trains the tiny model for ITERS steps with the fault at one data
step, then resumes the same run to MORE steps, with the real DeepSpeed engine, the real
sinks and checkpoints. `expected(cell)` is the documented outcome, derived from the rules
below, never from a run; `problems(cell, seen)` lists where a run departed from it.

The rules (DeepSpeed 0.19's own overflow checks, read in its source and held by these cells):
- DeepSpeed skips a step whose gradients are not finite itself, holding the LR schedule,
  everywhere but fp32 at ZeRO 0 (the bare torch optimizer), which applies it;
- the guard flags every non-finite step, and a finite spike once its window has history;
  with spikes.skip_step it withholds a flagged update; with spikes.rollback_after it rolls
  back at the flush after the flagged step, to the checkpoint before it, skipping its data;
- a non-finite update applied leaves NaN weights: every later loss is NaN, until a rollback.
"""

from __future__ import annotations

import itertools
import json
import math
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from train_support import tiny_config

PRECISIONS: dict[str, dict[str, str]] = {
    "fp32": {"precision": "fp32"},
    "bf16": {"precision": "bf16", "grad_accum_dtype": "fp32"},  # the paper's
    "bf16_acc": {"precision": "bf16", "grad_accum_dtype": "bf16"},
}
ZERO = (0, 1, 2)
ACCUM = (1, 2)
LOG = 4  # logging.log_interval: the flush windows are steps 1-4, 5-8, 9-12, 13-16
POSITIONS = {"first": 13, "middle": 14, "last": 16}  # the fault's data step in its window
MITIGATIONS = ("off", "skip", "rollback")
RANKS = (1, 2)
FAULTS = ("nan", "inf_grads", "spike", "nan_one_rank")
ITERS, MORE = 16, 20  # the run, then its resume
AXES = {
    "precision": tuple(PRECISIONS),
    "zero": ZERO,
    "accum": ACCUM,
    "position": tuple(POSITIONS),
    "mitigation": MITIGATIONS,
    "ranks": RANKS,
    "fault": FAULTS,
}


@dataclass(frozen=True)
class Cell:
    precision: str
    zero: int
    accum: int
    position: str
    mitigation: str
    ranks: int
    fault: str

    @property
    def id(self) -> str:
        return (
            f"{self.precision}-zero{self.zero}-accum{self.accum}-{self.position}-"
            f"{self.mitigation}-{self.ranks}rank-{self.fault}"
        )

    @property
    def accepted(self) -> bool:
        """Whether the config accepts the setting (train.zero_stage=0 cannot accumulate bf16
        gradients in fp32) and the fault fits it (one rank of two)."""
        return not (self.precision == "bf16" and self.zero == 0) and not (
            self.fault == "nan_one_rank" and self.ranks == 1
        )

    @property
    def bad_step(self) -> int:
        return POSITIONS[self.position]


def all_cells() -> list[Cell]:
    """Every accepted cell of the matrix."""
    cells = (Cell(*values) for values in itertools.product(*AXES.values()))
    return [c for c in cells if c.accepted]


def sample_cells() -> list[Cell]:
    """Few cells that hold every value of every axis, each fault under each mitigation, and
    the paper's own default (bf16, ZeRO-1, no mitigation) with every fault; for the suite.
    Chosen by walking the axes together (cell i takes value i of each, cycling), then adding
    what that walk missed."""
    chosen: list[Cell] = []
    for fault, mitigation in itertools.product(FAULTS, MITIGATIONS):
        i = len(chosen)
        pick = {k: v[i % len(v)] for k, v in AXES.items()}
        pick.update(fault=fault, mitigation=mitigation)
        if fault == "nan_one_rank":
            pick["ranks"] = 2
        cell = Cell(**pick)
        if not cell.accepted:
            cell = Cell(**{**pick, "zero": 1})
        chosen.append(cell)
    for fault in FAULTS:  # the paper's setting, which once crashed at the next flush
        chosen.append(
            Cell("bf16", 1, 2, "middle", "off", 2 if fault == "nan_one_rank" else 1, fault)
        )
    return list(dict.fromkeys(chosen))


# ----------------------------------------------------------------------------- outcomes


@dataclass(frozen=True)
class Expected:
    """What a cell must end as."""

    deepspeed_skips: bool  # DeepSpeed withheld the bad update itself (norm published as inf)
    skipped: bool  # no update applied at the bad step (spikes/skipped = 1)
    loss_nan: bool  # the bad step's published loss is NaN
    nan_after: bool  # the weights are NaN after it: every later loss NaN, to the end
    rolled_back: bool  # one rollback, to the checkpoint before the bad step

    def describe(self) -> str:
        if self.rolled_back:
            return "rolled back at the next flush; the bad data step skipped"
        if self.skipped:
            return "skipped by DeepSpeed" if self.deepspeed_skips else "skipped by the guard"
        return "applied: NaN weights from here on" if self.nan_after else "applied"


def deepspeed_skips_non_finite(precision: str, zero: int) -> bool:
    """DeepSpeed's own check of the gradients: everywhere but fp32 at ZeRO 0."""
    return not (precision == "fp32" and zero == 0)


def expected(cell: Cell) -> Expected:
    non_finite = cell.fault != "spike"
    ds_skips = non_finite and deepspeed_skips_non_finite(cell.precision, cell.zero)
    # The guard flags every bad step (`problems` holds it to that): a non-finite one always,
    # a finite spike once the detector has 10 steps of history (the window's minimum), and
    # the fault falls at step 13 or later.
    skipped = ds_skips or cell.mitigation == "skip"
    rolled = cell.mitigation == "rollback"
    return Expected(
        deepspeed_skips=ds_skips,
        skipped=skipped,
        loss_nan=cell.fault in ("nan", "nan_one_rank"),
        nan_after=non_finite and not skipped and not rolled,
        rolled_back=rolled,
    )


# ----------------------------------------------------------------------------- a run


def config(cell: Cell, run: Path, data: Path, iters: int = ITERS) -> dict[str, Any]:
    fault: dict[str, Any] = {"step": cell.bad_step}
    fault.update(
        {
            "nan": {"kind": "nan"},
            "inf_grads": {"kind": "inf_grads"},
            "spike": {"kind": "scale_loss", "factor": 100.0},
            "nan_one_rank": {"kind": "nan", "rank": 1},
        }[cell.fault]
    )
    spikes: dict[str, Any] = {"window": 20, "faults": [fault]}
    if cell.mitigation == "skip":
        spikes["skip_step"] = True
    if cell.mitigation == "rollback":
        spikes.update(rollback_after=1, rollback_within=1)
        spikes.update(rollback_skip_before=0, rollback_skip_after=0)
    micro = 8 // (cell.accum * cell.ranks)
    return tiny_config(
        run,
        data,
        train={
            **PRECISIONS[cell.precision],
            "zero_stage": cell.zero,
            "train_iters": iters,
            "global_batch_size": 8,
            "micro_batch_size": micro,
            "eval_interval": 0,
            "hang_timeout": 0,
        },
        checkpoint={"interval": LOG, "keep_last": 2},
        logging={"log_interval": LOG, "max_logit_interval": 0},
        spikes=spikes,
    )


def run_cell(cell: Cell, root: Path, data: Path) -> dict[str, Any]:
    """Train the cell's run in this process (its rank of a process group already set up for
    2 ranks), then resume it to MORE steps; what the files say, by rank 0."""
    from pretrain.config import Config, from_dict
    from pretrain.train.trainer import Trainer

    run = root / cell.id
    shutil.rmtree(run, ignore_errors=True)
    seen: dict[str, Any] = {"cell": asdict(cell)}
    for name, iters in (("exit", ITERS), ("resume_exit", MORE)):
        try:
            seen[name] = Trainer(from_dict(Config, config(cell, run, data, iters))).fit()
        except Exception as e:  # noqa: BLE001 (the cell's outcome, reported)
            seen[name] = f"{type(e).__name__}: {e}"
            return seen
        if name == "exit":
            seen["rows"] = _rows(run)
    seen["resumed_rows"] = _rows(run)
    seen["tensorboard_steps"] = _tensorboard_steps(run)
    rollbacks = run / "rollbacks.json"
    seen["rollbacks"] = json.loads(rollbacks.read_text()) if rollbacks.is_file() else []
    return seen


def _rows(run: Path) -> list[dict[str, float]]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _tensorboard_steps(run: Path) -> list[int]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run / "tensorboard"), size_guidance={"scalars": 0})
    acc.Reload()
    return [e.step for e in acc.Scalars("train/loss")]


# ----------------------------------------------------------------------------- the check


def _nan(x: Any) -> bool:
    return isinstance(x, float) and math.isnan(x)


def problems(cell: Cell, seen: dict[str, Any]) -> list[str]:
    """Where the run departed from `expected(cell)`; empty when it ended as documented."""
    want, out = expected(cell), []
    if seen.get("exit") != 0 or seen.get("resume_exit") != 0:
        return [f"exit {seen.get('exit')!r}, resumed {seen.get('resume_exit')!r} (want 0, 0)"]
    # A rollback writes a record of its own at the step it went back to (spikes/rollbacks).
    rewound = [r for r in seen["resumed_rows"] if "spikes/rollbacks" in r]
    rows = [r for r in seen["rows"] if "spikes/rollbacks" not in r]
    resumed = [r for r in seen["resumed_rows"] if "spikes/rollbacks" not in r]
    if [r["step"] for r in rows] != list(range(1, ITERS + 1)):
        out.append(f"metrics.jsonl steps {[r['step'] for r in rows]}: not 1-{ITERS} once each")
    if [r["step"] for r in resumed] != list(range(1, MORE + 1)):
        out.append(f"after the resume, steps {[r['step'] for r in resumed]}: not 1-{MORE}")
    if seen["tensorboard_steps"] != [r["step"] for r in resumed]:
        out.append(f"TensorBoard steps {seen['tensorboard_steps']} != metrics.jsonl's")
    names = set(rows[0])
    if any(not names <= set(r) for r in rows):
        out.append("a row lacks a name an earlier row had")
    by = {r["step"]: r for r in rows}
    s = cell.bad_step
    if want.rolled_back:
        rb = seen["rollbacks"]
        if len(rb) != 1 or rb[0]["to_step"] != 12 or rb[0]["skip"] != [s, s]:
            out.append(f"rollbacks.json {rb}: want one, to step 12, skipping data step {s}")
        if any(_nan(r["train/loss"]) for r in resumed):
            out.append("a NaN loss is left after the rollback")
        if [(r["step"], r["spikes/rollbacks"]) for r in rewound] != [(12, 1.0)]:
            out.append(f"the rollback's records {rewound}: want one at step 12")
        return out
    if seen["rollbacks"]:
        out.append(f"rolled back {seen['rollbacks']} without spikes.rollback_after")
    bad = by[s]
    if _nan(bad["train/loss"]) != want.loss_nan:
        out.append(f"step {s}: train/loss {bad['train/loss']} (want NaN: {want.loss_nan})")
    if (bad.get("spikes/skipped") == 1.0) != want.skipped:
        out.append(f"step {s}: spikes/skipped {bad.get('spikes/skipped')} (want {want.skipped})")
    norm = bad.get("train/grad_norm")
    if want.deepspeed_skips and norm != math.inf:
        out.append(f"step {s}: train/grad_norm {norm} (DeepSpeed skipped: want inf)")
    if (
        cell.fault != "spike"
        and not want.deepspeed_skips
        and norm is not None
        and math.isfinite(norm)
    ):
        out.append(f"step {s}: train/grad_norm {norm} is finite for non-finite gradients")
    flagged = "spikes/loss" in bad or "spikes/grad_norm" in bad
    if not flagged:
        out.append(f"step {s}: not flagged by the guard (spikes/loss or spikes/grad_norm)")
    later = [r["train/loss"] for r in resumed if r["step"] > s]
    if want.nan_after != all(_nan(x) for x in later) or (
        not want.nan_after and any(map(_nan, later))
    ):
        out.append(f"losses after step {s}: {later} (want all NaN: {want.nan_after})")
    before = [r["train/loss"] for r in resumed if r["step"] < s]
    if any(map(_nan, before)):
        out.append(f"a NaN loss before step {s}")
    return out


# ----------------------------------------------------------------------------- the table


def outcome_table() -> str:
    """docs/spikes.md's table of outcomes, from `expected` (every cell of a row of the
    matrix ends the same way whatever its accumulation, position, ranks and precision
    within a column: the table says so only because `expected` does, and the cells hold
    `expected` to every run)."""
    from pretrain.tables import pipe_table

    columns = {"fp32, ZeRO 0": ("fp32", 0), "every other setting": ("bf16", 1)}
    names = {
        "nan": "NaN loss",
        "inf_grads": "infinite gradients, finite loss",
        "spike": "loss spike (x100, finite)",
        "nan_one_rank": "NaN loss on one rank of two",
    }
    rows = []
    for fault, mitigation in itertools.product(FAULTS, MITIGATIONS):
        cells = [
            expected(Cell(p, z, 1, "middle", mitigation, 2, fault)) for p, z in columns.values()
        ]
        rows.append([names[fault], mitigation, *(c.describe() for c in cells)])
    return pipe_table(["fault", "mitigation", *columns], rows)


if __name__ == "__main__":
    print(outcome_table())
