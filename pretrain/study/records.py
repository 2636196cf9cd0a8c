"""What a study remembers of running its runs, in studies/NAME/state/ (this checkout's record,
not part of the study: keep it out of git):

    jobs.json      every Slurm submission per run (appended: the newest last)
    submit.lock    held while `submit` decides and submits, and by the local executor
    RUN.lock       held by the run's training process while it lives, whoever started it
    RUN.json       that process under the local executor: pid, start and end, exit code
    RUN.log        its output; RUN.eval.log its evaluation's

Locks are `flock`s: the kernel drops them with their last holder (kill -9 included), so no
lock outlives its process and there is no stale lock file to clean up.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

from pretrain.errors import UserError
from pretrain.run_layout import atomic_write

STATE_DIR = "state"
JOBS_FILE = "jobs.json"
SUBMIT_LOCK = "submit.lock"
RUN_LOCK_FD_VAR = "PRETRAIN_RUN_LOCK_FD"  # the run's lock, open in the training process


class StudyUsageError(UserError, ValueError):
    """What was asked of a study cannot be done as asked; the message says what to change."""


class StudyBusyError(UserError, RuntimeError):
    """Another `submit` (or the local executor) holds the study, or its record is damaged."""


@dataclass(frozen=True)
class Submission:
    """One Slurm submission of a run."""

    job: str
    eval_job: str | None = None
    time: str = ""  # UTC, ISO 8601


def now_utc() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def read_submissions(out_dir: Path) -> dict[str, list[Submission]]:
    """Run name -> its Slurm submissions, oldest first ({} before the first submit)."""
    path = Path(out_dir) / STATE_DIR / JOBS_FILE
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise StudyBusyError(f"{path}: not valid JSON ({e}); restore it or remove it") from None
    return {
        name: [Submission(**entry) for entry in entries]
        for name, entries in (data.get("runs") or {}).items()
    }


def add_submission(out_dir: Path, run: str, submission: Submission) -> None:
    """Record one submission at once (before the next sbatch): a submit that dies half-way
    must still know what it submitted, or the next one would submit it again."""
    runs = read_submissions(out_dir)
    runs.setdefault(run, []).append(submission)
    data = {"runs": {name: [asdict(s) for s in subs] for name, subs in runs.items()}}
    atomic_write(state_dir(out_dir) / JOBS_FILE, json.dumps(data, indent=1) + "\n")


@contextlib.contextmanager
def study_lock(out_dir: Path, what: str) -> Iterator[None]:
    """Hold the study's submit lock, or refuse at once naming who holds it."""
    path = state_dir(out_dir) / SUBMIT_LOCK
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = path.read_text().strip() or "another process"
            raise StudyBusyError(
                f"{Path(out_dir).name}: {holder} holds {path}; wait for it to end (the local "
                f"executor holds it until its runs end), or stop that process"
            ) from None
        os.ftruncate(fd, 0)
        os.write(fd, f"{what} (pid {os.getpid()})".encode())
        yield
    finally:
        os.close(fd)


# ----------------------------------------------------------------------------- local runs


@dataclass(frozen=True)
class LocalRecord:
    """The newest training process of a run under the local executor."""

    pid: int
    started: str
    ended: str | None = None
    exit_code: int | None = None  # None: still running, or its executor died first


def state_dir(out_dir: Path) -> Path:
    """studies/NAME/state/ of the study whose out_dir is studies/NAME/, made if need be."""
    path = Path(out_dir) / STATE_DIR
    path.mkdir(parents=True, exist_ok=True)
    return path


def read_local_record(out_dir: Path, run: str) -> LocalRecord | None:
    path = Path(out_dir) / STATE_DIR / f"{run}.json"
    try:
        return LocalRecord(**json.loads(path.read_text()))
    except (FileNotFoundError, json.JSONDecodeError, TypeError):
        return None


def write_local_record(out_dir: Path, run: str, record: LocalRecord) -> None:
    atomic_write(state_dir(out_dir) / f"{run}.json", json.dumps(asdict(record)) + "\n")


def take_run_lock(out_dir: Path, run: str, wait_s: float = 2.0) -> int | None:
    """The fd of the run's lock, held; None when a process holds it (the run is running).
    Retries for `wait_s`: `status` holds it shared for an instant while it looks."""
    fd = os.open(state_dir(out_dir) / f"{run}.lock", os.O_RDWR | os.O_CREAT, 0o644)
    end = time.monotonic() + wait_s
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return fd
        except BlockingIOError:
            if time.monotonic() >= end:
                os.close(fd)
                return None
            time.sleep(0.05)


def run_lock_held(out_dir: Path, run: str) -> bool:
    """True while a local training process of the run lives (whoever started it)."""
    path = Path(out_dir) / STATE_DIR / f"{run}.lock"
    if not path.exists():
        return False
    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # drops the shared lock, if taken


def keep_run_lock_from_children() -> None:
    """Called first by a training process: the run's lock that the executor passed open
    ($PRETRAIN_RUN_LOCK_FD) stays with this process alone. A forked child (a DataLoader
    worker) would share the lock and hold it for seconds after the run ended, while `status`
    said running and a new executor refused to start the run."""
    value = os.environ.pop(RUN_LOCK_FD_VAR, None)
    if not value:
        return
    fd = int(value)
    os.set_inheritable(fd, False)  # nor an exec'd child
    os.register_at_fork(after_in_child=lambda: _close_quietly(fd))


def _close_quietly(fd: int) -> None:
    with contextlib.suppress(OSError):  # closed already: nothing to keep
        os.close(fd)
