"""The callback interface: a few hooks the Trainer calls, in order, on every rank."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import torch

if TYPE_CHECKING:
    from pretrain.train.spikes import Rollback, Verdict
    from pretrain.train.trainer import Trainer


@dataclass
class StepOutput:
    """What one optimizer step produced. Callbacks read it and add to `scalars` (written to
    the metrics file, TensorBoard and W&B by the writer callbacks) and `events` (text lines)."""

    step: int
    loss: float  # mean over the step's micro batches and ranks
    grad_norm: float | None  # after clipping's measurement, before the clip
    lr: float  # the rate this update used
    tokens: int  # tokens in this step, over all ranks
    batch_token_sum: float  # sum of the step's token ids over all ranks (a data fingerprint)
    stopping: bool  # some rank received a pre-emption signal: save and stop after this step
    first_input: torch.Tensor | None  # this rank's first sequence of the step (for probes)
    log: bool  # a logging step (logging.log_interval, the last step, or stopping)
    verdict: Verdict | None = None  # the loss-spike guard's judgement (pretrain/train/spikes.py)
    scalars: dict[str, float] = field(default_factory=dict)
    events: list[tuple[str, str]] = field(default_factory=list)  # (tag, text)


class Callback:
    """Override the hooks you need. Each gets the Trainer (its `cfg`, `env`, `step`,
    `consumed`, `module`, `engine`, `layout`, `is_main`, `log()`, `save()`).

    Order of the hooks in a run:
        on_fit_start      before anything is built (signal handlers belong here)
        on_train_start    model built, checkpoint restored; before the first step
        on_step_end       after every optimizer step, with its StepOutput
        on_evaluation     after a validation pass, with its results
        on_save           after a checkpoint is complete, with its folder
        on_rollback       after a rollback restored an earlier checkpoint (spikes.rollback_after),
                          with its Rollback record; trainer.step is the checkpoint's step
        on_fit_end        always, last; exit_code is 0, 99 (pre-empted) or None (an error)

    A callback with `state_key` set has its `state_dict()` saved in every checkpoint and
    handed back to `load_state_dict()` on resume.
    """

    state_key: ClassVar[str | None] = None

    def on_fit_start(self, trainer: Trainer) -> None: ...

    def on_train_start(self, trainer: Trainer) -> None: ...

    def on_step_end(self, trainer: Trainer, out: StepOutput) -> None: ...

    def on_evaluation(self, trainer: Trainer, results: dict[str, float]) -> None: ...

    def on_save(self, trainer: Trainer, folder: Path) -> None: ...

    def on_rollback(self, trainer: Trainer, rollback: Rollback) -> None: ...

    def on_fit_end(self, trainer: Trainer, exit_code: int | None) -> None: ...

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None: ...
