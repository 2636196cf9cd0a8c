"""One path for a step's values: recorded on the device, read once, published once, in order.

    StepRecord     what the loop knows of a step on the host as it ends (step, lr, tokens,
                   stopping, evaluation results); callbacks add host scalars to it in
                   on_step_end (speed, attention logits, a user's own)
    StepMetrics    the step's named device tensors (loss, token sum, z term, grad norm) and
                   the spike guard's pending judgement, per step until they are read;
                   `read()` brings every pending step to the host in one transfer and has
                   the guard judge them in step order; `flush()` reads, then returns each
                   step as a frozen StepOutput, in step order, exactly once
    StepOutput     a finished step, host-side only: what `on_values` gets and the writers
                   write

Why on the device until a flush: on a GPU, reading a value the step computed (`float(loss)`)
waits until the GPU has run everything queued before it, and the GPU then idles while the
host queues the next step's kernels. The trainer flushes at logging steps
(logging.log_interval) and before anything that needs every step judged or on disk: an
evaluation, a save, a stop, a rollback, the end of the run. A save needs the guard's history
up to its step but must not publish (a user's callback may save from on_step_end, before
the step's other callbacks added their scalars): it calls `read()` only. The pre-emption
flag is needed every step and goes its own way (TrainModule.stop_requested).
tests/test_train_module.py counts the host reads of a run.

OLMo-core's trainer has the same shape: modules record metrics as device tensors, the
trainer reduces and reads them at its log interval and hands callbacks plain floats.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from collections.abc import Mapping

    import numpy as np

    from pretrain.train.spikes import StepGuard, Unjudged, Verdict

# The device values of a step, in the order StepMetrics stacks them.
VALUE_NAMES = ("loss", "batch_token_sum", "z_loss", "grad_norm")


@dataclass
class StepRecord:
    """A step as the loop knows it on the host when it ends. Callbacks may add to `scalars`,
    `events` and `images` in on_step_end; its device values come with its StepOutput."""

    step: int
    lr: float  # the rate this update used
    tokens: int  # tokens in this step, over all ranks
    stopping: bool  # a rank received a pre-emption signal: save and stop after this step
    first_input: torch.Tensor | None  # this rank's first sequence of the step (for probes)
    log: bool  # a logging step (logging.log_interval, the last step, or stopping)
    evaluation: dict[str, float] | None = None  # every evaluator's results when any ran
    eval_seconds: float = 0.0  # of the step's wall time, spent evaluating
    scalars: dict[str, float] = field(default_factory=dict)
    events: list[tuple[str, str]] = field(default_factory=list)  # (tag, text)
    images: dict[str, np.ndarray] = field(default_factory=dict)  # tag -> HWC uint8 RGB

    def __post_init__(self) -> None:
        self.scalars.setdefault("train/lr", self.lr)


@dataclass(frozen=True)
class StepOutput:
    """A finished step: its host record and its device values, read. `scalars` holds every
    scalar the writers write for it (train/*, progress/*, perf/*, valid/*, spikes/*, ...)."""

    step: int
    loss: float  # mean over the step's micro batches and ranks
    grad_norm: float | None  # before clipping; None where DeepSpeed reports none
    lr: float
    tokens: int
    batch_token_sum: float  # sum of the step's token ids over all ranks (a data fingerprint)
    stopping: bool
    log: bool
    verdict: Verdict | None  # the loss-spike guard's (train/spikes.py)
    evaluation: Mapping[str, float] | None
    eval_seconds: float
    scalars: Mapping[str, float]
    events: tuple[tuple[str, str], ...]
    images: Mapping[str, Any]


def spike_report(v: Verdict, log: bool) -> tuple[dict[str, float], list[str]]:
    """The scalars and console/event lines of what the guard judged about one step: the
    robust z-scores (once the window holds enough steps); for a spike its value, expected
    value and score; for a skipped update spikes/skipped and the run's count (on logging
    steps the count alone, so the curve shows it)."""
    sc: dict[str, float] = {}
    if v.loss_score is not None:
        sc["spikes/loss_score"] = v.loss_score
    if v.grad_score is not None:
        sc["spikes/grad_norm_score"] = v.grad_score
    lines = []
    if v.loss_spike is not None:
        sp = v.loss_spike
        sc.update({"spikes/loss": sp.value, "spikes/expected_loss": sp.expected})
        sc["spikes/score"] = sp.score
        lines.append(
            f"loss spike at step {v.step}: loss {sp.value:.4f}, expected {sp.expected:.4f} "
            f"(robust z-score {sp.score:.1f})"
        )
    if v.grad_spike is not None:
        sp = v.grad_spike
        sc.update({"spikes/grad_norm": sp.value, "spikes/expected_grad_norm": sp.expected})
        sc["spikes/grad_norm_spike_score"] = sp.score
        lines.append(
            f"grad-norm spike at step {v.step}: grad norm {sp.value:.4g}, expected "
            f"{sp.expected:.4g} (robust z-score {sp.score:.1f})"
        )
    if v.skipped:
        sc["spikes/skipped"] = 1.0
        sc["spikes/skipped_steps"] = float(v.skipped_total)
        lines.append(
            f"step {v.step} skipped: no update applied ({v.reason}; data step {v.data_step})"
        )
    elif log:
        sc["spikes/skipped_steps"] = float(v.skipped_total)
    return sc, lines


@dataclass
class _Pending:
    record: StepRecord
    values: torch.Tensor  # float64 [loss, token sum, z term, grad norm], on the device
    judged: Verdict | Unjudged
    host: list[float] | None = None  # `values`, once read
    verdict: Verdict | None = None


class StepMetrics:
    """The steps taken and not yet published; see the module docstring. `z_loss`: whether
    train/z_loss is a scalar of the run."""

    def __init__(self, guard: StepGuard, z_loss: bool = False) -> None:
        self.guard = guard
        self.z_loss = z_loss
        self._steps: list[_Pending] = []
        self._unread = 0  # the newest steps whose values are still on the device

    def record(
        self, record: StepRecord, values: dict[str, torch.Tensor], judged: Verdict | Unjudged
    ) -> None:
        """A step's named device scalars (VALUE_NAMES; a missing grad norm is NaN) and the
        guard's verdict, or its Unjudged values, kept until read."""
        ref = values["loss"]
        row = [
            values[n].reshape(()).to(torch.float64)
            if n in values
            else ref.new_full((), float("nan"), dtype=torch.float64)
            for n in VALUE_NAMES
        ]
        self._steps.append(_Pending(record, torch.stack(row), judged))
        self._unread += 1

    @property
    def pending(self) -> int:
        """Steps recorded and not yet published."""
        return len(self._steps)

    def read(self) -> None:
        """The unread steps' values to the host in one transfer, judged in step order."""
        if not self._unread:
            return
        from pretrain.train.spikes import Unjudged

        todo = self._steps[-self._unread :]
        rows = torch.stack([p.values for p in todo]).tolist()
        self._unread = 0
        for p, row in zip(todo, rows, strict=True):
            p.host = row
            judged = p.judged
            if isinstance(judged, Unjudged):
                norm = (
                    judged.grad_norm if not isinstance(judged.grad_norm, torch.Tensor) else row[3]
                )
                p.verdict = self.guard.judge(judged, row[0], None if norm is None else float(norm))
            else:
                p.verdict = judged

    def flush(self) -> list[StepOutput]:
        """Every recorded step as a StepOutput, in step order, each once."""
        self.read()
        outs = [self._output(p) for p in self._steps]
        self._steps.clear()
        return outs

    def drop(self) -> None:
        """Forget the steps not yet published (a run that failed on the device)."""
        self._steps.clear()
        self._unread = 0

    def _output(self, p: _Pending) -> StepOutput:
        r, v = p.record, p.verdict
        loss, token_sum, z_term, _ = p.host
        grad_norm = None if v is None else v.grad_norm
        scalars = {**r.scalars, "train/loss": loss}
        if grad_norm is not None:
            scalars["train/grad_norm"] = grad_norm
        if self.z_loss:
            scalars["train/z_loss"] = z_term
        scalars["progress/batch_token_sum"] = token_sum
        events = list(r.events)
        if v is not None:
            spike_scalars, lines = spike_report(v, r.log)
            scalars.update(spike_scalars)
            events += [("spikes", line) for line in lines]
        return StepOutput(
            step=r.step,
            loss=loss,
            grad_norm=grad_norm,
            lr=r.lr,
            tokens=r.tokens,
            batch_token_sum=token_sum,
            stopping=r.stopping,
            log=r.log,
            verdict=v,
            evaluation=None if r.evaluation is None else MappingProxyType(dict(r.evaluation)),
            eval_seconds=r.eval_seconds,
            scalars=MappingProxyType(scalars),
            events=tuple(events),
            images=MappingProxyType(dict(r.images)),
        )


__all__ = ["VALUE_NAMES", "StepMetrics", "StepOutput", "StepRecord", "spike_report"]
