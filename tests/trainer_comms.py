"""What the trainer's own code sends in training steps: its collectives, not DeepSpeed's
(a test's measurement: it runs the whole trainer, which pretrain.measure may not import).

`measure(configs, world_size)` starts `world_size` CPU ranks (gloo) and in each trains every
config with the real `Trainer` (its callbacks and sinks as the config builds them, random
tokens, no checkpoints) with torch.distributed's collectives wrapped: every call from the
first step on is recorded with the trainer's step at the time, its op, its bytes (the
tensor's; an all_gather's input: what the rank sends, as DeepSpeed's logger counts it) and
the functions of this package that made it. A call made for DeepSpeed (from
`deepspeed.comm`, which its own comms logger records: pretrain/measure/deepspeed_comms.py) is
left out. The planner's trainer collectives (`trainer_collectives` in
pretrain/planner/comms.py) are checked against it exactly (tests/test_plan_comms.py). Run as
a script to print what 2 ranks send in 4 steps of the test model:

    .venv/bin/python tests/trainer_comms.py

Recorded from the first step's start (after the set-up's collectives: the process group,
the data, the host names) to the run's end (before the last barrier).
"""

from __future__ import annotations

import functools
import json
import os
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp
from warm_start import rank_vars

from pretrain.config import Config, from_dict, to_dict
from pretrain.data.dataset import make_loader
from pretrain.data.pipeline import DataSource
from pretrain.measure.deepspeed_comms import free_port
from pretrain.measure.measured_run import RandomTokens
from pretrain.train import deepspeed_adapter
from pretrain.train.callbacks import Callback, build_callbacks
from pretrain.train.trainer import Trainer

# the collectives torch.distributed offers that this toolkit or DeepSpeed call
WRAPPED = (
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_object",
    "broadcast",
    "broadcast_object_list",
    "reduce",
    "reduce_scatter_tensor",
    "barrier",
)
PACKAGE = str(Path(__file__).resolve().parents[1] / "pretrain")


@dataclass(frozen=True)
class Call:
    step: int  # the trainer's step when the call was made (steps done, the current included)
    op: str
    size: int  # bytes of the tensor (all_gather: the rank's input); 0 for objects, barriers
    by: str  # this package's functions that made it, innermost first


def _tensor_bytes(op: str, args: tuple, kwargs: dict) -> int:
    if op in ("all_gather", "all_gather_into_tensor"):
        t = kwargs.get("tensor", kwargs.get("input_tensor", args[1] if len(args) > 1 else None))
    else:
        t = kwargs.get("tensor", args[0] if args else None)
    return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0


def _callers() -> tuple[bool, str]:
    """(made for DeepSpeed, this package's functions on the stack, innermost first)."""
    frame = sys._getframe(2)
    ours: list[str] = []
    deepspeed = False
    while frame is not None:
        path = frame.f_code.co_filename
        if "deepspeed" in Path(path).parts and not ours:
            deepspeed = True
        if path.startswith(PACKAGE):
            ours.append(frame.f_code.co_name)
        frame = frame.f_back
    return deepspeed, "<".join(ours[:4])


class Recorder:
    """torch.distributed's collectives wrapped; calls recorded while `on`."""

    def __init__(self) -> None:
        self.calls: list[Call] = []
        self.trainer: Any = None
        self.on = False

    def install(self) -> None:
        for op in WRAPPED:
            setattr(torch.distributed, op, self._wrap(op, getattr(torch.distributed, op)))

    def _wrap(self, op: str, original):
        @functools.wraps(original)
        def wrapped(*args, **kwargs):
            if self.on:
                deepspeed, by = _callers()
                if not deepspeed:
                    size = _tensor_bytes(op, args, kwargs)
                    self.calls.append(Call(self.trainer.step, op, size, by))
            return original(*args, **kwargs)

        return wrapped


def _worker(rank: int, world_size: int, port: int, configs: dict, out: str) -> None:
    os.environ.update(
        rank_vars(rank, world_size, str(port)),
        LOCAL_WORLD_SIZE=str(world_size),
        OMP_NUM_THREADS="1",
    )
    torch.set_num_threads(1)
    deepspeed_adapter.quiet_logs()
    recorder = Recorder()
    recorder.install()

    class Bracket(Callback):
        """Records from the first step (after every set-up hook) to the run's end."""

        def on_train_start(self, trainer) -> None:
            recorder.trainer, recorder.on = trainer, True

        def on_fit_end(self, trainer, exit_code) -> None:
            recorder.on = False

    results = {}
    for name, data in configs.items():
        cfg = from_dict(Config, data)
        t = cfg.train
        tokens = RandomTokens(
            t.train_iters * t.global_batch_size, cfg.seq_len, cfg.model.vocab_size
        )
        recorder.calls = []
        trainer = Trainer(
            cfg,
            DataSource(tokens, None, make_loader),
            callbacks=[*build_callbacks(cfg), Bracket()],
            save_checkpoints=False,
        )
        trainer.fit()
        results[name] = [c.__dict__ for c in recorder.calls]
    Path(out, f"rank{rank}.json").write_text(json.dumps(results))
    torch.distributed.destroy_process_group()


def measure(configs: dict[str, Config], world_size: int) -> dict[str, list[list[Call]]]:
    """Every config trained on `world_size` CPU ranks: per config, each rank's calls in order.
    Each config's logging.run_dir is replaced by a temporary folder."""
    with tempfile.TemporaryDirectory() as out:
        data = {}
        for name, cfg in configs.items():
            d = to_dict(cfg)
            d["logging"]["run_dir"] = str(Path(out, name))
            data[name] = d
        mp.spawn(_worker, (world_size, free_port(), data, out), nprocs=world_size)
        ranks = [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(world_size)]
    return {name: [[Call(**c) for c in rank[name]] for rank in ranks] for name in configs}


if __name__ == "__main__":
    from test_plan_comms import trainer_config

    for name, ranks in measure({"fp32_zero1": trainer_config(2)}, 2).items():
        for call in ranks[0]:
            print(name, call)
