"""One path for a step's values (pretrain/train/metrics.py) and evaluators as components
(pretrain/train/evaluators/): every step published once, in order, as a frozen host record;
evaluators on their own schedule, in the watchdog's slow phase, outside tokens/s, written by
the one writer, and leaving training bit-identical."""

from __future__ import annotations

import dataclasses
import json
import os
import time

import pytest
import torch
from train_support import stdlib_data, tiny_config

from pretrain.config import Config, ConfigError, from_dict
from pretrain.train import watchdog
from pretrain.train.callbacks import Callback, build_callbacks, callback_class
from pretrain.train.evaluators import Evaluator
from pretrain.train.metrics import StepMetrics, StepRecord
from pretrain.train.module import settle
from pretrain.train.spikes import StepGuard, Unjudged
from pretrain.train.trainer import Trainer


@pytest.fixture
def isolated_env(monkeypatch):
    keep = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    monkeypatch.setattr(os, "environ", {k: v for k, v in os.environ.items() if k not in keep})


def _record(step: int, log: bool = False) -> StepRecord:
    return StepRecord(step=step, lr=0.1, tokens=8, stopping=False, first_input=None, log=log)


def test_step_metrics_read_once_judge_in_order_and_publish_each_step_once():
    """Three steps recorded by name; a read mid-way (a save) brings steps 1-2 to the host and
    judges nothing by itself; the guard judges what it is handed; the flush publishes all
    three in order, frozen, with the values as recorded; a second flush publishes nothing."""
    from pretrain.config import SpikesConfig

    guard = StepGuard(SpikesConfig(window=8))
    metrics = StepMetrics()
    for step in (1, 2, 3):
        values = {
            "train/loss": torch.tensor(float(step), dtype=torch.float64),
            "train/grad_norm": torch.tensor(10.0 + step),
            "train/z_loss": torch.tensor(0.5, dtype=torch.float64),
            "progress/batch_token_sum": torch.tensor(100.0 * step, dtype=torch.float64),
            "my/metric": torch.tensor(7.0 * step),  # a metric more: one name, no other edit
        }
        judged = Unjudged(step, step, values["train/loss"], values["train/grad_norm"], False)
        metrics.record(_record(step, log=step == 3), values, judged)
        if step == 2:
            read = metrics.read()  # what a save does
            assert [p.host["train/loss"] for p in read] == [1.0, 2.0]
            assert list(guard.loss.history) == [] and metrics.unsettled == [1, 2]  # no judging
            settle(read, guard)  # the guard judges the host values handed to it
            assert list(guard.loss.history) == [1.0, 2.0] and metrics.pending == 2
    with pytest.raises(RuntimeError, match=r"steps \[3\] published before the guard judged"):
        metrics.flush()
    settle(metrics.read(), guard)
    assert metrics.read() == []  # each step read once
    outs = metrics.flush()
    assert [o.step for o in outs] == [1, 2, 3] and list(guard.loss.history) == [1.0, 2.0, 3.0]
    assert [o.scalars["train/loss"] for o in outs] == [1.0, 2.0, 3.0]
    assert [o.scalars["train/grad_norm"] for o in outs] == [11.0, 12.0, 13.0]
    assert [o.verdict.step for o in outs] == [1, 2, 3]
    assert outs[2].scalars["progress/batch_token_sum"] == 300.0
    assert outs[2].scalars["train/z_loss"] == 0.5 and outs[2].scalars["train/lr"] == 0.1
    assert outs[2].scalars["my/metric"] == 21.0
    assert outs[2].scalars["spikes/skipped_steps"] == 0.0  # a logging step shows the count
    assert "spikes/skipped_steps" not in outs[1].scalars
    # The order metrics.jsonl has always had: the record's, then the step's device values.
    assert list(outs[2].scalars)[:6] == [
        "train/lr",
        "train/loss",
        "train/grad_norm",
        "train/z_loss",
        "progress/batch_token_sum",
        "my/metric",
    ]
    with pytest.raises(dataclasses.FrozenInstanceError):
        outs[0].step = 0
    with pytest.raises(TypeError):
        outs[0].scalars["train/loss"] = 0.0
    assert metrics.flush() == [] and metrics.pending == 0


class Recorder(Callback):
    """Every on_step_end and on_values, in the order they came."""

    def __init__(self) -> None:
        self.events: list[tuple] = []

    def on_step_end(self, trainer, record) -> None:
        self.events.append(("end", record.step))

    def on_values(self, trainer, outs) -> None:
        self.events.append(("values", [o.step for o in outs]))

    def on_save(self, trainer, folder) -> None:
        self.events.append(("save", trainer.step))


class Clock:
    """time.perf_counter plus an offset an evaluator moves: a slow evaluation without the wait."""

    offset = 0.0

    def __init__(self, monkeypatch) -> None:
        real = time.perf_counter
        monkeypatch.setattr(time, "perf_counter", lambda: real() + Clock.offset)


class SlowProbe(Evaluator):
    """Due every 3 steps; notes the watchdog's phase while it runs and 'takes' 1000 s."""

    phases: list[str | None] = []

    def __init__(self, interval: int = 3) -> None:
        self.interval = interval

    def due(self, step: int, last: bool, stopping: bool) -> bool:
        return step % self.interval == 0

    def run(self, trainer, record) -> dict[str, float]:
        SlowProbe.phases.append(watchdog.current_phase())
        Clock.offset += 1000.0
        return {"probe/value": float(record.step)}


def test_one_flush_per_log_interval_and_before_saves_evaluators_in_their_phase(
    tmp_path, tmp_path_factory, isolated_env, monkeypatch
):
    """8 steps, log every 4, checkpoint every 3 (and the last), validation every 4 and a
    probe evaluator every 3: each step's on_values comes once, after its on_step_end, in
    order, flushed at steps 3 (save), 4 (log, evaluation), 6 (save), 8 (the end); saves after
    their step's values are published; the probe ran in the slow phase "an evaluation", the
    saves in "a checkpoint"; its 1000 s are out of perf/step_time_s and tokens/s; its scalar
    and valid/* are written with the step that ran them."""
    Clock(monkeypatch)
    Clock.offset, SlowProbe.phases = 0.0, []
    raw = tiny_config(
        tmp_path / "run",
        stdlib_data(tmp_path_factory),
        logging={"log_interval": 4, "max_logit_interval": 0, "tensorboard": False},
        checkpoint={"interval": 3},
    )
    raw["callbacks"] = [{"class": "test_train_metrics_path.SlowProbe", "interval": 3}]
    cfg = from_dict(Config, raw)
    recorder = Recorder()
    save_phases = []

    class SavePhase(Callback):
        def on_train_start(self, trainer) -> None:
            original = trainer.run.checkpointer.save

            def save(*args, **kwargs):
                save_phases.append(watchdog.current_phase())
                return original(*args, **kwargs)

            object.__setattr__(trainer.run.checkpointer, "save", save)

    trainer = Trainer(cfg, callbacks=[SavePhase(), recorder, *build_callbacks(cfg)])
    assert trainer.fit() == 0
    assert [type(e).__name__ for e in trainer.evaluators] == ["Validation", "SlowProbe"]
    assert recorder.events == [
        ("end", 1),
        ("end", 2),
        ("end", 3),
        ("values", [1, 2, 3]),
        ("save", 3),
        ("end", 4),
        ("values", [4]),
        ("end", 5),
        ("end", 6),
        ("values", [5, 6]),
        ("save", 6),
        ("end", 7),
        ("end", 8),
        ("values", [7, 8]),
        ("save", 8),
    ]
    assert SlowProbe.phases == ["an evaluation"] * 2 and watchdog.current_phase() is None
    assert save_phases == ["a checkpoint"] * 3
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
    assert [r["step"] for r in rows] == list(range(1, 9))
    by = {r["step"]: r for r in rows}
    assert by[3]["probe/value"] == 3.0 and by[6]["probe/value"] == 6.0
    assert "valid/loss" in by[4] and "valid/loss" in by[8] and "valid/loss" not in by[6]
    # 2000 s of evaluation in the log window of steps 5-8: a step time or a rate that
    # counted it would show 500 s a step.
    assert by[8]["perf/step_time_s"] < 100 and by[8]["perf/tokens_per_s"] > 4 * 256 / 100


def test_an_evaluator_leaves_training_bit_identical(tmp_path, tmp_path_factory, isolated_env):
    """Loss by position every 2 steps (the model to eval mode and back, the validation
    batches read): with dropout 0.1, so that a random number drawn or a mode left behind
    would show, the training losses and gradient norms equal a run without it, bit for bit."""

    def losses(name: str, callbacks: list) -> list[tuple[float, float]]:
        raw = tiny_config(
            tmp_path / name,
            stdlib_data(tmp_path_factory),
            train={"train_iters": 6, "eval_interval": 1000},
            model={"dropout": 0.1},
            logging={"log_interval": 1, "max_logit_interval": 0, "tensorboard": False},
        )
        raw["callbacks"] = callbacks
        assert Trainer(from_dict(Config, raw), save_checkpoints=False).fit() == 0
        rows = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").open()]
        return [(r["train/loss"], r["train/grad_norm"]) for r in rows]

    plain = losses("plain", [])
    probed = losses(
        "probed", [{"class": "pretrain.train.evaluators.PositionEvaluation", "interval": 2}]
    )
    assert len(plain) == 6 and plain == probed


def test_a_callbacks_entry_must_name_a_callback_or_an_evaluator():
    with pytest.raises(ConfigError, match=r"callbacks\[0\]\.class='pretrain\.config\.Config'"):
        callback_class({"class": "pretrain.config.Config"})
    assert callback_class({"class": "pretrain.train.evaluators.PositionEvaluation"})
    with pytest.raises(ConfigError, match="interval=0 must be a positive step count"):
        from pretrain.train.evaluators import PositionEvaluation

        PositionEvaluation(0)
