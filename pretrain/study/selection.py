"""What a study's `submit` runs, for both executors (slurm_submit.py, local_executor.py): the
runs `--only` names, and of those the ones to train or evaluate, the files they need, the runs
skipped and why. What is SUBMITTABLE and how a run is never submitted twice: docs/studies.md,
"submit"."""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

from pretrain.run_layout import EVAL_DIR, step_tag
from pretrain.study.records import StudyUsageError
from pretrain.study.runs import relative_path
from pretrain.study.status import SUBMITTABLE, State, StudyStatus, run_folder
from pretrain.study.write import study_files

if TYPE_CHECKING:
    from pretrain.study.runs import Study, StudyRun

Echo = Callable[[str], None]
Chosen = tuple[list["StudyRun"], list["StudyRun"], list[tuple[str, str]]]


def select_runs(study: Study, only: Sequence[str] = ()) -> list[StudyRun]:
    """The runs matching every `AXIS=LABEL[,LABEL...]` of `only` (`seed=1`, `run=NAME` too)."""
    wanted: dict[str, set[str]] = {}
    for text in only:
        axis, sep, labels = text.partition("=")
        if not sep or not axis.strip() or not labels.strip():
            raise StudyUsageError(f"--only {text!r}: give AXIS=LABEL, e.g. rope=0.25 or seed=1")
        wanted.setdefault(axis.strip(), set()).update(v.strip() for v in labels.split(","))

    # Each run's label on every axis, its seed and name too.
    values = {r.name: {**r.labels, "seed": str(r.seed), "run": r.name} for r in study.runs}
    axes = sorted({a for v in values.values() for a in v})
    for axis, labels in wanted.items():
        if axis not in axes:
            raise StudyUsageError(
                f"--only {axis}=...: no axis {axis!r}; the axes: {', '.join(axes)}"
            )
        known = {v.get(axis) for v in values.values()}
        unknown = sorted(labels - known)
        if unknown:
            raise StudyUsageError(
                f"--only {axis}={','.join(unknown)}: no such label; {axis} is one of "
                f"{', '.join(sorted(str(k) for k in known))}"
            )
    runs = [r for r in study.runs if all(values[r.name].get(a) in ls for a, ls in wanted.items())]
    if not runs:
        raise StudyUsageError(f"--only {' '.join(only)}: no run has all of these labels")
    return runs


@dataclass
class Executor:
    """What both executors share: the study and its repository, whether to evaluate each run
    (with tools/evaluate.py's `eval_args`), where messages go, and choosing the runs."""

    slurm: ClassVar[bool] = False  # Slurm runs job scripts; the local executor, configs only

    study: Study
    repo: Path
    evaluate: bool
    eval_args: Sequence[str]
    echo: Echo

    def choose_runs(self, runs: Sequence[StudyRun], status: StudyStatus) -> Chosen:
        """(the runs to train: SUBMITTABLE, those to evaluate: completed without an evaluation
        of their last checkpoint, (name, state) of the others), their files checked; says why
        each other run is skipped, and when there is nothing to do."""
        rows = {r.run.name: r for r in status.rows}
        train = [r for r in runs if rows[r.name].state in SUBMITTABLE]
        evals = []
        if self.evaluate:
            done = [r for r in runs if rows[r.name].state == State.COMPLETED]
            evals = [r for r in done if not _evaluated(r, self.repo)]
            queued = self.evals_queued(evals) if evals else ()
            evals = [r for r in evals if r.name not in queued]
        _check_files(self.study, self.repo, train, self.slurm)
        skipped = [(r.name, rows[r.name].state) for r in runs if r not in train and r not in evals]
        for name, state in skipped:
            if state == State.DIVERGED:
                self.echo(
                    f"{name}: diverged ({rows[name].detail}), skipped: change its config, or "
                    "remove its run folder to start over"
                )
            else:
                self.echo(f"{name}: {state}, skipped")
        if not train and not evals:
            self.echo(
                f"nothing to {'submit' if self.slurm else 'run'}: every run is done, queued or "
                "running (python tools/study.py status)"
            )
        return train, evals, skipped

    def evals_queued(self, runs: list[StudyRun]) -> Collection[str]:
        """The names of those of `runs` whose evaluation waits in the queue already."""
        return ()


def _evaluated(run: StudyRun, repo: Path) -> bool:
    """The run's last checkpoint has an evaluation folder (RUN/eval/step_TOTAL[_scaling]/)."""
    total = int((run.config.get("train") or {}).get("train_iters") or 0)
    return any((run_folder(run, repo) / EVAL_DIR).glob(step_tag(total) + "*"))


def _check_files(study: Study, repo: Path, runs: Sequence[StudyRun], slurm: bool) -> None:
    """The files the runs need are written and are what the study writes today: a study
    edited since its `write` would otherwise train the old configs."""

    def first_three(names: Sequence[str]) -> str:
        return ", ".join(names[:3]) + (" ..." if len(names) > 3 else "")

    no_script = [r.name for r in runs if not r.script_path]
    if slurm and not study.array and no_script:
        raise StudyUsageError(
            f"runs {first_three(no_script)} have no Slurm job script (the study has no slurm: "
            "layout); use --executor local"
        )
    need = {r.config_path for r in runs}
    if slurm:
        need |= {r.script_path for r in runs if r.script_path}
        if study.array and runs:
            need.add(str(study.array_script))
    want = study_files(study)
    missing = sorted(p for p in need if not (repo / p).is_file())
    stale = sorted(
        p for p in need - set(missing) if p in want and (repo / p).read_text() != want[p]
    )
    for files, what in ((missing, "are not written"), (stale, "differ from what the study writes")):
        if files:
            raise StudyUsageError(
                f"{len(files)} file(s) of the study {what} ({first_three(files)}); "
                f"run: python tools/study.py write {relative_path(Path(study.path), repo)}"
            )
