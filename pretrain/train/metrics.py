"""One path for a step's values: recorded by name on the device, read once, published once.

    StepRecord     what the loop knows of a step on the host as it ends (step, lr, tokens,
                   stopping, evaluation results); callbacks add host scalars to it in
                   on_step_end (speed, attention logits, a user's own)
    StepMetrics    the steps taken and not yet published: each step's named device scalars
                   (the names the sinks write: train/loss, progress/batch_token_sum, ...)
                   and the spike guard's verdict or the values it will judge. `read()`
                   brings the unread steps to the host in one transfer and returns them
                   (nothing else: TrainModule.settle hands their values to the guard);
                   `flush()` returns every step, settled, as a StepOutput, in step order,
                   exactly once (pretrain/train/publish.py sends them to the sinks)

Why on the device until a flush: on a GPU, reading a value the step computed (`float(loss)`)
waits until the GPU has run everything queued before it, and the GPU then idles while the
host queues the next step's kernels. The trainer flushes at logging steps
(logging.log_interval) and before anything that needs every step judged or on disk: an
evaluation, a save, a stop, a rollback, the end of the run. A save needs the guard's history
up to its step but must not publish (a user's callback may save from on_step_end, before
the step's other callbacks added their scalars): the trainer settles the steps only. The
pre-emption flag is needed every step and goes its own way (TrainModule.stop_requested).
tests/test_train_module.py counts the host reads of a run.

OLMo-core's trainer has the same shape: modules record metrics as device tensors, the
trainer reduces and reads them at its log interval and hands callbacks plain floats.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING

import torch

from pretrain.train.records import StepOutput

if TYPE_CHECKING:
    import numpy as np

    from pretrain.train.spikes import Unjudged, Verdict

# What the guard judges: published from its verdict (a norm DeepSpeed skipped on is inf).
LOSS, GRAD_NORM = "train/loss", "train/grad_norm"


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
class PendingStep:
    """A step taken and not yet published."""

    record: StepRecord
    names: tuple[str, ...]  # of `values`' rows
    values: torch.Tensor  # float64, one per name, on the device
    judged: Verdict | Unjudged
    host: dict[str, float] | None = None  # `values` by name, once read
    verdict: Verdict | None = None  # once judged (TrainModule.settle)


class StepMetrics:
    """The steps taken and not yet published; see the module docstring."""

    def __init__(self) -> None:
        self._steps: list[PendingStep] = []
        self._unread = 0  # the newest steps whose values are still on the device

    def record(
        self, record: StepRecord, values: dict[str, torch.Tensor], judged: Verdict | Unjudged
    ) -> None:
        """A step's named device scalars (0-d tensors) and the guard's verdict, or the
        values it will judge, kept until published."""
        row = torch.stack([v.reshape(()).to(torch.float64) for v in values.values()])
        self._steps.append(PendingStep(record, tuple(values), row, judged))
        self._unread += 1

    @property
    def pending(self) -> int:
        """Steps recorded and not yet published."""
        return len(self._steps)

    @property
    def unsettled(self) -> list[int]:
        """The steps the guard has not judged yet."""
        return [p.record.step for p in self._steps if p.verdict is None]

    def read(self) -> list[PendingStep]:
        """The unread steps, their values brought to the host in one transfer."""
        if not self._unread:
            return []
        todo = self._steps[-self._unread :]
        self._unread = 0
        # Steps may differ in names only if the config changed mid-run, which it cannot.
        rows = torch.stack([p.values for p in todo]).tolist()
        for p, row in zip(todo, rows, strict=True):
            p.host = dict(zip(p.names, row, strict=True))
        return todo

    def flush(self) -> list[StepOutput]:
        """Every recorded step as a StepOutput, in step order, each once. Each must be
        settled (read and judged) first."""
        if self.unsettled:
            raise RuntimeError(f"steps {self.unsettled} published before the guard judged them")
        outs = [_output(p) for p in self._steps]
        self._steps.clear()
        return outs

    def drop(self) -> None:
        """Forget the steps not yet published (a run that failed on the device)."""
        self._steps.clear()
        self._unread = 0


def _output(p: PendingStep) -> StepOutput:
    r, v = p.record, p.verdict
    scalars = {**r.scalars, LOSS: v.loss}
    if v.grad_norm is not None:
        scalars[GRAD_NORM] = v.grad_norm
    scalars.update((k, x) for k, x in p.host.items() if k not in (LOSS, GRAD_NORM))
    spike_scalars, lines = spike_report(v, r.log)
    scalars.update(spike_scalars)
    return StepOutput(
        step=r.step,
        log=r.log,
        scalars=MappingProxyType(scalars),
        verdict=v,
        events=(*r.events, *(("spikes", line) for line in lines)),
        images=MappingProxyType(dict(r.images)),
    )


__all__ = ["GRAD_NORM", "LOSS", "PendingStep", "StepMetrics", "StepRecord", "spike_report"]
