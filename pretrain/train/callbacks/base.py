"""The callback interface: a few hooks the Trainer calls, in order, on every rank."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

import torch

from pretrain.config import Config
from pretrain.run_layout import RunLayout

if TYPE_CHECKING:
    from pretrain.train.context import RunContext
    from pretrain.train.spikes import Rollback, Verdict


class OnDevice:
    """A StepOutput field whose value the step leaves on the device (the all-reduced loss,
    the gradient norm, the guard's verdict, ...). The trainer reads every pending step's
    values at once (`TrainModule.read`: one host transfer) at logging steps and at steps that
    evaluate, save or stop; until then `out.pending` is set. Reading such a field earlier
    reads them then, which waits for the GPU: built-in callbacks read them on logging steps,
    or in `on_values`, which gets each step once its values are read."""

    def __init__(self, default: Any = dataclasses.MISSING) -> None:
        self.default = default

    def __set_name__(self, owner: type, name: str) -> None:
        self.attr = "_" + name

    def __get__(self, out: Any, owner: type | None = None) -> Any:
        if out is None:  # the class's: the dataclass default (none without one)
            if self.default is dataclasses.MISSING:
                raise AttributeError(self.attr)
            return self.default
        if out.pending is not None:
            out.pending.read()
        return getattr(out, self.attr)

    def __set__(self, out: Any, value: Any) -> None:
        setattr(out, self.attr, value)


@dataclass
class StepOutput:
    """What one optimizer step produced. Callbacks read it and add to `scalars` (written to
    the metrics file, TensorBoard and W&B by the writer callbacks) and `events` (text lines).

    The fields marked OnDevice, and scalars train/loss, train/grad_norm, train/z_loss and
    progress/batch_token_sum, are filled when the step's values are read from the device
    (see OnDevice): on logging steps before on_step_end, on other steps at the next read;
    the writers write each step once it is read."""

    step: int
    loss: float = OnDevice()  # mean over the step's micro batches and ranks
    grad_norm: float | None = OnDevice()  # after clipping's measurement, before the clip
    lr: float  # the rate this update used
    tokens: int  # tokens in this step, over all ranks
    batch_token_sum: float = OnDevice()  # sum of the step's token ids over all ranks
    stopping: bool  # a rank received a pre-emption signal: save and stop after this step
    first_input: torch.Tensor | None  # this rank's first sequence of the step (for probes)
    log: bool  # a logging step (logging.log_interval, the last step, or stopping)
    verdict: Verdict | None = OnDevice(None)  # the loss-spike guard's (train/spikes.py)
    evaluation: dict[str, float] | None = None  # valid/* when the step evaluated (also in scalars)
    eval_seconds: float = 0.0  # of the step's wall time, spent evaluating
    scalars: dict[str, float] = field(default_factory=dict)
    events: list[tuple[str, str]] = field(default_factory=list)  # (tag, text)
    pending: Any = None  # what reads the OnDevice fields (TrainModule) until they are read


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


class Callback:
    """Override the hooks you need. Each gets the trainer, as the `Trainer` protocol above
    shows it (`cfg`, `run`, `step`, `consumed`, `layout`, `is_main`, `log()`, `save()`, ...).

    Order of the hooks in a run:
        on_fit_start      before anything is built (signal handlers belong here)
        on_train_start    model built, checkpoint restored; before the first step
        on_evaluation     after a step that evaluated, with its valid/* (before its on_step_end)
        on_values         when steps' device values were read (StepOutput's OnDevice fields),
                          with those steps' StepOutputs in order: at logging steps before
                          their on_step_end, each step exactly once
        on_step_end       after every optimizer step, with its StepOutput
        on_save           after a checkpoint is complete, with its folder (with
                          checkpoint.async: once its state is copied; the folder is
                          complete when the writer thread is done)
        on_rollback       after a rollback restored an earlier checkpoint (spikes.rollback_after),
                          with its Rollback record; trainer.step is the checkpoint's step
        on_fit_end        always, last; exit_code is 0, 99 (pre-empted) or None (an error)

    A callback with `state_key` set has its `state_dict()` saved in every checkpoint and
    handed back to `load_state_dict()` on resume.
    """

    state_key: ClassVar[str | None] = None

    def on_fit_start(self, trainer: Trainer) -> None: ...

    def on_train_start(self, trainer: Trainer) -> None: ...

    def on_values(self, trainer: Trainer, outs: list[StepOutput]) -> None: ...

    def on_step_end(self, trainer: Trainer, out: StepOutput) -> None: ...

    def on_evaluation(self, trainer: Trainer, results: dict[str, float]) -> None: ...

    def on_save(self, trainer: Trainer, folder: Path) -> None: ...

    def on_rollback(self, trainer: Trainer, rollback: Rollback) -> None: ...

    def on_fit_end(self, trainer: Trainer, exit_code: int | None) -> None: ...

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None: ...
