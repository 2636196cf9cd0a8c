"""What a run's set-up builds, once: the frozen context the loop and the callbacks read."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pretrain.data.pipeline import DataSource
from pretrain.train.checkpoint import Checkpointer
from pretrain.train.distributed import DistEnv
from pretrain.train.module import TrainModule


@dataclass(frozen=True)
class RunContext:
    env: DistEnv  # rank, world size, local rank
    device: torch.device
    grad_accum: int  # micro batches per optimizer step on each rank
    tokens_per_step: int  # over all ranks
    data: DataSource
    eval_enabled: bool  # validation data and train.eval_interval/eval_iters ask for it
    text_units: dict[str, float]  # bytes (and characters) per validation token, on rank 0
    module: TrainModule  # the engine, forward/backward, optimizer step, spike guard
    checkpointer: Checkpointer


__all__ = ["RunContext"]
