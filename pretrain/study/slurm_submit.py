"""Running a study on Slurm (`submit`): one sbatch per run script, or one of the study's job
array, each job recorded at once in studies/NAME/state/jobs.json; selection.py chooses the
runs. docs/studies.md ("submit") describes the lanes of `max_running` and the chained `--eval`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

from pretrain.slurm_jobs import queued_jobs, sbatch, slurm_unreachable
from pretrain.study.records import StudyUsageError, Submission, add_submission, now_utc, study_lock
from pretrain.study.selection import Echo, Executor
from pretrain.study.status import ACTIVE, run_folder, study_status

if TYPE_CHECKING:
    from pretrain.study.runs import Study, StudyRun

EVALUATE_SCRIPT = "slurm/evaluate.sh"


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
) -> SlurmSubmit:
    """Submit `runs` that are not done, queued or running; print the job ids, and return the
    submission (its `jobs` and `skipped`)."""
    if max_running is not None and max_running < 1:
        raise StudyUsageError(f"--max-running {max_running}: give at least 1")
    why = slurm_unreachable(env)
    if why is not None:
        raise StudyUsageError(
            f"cannot reach Slurm ({why}); on a machine without Slurm use --executor local"
        )
    submit = SlurmSubmit(study, Path(repo), evaluate, eval_args, echo, env, dry_run)
    with study_lock(study.out_dir, "submit"):
        status = study_status(study, submit.repo, ask_slurm=True, env=env)
        train, evals, submit.skipped = submit.choose_runs(runs, status)
        if not train and not evals:
            return submit
        max_running = max_running or study.max_running
        if study.array:
            submit.array(train, max_running)
        else:
            queue = [r.job for r in status.rows if r.state in ACTIVE and r.job.isdigit()]
            submit.scripts(sorted(queue, key=lambda j: (len(j), j)), train, max_running)
        for run in evals:
            if dry_run:
                echo(f"{run.name}: would submit its evaluation ({EVALUATE_SCRIPT})")
                continue
            eval_job = submit.evaluation(run, None)
            submit.jobs.append((run.name, None, eval_job))
            echo(f"{run.name}: completed; evaluation job {eval_job}")
    if dry_run:
        echo(f"dry run: {len(train)} run(s) and {len(evals)} evaluation(s) would be submitted")
    else:
        ids = [j for _, t, e in submit.jobs for j in (t, e) if j]
        echo(f"submitted {len(submit.jobs)} run(s): jobs {' '.join(ids)}")
    return submit


@dataclass
class SlurmSubmit(Executor):
    """One `submit`: its sbatch calls, from the repository root (the scripts use relative
    paths), and what it did: (run name, training job, evaluation job) per submission."""

    slurm: ClassVar[bool] = True

    env: Mapping[str, str] | None
    dry_run: bool
    jobs: list[tuple[str, str | None, str | None]] = field(default_factory=list)
    skipped: list[tuple[str, str]] = field(default_factory=list)

    def scripts(self, queue: list[str], train: Sequence[StudyRun], max_running: int | None) -> None:
        """One sbatch per run script. With `max_running` N, job k of the study's `queue` (its
        jobs in the queue, oldest first, then these) waits for job k - N to end, whatever its
        end: N lanes, so no more than N run at once, and a failure does not stop the lane."""
        if max_running:
            self.echo(
                f"at most {max_running} of the study's jobs at once ({len(queue)} in the queue)"
            )
        for run in train:
            opts = [f"--job-name={run.job_name}"]
            after = queue[-max_running] if max_running and len(queue) >= max_running else None
            if after is not None:
                opts.append(f"--dependency=afterany:{after}")
            if self.dry_run:
                self.echo(f"{run.name}: would submit sbatch {' '.join(opts)} {run.script_path}")
                queue.append(f"<{run.name}>")
                continue
            job = self._sbatch([*opts, str(run.script_path)], [run])
            queue.append(job)
            waits = f", after job {after}" if after else ""
            self.echo(f"{run.name}: job {job} ({run.script_path}, run folder {run.run_dir}){waits}")
            self._record(run, job)

    def array(self, train: Sequence[StudyRun], max_running: int | None) -> None:
        """One sbatch of the study's job array with the tasks of `train` (task i = run i);
        `max_running` N is the array's own throttle (%N)."""
        if not train:
            return
        index = {r.name: i for i, r in enumerate(self.study.runs)}
        tasks = ",".join(str(index[r.name]) for r in train)
        tasks += f"%{max_running}" if max_running else ""
        args = [f"--array={tasks}", str(self.study.array_script)]
        if self.dry_run:
            self.echo(f"would submit sbatch {' '.join(args)}")
            return
        array = self._sbatch(args, train)
        self.echo(f"job array {array}: tasks {tasks} of {self.study.array_script}")
        for run in train:
            job = f"{array}_{index[run.name]}"
            self.echo(f"{run.name}: job {job} (run folder {run.run_dir})")
            self._record(run, job)

    def evaluation(self, run: StudyRun, after: str | None) -> str:
        opts = [f"--job-name={_eval_job_name(run)}"]
        if after is not None:
            # afterok holds it through every requeue of the training job; a failure cancels it.
            opts += [f"--dependency=afterok:{after}", "--kill-on-invalid-dep=yes"]
        return sbatch([*opts, EVALUATE_SCRIPT, run.run_dir, *self.eval_args], self.repo, self.env)

    def evals_queued(self, runs: list[StudyRun]) -> set[str]:
        """The names of those of `runs` whose evaluation job is in the queue."""
        queued = {j.name for j in queued_jobs([_eval_job_name(r) for r in runs], self.env)}
        return {r.name for r in runs if _eval_job_name(r) in queued}

    def _record(self, run: StudyRun, job: str) -> None:
        """Chain the evaluation, and record the job before anything else can fail: a submit
        that dies half-way must still know its jobs (the queue knows them by name too, until
        they leave it)."""
        eval_job = None
        try:
            eval_job = self.evaluation(run, job) if self.evaluate else None
        finally:
            add_submission(self.study.out_dir, run.name, Submission(job, eval_job, now_utc()))
            self.jobs.append((run.name, job, eval_job))
        if eval_job:
            self.echo(f"{run.name}: evaluation job {eval_job} after job {job} completes")

    def _sbatch(self, args: list[str], runs: Sequence[StudyRun]) -> str:
        for run in runs:  # slurm/launch.sh links its log into the run folder
            run_folder(run, self.repo).mkdir(parents=True, exist_ok=True)
        return sbatch(args, self.repo, self.env)


def _eval_job_name(run: StudyRun) -> str:
    return f"eval_{run.job_name}"
