"""Users' callbacks, as a config names them (`callbacks: [{class: callback_probe.HookRecorder}]`):
HookRecorder records every hook it sees and keeps a step count in the checkpoints; SyncTwin
saves synchronously beside a run's own (asynchronous) saves, for comparison; RecordSink is a
user's own sink: every record of the run, one JSON line each."""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

from pretrain.config import CheckpointConfig
from pretrain.train.callbacks import Callback
from pretrain.train.checkpoint import Checkpointer
from pretrain.train.publish import Sink
from pretrain.train.records import Notice, Rewound, StepOutput


class HookRecorder(Callback):
    state_key = "hook_recorder"

    def __init__(self, out: str, tag: str = "") -> None:
        self.out, self.tag, self.steps_seen = Path(out), tag, 0

    def _record(self, trainer, *event) -> None:
        if trainer.is_main:
            with open(self.out, "a") as f:
                f.write(json.dumps([self.tag, *event]) + "\n")

    def on_fit_start(self, trainer) -> None:
        self._record(trainer, "fit_start")

    def on_train_start(self, trainer) -> None:
        self._record(trainer, "train_start", trainer.step, self.steps_seen)

    def on_step_end(self, trainer, out) -> None:
        self.steps_seen += 1
        self._record(trainer, "step_end", out.step, sorted(k for k in out.scalars if "/" in k))
        out.scalars["probe/steps_seen"] = self.steps_seen

    def on_values(self, trainer, outs) -> None:
        for out in outs:
            self._record(trainer, "values", out.step, sorted(k for k in out.scalars if "/" in k))

    def on_evaluation(self, trainer, results) -> None:
        self._record(trainer, "evaluation", trainer.step, round(results["valid/loss"], 6))

    def on_save(self, trainer, folder) -> None:
        self._record(trainer, "save", trainer.step, Path(folder).name)

    def on_fit_end(self, trainer, exit_code) -> None:
        self._record(trainer, "fit_end", exit_code)

    def state_dict(self) -> dict:
        return {"steps_seen": self.steps_seen}

    def load_state_dict(self, state: dict) -> None:
        self.steps_seen = state["steps_seen"]


class SyncTwin(Callback):
    """At every checkpoint step, before the run's own save, a synchronous save of the same
    state into `twin_dir` (a second Checkpointer with checkpoint.async off), and the wall
    time each step ended (rank 0, `times`): what an asynchronous save is compared with."""

    def __init__(self, twin_dir: str, times: str) -> None:
        self.twin_dir, self.times = Path(twin_dir), Path(times)

    def on_train_start(self, trainer) -> None:
        env = trainer.run.env
        self.twin = Checkpointer(
            self.twin_dir, CheckpointConfig(keep_last=100), env.rank, env.world_size
        )

    def on_step_end(self, trainer, out) -> None:
        if trainer.is_main:
            with open(self.times, "a") as f:
                f.write(json.dumps([out.step, time.time()]) + "\n")
        t = trainer.cfg
        if out.step % t.checkpoint.interval == 0 or out.step == t.train.train_iters:
            run = trainer.run
            trainer.run = dataclasses.replace(run, checkpointer=self.twin)
            try:
                trainer.save()
            finally:
                trainer.run = run


class RecordSink(Sink):
    """A sink in one class: each record as a JSON line in `out` (rank 0)."""

    def __init__(self, out: str) -> None:
        self.out, self.main = Path(out), False

    def open(self, trainer) -> None:
        self.main = trainer.is_main

    def write(self, record) -> None:
        if not self.main:
            return
        if isinstance(record, StepOutput):
            row = ["step", record.step, dict(record.scalars)]
        elif isinstance(record, Rewound):
            row = ["rewound", record.step, dict(record.scalars)]
        else:
            assert isinstance(record, Notice)
            row = ["notice", record.step, record.text]
        with open(self.out, "a") as f:
            f.write(json.dumps(row) + "\n")
