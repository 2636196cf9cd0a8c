"""The training module: what one optimizer step does to the model, beside the loop.

`TrainModule` owns the DeepSpeed engine, the forward and backward of each micro batch, the
optimizer step and the loss-spike guard that may withhold it. The loop (trainer.py) decides
when to step, what data to read, when to save, evaluate and roll back; it never touches the
engine's numerics. (OLMo-core splits its Trainer and TrainModule the same way.)

    module = TrainModule(cfg, engine, world_size, faults)
    for each micro batch:  loss, z = module.forward_backward(x, y, data_step, micro)
                           module.micro_step()            # not on the last micro batch
    verdict = module.optimizer_step(step, data_step, loss) # the guard may skip the update
"""

from __future__ import annotations

import time
from typing import Any

import torch

from pretrain.config import Config
from pretrain.data.documents import model_inputs_of
from pretrain.faults import DataFaults
from pretrain.model.transformer import Transformer
from pretrain.train.spikes import StepGuard, Verdict


class TrainModule:
    def __init__(self, cfg: Config, engine: Any, world_size: int, faults: DataFaults) -> None:
        self.cfg = cfg
        self.engine = engine
        self.model: Transformer = engine.module
        self.faults = faults
        self.guard = StepGuard(cfg.spikes, world_size)
        self.guard.install(engine)
        # This rank's own time since SpeedMonitor last took it: reading its micro batches
        # (the trainer adds it) and their forward passes, which no other rank can hold up
        # (no collective in a forward under ZeRO 0-2). Host clock: on a GPU, a slow host shows.
        self.own_seconds = 0.0

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
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Loss of one micro batch and its backward (DeepSpeed reduces the gradients at the
        accumulation boundary). Returns the detached cross-entropy and z-loss term in fp64.
        `batch` gives the document inputs where the data switches are on (document ids,
        positions). A configured fault (spikes.faults) corrupts the batch or the loss on
        purpose, or stalls this rank."""
        t0 = time.perf_counter()
        self.faults.stall(data_step, micro)  # an injected hang or slow rank
        documents = model_inputs_of(batch or {}, x.device)
        x, y = self.faults.batch(x, y, data_step, micro)
        loss, z_term = self.engine(x, targets=y, z_loss=self.cfg.train.z_loss, **documents)
        self.own_seconds += time.perf_counter() - t0
        loss, objective = self.faults.loss(loss, data_step)
        self.engine.backward(objective)
        z_term = z_term.double()
        return loss.detach().double() - z_term, z_term

    def micro_step(self) -> None:
        """DeepSpeed counts micro steps; off the accumulation boundary it updates nothing."""
        self.engine.step()

    def optimizer_step(self, step: int, data_step: int, loss: float) -> Verdict:
        """The update, unless the guard judges the step a spike (loss known, grad norm after
        the engine computed it) and withholds it."""
        self.guard.begin(step, data_step, loss)
        self.engine.step()
        return self.guard.finish()

    def rollback_due(self, step: int) -> tuple[int, int] | None:
        return self.guard.rollback_due(step)

    def forget_flags(self) -> None:
        self.guard.forget_flags()

    def state_dict(self) -> dict[str, Any]:
        return self.guard.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.guard.load_state_dict(state)


__all__ = ["TrainModule"]
