"""Checkpoints at checkpoint.interval, at the last step and when a rank is pre-empted.

With checkpoint.async a save returns once the state is copied to host memory; the last
save of a run (the last step, or a pre-emption's) is waited for here, so the run ends (or
exits 99 for a requeue) only with it on disk, and a failed write ends the run with the
same error a synchronous save gives.
"""

from __future__ import annotations

from pretrain.run_layout import CheckpointSaveError, step_tag
from pretrain.train.callbacks.base import Callback, StepOutput


class Checkpointing(Callback):
    def on_train_start(self, trainer) -> None:
        self.last_saved = trainer.step if trainer.resumed_from else None

    def on_step_end(self, trainer, out: StepOutput) -> None:
        t, interval = trainer.cfg.train, trainer.cfg.checkpoint.interval
        if out.stopping or out.step % interval == 0 or out.step == t.train_iters:
            trainer.save()
            self.last_saved = out.step
        if out.stopping or out.step == t.train_iters:
            trainer.run.checkpointer.wait()

    def on_fit_end(self, trainer, exit_code) -> None:
        if exit_code is None and trainer.run is not None:  # an error: let a save in flight land
            try:
                trainer.run.checkpointer.wait()
            except CheckpointSaveError as e:
                trainer.log(f"warning: {e}")
        if exit_code == 0 and trainer.train_started and self.last_saved is not None:
            trainer.log(
                f"checkpoint:  {trainer.layout.checkpoints / step_tag(self.last_saved)} "
                f"(weights: model.safetensors)"
            )
