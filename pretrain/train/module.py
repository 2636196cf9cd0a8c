"""The training module: what one optimizer step does to the model, beside the loop.

`TrainModule` owns the DeepSpeed engine, the forward and backward of each micro batch, the
optimizer step and the loss-spike guard that may withhold it, and records each step's
values (pretrain/train/metrics.py). The loop (trainer.py) decides when to step, what data
to read, when to save, evaluate and roll back; it never touches the engine's numerics.
(OLMo-core splits its Trainer and TrainModule the same way.)

    module = TrainModule(cfg, engine, world_size, faults)
    module.metrics.open(step)
    for each micro batch:  module.forward_backward(x, y, data_step, micro)  # loss recorded
                           module.micro_step()            # not on the last micro batch
    sums = all_reduce_named({stop, loss})                 # the trainer's one collective
    stopping = module.stop_requested(sums["stop"])        # the previous step's flag, no wait
    module.optimizer_step(record, data_step, loss)        # the guard may skip the update;
                                                          # the grad norm recorded, row closed
    module.settle()                                       # at flushes and saves: read, judged
    module.metrics.flush()                                # at logging steps: StepOutputs, once

No wait for the GPU per step: the step's values stay on the device until the trainer's
flush (metrics.py says when and why). The pre-emption flag is needed every step: it is
copied to the host without waiting, and read one step later (`stop_requested`). What still
waits: the guard with spikes.skip_step (StepGuard.synchronous),
DeepSpeed's own overflow check of bf16 ZeRO 0/1 and fp32 ZeRO 1/2 (a host read of a flag in
its step), the first step's stop flag, and what a callback reads (evaluation, probes).
tests/test_train_module.py counts the host reads of a run.
"""

from __future__ import annotations

from typing import Any

import torch

from pretrain.config import Config
from pretrain.data.documents import model_inputs_of
from pretrain.faults import DataFaults
from pretrain.model.transformer import Transformer
from pretrain.train.metrics import GRAD_NORM, LOSS, PendingStep, StepMetrics, StepRecord
from pretrain.train.spikes import StepGuard, Unjudged
from pretrain.train.step_parts import PartTimer


class TrainModule:
    def __init__(
        self,
        cfg: Config,
        engine: Any,
        world_size: int,
        faults: DataFaults,
    ) -> None:
        self.cfg = cfg
        self.engine = engine
        self.model: Transformer = engine.module
        self.faults = faults
        self.world_size = world_size
        self.guard = StepGuard(cfg.spikes, world_size)
        self.guard.install(engine)
        # Where this rank's step time goes (pretrain/train/step_parts.py), read by SpeedMonitor
        # at logging steps: the trainer times reading the batches and its collective, the
        # module the forward, backward and optimizer parts.
        self.timer = PartTimer(next(self.model.parameters()).device)
        self.metrics = StepMetrics(next(self.model.parameters()).device, world_size)
        self._stop_copy: tuple[torch.Tensor, Any] | None = None  # (host copy, CUDA event)

    @property
    def lr(self) -> float:
        """The scheduler's rate for the next update."""
        return self.engine.get_lr()[0]

    def forward_backward(
        self,
        x: torch.Tensor,
        y: torch.Tensor,
        data_step: int,
        micro: int,
        batch: dict[str, Any] | None = None,
    ) -> None:
        """Loss of one micro batch and its backward (DeepSpeed reduces the gradients at the
        accumulation boundary); the cross-entropy (and the z-loss term) recorded as the step's
        train/loss (train/z_loss), averaged over the micro batches and the ranks.
        `batch` gives the document inputs where the data switches are on (document ids,
        positions). A configured fault (spikes.faults) corrupts the batch or the loss on
        purpose, or stalls this rank."""
        with self.timer.part("forward"):
            self.faults.stall(data_step, micro)  # an injected hang or slow rank
            documents = model_inputs_of(batch or {}, x.device)
            x, y = self.faults.batch(x, y, data_step, micro)
            loss, z_term = self.engine(x, targets=y, z_loss=self.cfg.train.z_loss, **documents)
        loss, objective = self.faults.loss(loss, data_step)
        with self.timer.part("backward"):
            self.engine.backward(objective)
        # The loss reported is the cross-entropy; the z term has a metric of its own.
        z_term = z_term.detach().double()
        self.metrics.record(LOSS, loss.detach().double() - z_term, "mean")
        if self.cfg.train.z_loss:
            self.metrics.record("train/z_loss", z_term, "mean")

    def micro_step(self) -> None:
        """DeepSpeed counts micro steps; off the accumulation boundary it updates nothing."""
        with self.timer.part("optimizer"):
            self.engine.step()

    def optimizer_step(self, record: StepRecord, data_step: int, loss: torch.Tensor) -> None:
        """The update, unless the guard judges the step a spike and withholds it
        (spikes.skip_step; `loss`, the step's all-reduced mean loss, is what it judges
        then). The step's gradient norm is recorded (inf where DeepSpeed skipped the update),
        and the step's values closed (StepMetrics.close)."""

        def run_step() -> None:
            with self.timer.part("optimizer"):
                self.engine.step()

        judged, norm = self.guard.guarded_step(record.step, data_step, loss, run_step)
        if norm is not None:
            self.metrics.record(GRAD_NORM, norm, "max")  # global: the same on every rank
        self.metrics.close(record, judged)

    def settle(self) -> None:
        """The steps not yet read brought to the host (one transfer) and judged by the guard."""
        settle(self.metrics.read(), self.guard)

    def stop_requested(self, flag: torch.Tensor) -> bool:
        """Whether a rank asked to stop (`flag`: this step's all-reduced "signal received",
        > 0 if any). The flag is copied to the host without waiting (pinned memory and an
        event on CUDA) and the answer is the previous step's copy, which has long arrived:
        every rank reads the same all-reduced value at the same step, so all stop after the
        same step, one step after the signal. The first step after set-up has no previous
        copy and waits for its own (once)."""
        copy = torch.empty(flag.shape, dtype=flag.dtype, pin_memory=flag.is_cuda)
        copy.copy_(flag, non_blocking=True)
        event = torch.cuda.Event() if flag.is_cuda else None
        if event is not None:
            event.record()
        previous, self._stop_copy = self._stop_copy or (copy, event), (copy, event)
        if previous[1] is not None:
            previous[1].synchronize()
        return previous[0].item() > 0

    def rollback_due(self) -> tuple[int, int, int] | None:
        return self.guard.rollback_due()

    def forget_flags(self) -> None:
        self.guard.forget_flags()

    def state_dict(self) -> dict[str, Any]:
        """The guard's history; every step taken must be settled (its windows hold them)."""
        self._check_settled()
        return self.guard.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._check_settled()  # steps taken before the load are judged by the guard they met
        self.guard.load_state_dict(state)

    def _check_settled(self) -> None:
        if self.metrics.unsettled:
            raise RuntimeError(
                f"the guard's state is read before steps {self.metrics.unsettled} were judged "
                f"(TrainModule.settle)"
            )


def settle(steps: list[PendingStep], guard: StepGuard) -> None:
    """Each step's verdict: the guard's from inside the step, or the guard judges the step's
    host values now, in step order (the detectors' windows): the same inputs in the same
    order as a guard judging inside each step."""
    for p in steps:
        judged = p.judged
        if isinstance(judged, Unjudged):
            p.verdict = guard.judge(judged, p.host[LOSS], p.host.get(GRAD_NORM))
        else:
            p.verdict = judged
