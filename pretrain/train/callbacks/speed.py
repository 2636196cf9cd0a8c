"""Throughput, step time, MFU from the model's own FLOP count, peak memory, parameter norm,
and the slowest rank."""

from __future__ import annotations

import resource
import statistics
import time

import torch

from pretrain.train import distributed as dist_utils
from pretrain.train.callbacks.base import Callback, StepRecord
from pretrain.train.records import Notice
from pretrain.train.step_parts import OWN, PARTS, StragglerWatch


def peak_memory_gib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB -> GiB (process RSS)


def rank_parts(parts: dict[str, float], rank: int, world_size: int, device) -> list[dict]:
    """Every rank's seconds per part (step_parts.PARTS), on every rank: one all-reduce of a
    world_size x parts matrix with this rank's row filled (a logged step's only extra
    collective; 40 bytes a rank)."""
    slots = torch.zeros(world_size, len(PARTS), dtype=torch.float64, device=device)
    slots[rank] = torch.tensor([parts[k] for k in PARTS], dtype=torch.float64)
    rows = dist_utils.all_reduce_sum(slots).tolist()
    return [dict(zip(PARTS, row, strict=True)) for row in rows]


def part_scalars(parts: list[dict]) -> dict[str, float]:
    """perf/part/NAME_s (the median rank's seconds per step in each part) and
    perf/part/NAME_max_s (the slowest rank's)."""
    out = {}
    for k in PARTS:
        values = [p[k] for p in parts]
        out[f"perf/part/{k}_s"] = statistics.median(values)
        out[f"perf/part/{k}_max_s"] = max(values)
    return out


def straggler_scalars(times: list[float]) -> dict[str, float]:
    """perf/step_time_max_rank (seconds) and the rank it belongs to, beside the median."""
    slowest = max(range(len(times)), key=times.__getitem__)
    return {
        "perf/step_time_max_rank": times[slowest],
        "perf/step_time_max_rank_id": float(slowest),
        "perf/step_time_rank_median": statistics.median(times),
    }


@torch.no_grad()
def parameter_norm(model: torch.nn.Module) -> float:
    norms = [p.detach().float().norm() for p in model.parameters()]
    return float(torch.stack(norms).norm()) if norms else 0.0


class SpeedMonitor(Callback):
    """perf/* and progress/* scalars on logged steps.

    Tokens per second and MFU count the steps since the last logged step, leaving out time
    spent in evaluators (every one the trainer ran: StepRecord.eval_seconds) and saving. MFU = flops_per_token x tokens/s / (logging.peak_tflops x
    ranks): the model's FLOPs (6N + attention), not the executed ones with recompute.
    Stragglers: every rank's time per step in each part (pretrain/train/step_parts.py: data,
    forward, backward, optimizer, collective), gathered in one all-reduce; perf/part/* the
    median and slowest rank's; perf/step_time_max_rank* its own time (data + forward, which
    waiting for other ranks does not inflate), its rank, the median; a rank slow for
    train.straggler_steps logged steps in a row is named in one line (a Notice).
    """

    def on_train_start(self, trainer) -> None:
        t = trainer.cfg.train
        hosts = dist_utils.gather_hostnames(trainer.run.env.world_size)  # once, at the start
        self.watch = (
            StragglerWatch(t.straggler_fraction, t.straggler_steps, hosts)
            if t.straggler_steps and len(hosts) > 1
            else None
        )
        self.flops_per_token = trainer.run.module.model.flops_per_token(trainer.cfg.seq_len)
        self.peak = trainer.cfg.logging.peak_tflops * 1e12 * trainer.run.env.world_size
        self._reset()
        self._new_window()

    def _new_window(self) -> None:
        # perf/step_time_s: wall time per step over the log window, saves included (what an
        # ETA needs), evaluations not (their cost is their own, logged as eval seconds)
        self.window_start, self.steps, self.window_eval_seconds = time.perf_counter(), 0, 0.0

    def _reset(self) -> None:
        self.t0, self.tokens, self.eval_seconds = time.perf_counter(), 0, 0.0

    def on_step_end(self, trainer, out: StepRecord) -> None:
        self.tokens += out.tokens
        self.steps += 1
        self.eval_seconds += out.eval_seconds  # inside the step's wall time, not training
        self.window_eval_seconds += out.eval_seconds
        if not out.log:
            return
        tps = self.tokens / max(time.perf_counter() - self.t0 - self.eval_seconds, 1e-9)
        self._reset()
        step_time = (time.perf_counter() - self.window_start - self.window_eval_seconds) / max(
            1, self.steps
        )
        run, steps = trainer.run, max(1, self.steps)
        mine = {k: v / steps for k, v in run.module.timer.take().items()}
        parts = rank_parts(mine, run.env.rank, run.env.world_size, run.device)
        out.scalars.update(straggler_scalars([sum(p[k] for k in OWN) for p in parts]))
        out.scalars.update(part_scalars(parts))
        if self.watch is not None and trainer.is_main:
            for straggler in self.watch.update(parts):
                trainer.publish(Notice(out.step, "straggler", straggler.line()))
        self._new_window()
        out.scalars.update(
            {
                "perf/tokens_per_s": tps,
                "perf/mfu": self.flops_per_token * tps / self.peak
                if self.peak > 0
                else float("nan"),
                "perf/step_time_s": step_time,
                "perf/peak_memory_gib": peak_memory_gib(trainer.run.device),
                "progress/samples": trainer.consumed,
                "progress/tokens": trainer.consumed * trainer.cfg.seq_len,
                "stability/param_norm": parameter_norm(trainer.run.module.model),
            }
        )

    def on_save(self, trainer, folder) -> None:
        self._reset()

    def on_rollback(self, trainer, rollback) -> None:
        self._reset()  # loading the checkpoint is not training time
        self._new_window()
        trainer.run.module.timer.take()
