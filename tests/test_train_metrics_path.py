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
        metrics.open(step)
        metrics.record("train/loss", torch.tensor(float(step), dtype=torch.float64))
        metrics.record("train/z_loss", 0.5)
        metrics.record("progress/batch_token_sum", torch.tensor(100.0 * step), "sum")
        metrics.record("my/metric", torch.tensor(7.0 * step))  # a metric more: one call
        metrics.record("train/grad_norm", torch.tensor(10.0 + step), "max")
        metrics.close(_record(step, log=step == 3), Unjudged(step, step, False))
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
    assert list(guard.grad_norm.history) == [11.0, 12.0, 13.0]
    assert [o.verdict.step for o in outs] == [1, 2, 3]
    assert outs[2].scalars["progress/batch_token_sum"] == 300.0
    assert outs[2].scalars["train/z_loss"] == 0.5 and outs[2].scalars["train/lr"] == 0.1
    assert outs[2].scalars["my/metric"] == 21.0
    assert outs[2].scalars["spikes/skipped_steps"] == 0.0  # a logging step shows the count
    assert "spikes/skipped_steps" not in outs[1].scalars
    # The record's scalars, then the step's values in the order they were first recorded.
    assert list(outs[2].scalars)[:6] == [
        "train/lr",
        "train/loss",
        "train/z_loss",
        "progress/batch_token_sum",
        "my/metric",
        "train/grad_norm",
    ]
    with pytest.raises(dataclasses.FrozenInstanceError):
        outs[0].step = 0
    with pytest.raises(TypeError):
        outs[0].scalars["train/loss"] = 0.0
    assert metrics.flush() == [] and metrics.pending == 0


def test_a_metric_combines_by_its_reduction_and_stays_in_every_later_row():
    """Recorded per micro batch, each reduction combines the step's records its own way; a
    name recorded at step 2 only is NaN at step 3 (a column every sink writes, never a
    shorter row: steps of 2, 3 and 2 names read together, matched by name); a name keeps its
    reduction, and nothing is recorded between steps."""
    metrics = StepMetrics()
    micro = [1.0, 2.0, 6.0]
    for step in (1, 2, 3):
        metrics.open(step)
        for x in micro:
            for kind in ("mean", "sum", "max", "min"):
                metrics.record(f"m/{kind}", torch.tensor(x * step), kind)
        if step == 2:
            metrics.record("train/grad_norm", float("inf"), "max")  # a skipped step's norm
        metrics.close(_record(step), Unjudged(step, step, False))
    steps = metrics.read()
    got = [p.host for p in steps]
    assert got[0] == {"m/mean": 3.0, "m/sum": 9.0, "m/max": 6.0, "m/min": 1.0}
    assert got[1] == {"m/mean": 6.0, "m/sum": 18.0, "m/max": 12.0, "m/min": 2.0,
                      "train/grad_norm": float("inf")}  # fmt: skip
    assert got[2]["m/sum"] == 27.0 and list(got[2]) == list(got[1])
    assert got[2]["train/grad_norm"] != got[2]["train/grad_norm"]  # NaN: not recorded
    metrics.open(4)
    metrics.record("m/max", float("nan"), "max")
    metrics.record("m/max", 1.0, "max")  # a NaN is never hidden by a larger value
    assert torch.isnan(metrics.current("m/max"))
    with pytest.raises(ValueError, match=r"'m/max' is recorded with reduce='sum', but it was"):
        metrics.record("m/max", 1.0, "sum")
    with pytest.raises(ValueError, match=r"reduce='median'; choose one of mean, sum, max, min"):
        metrics.record("m/other", 1.0, "median")  # type: ignore[arg-type]
    metrics.close(_record(4), Unjudged(4, 4, False))
    with pytest.raises(RuntimeError, match="'late' recorded between steps"):
        metrics.record("late", 1.0)


def _reduce_on_rank(rank: int, port: int, out) -> None:
    import torch.distributed as dist

    from pretrain.train.metrics import reduce_over_ranks

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    # Two steps x four names: rank 1's second step has a NaN mean (one rank's NaN loss).
    mine = torch.tensor([[1.0 + rank, 10.0 * (rank + 1), 5.0 - rank, 3.0 + rank],
                         [2.0, float("nan") if rank else 4.0, 7.0, -1.0 * rank]],
                        dtype=torch.float64)  # fmt: skip
    got = reduce_over_ranks(mine, ["mean", "sum", "max", "min"], 2)
    out.put((rank, got.tolist()))
    dist.destroy_process_group()


def test_values_reduce_over_two_ranks_in_one_gather():
    """reduce_over_ranks on two gloo ranks: each column by its reduction, a NaN on one rank
    stays NaN; both ranks get the same matrix."""
    import multiprocessing as mp

    from warm_start import free_port

    ctx = mp.get_context("spawn")  # forked, a child would inherit this process's group
    out, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=_reduce_on_rank, args=(r, port, out)) for r in range(2)]
    for p in procs:
        p.start()
    results = dict(out.get(timeout=600) for _ in procs)  # a hang, not a busy machine
    for p in procs:
        p.join(300)
        assert p.exitcode == 0
    assert results[0] == results[1] or str(results[0]) == str(results[1])  # NaN != NaN
    first, second = results[0]
    assert first == [1.5, 30.0, 5.0, 3.0]
    assert second[0] == 2.0 and second[1] != second[1] and second[2:] == [7.0, -1.0]


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


def test_the_loss_path_is_what_the_docs_say(tmp_path, tmp_path_factory, isolated_env):
    """The holders of a step's loss from the model to the TensorBoard sink, measured by
    tests/value_path.py (a marker loss followed under sys.settrace), are docs/architecture.md's
    table, in order, and at most 8; the guard holds nothing of the step but its verdict and
    its window."""
    import re

    from train_support import REPO
    from value_path import trace_loss_path

    raw = tiny_config(
        tmp_path / "run",
        stdlib_data(tmp_path_factory),
        train={"train_iters": 2, "eval_interval": 0, "hang_timeout": 0},
        schedule={"warmup_steps": 1},
        logging={"log_interval": 1, "max_logit_interval": 0},
    )
    tracer = trace_loss_path(from_dict(Config, raw))
    doc = (REPO / "docs" / "architecture.md").read_text()
    table = doc.split("<!-- loss-path -->")[1].split("<!-- /loss-path -->")[0]
    documented = re.findall(r"^\| \d+ \| `([^`]+)` \|", table, re.MULTILINE)
    assert tracer.done, "the marker never reached the TensorBoard sink"
    assert tracer.attributes == documented, tracer.attributes
    assert len(tracer.attributes) <= 8
    assert f"{len(documented)} holders:" in doc
    assert f"({len(tracer.locals)} of them" in doc
    assert not any(h.startswith(("StepGuard.", "SkipStepOptimizer.")) for h in tracer.attributes)
