"""Running a study: on Slurm (`submit`), or on this machine (`submit --executor local`).

Both submit what is not done, queued or running (status.SUBMITTABLE: not started, stopped,
cancelled, failed, hung), each run resuming from its newest checkpoint, and never a run
twice: the study's submit lock admits one submitter at a time, Slurm is asked for the
study's jobs by name before anything is submitted, and a local run's training process holds
the run's lock for as long as it lives (records.py).

Slurm: one `sbatch` of the run's job script per run, or one `sbatch --array=I,J,...` of the
study's job array (task i is run i), from the repository root (the scripts use relative
paths); each job id recorded at once in studies/NAME/state/jobs.json. With `evaluate`, the
evaluation is chained as slurm/submit.sh chains it (`--dependency=afterok:JOB
--kill-on-invalid-dep=yes slurm/evaluate.sh RUN_DIR`: held through every requeue, cancelled
if the training fails). `max_running` N: each new job waits (`afterany`) for the job N
places before it in the study's queue, so no more than N of the study's jobs run at once;
a job array gets Slurm's own %N.

Local: one process per run (`python -m pretrain.cli.train --config CONFIG`, pretrain/main.py's
program), `parallel` at once, in the foreground, output to studies/NAME/state/RUN.log. A
second call continues where the first stopped: finished runs are skipped, the others resume
from their checkpoints. Stopping the executor (Ctrl-C, SIGTERM, or kill -9, through the
kernel's parent-death signal on Linux) sends the runs SIGTERM: each saves a checkpoint and
exits 99, as before a Slurm time limit.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from pretrain.run_layout import EVAL_DIR, step_tag
from pretrain.study.records import (
    RUN_LOCK_FD_VAR,
    LocalRecord,
    StudyUsageError,
    Submission,
    add_submission,
    now_utc,
    read_local_record,
    state_dir,
    study_lock,
    take_run_lock,
    write_local_record,
)
from pretrain.study.slurm_jobs import queued_jobs, sbatch, slurm_unreachable
from pretrain.study.status import (
    ACTIVE,
    COMPLETED,
    DIVERGED,
    SUBMITTABLE,
    RunStatus,
    StudyStatus,
    read_progress,
    run_folder,
    study_status,
)
from pretrain.study.write import study_files
from pretrain.train.distributed import LAUNCH_VARS

if TYPE_CHECKING:
    from pretrain.study.spec import Study, StudyRun

Echo = Callable[[str], None]
EVALUATE_SCRIPT = "slurm/evaluate.sh"
# The programs by module, not by path: a study may live outside this checkout (its repo is
# the folder above its studies/), and the run's paths are relative to that folder.
_EVALUATE = "import sys; from pretrain.cli.evaluate import main; sys.exit(main())"
EVAL_ARGS_ENV = "PRETRAIN_EVAL_ARGS"  # as slurm/submit.sh reads it


# ----------------------------------------------------------------------------- choosing runs


def select_runs(study: Study, only: Sequence[str] = ()) -> list[StudyRun]:
    """The runs matching every `AXIS=LABEL[,LABEL...]` of `only` (`seed=1`, `run=NAME` too)."""
    wanted: dict[str, set[str]] = {}
    for text in only:
        axis, sep, labels = text.partition("=")
        if not sep or not axis.strip() or not labels.strip():
            raise StudyUsageError(f"--only {text!r}: give AXIS=LABEL, e.g. rope=0.25 or seed=1")
        wanted.setdefault(axis.strip(), set()).update(v.strip() for v in labels.split(","))

    def value(run: StudyRun, axis: str) -> str | None:
        if axis == "seed":
            return None if run.seed is None else str(run.seed)
        if axis == "run":
            return run.name
        return run.labels.get(axis)

    axes = sorted({a for r in study.runs for a in r.labels} | {"seed", "run"})
    for axis, labels in wanted.items():
        if axis not in axes:
            raise StudyUsageError(
                f"--only {axis}=...: no axis {axis!r}; the axes: {', '.join(axes)}"
            )
        known = {value(r, axis) for r in study.runs}
        unknown = sorted(labels - known)
        if unknown:
            raise StudyUsageError(
                f"--only {axis}={','.join(unknown)}: no such label; {axis} is one of "
                f"{', '.join(sorted(str(k) for k in known))}"
            )
    runs = [r for r in study.runs if all(value(r, a) in ls for a, ls in wanted.items())]
    if not runs:
        raise StudyUsageError(f"--only {' '.join(only)}: no run has all of these labels")
    return runs


def eval_done(run: StudyRun, repo: Path) -> bool:
    """The run's last checkpoint has an evaluation folder (RUN/eval/step_TOTAL[_scaling]/)."""
    total = int((run.config.get("train") or {}).get("train_iters") or 0)
    return any((run_folder(run, repo) / EVAL_DIR).glob(step_tag(total) + "*"))


def _check_files(study: Study, runs: Sequence[StudyRun], repo: Path, slurm: bool) -> None:
    """The files the runs need are written and are what the study writes today: a study
    edited since its `write` would otherwise train the old configs."""
    if slurm and not study.array:
        no_script = [r.name for r in runs if not r.script_path]
        if no_script:
            raise StudyUsageError(
                f"runs {', '.join(no_script[:3])}{' ...' if len(no_script) > 3 else ''} have no "
                f"Slurm job script (the study has no slurm: layout); use --executor local"
            )
    need = {r.config_path for r in runs}
    if slurm:
        need |= {r.script_path for r in runs if r.script_path}
        if study.array and runs:
            need.add(str(study.array_script))
    want = study_files(study)
    missing = sorted(p for p in need if not (Path(repo) / p).is_file())
    stale = sorted(
        p for p in need - set(missing) if p in want and (Path(repo) / p).read_text() != want[p]
    )
    for files, what in ((missing, "are not written"), (stale, "differ from what the study writes")):
        if files:
            raise StudyUsageError(
                f"{len(files)} file(s) of the study {what} ({', '.join(files[:3])}"
                f"{' ...' if len(files) > 3 else ''}); run: python tools/study.py write "
                f"{_rel(Path(study.path), Path(repo))}"
            )


def eval_arguments(text: str | None) -> list[str]:
    """tools/evaluate.py options: `text`, else $PRETRAIN_EVAL_ARGS (as slurm/submit.sh)."""
    return shlex.split(text if text is not None else os.environ.get(EVAL_ARGS_ENV, ""))


def _skip_reason(row: RunStatus) -> str:
    if row.state == DIVERGED:
        return (
            f"diverged ({row.detail}), skipped: change its config, or remove its run folder "
            f"to start over"
        )
    return f"{row.state}, skipped"


# ----------------------------------------------------------------------------- Slurm


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
            busy = {j.name for j in queued_jobs([f"eval_{r.job_name}" for r in runs], env)}
            eval_only = [
                r
                for r in runs
                if rows[r.name].state == COMPLETED
                and not eval_done(r, repo)
                and f"eval_{r.job_name}" not in busy
            ]
        _check_files(study, train, repo, slurm=True)
        max_running = max_running or study.max_running
        for run in runs:
            row = rows[run.name]
            if run not in train and run not in eval_only:
                done.skipped.append((run.name, row.state))
                echo(f"{run.name}: {_skip_reason(row)}")

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
    opts = [f"--job-name=eval_{run.job_name}"]
    if after is not None:
        # afterok holds it through every requeue of the training job; a failure cancels it.
        opts += [f"--dependency=afterok:{after}", "--kill-on-invalid-dep=yes"]
    return sbatch([*opts, EVALUATE_SCRIPT, run.run_dir, *eval_args], repo, env)


# ----------------------------------------------------------------------------- local

_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:  # pragma: no cover (runs in the child before exec)
    """Linux: SIGTERM to the child when the executor dies, kill -9 included, so that no
    run trains on unwatched (the trainer saves and exits 99)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def local_gpus(text: str | None) -> list[str]:
    """GPU ids for the local executor: `text` ('0,1', 'none'), else CUDA_VISIBLE_DEVICES,
    else what nvidia-smi lists; [] = CPU."""
    if text is not None:
        return (
            [] if text.strip().lower() in ("", "none", "cpu") else text.replace(" ", "").split(",")
        )
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return [g for g in visible.split(",") if g.strip() and g.strip() != "-1"]
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [str(i) for i, line in enumerate(out.stdout.splitlines()) if line.startswith("GPU ")]


@dataclass
class _Process:
    run: StudyRun
    kind: str  # "train" | "eval"
    proc: subprocess.Popen
    log: TextIO
    started: float
    gpu: str | None
    lock_fd: int | None = None
    log_start: int = 0  # where this start's output begins in the log
    ready: bool = False  # training: its data is built (the "model:" line is out)


class LocalExecutor:
    """The local executor's loop; `run_locally` is the way in."""

    # Two runs that build the same megatron index cache (same data, seed and length) at
    # once can read each other's half-written files: a run starts only after the one
    # started before it has built its data (printed its "model:" line) or ended.
    READY_MARK = "\nmodel: "
    READY_TIMEOUT_S = 900.0

    def __init__(
        self,
        study: Study,
        repo: Path,
        parallel: int,
        gpus: list[str],
        evaluate: bool,
        eval_args: Sequence[str],
        python: Sequence[str],
        echo: Echo,
        progress_every: float,
    ) -> None:
        self.study, self.repo, self.parallel, self.gpus = study, Path(repo), parallel, gpus
        self.evaluate, self.eval_args, self.python = evaluate, list(eval_args), list(python)
        self.echo, self.progress_every = echo, progress_every
        self.procs: list[_Process] = []
        self.stopping: int | None = None  # the signal that asked us to stop
        self.failed: list[str] = []
        self.finished: list[str] = []
        self.stopped: list[str] = []
        self.t0 = time.monotonic()

    # -- the loop

    def run(self, train: list[StudyRun], evals: list[StudyRun]) -> int:
        previous = {
            s: signal.signal(s, self._on_signal)
            for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
        }
        last_progress = time.monotonic()
        try:
            while True:
                self._reap()
                while self.stopping is None and len(self.procs) < self.parallel:
                    if evals:
                        self._start_eval(evals.pop(0))
                    elif train and all(p.ready for p in self.procs if p.kind == "train"):
                        self._start_train(train.pop(0))
                    else:
                        break
                if not self.procs and (self.stopping is not None or not (train or evals)):
                    break
                for p in self.procs:
                    if p.kind == "train" and not p.ready:
                        p.ready = self._became_ready(p)
                if time.monotonic() - last_progress >= self.progress_every:
                    last_progress = time.monotonic()
                    self._progress(len(train) + len(evals))
                time.sleep(0.2)
        finally:
            for s, h in previous.items():
                signal.signal(s, h)
        left = len(train) + len(evals)
        elapsed = _clock(time.monotonic() - self.t0)
        if self.stopping is not None:
            self.echo(
                f"stopped by {signal.Signals(self.stopping).name} after {elapsed}: "
                f"{len(self.finished)} finished, {len(self.stopped)} stopped, {left} not "
                f"started; run the same command to continue (each run resumes from its "
                f"checkpoint)"
            )
            return 128 + self.stopping
        self.echo(
            f"done in {elapsed}: {len(self.finished)} finished, {len(self.failed)} failed"
            + (f" ({', '.join(self.failed)})" if self.failed else "")
        )
        return 1 if self.failed else 0

    def _on_signal(self, signum: int, frame: Any) -> None:
        first = self.stopping is None
        self.stopping = signum
        if first:
            self.echo(
                f"got {signal.Signals(signum).name}: asking {len(self.procs)} process(es) to "
                f"save a checkpoint and stop"
            )
        for p in self.procs:
            if p.proc.poll() is None:
                p.proc.send_signal(signal.SIGTERM)

    # -- starting

    def _env(self, gpu: str | None) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}
        env["PYTHONUNBUFFERED"] = "1"
        if gpu is not None:
            env["CUDA_VISIBLE_DEVICES"] = gpu
        if "OMP_NUM_THREADS" not in os.environ:
            # Share the cores: torch would give every process all of them.
            env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // self.parallel))
        return env

    def _gpu(self) -> str | None:
        if not self.gpus:
            return None
        used = [p.gpu for p in self.procs]
        return min(self.gpus, key=used.count)

    def _spawn(
        self, run: StudyRun, kind: str, argv: list[str], log_path: Path, lock_fd: int | None
    ) -> _Process:
        log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(log_path, "a")  # noqa: SIM115 (closed when the process ends)
        log.write(f"\n[study {time.strftime('%Y-%m-%d %H:%M:%S')}] {' '.join(argv)}\n")
        log.flush()
        gpu = self._gpu()
        env = self._env(gpu)
        if lock_fd is not None:
            env[RUN_LOCK_FD_VAR] = str(lock_fd)
        proc = subprocess.Popen(
            argv,
            cwd=self.repo,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            pass_fds=() if lock_fd is None else (lock_fd,),
            # Its own session: a Ctrl-C in the terminal reaches the executor alone, which
            # asks each run to save first.
            start_new_session=True,
            preexec_fn=_die_with_parent if sys.platform == "linux" else None,  # noqa: PLW1509
        )
        p = _Process(run, kind, proc, log, time.monotonic(), gpu, lock_fd, log.tell())
        self.procs.append(p)
        return p

    def _start_train(self, run: StudyRun) -> None:
        fd = take_run_lock(self.study.out_dir, run.name)
        if fd is None:  # a process of an earlier executor still trains it
            self.echo(f"{run.name}: a training process of it is still running; not started again")
            return
        argv = [*self.python, "-u", "-m", "pretrain.cli.train", "--config", run.config_path]
        for override in run.overrides:  # the seed and run folder of a config seeds share
            argv += ["--set", override]
        p = self._spawn(run, "train", argv, state_dir(self.study.out_dir) / f"{run.name}.log", fd)
        write_local_record(self.study.out_dir, run.name, LocalRecord(p.proc.pid, now_utc()))
        progress = read_progress(run, self.repo)
        where = (
            f"from step {progress.checkpoint_step}" if progress.checkpoint_step else "from scratch"
        )
        gpu = f" on GPU {p.gpu}" if p.gpu is not None else ""
        self.echo(
            f"{run.name}: started {where}{gpu} (pid {p.proc.pid}, log {_rel(Path(p.log.name), self.repo)})"
        )

    def _start_eval(self, run: StudyRun) -> None:
        argv = [*self.python, "-u", "-c", _EVALUATE, "--run", run.run_dir, *self.eval_args]
        p = self._spawn(
            run, "eval", argv, state_dir(self.study.out_dir) / f"{run.name}.eval.log", None
        )
        self.echo(
            f"{run.name}: evaluating (pid {p.proc.pid}, log {_rel(Path(p.log.name), self.repo)})"
        )

    def _became_ready(self, p: _Process) -> bool:
        if p.proc.poll() is not None or time.monotonic() - p.started > self.READY_TIMEOUT_S:
            return True
        try:
            with open(p.log.name) as f:
                f.seek(p.log_start)
                return self.READY_MARK in "\n" + f.read()
        except OSError:
            return True

    # -- ending

    def _reap(self) -> None:
        for p in list(self.procs):
            code = p.proc.poll()
            if code is None:
                continue
            self.procs.remove(p)
            p.log.close()
            took = _clock(time.monotonic() - p.started)
            if p.kind == "eval":
                if code == 0:
                    self.echo(f"{p.run.name}: evaluated in {took}")
                else:
                    self.failed.append(p.run.name + " (evaluation)")
                    self.echo(
                        f"{p.run.name}: evaluation failed (exit {code}); see {_rel(Path(p.log.name), self.repo)}"
                    )
                continue
            record = read_local_record(self.study.out_dir, p.run.name)
            started = record.started if record else now_utc()
            write_local_record(
                self.study.out_dir, p.run.name, LocalRecord(p.proc.pid, started, now_utc(), code)
            )
            if p.lock_fd is not None:
                os.close(p.lock_fd)  # the process is gone: the lock goes with our copy
            progress = read_progress(p.run, self.repo)
            if code == 0 and progress.done:
                valid = (
                    "" if progress.valid_loss is None else f", valid loss {progress.valid_loss:.4f}"
                )
                self.finished.append(p.run.name)
                self.echo(f"{p.run.name}: completed in {took} ({progress.step} steps{valid})")
                if self.evaluate and self.stopping is None:
                    self._start_eval(p.run)
            elif self.stopping is not None and code in (99, -signal.SIGTERM):
                self.stopped.append(p.run.name)
                self.echo(
                    f"{p.run.name}: stopped at step {progress.step}/{progress.total} (checkpoint saved)"
                )
            else:
                self.failed.append(p.run.name)
                tail = _last_line(Path(p.log.name))
                self.echo(
                    f"{p.run.name}: failed (exit {code}) at step {progress.step}/{progress.total}: "
                    f"{tail}; see {_rel(Path(p.log.name), self.repo)}"
                )

    def _progress(self, waiting: int) -> None:
        parts = []
        for p in self.procs:
            if p.kind == "eval":
                parts.append(f"{p.run.name} evaluating")
                continue
            pr = read_progress(p.run, self.repo)
            loss = "" if pr.train_loss is None else f" loss {pr.train_loss:.3f}"
            parts.append(f"{p.run.name} {pr.step}/{pr.total}{loss}")
        self.echo(
            f"[{_clock(time.monotonic() - self.t0)}] {len(self.finished)} done, "
            f"{waiting} waiting; " + ", ".join(parts)
        )


def _clock(seconds: float) -> str:
    m, s = divmod(int(seconds), 60)
    return f"{m}m{s:02d}s"


def _rel(path: Path, repo: Path) -> str:
    try:
        return str(path.resolve().relative_to(Path(repo).resolve()))
    except ValueError:
        return str(path)


def _last_line(log: Path) -> str:
    try:
        lines = [
            line.strip() for line in log.read_text(errors="replace").splitlines() if line.strip()
        ]
    except OSError:
        return "no log"
    return lines[-1][:200] if lines else "no output"


def run_locally(
    study: Study,
    repo: Path,
    runs: Sequence[StudyRun],
    parallel: int = 1,
    evaluate: bool = False,
    eval_args: Sequence[str] = (),
    gpus: list[str] | None = None,
    python: Sequence[str] | None = None,
    echo: Echo = print,
    progress_every: float = 30.0,
) -> int:
    """Train `runs` that are not done, queued or running on this machine, `parallel` at once,
    in the foreground; 0 when every one completed, 1 when one failed, 128 + N when stopped by
    signal N."""
    if parallel < 1:
        raise StudyUsageError(f"--parallel {parallel}: give at least 1")
    gpus = local_gpus(None) if gpus is None else gpus
    with study_lock(study.out_dir, "the local executor"):
        status = study_status(study, repo)
        rows = {r.run.name: r for r in status.rows}
        train = [r for r in runs if rows[r.name].state in SUBMITTABLE]
        evals = [
            r
            for r in runs
            if evaluate and rows[r.name].state == COMPLETED and not eval_done(r, repo)
        ]
        for r in runs:
            if r not in train and r not in evals:
                echo(f"{r.name}: {_skip_reason(rows[r.name])}")
        _check_files(study, train, repo, slurm=False)
        if not train and not evals:
            echo(
                "nothing to run: every run is done, queued or running (python tools/study.py status)"
            )
            return 0
        where = f"GPUs {','.join(gpus)}" if gpus else f"CPU, {os.cpu_count()} cores"
        echo(
            f"running {len(train)} run(s){f' and {len(evals)} evaluation(s)' if evals else ''} "
            f"here, {parallel} at once ({where}); logs in {_rel(state_dir(study.out_dir), Path(repo))}/"
        )
        executor = LocalExecutor(
            study,
            repo,
            parallel,
            gpus,
            evaluate,
            eval_args,
            python or [sys.executable],
            echo,
            progress_every,
        )
        return executor.run(train, evals)


__all__ = [
    "EVAL_ARGS_ENV",
    "LocalExecutor",
    "SlurmSubmitted",
    "eval_arguments",
    "eval_done",
    "local_gpus",
    "run_locally",
    "select_runs",
    "submit_to_slurm",
]
