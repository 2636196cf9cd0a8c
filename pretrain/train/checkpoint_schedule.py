"""When the trainer saves: every checkpoint.interval steps, at the last step, and when a
rank is pre-empted. A component the trainer owns (as its evaluators), not a callback: the
loop asks `due` after the step's values are published, so a checkpoint never holds a step
the metrics file lacks.

With checkpoint.async a save returns once the state is copied to host memory; the last
save of a run (the last step, or a pre-emption's) is waited for here, so the run ends (or
exits 99 for a requeue) only with it on disk, and a failed write ends the run with the
same error a synchronous save gives.
"""

from __future__ import annotations

from typing import Any

from pretrain.run_layout import CheckpointSaveError, step_tag


class CheckpointSchedule:
    def __init__(self, interval: int) -> None:
        self.interval = interval
        self.last_saved: int | None = None

    def start(self, trainer: Any) -> None:
        self.last_saved = trainer.step if trainer.resumed_from else None

    def due(self, step: int, last: bool, stopping: bool) -> bool:
        return stopping or last or step % self.interval == 0

    def save(self, trainer: Any, last: bool, stopping: bool) -> None:
        trainer.save()
        self.last_saved = trainer.step
        if stopping or last:
            trainer.wait_for_saves()

    def end(self, trainer: Any, exit_code: int | None) -> None:
        if exit_code is None and trainer.run is not None:  # an error: let a save in flight land
            try:
                trainer.wait_for_saves()
            except CheckpointSaveError as e:
                trainer.log(f"warning: {e}")
        if exit_code == 0 and trainer.train_started and self.last_saved is not None:
            trainer.log(
                f"checkpoint:  {trainer.layout.checkpoints / step_tag(self.last_saved)} "
                f"(weights: model.safetensors)"
            )
