"""Learning-rate schedule: linear warmup, then cosine (or linear, or constant) to a floor.

Steps count optimizer updates from 1: update `s` uses `lr_at(s)`. Warmup rises linearly
to the peak at s = warmup (so the first update already has a non-zero rate); decay then
reaches `min_lr_ratio * lr` exactly at s = train_iters:

    s <= W:  lr * s / W
    s >  W:  p = (s - W) / (N - W)
             cosine:   min + (lr - min) * (1 + cos(pi * p)) / 2
             linear:   min + (lr - min) * (1 - p)
             constant: lr

The paper (GPT-NeoX): warmup 5% of 12,000 iterations, cosine from 4e-4 to 4e-5.
"""

from __future__ import annotations

import math

import torch

from pretrain.config import ScheduleConfig


def warmup_steps(schedule: ScheduleConfig, train_iters: int) -> int:
    """`schedule.warmup_steps` when set, else round(warmup_fraction * train_iters).

    The ranges are checked once, with the rest of the config (pretrain/train/config.py)."""
    if schedule.warmup_steps is not None:
        return schedule.warmup_steps
    return round((schedule.warmup_fraction or 0.0) * train_iters)


def lr_at(step: int, lr: float, schedule: ScheduleConfig, train_iters: int) -> float:
    """Learning rate of optimizer update `step` (1-based)."""
    return _lr(
        step,
        lr,
        schedule.kind,
        warmup_steps(schedule, train_iters),
        schedule.min_lr_ratio,
        train_iters,
    )


def _lr(step: int, lr: float, kind: str, w: int, min_ratio: float, n: int) -> float:
    if w > 0 and step <= w:
        return lr * step / w
    if kind == "constant":
        return lr
    floor = min_ratio * lr
    p = min(1.0, (step - w) / max(1, n - w))
    if kind == "linear":
        return floor + (lr - floor) * (1.0 - p)
    return floor + (lr - floor) * 0.5 * (1.0 + math.cos(math.pi * p))  # cosine


class _Factor:
    """Multiplier for LambdaLR. A callable object, holding plain numbers only, so that
    LambdaLR's state_dict (saved in checkpoints) records it and torch.load can read it."""

    def __init__(self, lr: float, schedule: ScheduleConfig, train_iters: int):
        self.lr, self.kind, self.min_ratio = lr, schedule.kind, schedule.min_lr_ratio
        self.warmup, self.train_iters = warmup_steps(schedule, train_iters), train_iters

    def __call__(self, k: int) -> float:
        # LambdaLR calls with the number of scheduler steps taken so far (0 before the first
        # update), and DeepSpeed steps the scheduler after each update: update k+1 uses k.
        return (
            _lr(k + 1, self.lr, self.kind, self.warmup, self.min_ratio, self.train_iters) / self.lr
        )


def make_scheduler(
    optimizer: torch.optim.Optimizer, lr: float, schedule: ScheduleConfig, train_iters: int
) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, _Factor(lr, schedule, train_iters))
