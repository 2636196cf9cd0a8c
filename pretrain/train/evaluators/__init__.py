"""Evaluators: measurements the trainer runs between steps (base.py says how).

Validation          valid/* every train.eval_interval steps (built in)
PositionEvaluation  loss by position, valid_position/* and a curve image (optional,
                    `callbacks: [{class: pretrain.train.evaluators.PositionEvaluation,
                    interval: 500}]`)
"""

from pretrain.train.evaluators.base import Evaluator, run_due
from pretrain.train.evaluators.positions import PositionEvaluation
from pretrain.train.evaluators.validation import Validation

__all__ = ["Evaluator", "PositionEvaluation", "Validation", "run_due"]
