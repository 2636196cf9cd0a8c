"""The Slurm layout of a study's runs: the #SBATCH header of a job script or a job array."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import ConfigDict, Field, model_validator

from pretrain.schema import Bool, ConfigError, Hint, Int, Section
from pretrain.slurm_limits import time_limit_s

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
    time: Annotated[str, Hint("MM, HH:MM:SS or D-HH:MM:SS")] = Field(
        "24:00:00", pattern=r"^(\d+-)?\d+(:\d+){0,2}$"
    )
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

    @model_validator(mode="before")
    @classmethod
    def _no_cluster_options(cls, data: Any) -> Any:
        for k in ("partition", "account", "qos"):
            if isinstance(data, dict) and k in data:
                raise ConfigError(
                    f"slurm.{k}: cluster options stay out of the study; give it at submit time: "
                    f"SBATCH_{k.upper()} in the environment (docs/slurm.md)"
                )
        return data

    @property
    def ranks(self) -> int:
        """Processes of the layout, the data-parallel world size: one per GPU (or
        ntasks_per_node on CPU nodes)."""
        return self.nodes * self.tasks_per_node

    @property
    def tasks_per_node(self) -> int:
        return self.ntasks_per_node or self.gpus_per_node or 1

    @model_validator(mode="after")
    def _margin_within_time(self) -> Slurm:
        if self.signal_margin_s >= time_limit_s(self.time):
            raise ConfigError(
                f"slurm.signal_margin_s={self.signal_margin_s} is not below slurm.time="
                f"{self.time}: the job would be told to stop as it starts; lengthen time or "
                f"shorten signal_margin_s"
            )
        return self

    def lines(self, job_name: str, array: str | None = None) -> list[str]:
        """The #SBATCH lines; `array`: a job array's index range (`0-53%8`)."""
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


class StudySlurm(Slurm):
    """A study's `slurm:`: the header of its runs' job scripts, and how they are submitted."""

    array: Bool = False
    """One Slurm job array for the study's runs instead of a script per run."""
    max_running: Int | None = Field(None, ge=1)
    """With array: at most N of the study's runs at once (%N)."""
