"""The Slurm layout of a study's runs: the #SBATCH header of a job script or a job array."""

from __future__ import annotations

from typing import Any

from pydantic import ConfigDict, Field

from pretrain.schema import Bool, ConfigError, Int, Section, from_dict
from pretrain.slurm_limits import time_limit_hours, time_limit_s
from pretrain.study.file import Where

# The header's log path when nothing else is asked for; a job array's tasks get their own log
# each (%A: the array's job id, %a: the task), which this default cannot tell apart by name.
DEFAULT_OUTPUT = "slurm/logs/%x-%j.out"
ARRAY_OUTPUT = "slurm/logs/%x-%A_%a.out"


class Slurm(Section):
    """The #SBATCH header of a job script. Cluster-specific options (partition, account,
    QoS) are left out on purpose: give them with SBATCH_PARTITION / SBATCH_ACCOUNT in the
    environment or on the sbatch command line (docs/slurm.md)."""

    model_config = ConfigDict(frozen=True)
    key = "slurm"

    nodes: Int = Field(4, ge=1)
    """Nodes per job."""
    gpus_per_node: Int = Field(8, ge=0)
    """GPUs per node; 0: CPU nodes (gloo), tasks per node then from ntasks_per_node."""
    ntasks_per_node: Int | None = Field(None, ge=1)
    """Processes per node; null: one per GPU."""
    cpus_per_task: Int | None = 8
    """Cores per process (data loader workers need them; many sites bind tasks)."""
    time: str = "24:00:00"
    """Time limit per job; a longer run requeues itself and resumes. A planned run takes its planned hours."""
    signal_margin_s: Int = 600
    """USR1 to the batch shell this long before the time limit (a checkpoint, then requeue)."""
    exclusive: Bool = True
    """Whole nodes (--exclusive)."""
    mem: str | None = "0"
    """Memory per node; "0": all of it."""
    output: str = DEFAULT_OUTPUT
    """The job's log, relative to the submit folder (the repo root)."""
    extra: tuple[str, ...] = ()
    """Further `--opt=value` lines, e.g. for a test cluster."""

    @property
    def ranks(self) -> int:
        """Processes of the layout, the data-parallel world size: one per GPU (or
        ntasks_per_node on CPU nodes)."""
        return self.nodes * self.tasks_per_node

    @property
    def tasks_per_node(self) -> int:
        return self.ntasks_per_node or self.gpus_per_node or 1

    def check(self) -> None:
        if self.signal_margin_s >= time_limit_s(self.time):
            raise ValueError(
                f"Slurm signal_margin_s={self.signal_margin_s} is not below the time limit "
                f"{self.time}: the job would be told to stop as it starts"
            )

    def lines(self, job_name: str, array: str | None = None) -> list[str]:
        """The #SBATCH lines; `array`: a job array's index range (`0-53%8`)."""
        self.check()
        output = (
            ARRAY_OUTPUT if array is not None and self.output == DEFAULT_OUTPUT else self.output
        )
        opts = [
            f"--job-name={job_name}",
            array is not None and f"--array={array}",
            f"--nodes={self.nodes}",
            f"--ntasks-per-node={self.tasks_per_node}",
            bool(self.gpus_per_node) and f"--gpus-per-node={self.gpus_per_node}",
            bool(self.cpus_per_task) and f"--cpus-per-task={self.cpus_per_task}",
            self.exclusive and "--exclusive",
            self.mem is not None and f"--mem={self.mem}",
            f"--time={self.time}",
            "--requeue",  # launch.sh requeues after a pre-emption checkpoint
            f"--signal=B:USR1@{self.signal_margin_s}",  # to the batch shell: launch.sh forwards it
            "--open-mode=append",  # a requeued job appends to the same log
            f"--output={output}",
            *self.extra,
        ]
        return [f"#SBATCH {o}" for o in opts if o]


def slurm_options(w: Where, spec: Any) -> tuple[dict[str, Any] | None, bool, int | None]:
    """A study's `slurm:` -> (the header's fields, array, max_running); the header must hold
    on its own (a grid's `slurm:` changes it per run)."""
    if spec is None:
        return None, False, None
    if not isinstance(spec, dict):
        raise w.error("slurm", f"{spec!r} is not a mapping", "e.g. {nodes: 4, gpus_per_node: 8}")
    spec = dict(spec)
    array = spec.pop("array", False)
    max_running = spec.pop("max_running", None)
    if not isinstance(array, bool):
        raise w.error("slurm array", f"{array!r}", "write true or false")
    if max_running is not None and (not isinstance(max_running, int) or max_running < 1):
        raise w.error("slurm max_running", f"{max_running!r}", "give a positive integer (%N)")
    parse_slurm(w, spec, "slurm")
    return spec, array, max_running


def parse_slurm(w: Where, spec: dict[str, Any], where: str) -> Slurm:
    """A Slurm header from a study's fields; cluster options refused (they are the site's)."""
    for k in ("partition", "account", "qos"):
        if k in spec:
            raise w.error(
                f"{where} {k}",
                "cluster options stay out of the study",
                f"give it at submit time: SBATCH_{k.upper()} in the environment (docs/slurm.md)",
            )
    try:
        slurm = from_dict(Slurm, spec, "slurm")
        slurm.check()
    except ConfigError as e:
        raise w.error(where, str(e), "fix the Slurm layout (docs/slurm.md)") from None
    except ValueError as e:
        raise w.error(where, str(e), "lengthen time or shorten signal_margin_s") from None
    return slurm


def planned_slurm(
    w: Where, slurm: Slurm, row: dict[str, Any] | None, gpu: str, where: str
) -> Slurm:
    """A run's header with its planned time limit (a plan file's row); a run the plan says
    does not fit the study's GPU is refused."""
    if row is None:  # not planned yet: the layout's own time limit
        return slurm
    if not row.get(f"fits_{gpu}", True):
        raise w.error(
            where,
            f"the plan file says it does not fit an {gpu.upper()} ({row['train_peak_gib']} GiB per GPU)",
            "change its micro batch or recompute, then re-plan: pretrain-plan --paper --write",
        )
    hours = time_limit_hours(row["run_hours"] * row["executed_flops"] / row["model_flops"])
    return slurm.replace(time=f"{hours}:00:00")


__all__ = ["Slurm", "parse_slurm", "planned_slurm", "slurm_options", "time_limit_s"]
