"""Where each run of a study stands, from its run folder, Slurm and the local executor;
docs/studies.md describes each state, and which of them `status` and `submit` act on.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pretrain.exit_codes import EXIT_HUNG, EXIT_PREEMPTED
from pretrain.run_layout import HANG_DIR, ROLLBACKS_FILE, RunLayout, read_metrics, tag_step
from pretrain.slurm_jobs import SlurmError, SlurmJob, finished_jobs, queued_jobs, slurm_unreachable
from pretrain.study.records import LocalRecord, read_local_record, read_submissions, run_lock_held
from pretrain.tables import Align, text_table

if TYPE_CHECKING:
    from pretrain.study.runs import Study, StudyRun


class State(StrEnum):
    """Where a run stands (docs/studies.md, "Where the runs stand")."""

    NOT_STARTED = "not started"  # no job, no process, nothing in the run folder
    QUEUED = "queued"  # a Slurm job waits (PENDING)
    RUNNING = "running"  # a Slurm job, or a local training process (its lock held), runs it
    REQUEUED = "requeued"  # its Slurm job was requeued and waits to start again
    COMPLETED = "completed"  # the run folder holds the checkpoint of the last step
    STOPPED = "stopped"  # started, not finished, nothing running, no failure known
    CANCELLED = "cancelled"  # its Slurm job was cancelled (scancel)
    FAILED = "failed"  # its job or process ended with an error
    HUNG = "hung"  # it ended after the hang watchdog fired, and nothing restarts it
    DIVERGED = "diverged"  # a loss is not finite, or the spike guard used every rollback


ACTIVE = frozenset({State.QUEUED, State.RUNNING, State.REQUEUED})
FAILURES = frozenset({State.FAILED, State.HUNG, State.DIVERGED})  # `status` exits 1
# What `submit` submits (again); a diverged run would diverge again: change its config first.
SUBMITTABLE = frozenset(
    {State.NOT_STARTED, State.STOPPED, State.CANCELLED, State.FAILED, State.HUNG}
)


@dataclass(frozen=True)
class RunProgress:
    """What a run folder says: how far, the last figures, and signs of trouble."""

    step: int
    total: int
    checkpoint_step: int | None = None
    train_loss: float | None = None
    valid_loss: float | None = None
    tokens_per_s: float | None = None
    mfu: float | None = None
    step_time_s: float | None = None
    hung: bool = False  # hang reports newer than the last metrics
    rollbacks: int = 0
    gave_up: bool = False  # every allowed rollback used
    non_finite: bool = False

    @property
    def done(self) -> bool:
        return self.checkpoint_step is not None and self.checkpoint_step >= self.total

    @property
    def diverged(self) -> bool:
        return self.non_finite or self.gave_up

    @property
    def started(self) -> bool:
        return self.step > 0 or self.checkpoint_step is not None


def run_folder(run: StudyRun, repo: Path) -> Path:
    """The run's folder: logging.run_dir, relative to the repository root unless absolute."""
    return Path(repo) / run.run_dir


def _finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def read_progress(run: StudyRun, repo: Path) -> RunProgress:
    """The run folder of `run` read without writing anything (safe while it trains)."""
    folder = run_folder(run, repo)
    config = run.config
    layout = RunLayout(folder, (config.get("checkpoint") or {}).get("dir"))
    tag = layout.latest_tag()
    checkpoint_step = tag_step(tag) if tag else None
    rows = read_metrics(folder)
    last: dict[str, Any] = {}
    non_finite = False
    for row in rows:
        keys = ("train/loss", "valid/loss", "perf/tokens_per_s", "perf/mfu")
        last.update((k, row[k]) for k in keys if row.get(k) is not None)
        if "perf/step_time_s" in row:  # the newest row's timing, None included
            last["perf/step_time_s"] = row["perf/step_time_s"]
        # A non-finite loss on a step the guard skipped left the weights as they were;
        # one on a step that updated them has spoilt them (every later loss is NaN).
        if "train/loss" in row:
            non_finite = not _finite(row["train/loss"]) and not row.get("spikes/skipped")
    if "valid/loss" in last and not _finite(last["valid/loss"]):
        non_finite = True

    hang = folder / HANG_DIR
    reports = list(hang.glob("rank_*.txt")) if hang.is_dir() else []
    metrics_time = layout.metrics.stat().st_mtime if layout.metrics.exists() else 0.0
    try:
        rollbacks = len(json.loads((folder / ROLLBACKS_FILE).read_text()))
    except (FileNotFoundError, json.JSONDecodeError):  # none yet, or being written
        rollbacks = 0
    spikes = config.get("spikes") or {}
    most = int(spikes.get("max_rollbacks", 5))
    gave_up = bool(spikes.get("rollback_after")) and rollbacks >= most

    def value(key: str) -> float | None:
        v = last.get(key)
        return float(v) if isinstance(v, (int, float)) else None

    return RunProgress(
        step=max([int(r["step"]) for r in rows[-1:]] + [checkpoint_step or 0]),
        total=int((config.get("train") or {}).get("train_iters") or 0),
        checkpoint_step=checkpoint_step,
        train_loss=value("train/loss"),
        valid_loss=value("valid/loss"),
        tokens_per_s=value("perf/tokens_per_s"),
        mfu=value("perf/mfu"),
        step_time_s=value("perf/step_time_s"),
        hung=bool(reports) and max(p.stat().st_mtime for p in reports) >= metrics_time,
        rollbacks=rollbacks,
        gave_up=gave_up,
        non_finite=non_finite,
    )


@dataclass(frozen=True)
class RunStatus:
    """One row of `status`."""

    run: StudyRun
    state: str
    progress: RunProgress
    job: str = ""  # Slurm job id, or "local pid N"
    job_state: str = ""  # what Slurm (or the local process) says
    detail: str = ""  # why the state, when it is not plain

    @property
    def eta_s(self) -> float | None:
        p = self.progress
        if self.state != State.RUNNING or p.step_time_s is None:
            return None
        return max(0, p.total - p.step) * p.step_time_s


def decide_state(
    progress: RunProgress,
    slurm: SlurmJob | None = None,
    local_running: bool = False,
    local: LocalRecord | None = None,
) -> tuple[str, str]:
    """(state, detail) from the run folder and the newest job or process of the run."""
    if progress.diverged:
        if progress.gave_up:
            return State.DIVERGED, f"the spike guard used all {progress.rollbacks} rollbacks"
        return State.DIVERGED, "its loss is not finite"
    if local_running:
        return State.RUNNING, ""
    if slurm is not None and slurm.active:
        if slurm.requeued:
            return State.REQUEUED, ""
        return (State.QUEUED if slurm.state == "PENDING" else State.RUNNING), ""
    if progress.done:
        return State.COMPLETED, ""
    if slurm is not None and slurm.state == "CANCELLED":
        return State.CANCELLED, ""
    code = local.exit_code if local is not None and slurm is None else None
    if progress.hung or code == EXIT_HUNG:
        return State.HUNG, "the hang watchdog stopped it (stacks in RUN/hang/)"
    if slurm is not None:
        if slurm.state == "COMPLETED":  # the script ended 0 without the last checkpoint
            return State.FAILED, "the job completed without the run's last checkpoint"
        return State.FAILED, ""
    if code is not None:
        if code == EXIT_PREEMPTED or code < 0:  # a signal: stopped
            return State.STOPPED, ""
        return State.FAILED, f"exit code {code}"
    return (State.STOPPED if progress.started else State.NOT_STARTED), ""


@dataclass(frozen=True)
class StudyStatus:
    rows: list[RunStatus]
    slurm_note: str | None = None  # why Slurm was not asked, when it was not

    @property
    def failed(self) -> bool:
        return any(r.state in FAILURES for r in self.rows)

    @property
    def active(self) -> bool:
        return any(r.state in ACTIVE for r in self.rows)


def _study_jobs(study: Study, env: Mapping[str, str] | None) -> dict[str, list[SlurmJob]]:
    """Run name -> its jobs in the queue: a run's own job by its job name; a task of the
    study's job array (named after the study) by its index, task i being run i."""
    by_name = {r.job_name: r.name for r in study.runs}
    names = set(by_name) | ({study.name} if study.array else set())
    found: dict[str, list[SlurmJob]] = {}
    for job in queued_jobs(names, env):
        name = by_name.get(job.name)
        if job.array_task is not None and job.name == study.name and study.array:
            name = study.runs[job.array_task].name if job.array_task < len(study.runs) else None
        if name is not None:
            found.setdefault(name, []).append(job)
    return found


def study_status(
    study: Study, repo: Path, ask_slurm: bool | None = None, env: Mapping[str, str] | None = None
) -> StudyStatus:
    """Every run's row. `ask_slurm`: None asks Slurm where this machine can reach it."""
    submissions = read_submissions(study.out_dir)
    queue: dict[str, list[SlurmJob]] = {}
    ended: dict[str, SlurmJob] = {}
    note = "Slurm not asked" if ask_slurm is False else slurm_unreachable(env)
    if note is not None and ask_slurm:
        raise SlurmError(f"cannot ask Slurm: {note}")
    if note is None:
        queue = _study_jobs(study, env)
        queued_ids = {j.job_id for jobs in queue.values() for j in jobs}
        recorded = [subs[-1].job for subs in submissions.values() if subs]
        ended = finished_jobs([i for i in recorded if i not in queued_ids], env)
    elif ask_slurm is None:
        note = f"no Slurm here: {note}"

    rows = []
    for run in study.runs:
        subs = submissions.get(run.name, [])
        active = [j for j in queue.get(run.name, []) if j.active]
        slurm = max(active, key=lambda j: (len(j.job_id), j.job_id), default=None)
        if slurm is None and subs:
            slurm = ended.get(subs[-1].job)
        local = read_local_record(study.out_dir, run.name)
        local_running = run_lock_held(study.out_dir, run.name)
        # The newer of the two executors speaks for the run.
        if slurm is not None and local is not None and not local_running and subs:
            if local.started > subs[-1].time:
                slurm = None
            else:
                local = None
        progress = read_progress(run, repo)
        state, detail = decide_state(progress, slurm, local_running, local)
        job, job_state = "", ""
        if slurm is not None:
            job, job_state = slurm.job_id, slurm.describe()
            if len(active) > 1:
                ids = ", ".join(j.job_id for j in active)
                detail = f"{len(active)} jobs of this run in the queue: {ids}"
        elif local is not None or local_running:
            job = f"local pid {local.pid}" if local else "local"
            code = local.exit_code if local else None
            job_state = "running" if local_running else "gone" if code is None else f"exit {code}"
        elif subs:
            job, job_state = subs[-1].job, "unknown to Slurm" if note is None else "not asked"
        rows.append(RunStatus(run, state, progress, job, job_state, detail))
    return StudyStatus(rows, note)


def duration(seconds: float | None) -> str:
    """`4m10s`, `2h05m`; `-` for none."""
    if seconds is None or not math.isfinite(seconds):
        return "-"
    h, rem = divmod(int(seconds), 3600)
    m, sec = divmod(rem, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{sec:02d}s"


def _cells(row: RunStatus) -> list[str]:
    p = row.progress
    mfu = "-" if p.mfu is None else ("<0.1%" if 0 <= p.mfu < 1e-3 else f"{100 * p.mfu:.1f}%")
    return [
        row.run.name,
        row.state + (f": {row.detail}" if row.detail else ""),
        f"{p.step}/{p.total}",
        "-" if p.train_loss is None else f"{p.train_loss:.4f}",
        "-" if p.valid_loss is None else f"{p.valid_loss:.4f}",
        "-" if p.tokens_per_s is None else f"{p.tokens_per_s / 1e3:,.1f}k",
        mfu,
        duration(row.eta_s),
        row.job or "-",
        row.job_state or "-",
    ]


def format_status_table(status: StudyStatus) -> str:
    """The rows as aligned text, then one line that counts them: `6 runs: 2 completed,
    1 running, 3 queued; the running ones end in 4m10s at the latest`."""
    figures = ("step", "train loss", "valid loss", "tok/s", "MFU", "ETA")  # right-aligned
    header = ("run", "state", *figures, "job", "Slurm / process")
    align: list[Align] = ["left", "left", *["right"] * len(figures), "left", "left"]
    table = text_table(header, [_cells(r) for r in status.rows], align)
    counts = [(sum(r.state == s for r in status.rows), s) for s in State]
    summary = f"{len(status.rows)} runs: " + ", ".join(f"{n} {s}" for n, s in counts if n)
    etas = [r.eta_s for r in status.rows if r.eta_s is not None]
    if etas:
        summary += f"; the running ones end in {duration(max(etas))} at the latest"
    if status.slurm_note:
        summary += f" ({status.slurm_note}; the run folders say)"
    return f"{table}\n{summary}"
