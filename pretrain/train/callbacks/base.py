"""The callback interface: a few hooks the Trainer calls, in order, on every rank."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from pretrain.config import Config
from pretrain.run_layout import RunLayout
from pretrain.train.metrics import StepRecord
from pretrain.train.records import Record, StepOutput

if TYPE_CHECKING:
    from pretrain.train.context import RunContext
    from pretrain.train.spikes import Rollback


class Trainer(Protocol):
    """What a callback may read of the trainer: the config, the run's context (built once at
    set-up: env, device, data, the training module), the position, the run folder, and a few
    services. Nothing else: the loop is free to change behind it."""

    cfg: Config
    run: RunContext  # set before on_train_start (None during on_fit_start)
    layout: RunLayout
    step: int  # optimizer steps done
    consumed: int  # samples of the data stream passed, over all ranks
    resumed_from: str | None  # the checkpoint tag this run resumed from
    train_started: bool  # on_train_start has fired
    stop_signal: int | None  # a callback sets it: save and stop after this step

    @property
    def is_main(self) -> bool: ...

    def log(self, msg: str) -> None: ...

    def save(self) -> Path: ...

    def publish(self, record: Record) -> None: ...


class Callback:
    """Override the hooks you need. Each gets the trainer, as the `Trainer` protocol above
    shows it (`cfg`, `run`, `step`, `consumed`, `layout`, `is_main`, `log()`, `save()`, ...).

    Order of the hooks in a run:
        on_fit_start      before anything is built (signal handlers belong here)
        on_train_start    model built, checkpoint restored; before the first step
        on_evaluation     after a step whose evaluators ran (pretrain/train/evaluators/),
                          with their results (valid/*, ...), before its on_step_end
        on_step_end       after every optimizer step, with its StepRecord: what the host
                          knows (step, lr, tokens, stopping, evaluation); add host scalars,
                          events and images to it here. Its device values (loss, grad norm,
                          the spike guard's verdict) are not read yet: see on_values
        on_values         with finished steps (StepOutput: host-side, frozen: the step, its
                          named scalars, the guard's verdict, events, images), each exactly
                          once, in step order, after their on_step_end: at logging steps
                          and before a save, a stop, a rollback and the end
                          (pretrain/train/metrics.py), after the sinks wrote them
                          (pretrain/train/publish.py: to write records, write a Sink)
        on_save           after a checkpoint is complete, with its folder (with
                          checkpoint.async: once its state is copied; the folder is
                          complete when the writer thread is done)
        on_rollback       after a rollback restored an earlier checkpoint (spikes.rollback_after),
                          with its Rollback record; trainer.step is the checkpoint's step
        on_fit_end        always, last; exit_code is EXIT_OK, EXIT_PREEMPTED or None (an
                          error; pretrain/exit_codes.py)

    A callback with `state_key` set has its `state_dict()` saved in every checkpoint and
    handed back to `load_state_dict()` on resume.
    """

    state_key: ClassVar[str | None] = None

    def on_fit_start(self, trainer: Trainer) -> None: ...

    def on_train_start(self, trainer: Trainer) -> None: ...

    def on_step_end(self, trainer: Trainer, record: StepRecord) -> None: ...

    def on_values(self, trainer: Trainer, outs: list[StepOutput]) -> None: ...

    def on_evaluation(self, trainer: Trainer, results: dict[str, float]) -> None: ...

    def on_save(self, trainer: Trainer, folder: Path) -> None: ...

    def on_rollback(self, trainer: Trainer, rollback: Rollback) -> None: ...

    def on_fit_end(self, trainer: Trainer, exit_code: int | None) -> None: ...

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


__all__ = ["Callback", "StepOutput", "StepRecord", "Trainer"]
