"""Throughput, step time, MFU from the model's own FLOP count, peak memory, parameter norm,
and the slowest rank."""

from __future__ import annotations

import resource
import statistics
import time

import torch

from pretrain.train import distributed as dist_utils
from pretrain.train.callbacks.base import Callback, StepRecord


def peak_memory_gib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB -> GiB (process RSS)


def rank_times(own_seconds: float, rank: int, world_size: int, device) -> list[float]:
    """Every rank's `own_seconds`, on every rank: one all-reduce of a one-hot vector of
    world_size slots (a logged step's only extra collective; 8 bytes a rank)."""
    slots = torch.zeros(world_size, dtype=torch.float64, device=device)
    slots[rank] = own_seconds
    return dist_utils.all_reduce_sum(slots).tolist()


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
    Stragglers: every rank's own time per step over the same steps (reading its micro
    batches and their forward passes: TrainModule.own_seconds, which waiting for other
    ranks does not inflate); the largest, its rank, and the median.
    """

    def on_train_start(self, trainer) -> None:
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
        run, module = trainer.run, trainer.run.module
        own = module.own_seconds / max(1, self.steps)
        module.own_seconds = 0.0
        out.scalars.update(
            straggler_scalars(rank_times(own, run.env.rank, run.env.world_size, run.device))
        )
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
        trainer.run.module.own_seconds = 0.0
