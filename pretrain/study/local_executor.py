"""Running a study on this machine (`submit --executor local`; selection.py chooses the runs):
a training process per run, `parallel` at once, in the foreground, output in
studies/NAME/state/RUN.log. Stopping the executor, kill -9 included, asks each run to save a
checkpoint and stop; the next call resumes them. docs/studies.md ("submit") has the details.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, TextIO

from pretrain.exit_codes import EXIT_PREEMPTED
from pretrain.launch_env import LAUNCH_VARS
from pretrain.study.records import (
    RUN_LOCK_FD_VAR,
    LocalRecord,
    StudyUsageError,
    now_utc,
    state_dir,
    study_lock,
    take_run_lock,
    write_local_record,
)
from pretrain.study.runs import relative_path
from pretrain.study.selection import Executor
from pretrain.study.status import duration, read_progress, study_status

if TYPE_CHECKING:
    from pretrain.study.runs import StudyRun

# The programs by module, not by path: a study may live outside this checkout (its repo is
# the folder above its studies/), and the run's paths are relative to that folder.
_EVALUATE = "import sys; from pretrain.cli.evaluate import main; sys.exit(main())"


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
        cpu = text.strip().lower() in ("", "none", "cpu")
        return [] if cpu else text.replace(" ", "").split(",")
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
    record: LocalRecord | None = None  # training: what the state folder says of it


@dataclass
class LocalExecutor(Executor):
    """Trains a study's runs on this machine, `parallel` at once, in the foreground."""

    # Two runs that build the same megatron index cache (same data, seed and length) at
    # once can read each other's half-written files: a run starts only after the one
    # started before it has built its data (printed its "model:" line) or ended.
    READY_MARK: ClassVar[str] = "\nmodel: "
    READY_TIMEOUT_S: ClassVar[float] = 900.0

    gpus: list[str]  # [] = CPU
    parallel: int = 1
    progress_every: float = 30.0
    procs: list[_Process] = field(default_factory=list)
    stopping: int | None = None  # the signal that asked us to stop
    failed: list[str] = field(default_factory=list)
    finished: list[str] = field(default_factory=list)
    stopped: list[str] = field(default_factory=list)
    t0: float = field(default_factory=time.monotonic)

    def run(self, runs: Sequence[StudyRun]) -> int:
        """Train `runs` that are not done, queued or running; 0 when every one completed, 1
        when one failed, 128 + N when stopped by signal N."""
        if self.parallel < 1:
            raise StudyUsageError(f"--parallel {self.parallel}: give at least 1")
        study, repo = self.study, self.repo
        with study_lock(study.out_dir, "the local executor"):
            train, evals, _ = self.choose_runs(runs, study_status(study, repo))
            if not train and not evals:
                return 0
            where = f"GPUs {','.join(self.gpus)}" if self.gpus else f"CPU, {os.cpu_count()} cores"
            also = f" and {len(evals)} evaluation(s)" if evals else ""
            logs = relative_path(state_dir(study.out_dir), repo)
            self.echo(
                f"running {len(train)} run(s){also} here, {self.parallel} at once ({where}); "
                f"logs in {logs}/"
            )
            return self._loop(train, evals)

    # -- the loop

    def _loop(self, train: list[StudyRun], evals: list[StudyRun]) -> int:
        signals = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
        previous = {s: signal.signal(s, self._on_signal) for s in signals}
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
        elapsed = self._elapsed()
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
        if self.stopping is None:
            self.echo(
                f"got {signal.Signals(signum).name}: asking {len(self.procs)} process(es) to "
                f"save a checkpoint and stop"
            )
        self.stopping = signum
        for p in self.procs:
            if p.proc.poll() is None:
                p.proc.send_signal(signal.SIGTERM)

    # -- starting

    def _spawn(self, run: StudyRun, kind: str, argv: list[str], lock_fd: int | None) -> _Process:
        suffix = ".eval" if kind == "eval" else ""
        log_path = state_dir(self.study.out_dir) / f"{run.name}{suffix}.log"
        log = open(log_path, "a")  # noqa: SIM115 (closed when the process ends)
        log.write(f"\n[study {time.strftime('%Y-%m-%d %H:%M:%S')}] {' '.join(argv)}\n")
        log.flush()
        used = [p.gpu for p in self.procs]
        gpu = min(self.gpus, key=used.count) if self.gpus else None  # the least used
        env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}
        env["PYTHONUNBUFFERED"] = "1"
        if gpu is not None:
            env["CUDA_VISIBLE_DEVICES"] = gpu
        if "OMP_NUM_THREADS" not in os.environ:
            # Share the cores: torch would give every process all of them.
            env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // self.parallel))
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
        argv = [sys.executable, "-u", "-m", "pretrain.cli.train", "--config", run.config_path]
        for override in run.overrides:  # the seed and run folder of a config seeds share
            argv += ["--set", override]
        p = self._spawn(run, "train", argv, fd)
        p.record = LocalRecord(p.proc.pid, now_utc())
        write_local_record(self.study.out_dir, run.name, p.record)
        step = read_progress(run, self.repo).checkpoint_step
        where = f"from step {step}" if step else "from scratch"
        gpu = f" on GPU {p.gpu}" if p.gpu is not None else ""
        self.echo(f"{run.name}: started {where}{gpu} (pid {p.proc.pid}, log {self._log_name(p)})")

    def _start_eval(self, run: StudyRun) -> None:
        argv = [sys.executable, "-u", "-c", _EVALUATE, "--run", run.run_dir, *self.eval_args]
        p = self._spawn(run, "eval", argv, None)
        self.echo(f"{run.name}: evaluating (pid {p.proc.pid}, log {self._log_name(p)})")

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
        for p in [p for p in self.procs if p.proc.poll() is not None]:
            self.procs.remove(p)
            p.log.close()
            name, code = p.run.name, p.proc.returncode
            took, see = duration(time.monotonic() - p.started), f"see {self._log_name(p)}"
            if p.kind == "eval":
                if code == 0:
                    self.echo(f"{name}: evaluated in {took}")
                else:
                    self.failed.append(f"{name} (evaluation)")
                    self.echo(f"{name}: evaluation failed (exit {code}); {see}")
                continue
            assert p.record is not None  # a training process has one from its start
            ended = replace(p.record, ended=now_utc(), exit_code=code)
            write_local_record(self.study.out_dir, name, ended)
            if p.lock_fd is not None:
                os.close(p.lock_fd)  # the process is gone: the lock goes with our copy
            progress = read_progress(p.run, self.repo)
            at = f"step {progress.step}/{progress.total}"
            if code == 0 and progress.done:
                loss = progress.valid_loss
                valid = "" if loss is None else f", valid loss {loss:.4f}"
                self.finished.append(name)
                self.echo(f"{name}: completed in {took} ({progress.step} steps{valid})")
                if self.evaluate and self.stopping is None:
                    self._start_eval(p.run)
            elif self.stopping is not None and code in (EXIT_PREEMPTED, -signal.SIGTERM):
                self.stopped.append(name)
                self.echo(f"{name}: stopped at {at} (checkpoint saved)")
            else:
                self.failed.append(name)
                tail = _last_line(Path(p.log.name))
                self.echo(f"{name}: failed (exit {code}) at {at}: {tail}; {see}")

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
            f"[{self._elapsed()}] {len(self.finished)} done, {waiting} waiting; " + ", ".join(parts)
        )

    # -- for its messages

    def _log_name(self, p: _Process) -> str:
        return relative_path(Path(p.log.name), self.repo)

    def _elapsed(self) -> str:
        return duration(time.monotonic() - self.t0)


def _last_line(log: Path) -> str:
    try:
        text = log.read_text(errors="replace")
    except OSError:
        return "no log"
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1][:200] if lines else "no output"
