"""Callbacks: a user's own from the config sees every hook in order and keeps its state across
a resume; W&B logs offline; bad callback entries fail with one line."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from train_support import metrics, run_main, stdlib_data, tiny_config, wandb_rows, write_config

TESTS = Path(__file__).parent


def _events(path: Path) -> list[list]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_custom_callback_from_the_config_sees_its_hooks_in_order(tmp_path, tmp_path_factory):
    data = stdlib_data(tmp_path_factory)
    events = tmp_path / "events.jsonl"
    cfg = tiny_config(
        tmp_path / "run",
        data,
        train={"train_iters": 6, "eval_interval": 3},
        checkpoint={"interval": 3},
        logging={"log_interval": 3, "max_logit_interval": 3},
    )
    cfg["callbacks"] = [{"class": "callback_probe.HookRecorder", "out": str(events), "tag": "a"}]
    path = write_config(tmp_path / "run.yaml", cfg)
    env = {"PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}
    r = run_main(path, **env)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    got = [e[1:3] if e[1] != "step_end" else e[1:3] for e in _events(events)]
    assert got == [
        ["fit_start"],
        ["train_start", 0],
        ["step_end", 1],
        ["step_end", 2],
        ["evaluation", 3],
        ["step_end", 3],
        ["values", 1],
        ["values", 2],
        ["values", 3],
        ["save", 3],
        ["step_end", 4],
        ["step_end", 5],
        ["evaluation", 6],
        ["step_end", 6],
        ["values", 4],
        ["values", 5],
        ["values", 6],
        ["save", 6],
        ["fit_end", 0],
    ]
    # on_step_end runs after the built-in host scalars are in and before the writers: it
    # sees the step's evaluation, speed and logit scalars, not yet its device values; what
    # it adds reaches metrics.jsonl; on_values sees every scalar of the finished step.
    step3 = next(e for e in _events(events) if e[1:3] == ["step_end", 3])[3]
    assert {"valid/loss", "perf/tokens_per_s", "stability/max_attn_logit"} <= set(step3)
    assert "train/loss" not in step3
    values3 = next(e for e in _events(events) if e[1:3] == ["values", 3])[3]
    assert set(step3) | {"train/loss", "train/grad_norm", "probe/steps_seen"} <= set(values3)
    assert metrics(tmp_path / "run")[5]["probe/steps_seen"] == 5

    # Its state is in the checkpoint: the resumed run (2 more steps) starts from 6 seen steps.
    events.unlink()
    r = run_main(path, overrides=["train.train_iters=8"], **env)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert _events(events)[1] == ["a", "train_start", 6, 6]
    assert metrics(tmp_path / "run")[8]["probe/steps_seen"] == 8


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        ({"class": "NoDots"}, "callbacks[0].class='NoDots' must name a class by its dotted path"),
        ({"class": "no_such_module.Thing"}, "cannot import no_such_module"),
        (
            {"class": "pretrain.config.Config"},
            "is not a subclass of pretrain.train.callbacks.Callback, "
            "pretrain.train.evaluators.Evaluator or pretrain.train.publish.Sink",
        ),
        ({"class": "callback_probe.HookRecorder", "outt": "x"}, "does not accept ['outt']"),
    ],
)
def test_bad_callback_entry_is_one_line(
    tmp_path, tmp_path_factory, capsys, monkeypatch, entry, message
):
    from pretrain.cli.train import main

    monkeypatch.syspath_prepend(str(TESTS))
    monkeypatch.setattr(
        os,
        "environ",
        {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")},
    )
    data = stdlib_data(tmp_path_factory)
    cfg = tiny_config(tmp_path / "run", data)
    cfg["callbacks"] = [entry]
    code = main(["--config", str(write_config(tmp_path / "run.yaml", cfg))])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and message in err, err


def test_wandb_logs_the_runs_scalars_offline(tmp_path, tmp_path_factory):
    pytest.importorskip("wandb", reason="pip install wandb (the dev extras hold it)")
    data = stdlib_data(tmp_path_factory)
    cfg = tiny_config(tmp_path / "run", data, train={"train_iters": 4}, logging={"log_interval": 2})
    cfg["wandb"] = {"enabled": True, "project": "test", "mode": "offline"}
    r = run_main(
        write_config(tmp_path / "run.yaml", cfg), WANDB_MODE="offline", WANDB_SILENT="true"
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    logged = {int(row["train/step"]): row for row in wandb_rows(tmp_path / "run")}
    want = metrics(tmp_path / "run")
    assert sorted(logged) == [1, 2, 3, 4]
    for step in (1, 2, 3, 4):  # every scalar of metrics.jsonl, the same value
        assert {k: logged[step][k] for k in want[step]} == want[step]


def test_a_rollback_reaches_every_sink(tmp_path, tmp_path_factory):
    """Spikes at steps 9-11 roll the run back to checkpoint 5. The console, metrics.jsonl,
    TensorBoard and W&B each hold the rollback at step 5; W&B, which cannot forget rows,
    keeps the steps trained again after it on the training-step axis (a row per publish, in
    publish order: 1..11, the rollback at 5, then 6..16) rather than dropping them."""
    pytest.importorskip("wandb", reason="pip install wandb (the dev extras hold it)")
    data = stdlib_data(tmp_path_factory)
    run = tmp_path / "run"
    cfg = tiny_config(
        run,
        data,
        train={"train_iters": 16, "eval_interval": 1000},
        checkpoint={"interval": 5, "keep_last": 3},
        logging={"log_interval": 1},
        spikes={
            "skip_step": True,
            "rollback_after": 3,
            "rollback_within": 5,
            "faults": [{"step": s, "kind": "nan"} for s in (9, 10, 11)],
        },
    )
    cfg["wandb"] = {"enabled": True, "project": "test", "mode": "offline"}
    records = tmp_path / "records.jsonl"  # a user's own sink, named in `callbacks:`
    cfg["callbacks"] = [{"class": "callback_probe.RecordSink", "out": str(records)}]
    r = run_main(
        write_config(tmp_path / "run.yaml", cfg),
        WANDB_MODE="offline",
        WANDB_SILENT="true",
        PYTHONPATH=os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]),
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    text = "rollback 1 at step 11 (first spike at step 9): back to step 5, data steps 9-11 skipped"
    assert text in r.stdout  # the console
    rows = metrics(run)  # metrics.jsonl: the rollback's line at step 5, every step once
    assert rows[5]["spikes/rollbacks"] == 1 and rows[5]["spikes/rollback_from"] == 11
    assert sorted(rows) == list(range(1, 17))
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run / "tensorboard"), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("spikes/rollbacks")] == [(5, 1.0)]
    assert [e.step for e in acc.Scalars("train/loss")] == list(range(1, 17))
    logged = wandb_rows(run)
    steps = [int(row["train/step"]) for row in logged]
    assert steps == [*range(1, 12), 5, *range(6, 17)], steps
    (rollback,) = [row for row in logged if "spikes/rollbacks" in row]
    assert rollback["train/step"] == 5 and rollback["spikes/rollback_from"] == 11
    retrained = [row for row in logged if "train/loss" in row][-11:]  # steps 6..16, again
    assert [int(row["train/step"]) for row in retrained] == list(range(6, 17))
    assert [row["train/loss"] for row in retrained] == [rows[s]["train/loss"] for s in range(6, 17)]
    # The user's sink saw the same records in the same order, and the same scalars.
    mine = [json.loads(line) for line in records.read_text().splitlines()]
    assert [(kind, step) for kind, step, _ in mine] == [
        *(("step", s) for s in range(1, 12)),
        ("rewound", 5),
        *(("step", s) for s in range(6, 17)),
    ]
    assert mine[11][2].items() <= rows[5].items()  # metrics() merges step 5's two lines
    assert [m[2] for m in mine[12:]] == [
        {k: v for k, v in rows[s].items() if k != "step"} for s in range(6, 17)
    ]


def test_wandb_missing_is_one_line(tmp_path, capsys, monkeypatch):
    """Simulates a machine without wandb: the config check names the fix."""
    import importlib.util

    from pretrain.config import Config, WandbConfig
    from pretrain.preflight import check_wandb

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a)
    )
    with pytest.raises(
        Exception, match="wandb.enabled=true but wandb is not installed; pip install wandb"
    ):
        check_wandb(Config(wandb=WandbConfig(enabled=True)))
    check_wandb(Config())  # off: nothing to check
