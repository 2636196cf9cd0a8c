"""Validation loss, perplexity and bits per token / byte / character (valid/*)."""

from __future__ import annotations

from typing import Any

from pretrain.eval.metrics import evaluate_loss
from pretrain.train.evaluators.base import Evaluator
from pretrain.train.metrics import StepRecord


class Validation(Evaluator):
    """Every train.eval_interval steps and at the last, over the same train.eval_iters
    global batches of validation data each time; all-reduced over the ranks."""

    def __init__(self, interval: int) -> None:
        self.interval = interval

    def due(self, step: int, last: bool, stopping: bool) -> bool:
        return step % self.interval == 0 or last

    def run(self, trainer: Any, record: StepRecord) -> dict[str, float]:
        run, cfg = trainer.run, trainer.cfg
        batches = run.data.valid_batches(cfg, run.env, cfg.train.eval_iters * run.grad_accum)
        results = evaluate_loss(run.module.model, batches, **run.text_units)
        results.pop("tokens", None)
        return {f"valid/{k}": v for k, v in results.items()}
