"""The Slurm layout of a study's runs: the #SBATCH header of a job script or a job array."""

from __future__ import annotations

from dataclasses import dataclass

# The header's log path when nothing else is asked for; a job array's tasks get their own log
# each (%A: the array's job id, %a: the task), which this default cannot tell apart by name.
DEFAULT_OUTPUT = "slurm/logs/%x-%j.out"
ARRAY_OUTPUT = "slurm/logs/%x-%A_%a.out"


def time_limit_s(text: str) -> int:
    """Seconds of a Slurm time limit: MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM or D-HH:MM:SS."""
    days, _, clock = text.rpartition("-")
    parts = [int(p) for p in clock.split(":")]
    if days:  # after "D-" the clock starts with hours
        h, m, s = (parts + [0, 0])[:3]
        return int(days) * 86400 + h * 3600 + m * 60 + s
    if len(parts) == 1:
        return parts[0] * 60
    return sum(p * 60**i for i, p in enumerate(reversed(parts)))


@dataclass(frozen=True)
class Slurm:
    """The #SBATCH header of a job script. Cluster-specific options (partition, account,
    QoS) are left out on purpose: give them with SBATCH_PARTITION / SBATCH_ACCOUNT in the
    environment or on the sbatch command line (docs/slurm.md)."""

    nodes: int = 4
    gpus_per_node: int = 8  # 0: CPU nodes (gloo); tasks per node then come from ntasks_per_node
    ntasks_per_node: int | None = None  # None: one task per GPU
    cpus_per_task: int | None = 8  # data loader workers need cores; many sites bind tasks
    time: str = "24:00:00"  # per job; a longer run requeues itself and resumes
    signal_margin_s: int = 600  # USR1 to the batch shell this long before the time limit
    exclusive: bool = True
    mem: str | None = "0"  # 0: all of each node's memory
    output: str = DEFAULT_OUTPUT  # relative to the submit folder (the repo root)
    extra: tuple[str, ...] = ()  # further `--opt=value` lines, e.g. for a test cluster

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
        opts = [f"--job-name={job_name}"]
        if array is not None:
            opts.append(f"--array={array}")
        opts += [f"--nodes={self.nodes}", f"--ntasks-per-node={self.tasks_per_node}"]
        if self.gpus_per_node:
            opts.append(f"--gpus-per-node={self.gpus_per_node}")
        if self.cpus_per_task:
            opts.append(f"--cpus-per-task={self.cpus_per_task}")
        if self.exclusive:
            opts.append("--exclusive")
        if self.mem is not None:
            opts.append(f"--mem={self.mem}")
        output = (
            ARRAY_OUTPUT if array is not None and self.output == DEFAULT_OUTPUT else self.output
        )
        opts += [
            f"--time={self.time}",
            "--requeue",  # launch.sh requeues after a pre-emption checkpoint
            f"--signal=B:USR1@{self.signal_margin_s}",  # to the batch shell: launch.sh forwards it
            "--open-mode=append",  # a requeued job appends to the same log
            f"--output={output}",
            *self.extra,
        ]
        return [f"#SBATCH {o}" for o in opts]


__all__ = ["ARRAY_OUTPUT", "DEFAULT_OUTPUT", "Slurm", "time_limit_s"]
