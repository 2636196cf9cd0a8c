"""The variables a launcher (torchrun, srun, DeepSpeed's) sets for one process of a job.

pretrain/train/distributed.py reads them to find the rank and world size; a process that
starts its own, separate run (a study's local executor, a test's child) must not inherit
them, or the child would join the parent's job. A base module, so that the study's executor
can clean an environment without importing training.
"""

from __future__ import annotations

LAUNCH_VARS = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "SLURM_PROCID",
    "SLURM_LOCALID",
    "SLURM_NTASKS",
    "GROUP_RANK",
    "ROLE_RANK",
)
