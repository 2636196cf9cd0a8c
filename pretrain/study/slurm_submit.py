"""Running a study on Slurm (`submit`); selection.py chooses the runs.

One `sbatch` of the run's job script per run, or one `sbatch --array=I,J,...` of the
study's job array (task i is run i), from the repository root (the scripts use relative
paths); each job id recorded at once in studies/NAME/state/jobs.json. With `evaluate`, the
evaluation is chained as slurm/submit.sh chains it (`--dependency=afterok:JOB
--kill-on-invalid-dep=yes slurm/evaluate.sh RUN_DIR`: held through every requeue, cancelled
if the training fails). `max_running` N: each new job waits (`afterany`) for the job N
places before it in the study's queue, so no more than N of the study's jobs run at once;
a job array gets Slurm's own %N.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from pretrain.study.records import (
    StudyUsageError,
    Submission,
    add_submission,
    now_utc,
    study_lock,
)
from pretrain.study.selection import Echo, check_files, eval_done, report_skipped
from pretrain.study.slurm_jobs import queued_jobs, sbatch, slurm_unreachable
from pretrain.study.status import (
    ACTIVE,
    COMPLETED,
    SUBMITTABLE,
    StudyStatus,
    run_folder,
    study_status,
)

if TYPE_CHECKING:
    from pretrain.study.runs import Study, StudyRun

EVALUATE_SCRIPT = "slurm/evaluate.sh"


@dataclass
class SlurmSubmitted:
    """What one `submit` did: (run name, training job, evaluation job) per submission."""

    jobs: list[tuple[str, str | None, str | None]] = field(default_factory=list)
    skipped: list[tuple[str, str]] = field(default_factory=list)


def submit_to_slurm(
    study: Study,
    repo: Path,
    runs: Sequence[StudyRun],
    max_running: int | None = None,
    evaluate: bool = False,
    eval_args: Sequence[str] = (),
    dry_run: bool = False,
    env: Mapping[str, str] | None = None,
    echo: Echo = print,
) -> SlurmSubmitted:
    """Submit `runs` that are not done, queued or running; print and return the job ids."""
    if max_running is not None and max_running < 1:
        raise StudyUsageError(f"--max-running {max_running}: give at least 1")
    why = slurm_unreachable(env)
    if why is not None:
        raise StudyUsageError(
            f"cannot reach Slurm ({why}); on a machine without Slurm use --executor local"
        )
    repo = Path(repo)
    done = SlurmSubmitted()
    with study_lock(study.out_dir, "submit"):
        status = study_status(study, repo, ask_slurm=True, env=env)
        rows = {r.run.name: r for r in status.rows}
        train = [r for r in runs if rows[r.name].state in SUBMITTABLE]
        eval_only: list[StudyRun] = []
        if evaluate:
            busy = {j.name for j in queued_jobs([_eval_job_name(r) for r in runs], env)}
            eval_only = [
                r
                for r in runs
                if rows[r.name].state == COMPLETED
                and not eval_done(r, repo)
                and _eval_job_name(r) not in busy
            ]
        check_files(study, train, repo, slurm=True)
        max_running = max_running or study.max_running
        done.skipped += report_skipped(runs, rows, [*train, *eval_only], echo)

        def submitted(run: StudyRun, job: str) -> None:
            # Recorded before anything else can fail: a submit that dies half-way must still
            # know its jobs (the queue knows them by name too, until they leave it).
            eval_job = None
            try:
                eval_job = _submit_eval(run, job, eval_args, repo, env) if evaluate else None
            finally:
                add_submission(study.out_dir, run.name, Submission(job, eval_job, now_utc()))
                done.jobs.append((run.name, job, eval_job))
            if eval_job:
                echo(f"{run.name}: evaluation job {eval_job} after job {job} completes")

        if study.array:
            _submit_array(study, train, max_running, dry_run, repo, env, echo, submitted)
        else:
            _submit_scripts(status, train, max_running, dry_run, repo, env, echo, submitted)
        for run in eval_only:
            if dry_run:
                echo(f"{run.name}: would submit its evaluation ({EVALUATE_SCRIPT})")
                continue
            eval_job = _submit_eval(run, None, eval_args, repo, env)
            done.jobs.append((run.name, None, eval_job))
            echo(f"{run.name}: completed; evaluation job {eval_job}")
    ids = [j for _, t, e in done.jobs for j in (t, e) if j]
    if dry_run:
        echo(f"dry run: {len(train)} run(s) and {len(eval_only)} evaluation(s) would be submitted")
    elif ids:
        echo(f"submitted {len(done.jobs)} run(s): jobs {' '.join(ids)}")
    else:
        echo(
            "nothing to submit: every run is done, queued or running (python tools/study.py status)"
        )
    return done


def _submit_scripts(
    status: StudyStatus,
    train: Sequence[StudyRun],
    max_running: int | None,
    dry_run: bool,
    repo: Path,
    env: Mapping[str, str] | None,
    echo: Echo,
    submitted: Callable[[StudyRun, str], None],
) -> None:
    """One sbatch per run script, each handed to `submitted` at once. With `max_running` N, job k of the study's queue (its jobs
    in the queue, oldest first, then these) waits for job k - N to end, whatever its end:
    N lanes, so no more than N run at once, and a failure does not stop the lane."""
    queue = sorted(
        (r.job for r in status.rows if r.state in ACTIVE and r.job.isdigit()),
        key=lambda j: (len(j), j),
    )
    if max_running:
        echo(f"at most {max_running} of the study's jobs at once ({len(queue)} in the queue)")
    for run in train:
        opts = [f"--job-name={run.job_name}"]
        after = (
            queue[len(queue) - max_running] if max_running and len(queue) >= max_running else None
        )
        if after is not None:
            opts.append(f"--dependency=afterany:{after}")
        if dry_run:
            echo(f"{run.name}: would submit sbatch {' '.join(opts)} {run.script_path}")
            queue.append(f"<{run.name}>")
            continue
        run_folder(run, repo).mkdir(parents=True, exist_ok=True)  # launch.sh links its log there
        job = sbatch([*opts, str(run.script_path)], repo, env)
        queue.append(job)
        waits = f", after job {after}" if after else ""
        echo(f"{run.name}: job {job} ({run.script_path}, run folder {run.run_dir}){waits}")
        submitted(run, job)


def _submit_array(
    study: Study,
    train: Sequence[StudyRun],
    max_running: int | None,
    dry_run: bool,
    repo: Path,
    env: Mapping[str, str] | None,
    echo: Echo,
    submitted: Callable[[StudyRun, str], None],
) -> None:
    """One sbatch of the study's job array with the tasks of `train` (task i = run i), each
    task handed to `submitted`; `max_running` N is the array's own throttle (%N)."""
    if not train:
        return
    index = {r.name: i for i, r in enumerate(study.runs)}
    tasks = ",".join(str(index[r.name]) for r in train) + (f"%{max_running}" if max_running else "")
    args = [f"--array={tasks}", str(study.array_script)]
    if dry_run:
        echo(f"would submit sbatch {' '.join(args)}")
        return
    for run in train:
        run_folder(run, repo).mkdir(parents=True, exist_ok=True)
    array = sbatch(args, repo, env)
    echo(f"job array {array}: tasks {tasks} of {study.array_script}")
    for run in train:
        job = f"{array}_{index[run.name]}"
        echo(f"{run.name}: job {job} (run folder {run.run_dir})")
        submitted(run, job)


def _submit_eval(
    run: StudyRun,
    after: str | None,
    eval_args: Sequence[str],
    repo: Path,
    env: Mapping[str, str] | None,
) -> str:
    opts = [f"--job-name={_eval_job_name(run)}"]
    if after is not None:
        # afterok holds it through every requeue of the training job; a failure cancels it.
        opts += [f"--dependency=afterok:{after}", "--kill-on-invalid-dep=yes"]
    return sbatch([*opts, EVALUATE_SCRIPT, run.run_dir, *eval_args], repo, env)


def _eval_job_name(run: StudyRun) -> str:
    return f"eval_{run.job_name}"


__all__ = [
    "SlurmSubmitted",
    "submit_to_slurm",
]
