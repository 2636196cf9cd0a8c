"""The planner checked against a real allocator: a DeepSpeed step of small models on CPU,
profiled, against the plan for the CPU.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from pretrain.config import Config, from_dict
from pretrain.model.recompute import recompute_layers
from pretrain.model.transformer import Transformer
from pretrain.planner.gpus import GPU
from pretrain.planner.search import plan_run
from pretrain.train import distributed as dist_utils
from pretrain.train.engine import deepspeed_config, grad_accum_steps, param_groups


@dataclass
class Validation:
    name: str
    n_params: int
    predicted: int
    measured: int
    live_at_eval: list[str] = field(default_factory=list)  # the allocator's view, to diagnose

    @property
    def error(self) -> float:
        return (self.predicted - self.measured) / self.measured


# What docs/performance.md claims and tests/test_plan.py holds: measured +0.04% (training) and
# +0.21% (evaluation, the batch's ids counted) on an AVX2 EPYC; on an AVX-512-BF16 Xeon the
# kernel path pinned_cpu_kernels selects (there set by DNNL_MAX_CPU_ISA=AVX2) gave +0.04%.
VALIDATION_TOLERANCE = 0.005

# Small enough for a CPU without bf16 matrix units (bf16 matmuls run at ~1 GFLOP/s there),
# large enough that activations, the loss chunks and DeepSpeed's buffers all matter.
VALIDATION_SHAPES: dict[str, dict[str, Any]] = {
    "llama (GQA, sequential)": dict(
        vocab_size=512,
        n_layers=4,
        d_model=64,
        n_heads=4,
        n_kv_heads=2,
        d_ff=192,
        rope_fraction=0.25,
    ),
    "pythia (parallel, MHA)": dict(
        vocab_size=512,
        n_layers=4,
        d_model=64,
        n_heads=2,
        d_ff=160,
        block="parallel",
        rope_fraction=0.1,
    ),
    "llama + QK-Norm (NoPE)": dict(
        vocab_size=512,
        n_layers=4,
        d_model=64,
        n_heads=4,
        n_kv_heads=2,
        d_ff=192,
        qk_norm=True,
        rope_fraction=0.0,
    ),
}


def validation_config(
    shape: dict[str, Any],
    micro_batch: int = 4,
    seq_len: int = 256,
    layers: int = 2,
    precision: str = "bf16",
    grad_accum: str = "fp32",
    zero_stage: int = 1,
    accumulation: int = 1,
) -> Config:
    """A one-process run config of `shape` (bf16, ZeRO-1, fp32 accumulation: the paper's)."""
    return from_dict(
        Config,
        {
            "model": {
                "pad_vocab_to_multiple": 128,
                "max_seq_len": seq_len,
                "mlp_bias": True,
                **shape,
            },
            "train": {
                "train_iters": 10,
                "global_batch_size": micro_batch * accumulation,
                "micro_batch_size": micro_batch,
                "seq_len": seq_len,
                "precision": precision,
                "grad_accum_dtype": grad_accum,
                "zero_stage": zero_stage,
                "activation_checkpointing": layers,
            },
        },
    )


def _allocator_events(prof) -> list[tuple[int, int, int, str]]:
    """(time ns, bytes, address, operator path) of every CPU allocation (bytes > 0) and free
    (< 0) the profiler saw, in time order."""
    out = []
    alloc = torch._C._profiler._EventType.Allocation
    stack = [(node, "") for node in prof.profiler.kineto_results.experimental_event_tree()]
    while stack:
        node, path = stack.pop()
        if node.tag == alloc:
            f = node.extra_fields
            if f.device.type == "cpu":
                out.append((node.start_time_ns, f.alloc_size, f.ptr, path))
            continue
        stack.extend((child, f"{path}/{node.name}") for child in node.children)
    return sorted(out)


def allocated_over_time(events: list[tuple[int, int, int, str]]) -> list[tuple[int, int]]:
    """(time ns, bytes live) after each event, counting only memory allocated within the
    profiled window: a free of an address allocated before it is ignored. (c10's own running
    total does the same only for its first window: it keeps counting what earlier windows
    allocated and freed while no profiler listened.)"""
    live: dict[int, int] = {}
    total, out = 0, []
    for ts, nbytes, ptr, _ in events:
        if nbytes > 0:
            total += nbytes - live.pop(ptr, 0)  # an address reused: its free went unseen
            live[ptr] = nbytes
        elif ptr in live:
            total -= live.pop(ptr)
        out.append((ts, total))
    return out


def live_at(events: list[tuple[int, int, int, str]], when: int, top: int = 8) -> list[str]:
    """The largest allocations of the window still live at time `when`, with their operator."""
    live: dict[int, tuple[int, str]] = {}
    for ts, nbytes, ptr, path in events:
        if ts > when:
            break
        if nbytes > 0:
            live[ptr] = (nbytes, path)
        else:
            live.pop(ptr, None)
    biggest = sorted(live.values(), key=lambda v: -v[0])[:top]
    return [f"{n:>12,} B  {path[-100:]}" for n, path in biggest]


LAST_MEASUREMENT: dict[str, Any] = {}  # what measure_cpu_step saw last (for diagnosis)


@contextlib.contextmanager
def pinned_cpu_kernels() -> Iterator[None]:
    """Within: bf16 matmuls take ATen's own GEMM on every x86 CPU, as on one without AVX-512.

    On a CPU with AVX-512-BF16 (or AMX) torch sends bf16 matmuls to oneDNN
    (`mkldnn_bf16_gemm`, enabled by `ideep::has_bf16_type_support()`), which allocates
    scratch memory of its own inside `aten::mm` (460,544 B at the peak of the validation's
    loss chunk on a Xeon with AVX-512-BF16, docs/performance.md) that the CPU plan does
    not model: the plan models the kernels a GPU step replaces, not oneDNN's. With
    `torch.backends.mkldnn` off, the validation measures the same kernel path on an AVX2
    EPYC and on that Xeon (the effect of DNNL_MAX_CPU_ISA=AVX2, which oneDNN reads only
    once per process)."""
    before = torch.backends.mkldnn.enabled  # (mkldnn.flags() also warns about Intel GPUs' TF32)
    torch.backends.mkldnn.enabled = False
    try:
        yield
    finally:
        torch.backends.mkldnn.enabled = before


@contextlib.contextmanager
def one_rank_all_reduce_inline() -> Iterator[None]:
    """Within, on one rank: torch.distributed.all_reduce returns at once, the identity it is.

    gloo runs an all-reduce on a worker thread, and that thread can drop the last reference
    to DeepSpeed's flattened gradient buffer (`allreduce_bucket`); the profiler does not
    follow gloo's threads, so that free was never seen and the buffer (1 MB in the
    validation's shapes) looked live to the end of the window: the measured peak came out
    5 to 16% high in about one validation in five, at random. With the call inline the
    buffer is allocated and freed on this thread, as on a GPU (NCCL frees nothing of ours)."""
    import torch.distributed as dist

    real = dist.all_reduce
    if dist.is_initialized() and dist.get_world_size() > 1:
        yield
        return

    def identity(tensor, op=None, group=None, async_op=False):
        return None

    dist.all_reduce = identity
    try:
        yield
    finally:
        dist.all_reduce = real


def cpu_kernel_path() -> str:
    """The CPU's vector ISA as torch uses it, and whether bf16 matmuls would go to oneDNN."""
    onednn = torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    return (
        f"{torch.backends.cpu.get_cpu_capability()}, bf16 matmuls "
        f"{'oneDNN (pinned to ATen for the validation)' if onednn else 'ATen'}"
    )


def _profile_steps(cfg, engine_args, batches, steps, gas):
    import deepspeed
    from torch.profiler import ProfilerActivity, profile, record_function

    t = cfg.train
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        torch.manual_seed(0)
        model = Transformer(cfg.model)
        model.gradient_checkpointing = recompute_layers(
            t.activation_checkpointing, cfg.model.n_layers
        )
        engine, *_ = deepspeed.initialize(
            model=model, model_parameters=param_groups(model, cfg), **engine_args
        )
        del model
        for i in range(steps):
            with record_function(f"plan_step_{i}"):
                for x, y in batches[i * gas : (i + 1) * gas]:
                    loss = engine(x, targets=y).loss
                    engine.backward(loss)
                    engine.step()
                    del loss
        with record_function("plan_eval"), torch.no_grad():
            engine.module.eval()
            engine(batches[0][0], targets=batches[0][1])
        del engine
        gc.collect()  # this window's engine dies inside it
    return prof


def measure_cpu_step(cfg: Config, steps: int = 2) -> tuple[int, int]:
    """(training peak, evaluation peak) of c10's CPU allocator in bytes: the peak during the
    last of `steps` real DeepSpeed optimizer steps (every micro batch's forward, backward
    and `engine.step`, as the trainer runs them) of `cfg` on one process, and during an
    evaluation forward after it. Everything (model, DeepSpeed, optimizer) is allocated
    inside the profiled window, whose start is the zero."""
    import logging

    from deepspeed.utils import logger

    if not torch.distributed.is_initialized():
        dist_utils.setup_env()
        dist_utils.init_process_group(torch.device("cpu"))
    logger.setLevel(logging.WARNING)
    device = torch.device("cpu")
    t = cfg.train
    gas = grad_accum_steps(cfg, 1)
    # The CPU plan models the optimizer DeepSpeed builds itself (torch's single-tensor AdamW):
    # measure that path, whatever optim.impl the config asks for.
    cfg = cfg.replace(optim=cfg.optim.replace(impl="deepspeed"))
    engine_args = {"config": deepspeed_config(cfg, 1, device), "dist_init_required": False}
    gen = torch.Generator().manual_seed(0)
    shape = (t.micro_batch_size, cfg.seq_len)
    batches = [
        (
            torch.randint(0, cfg.model.vocab_size, shape, generator=gen),
            torch.randint(0, cfg.model.vocab_size, shape, generator=gen),
        )
        for _ in range(steps * gas)
    ]
    # Python's cycle collector would free a previous engine at a random point inside the
    # window; collect first and keep it off until this window's engine is gone.
    # (Freezing what exists also keeps DeepSpeed's many gc.collect() calls short.)
    gc.collect()
    gc.freeze()
    gc.disable()
    try:
        with pinned_cpu_kernels(), one_rank_all_reduce_inline():
            prof = _profile_steps(cfg, engine_args, batches, steps, gas)
    finally:
        gc.enable()
        gc.unfreeze()
    events = _allocator_events(prof)
    totals = allocated_over_time(events)
    ranges = {
        e.name(): (e.start_ns(), e.end_ns())
        for e in prof.profiler.kineto_results.events()
        if e.name() in (f"plan_step_{steps - 1}", "plan_eval")
    }

    def peak(name: str) -> int:
        start, end = ranges[name]
        return max(total for ts, total in totals if start <= ts <= end)

    LAST_MEASUREMENT.clear()
    LAST_MEASUREMENT["live_at_eval"] = live_at(events, ranges["plan_eval"][0])
    return peak(f"plan_step_{steps - 1}"), peak("plan_eval")


def validate(shapes: dict[str, dict[str, Any]] | None = None, **kw: Any) -> list[Validation]:
    """Planned vs measured training and evaluation peaks of a real CPU step per shape."""
    out = []
    for name, shape in (shapes or VALIDATION_SHAPES).items():
        cfg = validation_config(shape, **kw)
        plan = plan_run(cfg, GPU("CPU", 1 << 50, 1e12), 1, target="cpu", reserve=0)
        train, evaluation = measure_cpu_step(cfg)
        live = list(LAST_MEASUREMENT.get("live_at_eval", []))
        out.append(Validation(name, plan.n_params, plan.train_peak, train, live))
        out.append(Validation(f"{name}, eval", plan.n_params, plan.eval_peak, evaluation, live))
    return out
