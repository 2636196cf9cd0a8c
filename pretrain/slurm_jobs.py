"""What Slurm says of jobs, and submitting one, from the login node (the studies' `submit`
and `status`).

Jobs in the queue are found by name (`squeue --me`: a job submitted by hand counts too); a
job that left it by its id, with `sacct`, else `scontrol show job` while slurmctld remembers
it (MinJobAge), else not at all. Every command has a timeout: a status must not hang on a
controller that does not answer. Slurm 20.02 or newer (`squeue --me`).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from pretrain.errors import UserError

# Job states in which the job may still run (or runs): a run with such a job is not
# submitted again. PENDING with a restart count is a requeued job waiting to start again.
REQUEUE_STATES = frozenset({"REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED"})
_HELD_STATES = frozenset({"PENDING", "CONFIGURING", "SUSPENDED", "STOPPED", "RESIZING"})
_RUNNING_STATES = frozenset({"RUNNING", "COMPLETING", "SIGNALING", "STAGE_OUT"})
ACTIVE_STATES = _HELD_STATES | _RUNNING_STATES | REQUEUE_STATES
TIMEOUT_S = 60.0  # per Slurm command; a loaded controller can take seconds


class SlurmError(UserError, RuntimeError):
    """A Slurm command refused or failed; the message carries Slurm's own words."""

    label = "slurm error"


@dataclass(frozen=True)
class SlurmJob:
    """One job as Slurm reports it (`state` spelled as Slurm does: RUNNING, CANCELLED, ...)."""

    job_id: str
    name: str
    state: str
    reason: str = ""
    restarts: int = 0
    exit_code: str = ""  # "1:0": the batch script's exit code and the signal that ended it
    array_task: int | None = None  # a job array's task: job_id is then ARRAYJOB_TASK

    @property
    def active(self) -> bool:
        return self.state in ACTIVE_STATES

    @property
    def requeued(self) -> bool:
        """Waiting to start again after a requeue (pre-emption, time limit, hang, by hand)."""
        if self.state in REQUEUE_STATES:
            return True
        if self.state == "PENDING":
            return self.restarts > 0
        return self.state == "COMPLETING" and "requeue" in self.reason.lower()

    def describe(self) -> str:
        """The state column: `RUNNING`, `PENDING (Dependency)`, `FAILED (exit 1)`."""
        text = self.state
        if self.active and self.reason and self.reason != "None":
            text += f" ({self.reason})"
        code = self.exit_code.split(":")[0]
        if not self.active and code not in ("", "0"):
            text += f" (exit {code})"
        if self.restarts:
            text += f", restart {self.restarts}"
        return text


def _run(cmd: list[str], env: Mapping[str, str] | None, cwd: Path | None = None):
    return subprocess.run(
        cmd,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        env=None if env is None else dict(env),
        cwd=cwd,
    )


def _why(stderr: str) -> str:
    """Slurm's reason: many lines start "squeue: error:", and the last one usually says why."""
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    return lines[-1] if lines else ""


def slurm_unreachable(env: Mapping[str, str] | None = None) -> str | None:
    """None when this machine can ask a Slurm controller; else why not, in a few words."""
    if shutil.which("squeue", path=(env or os.environ).get("PATH")) is None:
        return "no squeue on this machine"
    try:
        out = _run(["squeue", "--me", "-h", "-o", "%i"], env)
    except subprocess.TimeoutExpired:
        return f"squeue did not answer within {TIMEOUT_S:.0f} s"
    if out.returncode != 0:
        return _why(out.stderr) or f"squeue failed with exit code {out.returncode}"
    return None


# One line per array task (-r); a task's JobID alone is its own (or, pending, the array's).
_SQUEUE_FORMAT = "ArrayJobID:|,ArrayTaskID:|,Name:|,State:|,Reason:|,RestartCnt:|"


def queued_jobs(names: Iterable[str], env: Mapping[str, str] | None = None) -> list[SlurmJob]:
    """This user's jobs in the queue with one of `names`; an array's tasks one by one, each
    named ARRAYJOB_TASK as sbatch --dependency and scontrol take it."""
    names = sorted(set(names))
    if not names:
        return []
    out = _run(
        ["squeue", "--me", "-h", "-r", "-O", _SQUEUE_FORMAT, f"--name={','.join(names)}"], env
    )
    if out.returncode != 0:
        raise SlurmError(f"squeue failed: {_why(out.stderr) or out.returncode}")
    jobs = []
    for line in out.stdout.splitlines():
        parts = [p.strip() for p in line.split("|")]
        if len(parts) < 6 or not parts[0]:
            continue
        array_job, task, name, state, reason, restarts = parts[:6]
        index = int(task) if task.isdigit() else None
        job_id = array_job if index is None else f"{array_job}_{index}"
        jobs.append(SlurmJob(job_id, name, state, reason, int(restarts or 0), "", index))
    return jobs


def _sacct(ids: list[str], env: Mapping[str, str] | None) -> dict[str, SlurmJob] | None:
    """None when the cluster keeps no accounting (sacct refuses)."""
    if shutil.which("sacct", path=(env or os.environ).get("PATH")) is None:
        return None
    out = _run(
        ["sacct", "-X", "-n", "-P", "-j", ",".join(ids), "-o", "JobID,JobName,State,ExitCode"], env
    )
    if out.returncode != 0 or "disabled" in out.stderr:
        return None
    found = {}
    for line in out.stdout.splitlines():
        parts = line.split("|")
        if len(parts) == 4 and parts[0] in ids:
            # "CANCELLED by 1000": the state is the first word
            found[parts[0]] = SlurmJob(parts[0], parts[1], parts[2].split()[0], "", 0, parts[3])
    return found


def _scontrol(job_id: str, env: Mapping[str, str] | None) -> SlurmJob | None:
    out = _run(["scontrol", "-o", "show", "job", job_id], env)
    if out.returncode != 0:  # "Invalid job id specified": slurmctld has forgotten it
        return None
    fields = dict(re.findall(r"(\w+)=(\S*)", out.stdout))
    return SlurmJob(
        job_id,
        fields.get("JobName", ""),
        fields.get("JobState", "UNKNOWN"),
        fields.get("Reason", "").replace("_", " "),  # -o writes its spaces as _
        int(fields.get("Restarts", "0") or 0),
        fields.get("ExitCode", ""),
    )


def finished_jobs(ids: Iterable[str], env: Mapping[str, str] | None = None) -> dict[str, SlurmJob]:
    """How the jobs `ids` ended (or stand), where Slurm still knows them."""
    ids = sorted(set(ids), key=lambda i: (len(i), i))
    if not ids:
        return {}
    found = _sacct(ids, env)
    if found is None:
        found = {}
        for job_id in ids:
            job = _scontrol(job_id, env)
            if job is not None:
                found[job_id] = job
    return found


def sbatch(args: list[str], cwd: Path, env: Mapping[str, str] | None = None) -> str:
    """`sbatch --parsable ARGS` from `cwd` (the repository root: job scripts use relative
    paths); returns the job id."""
    out = _run(["sbatch", "--parsable", *args], env, cwd)
    if out.returncode != 0:
        raise SlurmError(f"sbatch {' '.join(args)}: {_why(out.stderr) or out.returncode}")
    return out.stdout.strip().split(";")[0]
