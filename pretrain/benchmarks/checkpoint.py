"""The training stall of a checkpoint save: synchronous vs `checkpoint.async`.

    python tools/benchmark.py checkpoint                    # 39M parameters, fp32: 0.78 GB a save
    python tools/benchmark.py checkpoint --precision bf16 --optim-impl fused --interval 50 --json out.json
    python tools/benchmark.py checkpoint --dir /scratch/ckpt  # the file system to write to

The same run (random tokens, the real trainer and DeepSpeed engine) is trained twice, with
checkpoint.async off and on, saving every --interval steps; two callbacks take the time at
the end of every step, one just before the checkpointing callback and one after it.
Figures, per mode:

- stall: the time training stands still for a save (between the two callbacks, in a save
  step), the median over the saves (the first is left out, with the first steps, and the
  last: the end of a run waits for it);
- write: for async, from the save step's end to the marker's `saved_at` (written, fsynced,
  checksummed, committed): how long the host copy is held;
- async steps beside a write / alone: the median time of the steps that ended while a
  write was in flight, and of the others, in the same run: what the writer takes from
  training (CPU, memory bandwidth);
- overhead per save: all the steps' time minus as many median steps of the synchronous
  run, over the saves: the whole cost, stall and interference; on a loaded machine the
  load's noise swamps it.

Speed is measured here, never in tests. One run of each mode; on a shared machine repeat it.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

from pretrain.benchmarks.optim import model_section
from pretrain.config import Config, from_dict
from pretrain.data.dataset import make_loader
from pretrain.data.pipeline import DataSource
from pretrain.errors import UserError
from pretrain.measure.measured_run import RandomTokens
from pretrain.run_layout import STATE_FILE, step_tag
from pretrain.train.callbacks import Callback, build_callbacks
from pretrain.train.trainer import train

MODES = ("sync", "async")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--d-model", type=int, default=384, help="model width (default 384)")
    p.add_argument("--layers", type=int, default=6, help="transformer blocks (default 6)")
    p.add_argument("--vocab", type=int, default=32000, help="vocabulary size (default 32000)")
    p.add_argument("--micro-batch", type=int, default=1, help="sequences per step (default 1)")
    p.add_argument("--seq-len", type=int, default=128, help="tokens per sequence (default 128)")
    p.add_argument(
        "--precision", choices=["fp32", "bf16"], default="fp32", help="default fp32 (masters)"
    )
    p.add_argument("--zero-stage", type=int, default=1, help="train.zero_stage (default 1)")
    p.add_argument(
        "--optim-impl",
        choices=["auto", "fused", "foreach", "deepspeed"],
        default="auto",
        help="optim.impl (fused on a GPU skips compiling DeepSpeed's FusedAdam)",
    )
    p.add_argument(
        "--interval", type=int, default=4, help="steps between saves (checkpoint.interval)"
    )
    p.add_argument("--saves", type=int, default=3, help="timed saves per mode")
    p.add_argument(
        "--dir", default=None, help="where the runs write their checkpoints (default: temp dir)"
    )
    p.add_argument("--json", metavar="PATH", help="also write the figures as JSON")


def _config(args: argparse.Namespace, run_dir: str, mode: str) -> Config:
    return from_dict(
        Config,
        {
            "model": model_section(args),
            "data": {"train": [], "valid": []},
            "optim": {"impl": args.optim_impl},
            "schedule": {"warmup_steps": 1},
            "train": {
                # The first save is untimed (the first steps warm up), and the last.
                "train_iters": args.interval * (args.saves + 2),
                "global_batch_size": args.micro_batch,
                "micro_batch_size": args.micro_batch,
                "seq_len": args.seq_len,
                "precision": args.precision,
                "zero_stage": args.zero_stage,
                "eval_interval": 0,
            },
            "checkpoint": {
                "interval": args.interval,
                "keep_last": args.saves + 2,  # every marker stays, for its saved_at
                "resume": False,
                "async": mode == "async",
            },
            "logging": {
                "run_dir": run_dir,
                "tensorboard": False,
                "log_interval": args.interval,
                "max_logit_interval": 0,
            },
        },
    )


class _Clock(Callback):
    """Wall time at every step's end (the last callback; the trainer saves after it), and
    when the step is done: its save returned (on_save), or at its end where it saved none."""

    def __init__(self) -> None:
        self.ended: dict[int, float] = {}
        self.at: dict[int, float] = {}
        self.params = 0

    def on_train_start(self, trainer) -> None:
        self.at[trainer.step] = time.time()
        self.params = sum(p.numel() for p in trainer.run.module.model.parameters())

    def on_step_end(self, trainer, out) -> None:
        self.ended[out.step] = self.at[out.step] = time.time()

    def on_save(self, trainer, folder) -> None:
        self.at[trainer.step] = time.time()


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _measure(args: argparse.Namespace, root: Path, mode: str) -> dict:
    cfg = _config(args, str(root / mode), mode)
    after = _Clock()
    callbacks = [*build_callbacks(cfg), after]
    n = cfg.train.train_iters * cfg.train.global_batch_size
    data = DataSource(RandomTokens(n, cfg.seq_len, cfg.model.vocab_size), None, make_loader)
    train(cfg, data, callbacks=callbacks)
    ends, interval, last = after.at, args.interval, cfg.train.train_iters
    steps = {s: ends[s] - ends[s - 1] for s in ends if s > interval}  # after the first save
    saves = [s for s in steps if s % interval == 0 and s < last]
    folder = root / mode / "checkpoints" / step_tag(last)
    commit_after = [  # from the save step's end to the marker: the write, done
        json.loads((root / mode / "checkpoints" / step_tag(s) / STATE_FILE).read_text())["saved_at"]
        - ends[s]
        for s in saves
    ]
    # Steps that trained beside a write (ended before its marker) and steps that did not.
    writing = {
        t
        for s, c in zip(saves, commit_after, strict=True)
        for t in steps
        if 0 < ends[t] - ends[s] < c
    }
    plain = [s for s in steps if s % interval]
    size = sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())
    shutil.rmtree(root / mode)  # the disk for the next mode
    return {
        "params": after.params,
        "checkpoint_bytes": size,
        "step_s": statistics.median(steps[s] for s in plain),
        "step_s_beside_a_write": _median([steps[s] for s in plain if s in writing]),
        "step_s_alone": _median([steps[s] for s in plain if s not in writing]),
        "stall_s": statistics.median(ends[s] - after.ended[s] for s in saves),
        "window_s": sum(steps.values()),
        "window_steps": len(steps),
        "timed_saves": len(saves),
        "commit_after_s": commit_after,
    }


def run(args: argparse.Namespace) -> None:
    if args.interval < 2 or args.saves < 1:
        raise UserError("--interval must be at least 2 and --saves at least 1")
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        results = {mode: _measure(args, Path(tmp), mode) for mode in MODES}
    if os.environ.get("RANK", "0") != "0":
        return
    step = results["sync"]["step_s"]  # steps of the synchronous run train alone
    for r in results.values():
        r["overhead_per_save_s"] = (r["window_s"] - r["window_steps"] * step) / r["timed_saves"]
    s, a = results["sync"], results["async"]
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
    where = f"{device} ({os.cpu_count()} cores)"
    print(
        f"\ncheckpoint benchmark on {where}: {s['params'] / 1e6:.1f}M parameters, "
        f"{args.precision}, ZeRO-{args.zero_stage}, {s['checkpoint_bytes'] / 1e9:.2f} GB per "
        f"save, a save every {args.interval} steps of {step:.3f} s; {s['timed_saves']} timed "
        f"saves per mode; load average {os.getloadavg()[0]:.1f}"
    )
    print(f"{'mode':>6} {'stall s':>8} {'overhead/save s':>16} {'step s':>7} {'write s':>8}")
    for mode, r in results.items():
        w = (
            statistics.median(r["commit_after_s"])
            if mode == "async" and r["commit_after_s"]
            else r["stall_s"]
        )
        print(
            f"{mode:>6} {r['stall_s']:8.3f} {r['overhead_per_save_s']:16.3f} "
            f"{r['step_s']:7.3f} {w:8.2f}"
        )
    beside, alone = a["step_s_beside_a_write"], a["step_s_alone"]
    if beside is not None and alone is not None:
        print(f"async steps beside a write: {beside:.3f} s, alone: {alone:.3f} s (median)")
    ratio = s["stall_s"] / max(a["stall_s"], 1e-9)
    print(
        f"stall: async {a['stall_s']:.3f} s vs sync {s['stall_s']:.3f} s ({ratio:.0f}x less); "
        f"overhead per save {a['overhead_per_save_s']:.3f} s vs {s['overhead_per_save_s']:.3f} s"
    )
    figures = {
        "device": where,
        "precision": args.precision,
        "zero_stage": args.zero_stage,
        "interval": args.interval,
        "stall_ratio": ratio,
        **{f"{m}_{k}": v for m, r in results.items() for k, v in r.items()},
    }
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=1))
