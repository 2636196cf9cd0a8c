"""Callbacks: everything the training loop does besides the step itself.

The config chooses them (`build_callbacks`): the built-in ones below, configured by the
`logging` and `train` sections, then the user's own from `callbacks:` (a dotted class path
and its arguments), which run after the built-in ones: in on_step_end they see every
built-in host scalar of the step and may add their own; in on_values every scalar of the
finished step. A `callbacks:` entry may also name an evaluator (pretrain/train/evaluators/):
the trainer runs it on its schedule; or a sink (pretrain/train/publish.py): every record of
the run is written to it. Checkpoints, evaluations and the sinks (console, metrics file,
TensorBoard, W&B) are not callbacks: the trainer owns them as components
(pretrain/train/checkpoint_schedule.py, pretrain/train/evaluators/, pretrain/train/sinks.py).
"""

from __future__ import annotations

import importlib
import inspect
from typing import Any

from pretrain.config import ConfigError
from pretrain.exit_codes import EXIT_OK
from pretrain.train.callbacks.base import Callback, StepOutput, StepRecord
from pretrain.train.callbacks.hang import HangWatchdog
from pretrain.train.callbacks.max_logit import MaxLogitMonitor
from pretrain.train.callbacks.preemption import Preemption
from pretrain.train.callbacks.samples import Samples
from pretrain.train.callbacks.speed import SpeedMonitor
from pretrain.train.evaluators import Evaluator, Validation
from pretrain.train.publish import Sink


def build_callbacks(cfg) -> list[Callback]:
    """The callbacks a config asks for, in the order they run on each hook (the evaluators
    among `callbacks:` are the trainer's: `build_evaluators`)."""
    log, t = cfg.logging, cfg.train
    # The watchdog first: a step's heartbeat before anything else, the end too.
    out: list[Callback] = (
        [HangWatchdog(t.hang_timeout, t.hang_timeout_long)] if t.hang_timeout else []
    )
    out += [Preemption(), SpeedMonitor()]
    if log.max_logit_interval > 0:
        out.append(MaxLogitMonitor(log.max_logit_interval))
    for i, spec in enumerate(cfg.callbacks):
        cls = callback_class(spec, f"callbacks[{i}]")
        if issubclass(cls, Callback):
            out.append(cls(**{k: v for k, v in spec.items() if k != "class"}))
    out.append(Samples())
    out.append(_EndSummary())
    return out


def callback_class(spec: dict[str, Any], key: str = "callbacks[0]") -> type:
    """The class a `callbacks:` entry names, after checking that it exists, is a Callback,
    and accepts the entry's other keys as constructor arguments."""
    path = spec.get("class")
    if not isinstance(path, str) or "." not in path:
        raise ConfigError(
            f"{key}.class={path!r} must name a class by its dotted path, "
            f"e.g. {{class: mylab.callbacks.MyCallback}}"
        )
    module_name, _, name = path.replace(":", ".").rpartition(".")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ConfigError(
            f"{key}.class={path!r}: cannot import {module_name} ({e}); put it on PYTHONPATH "
            f"or install its package"
        ) from None
    cls = getattr(module, name, None)
    if not (isinstance(cls, type) and issubclass(cls, Callback | Evaluator | Sink)):
        raise ConfigError(
            f"{key}.class={path!r} is not a subclass of pretrain.train.callbacks.Callback, "
            f"pretrain.train.evaluators.Evaluator or pretrain.train.publish.Sink"
        )
    kwargs = {k: v for k, v in spec.items() if k != "class"}
    try:
        inspect.signature(cls).bind(**kwargs)
    except TypeError as e:
        raise ConfigError(f"{key}: {path} does not accept {sorted(kwargs)} ({e})") from None
    return cls


def build_evaluators(cfg, eval_enabled: bool) -> list[Evaluator]:
    """The evaluators a run has: validation (train.eval_interval), the `callbacks:` entries
    that name an evaluator, and the downstream tasks (`downstream.tasks`). Without
    validation data only the downstream tasks run: the others score it."""
    downstream: list[Evaluator] = []
    if cfg.downstream.tasks:
        # Imported here: only a run that asks for downstream tasks loads lm-eval.
        from pretrain.train.evaluators.downstream import DownstreamEvaluation

        downstream.append(DownstreamEvaluation(cfg.downstream))
    if not eval_enabled:
        return downstream
    out: list[Evaluator] = [Validation(cfg.train.eval_interval)]
    for i, spec in enumerate(cfg.callbacks):
        cls = callback_class(spec, f"callbacks[{i}]")
        if issubclass(cls, Evaluator):
            out.append(cls(**{k: v for k, v in spec.items() if k != "class"}))
    return out + downstream


class _EndSummary(Callback):
    """Where the results are, once a run has finished."""

    def on_fit_end(self, trainer, exit_code) -> None:
        if exit_code == EXIT_OK and trainer.train_started:
            trainer.log(f"TensorBoard: tensorboard --logdir {trainer.layout.root}")
            trainer.log(f"metrics:     {trainer.layout.metrics}")


__all__ = [
    "Callback",
    "callback_class",
    "HangWatchdog",
    "MaxLogitMonitor",
    "Preemption",
    "Samples",
    "SpeedMonitor",
    "StepOutput",
    "StepRecord",
    "build_callbacks",
    "build_evaluators",
]
