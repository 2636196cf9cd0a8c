"""The path of one step's loss from the model to a sink, measured: which of our objects hold
it on the way (docs/architecture.md, "The loss's path, measured").

`trace_loss_path(cfg)` trains one step with the model's loss replaced by a marker value
(its gradient kept) and follows the marker under `sys.settrace`: at every line of our
code (pretrain/), it looks at the frame's locals and at the attributes of the objects they
name, and notes each place that holds the marker, as a number, in a tensor of up to a few
thousand elements, or inside a dict, list, tuple or deque two levels down. Holders are
named "Class.attribute" (an object's: what outlives a call, what the docs count) or
"function:variable" (a local, reported apart). The path ends at the TensorBoard sink's
write, where the value leaves for the event file. Run it as a script to print the path:

    .venv/bin/python tests/value_path.py
"""

from __future__ import annotations

import sys
from collections import deque
from pathlib import Path
from typing import Any

import torch

MARK = 4321.0  # exact in fp32 (the traced run's precision) and far from any real loss
PACKAGE = str(Path(__file__).resolve().parents[1] / "pretrain")


def _holds(value: Any, depth: int = 2) -> bool:
    """`value` is the marker, or a tensor, dict, list or tuple (two levels) that holds it
    directly; an object of ours that holds it is a holder of its own."""
    if isinstance(value, float):
        return value == MARK
    if isinstance(value, torch.Tensor):
        return (
            0 < value.numel() <= 4096
            and value.device.type != "meta"
            and bool((value.detach() == MARK).any())
        )
    if depth == 0:
        return False
    if isinstance(value, dict) or type(value).__name__ == "mappingproxy":
        return any(_holds(v, depth - 1) for v in list(value.values())[:64])
    if isinstance(value, (list, tuple, deque)):
        return any(_holds(v, depth - 1) for v in list(value)[:128])
    return False


def _ours(obj: Any) -> bool:
    return type(obj).__module__.startswith("pretrain.")


class PathTracer:
    """The holders of MARK, in the order first seen."""

    def __init__(self) -> None:
        self.attributes: list[str] = []
        self.locals: list[str] = []
        self.done = False

    def _note(self, where: list[str], name: str) -> None:
        if name not in where:
            where.append(name)

    def _scan(self, frame) -> None:
        code = frame.f_code
        for name, value in list(frame.f_locals.items()):
            if _holds(value):
                self._note(self.locals, f"{code.co_qualname}:{name}")
            if _ours(value) and hasattr(value, "__dict__"):
                for attr, v in list(vars(value).items()):
                    if _holds(v):
                        self._note(self.attributes, f"{type(value).__name__}.{attr}")
        if code.co_qualname == "TensorBoard.write" and any(
            _holds(v) for v in frame.f_locals.values()
        ):
            self.done = True

    def local_trace(self, frame, event, arg):
        if not self.done and event in ("line", "return"):
            self._scan(frame)
        return self.local_trace

    def global_trace(self, frame, event, arg):
        if self.done or not frame.f_code.co_filename.startswith(PACKAGE):
            return None
        return self.local_trace


def trace_loss_path(cfg) -> PathTracer:
    """Train `cfg` for one step, the loss replaced by MARK, and trace where MARK goes."""
    from pretrain.model.transformer import Transformer
    from pretrain.train.trainer import Trainer

    forward = Transformer.forward

    def marked(self, *args, **kwargs):
        out = forward(self, *args, **kwargs)
        if kwargs.get("targets") is None:
            return out
        loss, z = out
        return loss * 0 + MARK + z, z  # the marker, its gradient (zero) kept

    tracer = PathTracer()
    Transformer.forward = marked  # type: ignore[method-assign]
    try:
        trainer = Trainer(cfg, save_checkpoints=False)
        sys.settrace(tracer.global_trace)
        try:
            trainer.fit()
        finally:
            sys.settrace(None)
    finally:
        Transformer.forward = forward  # type: ignore[method-assign]
    return tracer


def main() -> None:
    import tempfile

    from train_support import prepare_stdlib, tiny_config

    from pretrain.config import Config, from_dict

    with tempfile.TemporaryDirectory() as tmp:
        data = prepare_stdlib(Path(tmp) / "data")
        raw = tiny_config(
            Path(tmp) / "run",
            data,
            train={"train_iters": 2, "eval_interval": 0, "hang_timeout": 0},
            schedule={"warmup_steps": 1},
            logging={"log_interval": 1, "max_logit_interval": 0},
        )
        tracer = trace_loss_path(from_dict(Config, raw))
    print(f"holders ({len(tracer.attributes)}), model to TensorBoard:")
    for i, name in enumerate(tracer.attributes, 1):
        print(f"  {i}. {name}")
    print(f"locals on the way ({len(tracer.locals)}): " + ", ".join(tracer.locals))


if __name__ == "__main__":
    main()
