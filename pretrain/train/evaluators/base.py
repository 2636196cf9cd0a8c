"""The evaluator interface: a measurement the trainer runs between steps, on its schedule.

An evaluator is a component the trainer owns (as torchtitan's and OLMo-core's trainers own
theirs), not a callback: the trainer asks each whether it is `due` after a step, runs the
due ones inside the hang watchdog's slow phase (train.hang_timeout_long) with the time
left out of tokens/s, and reports what they return through the step's record, so the one
metrics path writes it (metrics file, TensorBoard, W&B) with the step's other values.
"""

from __future__ import annotations

import random
import time
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from pretrain.train.watchdog import slow_phase

if TYPE_CHECKING:
    from pretrain.train.metrics import StepRecord


class Evaluator:
    """Override `due` and `run`; `setup` if the evaluator needs the built run.

    `run` is called on every rank (an evaluation may use collectives: every rank must take
    part) with the trainer (as callbacks see it: `cfg`, `run`, `step`, `layout`, `is_main`,
    `log()`) and the step's record; it returns scalars (the same on every rank; rank 0
    writes them) and may add images to `record.images`. It must leave training as it found
    it: the model back in training mode, no RNG drawn (tests/test_train_metrics_path.py).
    """

    def setup(self, trainer: Any) -> None: ...

    def due(self, step: int, last: bool, stopping: bool) -> bool:
        raise NotImplementedError

    def run(self, trainer: Any, record: StepRecord) -> dict[str, float]:
        raise NotImplementedError


def run_due(
    evaluators: list[Evaluator], trainer: Any, record: StepRecord, last: bool
) -> dict[str, float] | None:
    """The evaluators due after `record`'s step, in the watchdog's slow phase; their results
    (None when none was due) go into the record, their time into `record.eval_seconds`,
    which tokens/s leaves out."""
    due = [e for e in evaluators if e.due(record.step, last, record.stopping)]
    if not due:
        return None
    t0, results = time.perf_counter(), {}
    # Every generator as training left it, whatever the evaluators draw (a DataLoader draws
    # its base seed from torch's, lm-eval from Python's): the training trajectory does not
    # depend on how often, or whether, a run evaluates.
    device = trainer.run.device
    python_state, numpy_state = random.getstate(), np.random.get_state()
    try:
        with (
            slow_phase("an evaluation"),
            torch.random.fork_rng([device] if device.type == "cuda" else []),
        ):
            for evaluator in due:
                results.update(evaluator.run(trainer, record))
    finally:
        random.setstate(python_state)
        np.random.set_state(numpy_state)
    record.eval_seconds = time.perf_counter() - t0
    record.evaluation = results
    record.scalars.update(results)
    return results
