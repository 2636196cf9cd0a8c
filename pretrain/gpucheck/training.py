"""Real training steps through the Trainer (DeepSpeed engine, ZeRO-1, the run's precision),
measured by one callback: step time, the allocator's peak per step (allocated and reserved),
the evaluation forward's peak, and a torch.profiler trace of one step split into forward,
backward, optimizer and communication.

The run is the paper config with the micro batch and recompute the stage chose, two micro
batches per step (gradient accumulation 2, as the paper's runs on 32 GPUs), random tokens
(pretrain/measure/measured_run.py's RandomTokens and measurement_config, the recipe of
`tools/benchmark.py train` too: speed and memory do not depend on the text), no evaluation,
no checkpoint. Step k's numbers are read at its end (after a device
synchronisation) and the allocator's peak is reset for step k + 1, so every peak is one
step's; memory is counted above what was allocated before the run was built.

Only `Meter` touches torch.cuda: on CPU (the smoke) it has no allocator figures (None) and
everything else runs as on a GPU.
"""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from pretrain.config import Config, to_dict
from pretrain.data.dataset import make_loader
from pretrain.data.pipeline import DataSource
from pretrain.measure.measured_run import RandomTokens, measurement_config
from pretrain.train.callbacks.base import Callback
from pretrain.train.deepspeed_adapter import compile_backend, wrap_engine_calls
from pretrain.train.trainer import Trainer

GiB = 2**30
# The engine's three calls, as the profiler sees them (record_function labels).
PHASES = {
    "gpucheck/forward": "forward",
    "gpucheck/backward": "backward",
    "gpucheck/optimizer": "optimizer",
}
PHASE_OF_CALL = {"forward": "forward", "backward": "backward", "step": "optimizer"}
COMMUNICATION = ("nccl", "all_reduce", "allreduce", "reduce_scatter", "all_gather", "broadcast")


class Meter:
    """The device's allocator statistics; on CPU none (None) and no synchronisation."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.base = 0

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def clean(self) -> None:
        """Free what earlier runs left and take the allocated bytes as the zero."""
        gc.collect()
        self.release_cache()
        if self.cuda:
            self.base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()

    def release_cache(self) -> None:
        """Hand the allocator's unused blocks back to the device."""
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()

    def reset_peak(self) -> None:
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()

    def peak(self) -> tuple[int | None, int | None]:
        """(peak allocated above the zero, peak reserved) since the last reset, in bytes."""
        if not self.cuda:
            return None, None
        return torch.cuda.max_memory_allocated() - self.base, torch.cuda.max_memory_reserved()


def _labelled(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    label = f"gpucheck/{PHASE_OF_CALL[name]}"

    def call(*args: Any, **kwargs: Any) -> Any:
        with record_function(label):
            return fn(*args, **kwargs)

    return call


def phase_times(prof, on_gpu: bool) -> dict[str, float]:
    """Milliseconds of the profiled step per phase (communication is inside the phases:
    DeepSpeed reduces gradients in its backward and step; reported apart as well).

    On a GPU: the device time of every kernel, given to the phase whose labelled call was
    running when the operator that launched it started. Launch time, not the label's own
    kernel total: the backward's operators run on autograd's device threads, outside the
    label's scope (the first H200 run's split gave the backward 1% of the step), but inside
    its time, since engine.backward returns only when they are done. On CPU: the labelled
    calls' CPU time, and the collectives' own."""
    out = dict.fromkeys([*PHASES.values(), "communication"], 0.0)
    cpu = torch.autograd.DeviceType.CPU
    if not on_gpu:
        for e in prof.key_averages():
            if e.key in PHASES and e.device_type == cpu:
                out[PHASES[e.key]] += e.cpu_time_total / 1e3
            elif any(c in e.key.lower() for c in COMMUNICATION):
                out["communication"] += e.self_cpu_time_total / 1e3
        return out
    events = [e for e in prof.events() if e.device_type == cpu]
    windows = [
        (e.time_range.start, e.time_range.end, PHASES[e.name]) for e in events if e.name in PHASES
    ]
    for e in events:
        if not e.kernels:
            continue
        start = e.time_range.start
        phase = next((name for a, b, name in windows if a <= start <= b), None)
        for k in e.kernels:
            if phase is not None:
                out[phase] += k.duration / 1e3
            if any(c in k.name.lower() for c in COMMUNICATION):
                out["communication"] += k.duration / 1e3
    return out


class Probe(Callback):
    """Times, peaks and the profile of a run's steps (see the module docstring)."""

    def __init__(
        self, meter: Meter, warmup: int, timed: int, profile_step: bool, eval_forward: bool
    ) -> None:
        self.meter, self.warmup, self.timed, self.profile_step = meter, warmup, timed, profile_step
        self.eval_forward = eval_forward
        self.step_s: list[float] = []
        self.allocated: list[int] = []
        self.reserved: list[int] = []
        self.eval_peak: tuple[int | None, int | None] = (None, None)
        self.split: dict[str, float] | None = None
        self.profiled_s: float | None = None
        self._prof = None
        self._t = 0.0
        self.first_step_s: float | None = None  # set-up to the end of step 1: compile's time

    def on_train_start(self, trainer) -> None:
        # The TrainModule's calls of the engine go through the labels; nothing of the
        # trainer changes.
        wrap_engine_calls(trainer.run.module.engine, _labelled)
        self.meter.sync()
        self.meter.reset_peak()
        self._t = time.perf_counter()

    def on_step_end(self, trainer, out) -> None:
        self.meter.sync()
        now = time.perf_counter()
        seconds, self._t = now - self._t, now
        step = out.step
        if step == 1:
            self.first_step_s = seconds
        if self.warmup < step <= self.warmup + self.timed:
            self.step_s.append(seconds)
            allocated, reserved = self.meter.peak()
            if allocated is not None:
                self.allocated.append(allocated)
                self.reserved.append(reserved)
        if self._prof is not None:  # the profiled step just ended
            self._prof.__exit__(None, None, None)
            self.split = phase_times(self._prof, self.meter.cuda)
            self.profiled_s = seconds
            self._prof = None
        last = self.warmup + self.timed + (1 if self.profile_step else 0)
        if step == last and self.eval_forward:
            self._measure_eval(trainer)
        if step == self.warmup + self.timed and self.profile_step:
            activities = [ProfilerActivity.CPU]
            if self.meter.cuda:
                activities.append(ProfilerActivity.CUDA)
            self._prof = profile(activities=activities)
            self._prof.__enter__()
        self.meter.reset_peak()
        self._t = time.perf_counter()

    def _measure_eval(self, trainer) -> None:
        """One evaluation forward of a micro batch (with targets, no gradients), as the
        trainer's evaluation runs it, after the last step: the cache is emptied first, so the
        reserved peak is the evaluation's (what stays allocated, weights and optimizer state,
        plus its own), not the training step's blocks the allocator still holds (the first
        H200 run measured those: 125 GiB reserved for a 25 GiB forward)."""
        cfg, model = trainer.cfg, trainer.run.module.model
        shape = (cfg.train.micro_batch_size, cfg.seq_len)
        device = trainer.run.device
        x = torch.randint(0, cfg.model.vocab_size, shape, device=device)
        self.meter.release_cache()
        self.meter.reset_peak()
        model.eval()
        with torch.no_grad():
            loss = model(x, targets=x).loss
            del loss
        model.train()
        self.meter.sync()
        self.eval_peak = self.meter.peak()
        del x


def run_config(
    cfg: Config,
    micro_batch: int,
    layers: int,
    steps: int,
    run_dir: str,
    compile_model: bool = False,
    accumulation: int = 2,
    compile_regions: str = "model",
) -> Config:
    """`cfg` as the measured run: `micro_batch` x `accumulation` sequences per step on one
    process, `layers` blocks recomputed, `steps` optimizer steps, nothing evaluated or saved."""
    return measurement_config(
        to_dict(cfg),
        run_dir,
        steps,
        micro_batch,
        micro_batch * accumulation,
        activation_checkpointing=layers,
        compile=compile_model,
        compile_regions=compile_regions,
    )


def measure_run(
    cfg: Config,
    device: torch.device,
    warmup: int,
    timed: int,
    profile_step: bool = True,
    backend: str = "inductor",
) -> dict[str, Any]:
    """Train `cfg` (run_config's) and return its medians and peaks (bytes, seconds, ms).
    A compiled model's evaluation forward is not measured: eval mode is a new graph to
    compile (a minute for a 1B model), and the plan traces the eager model anyway."""
    meter = Meter(device)
    meter.clean()
    probe = Probe(meter, warmup, timed, profile_step, eval_forward=cfg.train.compile is False)
    steps = warmup + timed + (1 if profile_step else 0)
    cfg = cfg.replace(train=cfg.train.replace(train_iters=steps))
    n = steps * cfg.train.global_batch_size
    data = DataSource(RandomTokens(n, cfg.seq_len, cfg.model.vocab_size), None, make_loader)
    trainer = Trainer(cfg, data, callbacks=[probe], save_checkpoints=False, sinks=[])
    try:
        with compile_backend(backend):
            trainer.fit()
    finally:
        if probe._prof is not None:
            probe._prof.__exit__(None, None, None)
        del trainer
        meter.clean()
    step_s = statistics.median(probe.step_s)
    return {
        "step_time_s": step_s,
        "step_times_s": probe.step_s,
        "tokens_per_s": cfg.train.global_batch_size * cfg.seq_len / step_s,
        "train_allocated": max(probe.allocated) if probe.allocated else None,
        "train_reserved": max(probe.reserved) if probe.reserved else None,
        "eval_allocated": probe.eval_peak[0],
        "eval_reserved": probe.eval_peak[1],
        "split_ms": probe.split,
        "profiled_step_s": probe.profiled_s,
        "first_step_s": probe.first_step_s,
    }
