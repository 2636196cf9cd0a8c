"""Where a run's records go: one publisher, a container of sinks.

    records      StepOutput (a finished step), Rewound (a rollback), Notice (a hang's
                 verdict): pretrain/train/records.py
    Sink         where records are written: the console, metrics.jsonl, TensorBoard, W&B
                 (pretrain/train/sinks.py), or a user's own (`callbacks:` may name a Sink)
    Publisher    sends every record to every sink, in order

The trainer publishes the steps at each flush (pretrain/train/metrics.py says when), a
rollback once it has loaded the checkpoint, and the hang watchdog its verdict. A new sink is
one class with `write`; a new metric is one call, `record_metric(name, value, reduce)`
(pretrain/train/metrics.py), which reaches every sink as a scalar of that name. Callbacks see
the same StepOutputs in `on_values`, after the sinks.

Rank 0 writes the files; every rank's console prints a Notice (the rank that judged a hang
may not be rank 0), rank 0's the steps.
(torchtitan's MetricsProcessor and LoggerContainer, OLMo-core's named metrics: the same shape.)
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

from pretrain.train.records import Record

if TYPE_CHECKING:
    from pretrain.train.callbacks.base import Trainer


class Sink:
    """Where records are written. `open` when training starts (after a resume: the run's
    step is the checkpoint's), `write` for every record in order, `flush` after each save
    (what the checkpoint has seen is on disk), `close` at the end (exit_code 0, 99 or None
    for an error). Every rank has the sinks; a file sink writes on rank 0 only. A sink with
    `state_key` set has its `state_dict()` saved in every checkpoint and handed back to
    `load_state_dict()` on resume (W&B's run id), as a callback's is."""

    state_key: ClassVar[str | None] = None

    def open(self, trainer: Trainer) -> None: ...

    def write(self, record: Record) -> None: ...

    def flush(self) -> None: ...

    def close(self, trainer: Trainer, exit_code: int | None) -> None: ...

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class Publisher:
    """The run's sinks, in order; every record goes to each."""

    def __init__(self, sinks: list[Sink]) -> None:
        self.sinks = list(sinks)

    def open(self, trainer: Trainer) -> None:
        for sink in self.sinks:
            sink.open(trainer)

    def publish(self, records: list[Record]) -> None:
        for record in records:
            for sink in self.sinks:
                sink.write(record)

    def flush(self) -> None:
        for sink in self.sinks:
            sink.flush()

    def close(self, trainer: Trainer, exit_code: int | None) -> None:
        for sink in self.sinks:
            sink.close(trainer, exit_code)
