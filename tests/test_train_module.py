"""The training side's parts: fault points and injected data faults (faults.py), the
recompute count a program resolves (train/engine.py), the run context built once and the
evaluation the trainer (not a callback) runs and announces (train/trainer.py)."""

from __future__ import annotations

import dataclasses
import errno
import json
import multiprocessing
import os

import pytest
import torch
from train_support import stdlib_data, tiny_config

from pretrain import faults
from pretrain.config import Config, ConfigError, FaultConfig, from_dict
from pretrain.faults import DataFaults, fault_point
from pretrain.train.callbacks import Callback
from pretrain.train.engine import resolve_recompute
from pretrain.train.trainer import Trainer

CPU = torch.device("cpu")


@pytest.fixture
def isolated_env(monkeypatch):
    """The trainer maps launcher variables into os.environ; keep that out of the test process."""
    keep = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    monkeypatch.setattr(os, "environ", {k: v for k, v in os.environ.items() if k not in keep})


# ----------------------------------------------------------------------------- faults


def test_fault_points_do_nothing_unless_a_test_arms_them(monkeypatch, capsys):
    died, slept = [], []
    monkeypatch.setattr(faults.os, "_exit", died.append)
    monkeypatch.setattr(faults.time, "sleep", slept.append)
    monkeypatch.delenv(faults.KILL_ENV, raising=False)
    monkeypatch.delenv(faults.PAUSE_ENV, raising=False)
    monkeypatch.delenv(faults.FAIL_ENV, raising=False)
    for name in faults.POINTS:
        fault_point(name, 3)
    assert died == slept == []
    with pytest.raises(ValueError, match="unknown fault point 'nowhere'"):
        fault_point("nowhere", 3)

    monkeypatch.setenv(faults.KILL_ENV, "mid_marker:4")
    fault_point("mid_marker", 3)  # another step
    fault_point("before_commit", 4)  # another point
    assert died == [] and faults.kill_requested("mid_marker", 4)
    fault_point("mid_marker", 4)
    assert died == [137]  # as kill -9: no clean-up
    monkeypatch.setenv(faults.KILL_ENV, "rollback_recorded")  # any step
    fault_point("rollback_done", 9)
    fault_point("rollback_recorded", 9)
    assert died == [137, 137]

    monkeypatch.setenv(faults.PAUSE_ENV, "before_commit:6:2.5")
    fault_point("before_commit", 5)
    assert slept == []
    fault_point("before_commit", 6)
    assert slept == [2.5] and "pausing 2.5s at before_commit (step 6)" in capsys.readouterr().out

    monkeypatch.setenv(faults.FAIL_ENV, "async_write:4")  # a full disk at that point
    fault_point("async_write", 3)
    with pytest.raises(OSError, match="No space left on device") as failed:
        fault_point("async_write", 4)
    assert failed.value.errno == errno.ENOSPC and died == [137, 137]


def test_data_faults_corrupt_their_data_steps_only():
    f = DataFaults(
        [
            FaultConfig(step=2, kind="nan"),
            FaultConfig(step=3, last=4, kind="scale_grads", factor=10.0),
            FaultConfig(step=5, kind="scale_loss", factor=2.0),
            FaultConfig(step=6, kind="noise"),
        ],
        seed=1,
        vocab_size=50,
        rank=0,
    )
    loss = torch.tensor(3.0)
    assert f.loss(loss, 1) == (loss, loss)
    reported, objective = f.loss(loss, 2)
    assert reported.isnan() and objective.isnan()
    for step in (3, 4):  # the gradients only: the loss reads normal
        assert [float(t) for t in f.loss(loss, step)] == [3.0, 30.0]
    assert [float(t) for t in f.loss(loss, 5)] == [6.0, 6.0]
    x = torch.zeros(2, 8, dtype=torch.long)
    assert f.batch(x, x, 5, 0)[0] is x  # only noise replaces the batch
    nx, ny = f.batch(x, x, 6, 0)
    assert nx.shape == x.shape and torch.equal(nx[:, 1:], ny[:, :-1]) and nx.any()
    assert torch.equal(f.batch(x, x, 6, 0)[0], nx)  # the same every time
    assert not torch.equal(f.batch(x, x, 6, 1)[0], nx)  # another micro batch, other tokens


# ----------------------------------------------------------------------------- recompute


class RecordingPlanner:
    """A planner that answers `recompute` with a fixed number and records who asked."""

    def __init__(self, layers: int) -> None:
        self.layers, self.asked = layers, []

    def recompute(self, cfg, world_size, device) -> int:
        self.asked.append((cfg, world_size, device))
        return self.layers

    def compiled_fits(self, cfg, world_size, device, layers) -> bool:
        raise AssertionError("not asked on CPU")


def test_auto_recompute_is_the_programs_decision():
    cfg = from_dict(Config, {"model": {"n_layers": 4}, "train": {"activation_checkpointing": 3}})
    assert resolve_recompute(cfg, 1, CPU, None) == 3
    cfg.train.activation_checkpointing = "full"
    planner = RecordingPlanner(2)
    assert resolve_recompute(cfg, 1, CPU, planner) == 4 and planner.asked == []
    cfg.train.activation_checkpointing = "auto"
    with pytest.raises(ConfigError, match=r"train\.activation_checkpointing='auto' needs"):
        resolve_recompute(cfg, 1, CPU, None)
    assert resolve_recompute(cfg, 8, CPU, planner) == 2
    assert planner.asked == [(cfg, 8, CPU)]


# ----------------------------------------------------------------------------- the loop


class HookProbe(Callback):
    def __init__(self) -> None:
        self.events: list[tuple] = []
        self.run_at_start = None

    def on_train_start(self, trainer) -> None:
        self.run_at_start = trainer.run

    def on_evaluation(self, trainer, results) -> None:
        self.events.append(("evaluation", trainer.step, sorted(results)))

    def on_step_end(self, trainer, out) -> None:
        self.events.append(("step_end", out.step, out.evaluation is not None))


def test_the_trainer_evaluates_plans_auto_and_builds_its_context_once(
    tmp_path, tmp_path_factory, isolated_env
):
    """No Evaluation callback: the trainer evaluates every eval_interval steps and at the
    last, and announces it before the step's on_step_end; `auto` recompute goes through the
    planner the program gave; what set-up builds is one frozen context."""
    raw = tiny_config(
        tmp_path / "run",
        stdlib_data(tmp_path_factory),
        train={"train_iters": 5, "eval_interval": 2, "activation_checkpointing": "auto"},
    )
    raw["data"]["num_workers"] = 1
    cfg = from_dict(Config, raw)
    with pytest.raises(ConfigError, match=r"train\.activation_checkpointing='auto' needs"):
        Trainer(cfg, callbacks=[], save_checkpoints=False).fit()
    asked, probe = [], HookProbe()

    class Planner:
        def recompute(self, c, world_size, device):
            asked.append((world_size, device.type))
            return 1

        def compiled_fits(self, c, world_size, device, layers):
            raise AssertionError("compile: auto asks the planner on CUDA only")

    trainer = Trainer(cfg, callbacks=[probe], save_checkpoints=False, planner=Planner())
    assert trainer.run is None and trainer.is_main  # before set-up: no context, no getattr
    children = set(multiprocessing.active_children())
    assert trainer.fit() == 0
    # The data worker stopped with the run, while the trainer lives on. Left to the garbage
    # collector with the trainer's cycles, its queues closed first and the shutdown waited
    # out DataLoader's 5 s join timeout (every in-process run: the GPU check, these tests).
    assert set(multiprocessing.active_children()) <= children
    assert asked == [(1, "cpu")] and trainer.run.module.model.gradient_checkpointing == 1
    valid = ["valid/bits_per_byte", "valid/bits_per_token", "valid/loss", "valid/ppl"]
    assert probe.events == [
        ("step_end", 1, False),
        ("evaluation", 2, valid),
        ("step_end", 2, True),
        ("step_end", 3, False),
        ("evaluation", 4, valid),
        ("step_end", 4, True),
        ("evaluation", 5, valid),
        ("step_end", 5, True),
    ]
    run = trainer.run
    assert probe.run_at_start is run and run.grad_accum == 2 and run.tokens_per_step == 256
    with pytest.raises(dataclasses.FrozenInstanceError):
        run.grad_accum = 3


# ----------------------------------------------------------------------------- host reads


class HostReads:
    """Every conversion of a tensor to a Python value (item, tolist, float, int, bool, index,
    numpy): what waits for a GPU's queue on a GPU. Attributed to the first frame outside
    torch: ours (pretrain/: by function name), DeepSpeed's, or another library's."""

    METHODS = ("item", "tolist", "__float__", "__int__", "__bool__", "__index__", "numpy")

    def __init__(self, monkeypatch) -> None:
        import sys
        from collections import Counter

        self.on, self.ours, self.deepspeed = False, Counter(), Counter()
        torch_dir = os.path.dirname(torch.__file__)
        for name in self.METHODS:
            original = getattr(torch.Tensor, name)

            def counted(t, *args, _original=original, **kwargs):
                if self.on:
                    frame = sys._getframe(1)
                    while frame.f_code.co_filename.startswith(torch_dir):
                        frame = frame.f_back
                    path = frame.f_code.co_filename
                    if f"{os.sep}pretrain{os.sep}" in path:
                        self.ours[frame.f_code.co_name] += 1
                    elif f"{os.sep}deepspeed{os.sep}" in path:
                        self.deepspeed[frame.f_code.co_name] += 1
                return _original(t, *args, **kwargs)

            monkeypatch.setattr(torch.Tensor, name, counted)


class CountSteps(Callback):
    """Counts host reads from the first step on (set-up reads what it needs)."""

    def __init__(self, reads: HostReads) -> None:
        self.reads = reads

    def on_train_start(self, trainer) -> None:
        self.reads.on = True

    def on_fit_end(self, trainer, exit_code) -> None:
        self.reads.on = False


def test_steps_read_their_values_on_the_host_once_per_log_interval(
    tmp_path, tmp_path_factory, isolated_env, monkeypatch
):
    """A CPU has no queue to wait for, so what is counted is the reads themselves: over 12
    steps with logging.log_interval 4 and the built-in callbacks, our code reads the steps'
    values 3 times (StepMetrics.read: loss, token sum, z term and grad norm of 4 steps in one
    tolist), the parameter norm 3 times (SpeedMonitor, at logging steps), and the pre-emption
    flag once per step, from the copy made one step earlier (TrainModule.stop_requested).
    Nothing else: a float(loss) per step would show here. The spike guard is judged at the
    reads; the metrics file still has every step. (DeepSpeed's fp32 ZeRO-1 optimizer reads
    3 flags per step of its own, is_invalid_grad_norm: not ours to remove, not asserted.)"""
    from pretrain.train.callbacks import build_callbacks

    cfg = from_dict(
        Config,
        tiny_config(
            tmp_path / "run",
            stdlib_data(tmp_path_factory),
            train={"train_iters": 12, "eval_interval": 0},
            checkpoint={"interval": 1000},
            logging={"log_interval": 4, "max_logit_interval": 0, "tensorboard": False},
            spikes={"window": 40},  # scored from step 11 on (10 steps of history)
        ),
    )
    reads = HostReads(monkeypatch)
    callbacks = [CountSteps(reads), *build_callbacks(cfg)]
    assert Trainer(cfg, callbacks=callbacks, save_checkpoints=False).fit() == 0
    # train_batches: the data stream opened at the first step (a CPU index, no device).
    # rank_parts: the straggler scalars' gather of each rank's step parts (SpeedMonitor),
    # on logging steps only, like the values themselves.
    want = {
        "read": 3,
        "parameter_norm": 3,
        "rank_parts": 3,
        "stop_requested": 12,
        "train_batches": 1,
    }
    assert dict(reads.ours) == want, (reads.ours, reads.deepspeed)
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
    assert [r["step"] for r in rows] == list(range(1, 13))
    assert all(
        {"train/loss", "train/grad_norm", "spikes/loss_score"} <= r.keys() for r in rows[10:]
    )
