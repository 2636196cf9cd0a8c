"""Loss by position during training (optional): how the model's use of context develops.

    callbacks:
      - {class: pretrain.train.evaluators.PositionEvaluation, interval: 500}

Every `interval` steps (and at the last, and before a pre-emption's stop) it scores the
validation batches the validation uses (train.eval_iters global batches) once more, keeping
each token's loss by its position (pretrain/eval/positions.py), on every rank, all-reduced.
Scalars valid_position/START-END for a few ranges of positions (the first 16, up to 256,
then by octave up to the training length) go to the metrics file and TensorBoard, and the
whole curve goes to TensorBoard as an image (tag valid_position/curve), drawn by the same
code as the offline tool's plot (pretrain/eval/position_plots.py).
"""

from __future__ import annotations

from typing import Any

from pretrain.config import ConfigError
from pretrain.eval.metrics import evaluate_loss
from pretrain.eval.position_plots import curve_image
from pretrain.eval.positions import PositionLosses, position_ranges
from pretrain.train.evaluators.base import Evaluator
from pretrain.train.metrics import StepRecord


class PositionEvaluation(Evaluator):
    def __init__(self, interval: int = 1000) -> None:
        if not isinstance(interval, int) or interval <= 0:
            raise ConfigError(
                f"PositionEvaluation interval={interval!r} must be a positive step count"
            )
        self.interval = interval
        self.image = False

    def setup(self, trainer: Any) -> None:
        self.image = trainer.is_main and trainer.cfg.logging.tensorboard

    def due(self, step: int, last: bool, stopping: bool) -> bool:
        return step % self.interval == 0 or last or stopping

    def run(self, trainer: Any, record: StepRecord) -> dict[str, float]:
        run, cfg = trainer.run, trainer.cfg
        batches = run.data.valid_batches(cfg, run.env, cfg.train.eval_iters * run.grad_accum)
        stats = PositionLosses(cfg.seq_len)
        evaluate_loss(run.module.model, batches, positions=stats)
        sums, counts = stats.sums.cpu(), stats.counts.cpu()
        out = {}
        for a, b in position_ranges(stats.length):
            n = float(counts[a:b].sum())
            if n:
                out[f"valid_position/{a}-{b}"] = float(sums[a:b].sum()) / n
        if self.image:
            record.images["valid_position/curve"] = curve_image(stats, record.step)
        return out
