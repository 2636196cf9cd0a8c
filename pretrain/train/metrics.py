"""One path for a step's values: recorded by name on the device, reduced and read once,
published once.

    StepRecord     what the loop knows of a step on the host as it ends (step, lr, tokens,
                   stopping, evaluation results); callbacks add host scalars to it in
                   on_step_end (speed, attention logits, a user's own)
    StepMetrics    the step being taken and the steps taken and not yet published.
                   `record(name, value, reduce)` from anywhere in the step, on every rank
                   (train/loss and train/z_loss per micro batch, progress/batch_token_sum,
                   train/grad_norm, a user's own): combined within the step and over the
                   ranks by `reduce` (mean, sum, max, min); `close` ends the step's row.
                   `read()` reduces the unread steps over the ranks in one collective,
                   brings them to the host in one transfer and returns them (nothing else:
                   TrainModule.settle hands their values to the guard); `flush()` returns
                   every step, settled, as a StepOutput, in step order, exactly once
                   (pretrain/train/publish.py sends them to the sinks)

Why on the device until a flush: on a GPU, reading a value the step computed (`float(loss)`)
waits until the GPU has run everything queued before it, and the GPU then idles while the
host queues the next step's kernels. The trainer flushes at logging steps
(logging.log_interval) and before anything that needs every step judged or on disk: an
evaluation, a save, a stop, a rollback, the end of the run. A save needs the guard's history
up to its step but must not publish (a user's callback may save from on_step_end, before
the step's other callbacks added their scalars): the trainer settles the steps only. The
pre-emption flag is needed every step and goes its own way (TrainModule.stop_requested).
tests/test_train_module.py counts the host reads of a run.

Why by name: a step's row is matched to its names by name, never by position, so a step
that records a value its neighbours do not (a norm DeepSpeed skipped on, a metric of a
later phase) can never shift another's column; a name once recorded is in every later row,
NaN where a step lacks it.

OLMo-core's trainer has the same shape: modules record metrics with their reduction as
device tensors, the trainer reduces all of them in one collective at its log interval and
hands callbacks plain floats.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Literal

import torch
import torch.nn.functional as F

from pretrain.train.records import StepOutput

if TYPE_CHECKING:
    import numpy as np

    from pretrain.train.spikes import Unjudged, Verdict

# What the guard judges (a norm DeepSpeed skipped on is recorded as inf).
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


Reduce = Literal["mean", "sum", "max", "min"]
REDUCTIONS: tuple[Reduce, ...] = ("mean", "sum", "max", "min")


@dataclass
class PendingStep:
    """A step taken and not yet published."""

    record: StepRecord
    values: torch.Tensor  # float64 on the device: the run's first `len(values)` names, in order
    judged: Verdict | Unjudged
    host: dict[str, float] | None = None  # by name, reduced over the ranks, once read
    verdict: Verdict | None = None  # once judged (TrainModule.settle)


class StepMetrics:
    """The steps taken and not yet published; see the module docstring.

    A value is recorded by name with how it combines (`record(name, value, reduce)`), from
    anywhere in the step, on every rank: repeated within a step (once per micro batch) it
    combines by the same reduction (the mean of the micro batches' losses), and at the read
    every rank's step values are combined by it too. Every rank must record the same names
    (the values' collective is the ranks' own, as every collective is). Once recorded, a name
    is in every later step's row: a step that did not record it shows NaN (a non-finite
    value every sink writes), never a missing column; rows are matched by name, never by
    position."""

    def __init__(self, device: torch.device | None = None, world_size: int = 1) -> None:
        self.device = device or torch.device("cpu")
        self.world_size = world_size
        self.kinds: dict[str, Reduce] = {}  # every name recorded in the run, in first-seen order
        self._open: dict[str, tuple[torch.Tensor, int]] = {}  # this step's: (combined, count)
        self._taking: int | None = None  # the step being taken (open ... close)
        self._steps: list[PendingStep] = []
        self._unread = 0  # the newest steps whose values are still on the device

    def open(self, step: int) -> None:
        """Step `step` is being taken: values recorded from now on are its."""
        self._taking, self._open = step, {}

    def record(self, name: str, value: torch.Tensor | float, reduce: Reduce = "mean") -> None:
        """Record `value` (a 0-d tensor, left on its device, or a number) under `name` in the
        step being taken; `reduce` says how records of it combine: within the step and then
        over the ranks. A name keeps the reduction it was first recorded with."""
        if self._taking is None:
            raise RuntimeError(
                f"metric {name!r} recorded between steps: a value of a step is recorded while "
                f"it is taken (its forward, backward and update); a callback's figures after "
                f"the step go into the StepRecord's scalars in on_step_end"
            )
        if reduce not in REDUCTIONS:
            raise ValueError(
                f"metric {name!r}: reduce={reduce!r}; choose one of {', '.join(REDUCTIONS)}"
            )
        kind = self.kinds.setdefault(name, reduce)
        if kind != reduce:
            raise ValueError(
                f"metric {name!r} is recorded with reduce={reduce!r}, but it was recorded with "
                f"reduce={kind!r} before; a name keeps one reduction"
            )
        v = torch.as_tensor(value).detach().to(self.device, torch.float64).reshape(())
        if name in self._open:
            acc, n = self._open[name]
            if kind in ("mean", "sum"):
                acc = acc + v
            else:  # torch.maximum / minimum keep a NaN: a bad value is never hidden
                acc = torch.maximum(acc, v) if kind == "max" else torch.minimum(acc, v)
            self._open[name] = (acc, n + 1)
        else:
            self._open[name] = (v, 1)

    def current(self, name: str) -> torch.Tensor:
        """This rank's value of `name` in the step being taken, so far (not reduced over
        ranks): what the trainer's per-step collective sends of the loss."""
        acc, n = self._open[name]
        return acc / n if self.kinds[name] == "mean" else acc

    def close(self, record: StepRecord, judged: Verdict | Unjudged) -> None:
        """The step is taken: its row holds every name recorded in the run so far (NaN where
        this step recorded none), kept on the device until read."""
        nan = torch.full((), math.nan, dtype=torch.float64, device=self.device)
        row = [self.current(k) if k in self._open else nan for k in self.kinds]
        values = torch.stack(row) if row else torch.zeros(0, dtype=torch.float64)
        self._steps.append(PendingStep(record, values, judged))
        self._open, self._taking = {}, None
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
        """The unread steps, reduced over the ranks in one collective and brought to the host
        in one transfer. Every rank calls it at the same steps."""
        if not self._unread:
            return []
        todo = self._steps[-self._unread :]
        self._unread = 0
        names, width = list(self.kinds), len(self.kinds)
        matrix = torch.stack(
            [
                F.pad(p.values.to(self.device), (0, width - len(p.values)), value=math.nan)
                for p in todo
            ]
        )
        rows = reduce_over_ranks(matrix, [self.kinds[k] for k in names], self.world_size).tolist()
        for p, row in zip(todo, rows, strict=True):
            p.host = dict(zip(names[: len(p.values)], row, strict=False))
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
        self._open, self._taking = {}, None
        self._unread = 0


def reduce_over_ranks(matrix: torch.Tensor, kinds: list[Reduce], world_size: int) -> torch.Tensor:
    """`matrix` (steps x names) combined over the ranks, column by column as `kinds` says, in
    one collective: an all_gather of every rank's matrix (a few hundred bytes a rank at a
    logging step), so that sums, means, maxima and minima need not be one all-reduce each.
    A NaN on any rank stays NaN, whatever the reduction."""
    if world_size == 1 or not torch.distributed.is_initialized():
        return matrix
    parts = [torch.empty_like(matrix) for _ in range(world_size)]
    torch.distributed.all_gather(parts, matrix.contiguous())
    every = torch.stack(parts)
    kind = torch.tensor([REDUCTIONS.index(k) for k in kinds], device=matrix.device)
    total = every.sum(0)
    out = torch.where(kind == 0, total / world_size, total)
    out = torch.where(kind == 2, every.amax(0), out)
    return torch.where(kind == 3, every.amin(0), out)


def _output(p: PendingStep) -> StepOutput:
    r, v = p.record, p.verdict
    scalars = {**r.scalars, **p.host}
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
