"""Rank and world size from whichever launcher started us, and the process group.

Launchers set different variables: `deepspeed` and `torchrun` set RANK, LOCAL_RANK,
WORLD_SIZE, MASTER_ADDR and MASTER_PORT; `srun python ...` sets only SLURM_PROCID,
SLURM_LOCALID and SLURM_NTASKS; plain `python` sets nothing. `setup_env` maps all of them
to the torch.distributed variables so that DeepSpeed never falls back to MPI discovery.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
from dataclasses import dataclass

import torch

from pretrain.config import ConfigError
from pretrain.train.deepspeed_adapter import init_distributed


@dataclass(frozen=True)
class DistEnv:
    rank: int
    local_rank: int
    world_size: int
    launcher: str  # "torch" (deepspeed/torchrun), "slurm" or "single"

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def first_host(nodelist: str) -> str:
    """First host of a Slurm node list: "gpu[007-009,012],cpu1" -> "gpu007"."""
    m = re.match(r"([^,\[]+)(?:\[([^\],\-]+))?", nodelist.strip())
    if not m:
        raise ConfigError(f"cannot read the Slurm node list {nodelist!r}; export MASTER_ADDR")
    return m.group(1) + (m.group(2) or "")


def _slurm_master_addr(env) -> str | None:
    """First host of the job (`scontrol show hostnames`, else parsed from the node list)."""
    nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST")
    if not nodelist:
        return None
    try:
        out = subprocess.run(
            ["scontrol", "show", "hostnames", nodelist],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        ).stdout.split()
        if out:
            return out[0]
    except (OSError, subprocess.SubprocessError):
        pass
    return first_host(nodelist)


def slurm_master_port(job_id: int) -> int:
    """A job's rendezvous port: 10000 + job id mod 20000, the same on every task, different
    for neighbouring jobs, and below Linux's ephemeral range (32768-60999 by default). Inside
    that range another process's connection, or gloo's own listening sockets, can already
    hold the port: the job's store then fails with EADDRINUSE and the other ranks wait for
    it until the rendezvous timeout (seen with 20000 + id mod 20000 on the test cluster).
    slurm/launch.sh computes the same number."""
    return 10000 + job_id % 20000


def setup_env(environ: dict[str, str] | None = None) -> DistEnv:
    """Fill RANK/LOCAL_RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT in `environ` (os.environ).

    Variables a launcher already set win. Under Slurm without them, SLURM_PROCID ->
    RANK, SLURM_LOCALID -> LOCAL_RANK, SLURM_NTASKS -> WORLD_SIZE; MASTER_ADDR defaults to
    the first node of the job and MASTER_PORT to `slurm_master_port(SLURM_JOB_ID)`, as
    slurm/launch.sh does. One process alone gets a free local port.
    """
    env = os.environ if environ is None else environ
    if "RANK" in env and "WORLD_SIZE" in env:
        launcher = "torch"
        env.setdefault("LOCAL_RANK", env["RANK"])
    elif "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        launcher = "slurm"
        env["RANK"] = env["SLURM_PROCID"]
        env["WORLD_SIZE"] = env["SLURM_NTASKS"]
        env["LOCAL_RANK"] = env.get("SLURM_LOCALID", "0")
        if "MASTER_ADDR" not in env:
            addr = _slurm_master_addr(env)
            if addr is None and int(env["WORLD_SIZE"]) > 1:
                raise ConfigError(
                    "MASTER_ADDR is not set and the Slurm node list could not be "
                    "read; export MASTER_ADDR=<first node> in the sbatch script"
                )
            env["MASTER_ADDR"] = addr or "127.0.0.1"
        env.setdefault("MASTER_PORT", str(slurm_master_port(int(env.get("SLURM_JOB_ID", "0")))))
    else:
        launcher = "single"
        env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"] = "0", "1", "0"
    if env["WORLD_SIZE"] == "1":
        env.setdefault("MASTER_ADDR", "127.0.0.1")
        env.setdefault("MASTER_PORT", str(_free_port()))
    missing = [k for k in ("MASTER_ADDR", "MASTER_PORT") if k not in env]
    if missing:
        raise ConfigError(
            f"{', '.join(missing)} not set for a {env['WORLD_SIZE']}-process run; "
            f"the launcher (deepspeed, torchrun, or the sbatch script) must set it"
        )
    return DistEnv(int(env["RANK"]), int(env["LOCAL_RANK"]), int(env["WORLD_SIZE"]), launcher)


def device_for(env: DistEnv) -> torch.device:
    if torch.cuda.is_available():
        torch.cuda.set_device(env.local_rank)
        return torch.device("cuda", env.local_rank)
    return torch.device("cpu")


def init_process_group(device: torch.device) -> None:
    """deepspeed.init_distributed with the right backend (NCCL on GPU, gloo on CPU)."""
    init_distributed(device.type)


def all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        torch.distributed.all_reduce(t)
    return t


def all_reduce_named(values: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Sums over the ranks of named scalars of one dtype, in one collective (stacked, reduced,
    handed back by name: no caller indexes a positional vector)."""
    summed = all_reduce_sum(torch.stack([v.reshape(()) for v in values.values()]))
    return dict(zip(values, summed.unbind(), strict=True))


def gather_hostnames(world_size: int) -> list[str]:
    """Every rank's host name, on every rank (one all_gather_object at set-up, never per
    step): the straggler line names the machine."""
    name = socket.gethostname()
    if world_size == 1 or not torch.distributed.is_initialized():
        return [name]
    names: list[str] = [""] * world_size
    torch.distributed.all_gather_object(names, name)
    return names


def shutdown() -> None:
    """Destroy the process group at the end of a run, every rank alike, so that its threads
    are joined before the interpreter's teardown (left to the exit, a gloo rank was once
    aborted there: "terminate called without an active exception")."""
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def barrier() -> None:
    if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        torch.distributed.barrier()
