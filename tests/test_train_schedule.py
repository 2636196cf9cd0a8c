"""The learning-rate schedule equals its formula, alone and through DeepSpeed's engine."""

from __future__ import annotations

import math

import pytest
import torch

from pretrain.config import ConfigError, ScheduleConfig
from pretrain.train.schedule import lr_at, make_scheduler, warmup_steps

PEAK, N = 4e-4, 12_000  # the paper: 4e-4, 5% warmup, cosine to 4e-5 over 12,000 iterations


def paper() -> ScheduleConfig:
    return ScheduleConfig(kind="cosine", warmup_fraction=0.05, min_lr_ratio=0.1)


def test_paper_schedule_warmup_mid_and_end():
    s = paper()
    assert warmup_steps(s, N) == 600
    assert lr_at(1, PEAK, s, N) == pytest.approx(PEAK / 600, rel=1e-12)
    assert lr_at(300, PEAK, s, N) == pytest.approx(PEAK / 2, rel=1e-12)
    assert lr_at(600, PEAK, s, N) == pytest.approx(PEAK, rel=1e-12)  # warmup end: the peak
    mid = 600 + (N - 600) // 2  # halfway through the cosine: (peak + floor) / 2
    assert lr_at(mid, PEAK, s, N) == pytest.approx((4e-4 + 4e-5) / 2, rel=1e-12)
    quarter = 600 + (N - 600) // 4
    expected = 4e-5 + (4e-4 - 4e-5) * 0.5 * (1 + math.cos(math.pi / 4))
    assert lr_at(quarter, PEAK, s, N) == pytest.approx(expected, rel=1e-12)
    assert lr_at(N, PEAK, s, N) == pytest.approx(4e-5, rel=1e-12)  # end: 10% of the peak


def test_linear_and_constant():
    lin = ScheduleConfig(kind="linear", warmup_steps=10, warmup_fraction=None, min_lr_ratio=0.0)
    assert lr_at(10, 1.0, lin, 110) == pytest.approx(1.0)
    assert lr_at(60, 1.0, lin, 110) == pytest.approx(0.5)
    assert lr_at(110, 1.0, lin, 110) == pytest.approx(0.0)
    const = ScheduleConfig(kind="constant", warmup_steps=4, warmup_fraction=None)
    assert [lr_at(s, 2.0, const, 100) for s in (1, 4, 50, 100)] == [0.5, 2.0, 2.0, 2.0]


def test_scheduler_drives_the_optimizer_step_by_step():
    """LambdaLR as DeepSpeed steps it (once per update): update s runs at lr_at(s)."""
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.AdamW([p], lr=PEAK)
    s = ScheduleConfig(kind="cosine", warmup_steps=3, warmup_fraction=None, min_lr_ratio=0.1)
    sched = make_scheduler(opt, PEAK, s, 20)
    for step in range(1, 21):
        assert opt.param_groups[0]["lr"] == pytest.approx(lr_at(step, PEAK, s, 20), rel=1e-12)
        opt.step()
        sched.step()
    state = sched.state_dict()  # what a checkpoint stores: plain numbers only
    restored = make_scheduler(torch.optim.AdamW([p], lr=PEAK), PEAK, s, 20)
    restored.load_state_dict(state)
    assert restored.last_epoch == 20


def test_bad_schedule_names_the_key():
    """The schedule trusts the config (pretrain/train/config.py), which refuses these."""
    from pretrain.config import Config, TrainConfig

    def check(schedule: dict) -> None:
        Config(
            train=TrainConfig(train_iters=10, global_batch_size=4, micro_batch_size=4),
            schedule=ScheduleConfig(**schedule),
        )

    with pytest.raises(ConfigError, match="schedule.warmup_steps=50"):
        check(dict(warmup_steps=50, warmup_fraction=None))
    with pytest.raises(ConfigError, match="schedule.warmup_fraction=1.5"):
        check(dict(warmup_fraction=1.5))
    with pytest.raises(ConfigError, match="schedule.min_lr_ratio=2"):
        check(dict(min_lr_ratio=2.0))
    check(dict(warmup_steps=10, warmup_fraction=None))  # the edge is allowed
