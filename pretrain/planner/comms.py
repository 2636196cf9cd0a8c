"""The collectives of one training step (DeepSpeed 0.19 engine's and the trainer's) and their time.

`step_collectives(cfg, n)` lists what DeepSpeed sends in one optimizer step on n data-parallel
ranks for the toolkit's engine settings: kind, bytes per call as DeepSpeed's communication
logger records them, calls per step and when in the step they run. Derived from DeepSpeed's
source (file:line of 0.19.8 below) and checked exactly against its logger on 2 and 4 CPU ranks
(tests/test_plan_comms.py). The engine path follows from the config:

- fp32 or bf16 with bf16 accumulation, ZeRO 0 (engine.py:3795-3926): after the last backward
  of a step, the gradients in `module.parameters()` order, cast to the fp32 communication
  dtype, all-reduced in buckets flushed once they pass 5e8 elements (MEMORY_OPT_ALLREDUCE_SIZE,
  engine.py:151; no config key); fp32 adds the clipping norm (4 B, runtime/utils.py:418).
- bf16 with fp32 accumulation, ZeRO 1: `BF16_Optimizer` (the paper's 1B runs;
  bf16_optimizer.py): its fp32 gradient buffers, one per AdamW group padded to a multiple of
  2n elements, all-reduced after the last backward in buckets flushed past 5e8 elements; the
  norm is local (no scalar collective); then each group's updated bf16 partition all-gathered.
- ZeRO 1 and 2 otherwise (`DeepSpeedZeroOptimizer`, zero/stage_1_and_2.py): gradients in
  buckets of `reduce_bucket_size` elements (5e8), a bucket flushed before it would pass it
  (1422); a larger parameter goes alone (1443); the buckets fill in AdamW-group order at the
  step's end under ZeRO 1 without overlap_comm, in the order the backward makes gradients
  (hooks) otherwise; ZeRO 2 reduces every micro step. How a bucket is sent (average_tensor,
  1590): with `reduce_scatter: true` (the default) it is cut at the ranks' partition
  boundaries and, with `use_multi_rank_bucket_allreduce: true` (the default), the slices
  all-reduced together, flushed past the bucket size (1695, 1545): one all-reduce of a
  bucket, a larger parameter's slices packed past the bucket size; with
  `use_multi_rank_bucket_allreduce: false` each partition's slices go to their owner in one
  `reduce` (1697, 1714, 2387): a call per partition the bucket touches; with
  `reduce_scatter: false` the bucket, or the larger parameter, is all-reduced whole (1618).
  `contiguous_gradients: false` all-reduces each bucket whole (2237). Then a norm per group
  (4 B, 2693), an overflow flag under bf16 (1 B, 3237), and each group's partition
  all-gathered (runtime/utils.py:1008: the logger records the rank's input shard, not the
  gathered tensor). `allgather_bucket_size` is not read where torch has
  all_gather_into_tensor (utils.py:1021).

The trainer's own collectives (torch.distributed directly, so not in DeepSpeed's logger),
`trainer_collectives(cfg, n)`, checked exactly against the real trainer on 2 gloo ranks
(tests/trainer_comms.py): every step one all-reduce of its stop flag and mean loss
(2 fp64, Trainer.train_step) and, under `spikes.skip_step`, the guard's verdict (1 fp32,
spikes.py); at a logging step (every `logging.log_interval` steps: phase LOG_STEP, calls per
logging step) one all_gather of the metrics of the steps since the last flush (steps x names
fp64, metrics.py reduce_over_ranks) and SpeedMonitor's all-reduce of every rank's seconds per
step part (n x 5 fp64, callbacks/speed.py rank_parts). An evaluation or a save between
logging steps flushes earlier (the same rows over a run, in more calls). Not planned: the
set-up's (process group, data, host names), evaluations', a checkpoint save's tag check and
barriers, a rollback's.

Time: each collective's from `Fabric.time` (pretrain/planner/network.py). What the backward
hides: with `overlap_comm` (ZeRO 1/2), buckets reduce on a side stream while the backward goes
on, so all but the last bucket of a backward hide behind it, up to the backward's own time;
without it (DeepSpeed's default at ZeRO 1/2, and always at ZeRO 0 and under BF16_Optimizer)
the reduction runs in line and nothing hides. The parameter all-gather and the scalars follow
the optimizer step: exposed. The trainer's: exposed, a logging step's spread over its interval.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from pretrain.config import Config, grad_accum_steps
from pretrain.model.transformer import Transformer
from pretrain.planner.network import Fabric
from pretrain.train.engine import deepspeed_config, param_groups

DS_FALLBACK_BUCKET = 500_000_000  # MEMORY_OPT_ALLREDUCE_SIZE: ZeRO 0's and BF16_Optimizer's
DEFAULT_REDUCE_BUCKET = 500_000_000  # zero_optimization.reduce_bucket_size's default
COMM_BYTES = 4  # every setting the toolkit makes communicates fp32 (communication_data_type)
TRAINER_SUMS = 2 * 8  # the trainer's own all-reduce per step: the stop flag and the loss, fp64
SKIP_FLAG = 4  # spikes.skip_step: the guard's verdict, one fp32 all-reduced (MAX) per step
# The values every step records (pretrain/train/: StepMetrics.record; gathered at a flush,
# fp64 each): the loss (module.py), the batch's token sum (trainer.py), the gradient norm
# (module.py), and the z-loss term where train.z_loss is on. Named here, not imported: the
# planner does not import the training loop (tests/contracts.py); the trainer's measured
# collectives keep them right (tests/test_plan_comms.py).
STEP_METRICS = ("train/loss", "progress/batch_token_sum", "train/grad_norm")
STEP_PARTS = 5  # pretrain/train/step_parts.py PARTS: SpeedMonitor's seconds per part, fp64

# When a collective runs: in the backward (per micro step or at its last), after the last
# backward, with the optimizer step, or at a logging step (its calls per logging step).
BACKWARD, AFTER_BACKWARD, STEP = "backward", "after backward", "step"
LOG_STEP = "logging step"


@dataclass(frozen=True)
class Collective:
    op: str  # DeepSpeed's name, as its logger records it
    size: int  # bytes per call as logged (all_gather_into_tensor: the rank's input shard)
    calls: int  # per optimizer step
    phase: str
    what: str
    hideable: bool = False  # issued on a side stream during the backward (overlap_comm)
    backwards: int = 1  # the backwards its calls spread over (ZeRO 2: every micro step's)

    def buffer(self, n: int) -> int:
        """The whole buffer a call moves (what the ring's time counts)."""
        return self.size * n if self.op.startswith("all_gather") else self.size


@dataclass(frozen=True)
class EngineComms:
    """The DeepSpeed settings that decide a step's communication."""

    path: str  # "fallback" (ZeRO 0), "bf16_optimizer", "zero" (ZeRO 1/2)
    stage: int
    param_bytes: int  # the model's dtype: what the parameter all-gather moves
    reduce_bucket: int
    overlap_comm: bool
    contiguous_gradients: bool
    reduce_scatter: bool  # a bucket cut at the partitions (else all-reduced whole)
    multi_rank_allreduce: bool  # the cut slices all-reduced together (else a reduce each)
    clip_norm: bool  # ZeRO 0, fp32: the clipping norm is all-reduced
    overflow_flag: bool  # bf16 at ZeRO 1/2: an overflow flag all-reduced every step
    grad_accum: int


@dataclass(frozen=True)
class Params:
    """The model's parameters as DeepSpeed sees them: numels per AdamW group (DeepSpeed's
    flat buffers, in group order) and the order the backward makes their gradients."""

    groups: tuple[tuple[int, ...], ...]
    hook_order: tuple[tuple[int, int], ...]  # (group, index in group)
    module_order: tuple[tuple[int, int], ...]  # module.parameters() order

    @property
    def total(self) -> int:
        return sum(sum(g) for g in self.groups)


def engine_comms(cfg: Config, world_size: int) -> EngineComms:
    """The engine path and its settings, read from the DeepSpeed config the toolkit
    generates for a CUDA run (train/engine.py), the user's train.deepspeed merged in."""
    ds = deepspeed_config(cfg, world_size, torch.device("cuda"))
    zero = ds.get("zero_optimization", {})
    stage = int(zero.get("stage", 0))
    bf16 = bool(ds.get("bf16", {}).get("enabled", False))
    accum = ds.get("data_types", {}).get("grad_accum_dtype", "fp32")
    if stage == 0:
        path = "fallback"
    elif bf16 and accum == "fp32" and stage == 1:
        path = "bf16_optimizer"
    else:
        path = "zero"
    return EngineComms(
        path=path,
        stage=stage,
        param_bytes=2 if bf16 else 4,
        reduce_bucket=int(zero.get("reduce_bucket_size", DEFAULT_REDUCE_BUCKET)),
        overlap_comm=bool(zero.get("overlap_comm", False)),
        contiguous_gradients=bool(zero.get("contiguous_gradients", True)),
        reduce_scatter=bool(zero.get("reduce_scatter", True)),
        multi_rank_allreduce=bool(zero.get("use_multi_rank_bucket_allreduce", True)),
        clip_norm=path == "fallback" and not bf16 and float(ds.get("gradient_clipping", 0)) > 0,
        overflow_flag=path == "zero"
        and bf16
        and ds.get("bf16", {}).get("check_grad_overflow", True),
        grad_accum=grad_accum_steps(cfg, world_size),
    )


def model_params(cfg: Config) -> Params:
    """The parameters of `cfg`'s model and their gradients' order, on fake tensors."""
    # A backward on fake tensors (shapes only, no memory) gives the order in which autograd
    # accumulates the gradients, the order DeepSpeed's hooks reduce them in (eager).
    order: list[int] = []
    with FakeTensorMode():
        model = Transformer(cfg.model)
        for p in model.parameters():
            p.register_post_accumulate_grad_hook(lambda t: order.append(id(t)))
        x = torch.zeros(1, min(8, cfg.model.max_seq_len) + 1, dtype=torch.long)
        loss, _ = model(x[:, :-1], targets=x[:, 1:])
        loss.backward()
    groups = param_groups(model, cfg)
    where = {id(p): (g, i) for g, group in enumerate(groups) for i, p in enumerate(group["params"])}
    return Params(
        groups=tuple(tuple(p.numel() for p in g["params"]) for g in groups),
        hook_order=tuple(where[i] for i in order),
        module_order=tuple(where[id(p)] for p in model.parameters()),
    )


def padded(numel: int, n: int) -> int:
    """A group's flat buffer: padded to a multiple of 2n elements (NCCL start alignment 2,
    stage_1_and_2.py:387 and bf16_optimizer.py:167)."""
    return math.ceil(numel / (2 * n)) * 2 * n


def _flush_past(sizes: list[int], limit: int) -> list[int]:
    """Buckets flushed once their elements pass `limit` (engine.py allreduce_no_retain)."""
    out, acc = [], 0
    for s in sizes:
        acc += s
        if acc > limit:
            out.append(acc)
            acc = 0
    return out + ([acc] if acc else [])


def _zero_buckets(e: EngineComms, params: Params, n: int) -> list[list[tuple[str, int]]]:
    """DeepSpeedZeroOptimizer's gradient buckets of one reduction pass, each as the calls
    that send it: (op, elements)."""
    offsets, partition = {}, {}
    for g, group in enumerate(params.groups):
        partition[g] = padded(sum(group), n) // n
        at = 0
        for i, numel in enumerate(group):
            offsets[(g, i)] = at
            at += numel
    order = (
        params.hook_order
        if e.overlap_comm or e.stage == 2
        else [(g, i) for g, group in enumerate(params.groups) for i in range(len(group))]
    )

    def sent(members: list[tuple[int, int]]) -> list[tuple[str, int]]:
        """average_tensor (stage_1_and_2.py:1590) of a bucket, or of a larger parameter."""
        whole = sum(params.groups[g][i] for g, i in members)
        if not (e.contiguous_gradients and e.reduce_scatter):
            return [("all_reduce", whole)]  # buffered_reduce_fallback / gradient_reduction
        # the slices at the partition boundaries (rank_and_offsets), in bucket order
        slices: list[tuple[int, int]] = []  # (partition, elements)
        for g, i in members:
            start, end, p = offsets[(g, i)], offsets[(g, i)] + params.groups[g][i], partition[g]
            cuts = sorted({start, end, *range((start // p + 1) * p, end, p)})
            slices += [(a // p, b - a) for a, b in zip(cuts, cuts[1:], strict=False)]
        if e.multi_rank_allreduce:  # allreduce_and_scatter
            return [("all_reduce", b) for b in _flush_past([s for _, s in slices], e.reduce_bucket)]
        owners: dict[int, list[int]] = {}  # allreduce_no_retain per owner, first seen first
        for owner, size in slices:
            owners.setdefault(owner, []).append(size)
        return [
            ("reduce", b) for sizes in owners.values() for b in _flush_past(sizes, e.reduce_bucket)
        ]

    out, bucket, acc = [], [], 0
    for g, i in order:
        numel = params.groups[g][i]
        if acc + numel > e.reduce_bucket and acc:
            out.append(sent(bucket))
            bucket, acc = [], 0
        if numel > e.reduce_bucket and e.contiguous_gradients:
            out.append(sent([(g, i)]))  # alone, outside the contiguous buffer
        else:
            bucket.append((g, i))
            acc += numel
    return out + ([sent(bucket)] if bucket else [])


def engine_collectives(e: EngineComms, params: Params, n: int) -> list[Collective]:
    """What DeepSpeed's engine sends in one optimizer step on n ranks."""
    out: list[Collective] = []

    def add(op: str, elements_or_bytes: list[int], calls: int, phase: str, what: str, **kw) -> None:
        counted: dict[int, int] = {}
        for size in elements_or_bytes:
            counted[size] = counted.get(size, 0) + calls
        out.extend(Collective(op, s, c, phase, what, **kw) for s, c in counted.items())

    groups = [sum(g) for g in params.groups]
    if e.path == "fallback":
        sizes = [params.groups[g][i] for g, i in params.module_order]
        buckets = _flush_past(sizes, DS_FALLBACK_BUCKET)
        add("all_reduce", [COMM_BYTES * b for b in buckets], 1, AFTER_BACKWARD, "gradients")
        if e.clip_norm:
            add("all_reduce", [4], 1, STEP, "clipping norm")
    elif e.path == "bf16_optimizer":
        buckets = _flush_past([padded(s, n) for s in groups], DS_FALLBACK_BUCKET)
        add("all_reduce", [COMM_BYTES * b for b in buckets], 1, AFTER_BACKWARD, "fp32 gradients")
    else:
        buckets = _zero_buckets(e, params, n)
        per_step = e.grad_accum if e.stage == 2 else 1
        phase = BACKWARD if e.overlap_comm or e.stage == 2 else AFTER_BACKWARD
        # With overlap_comm all but a backward's last bucket reduce behind it.
        *early, last = buckets
        for op in sorted({op for bucket in buckets for op, _ in bucket}):
            add(
                op,
                [COMM_BYTES * size for bucket in early for o, size in bucket if o == op],
                per_step,
                phase,
                "gradient buckets",
                hideable=e.overlap_comm,
                backwards=per_step,
            )
            add(
                op,
                [COMM_BYTES * size for o, size in last if o == op],
                per_step,
                phase,
                "last gradient bucket",
            )
        add("all_reduce", [4] * len(groups), 1, STEP, "norm per group")
        if e.overflow_flag:
            add("all_reduce", [1], 1, STEP, "overflow flag")
    if e.path != "fallback" and n > 1:
        shards = [e.param_bytes * padded(s, n) // n for s in groups]
        add("all_gather_into_tensor", shards, 1, STEP, "updated parameters")
    return out


def step_collectives(cfg: Config, world_size: int) -> list[Collective]:
    """DeepSpeed's collectives of one optimizer step of `cfg` on `world_size` ranks."""
    return engine_collectives(engine_comms(cfg, world_size), model_params(cfg), world_size)


def step_metrics(cfg: Config) -> tuple[str, ...]:
    """The names every step records (a row of the metrics a flush gathers)."""
    return STEP_METRICS + (("train/z_loss",) if cfg.train.z_loss else ())


def trainer_collectives(cfg: Config, world_size: int) -> list[Collective]:
    """The trainer's own collectives (torch.distributed, outside DeepSpeed's logger): per
    optimizer step, and per logging step (phase LOG_STEP, every logging.log_interval steps);
    what a callback or evaluator of a user's own adds is not counted."""
    n = world_size
    if n < 2:
        return []
    out = [Collective("all_reduce", TRAINER_SUMS, 1, AFTER_BACKWARD, "trainer: stop, loss")]
    if cfg.spikes.skip_step:
        out.append(Collective("all_reduce", SKIP_FLAG, 1, STEP, "trainer: skip verdict"))
    rows = cfg.logging.log_interval  # the steps since the last flush
    metrics = rows * len(step_metrics(cfg)) * 8
    out.append(Collective("all_gather", metrics, 1, LOG_STEP, "trainer: step metrics"))
    out.append(Collective("all_reduce", n * STEP_PARTS * 8, 1, LOG_STEP, "speed: rank parts"))
    return out


# ----------------------------------------------------------------------------- time


@dataclass(frozen=True)
class StepTime:
    """One optimizer step's seconds on each rank."""

    compute: float  # forward and backward at the plan's MFU
    optimizer: float  # the AdamW update of the rank's partition (HBM-bound)
    communication: float  # every collective's time, hidden or not
    exposed: float  # communication the step waits for
    by_op: dict[str, float] = field(default_factory=dict)

    @property
    def total(self) -> float:
        return self.compute + self.optimizer + self.exposed

    @property
    def efficiency(self) -> float:
        """The share of the step that is the model's compute (1.0: perfect scaling)."""
        return self.compute / self.total if self.total else 1.0


ADAM_BYTES = 4 * 2 + 4 + 4 * 2 * 2 + 2  # fp32 master r/w, fp32 grad, m and v r/w, bf16 copy


def step_time(
    collectives: list[Collective],
    fabric: Fabric,
    n: int,
    compute: float,
    grad_accum: int,
    optimizer: float = 0.0,
    backward_share: float = 2 / 3,
) -> StepTime:
    """Seconds of a step: `compute` (all micro steps' forward and backward), the collectives'
    time on `fabric`, what the backward hides of it (overlap_comm: all but a backward's last
    bucket, up to the backward's own time) and `optimizer`."""
    by_op: dict[str, float] = {}
    total = exposed = 0.0
    backward = backward_share * compute / grad_accum  # one micro step's
    for c in collectives:
        t = fabric.time(c.op, c.buffer(n), n) * c.calls
        by_op[c.op] = by_op.get(c.op, 0.0) + t
        total += t
        exposed += t
    hideable = [c for c in collectives if c.hideable]
    if hideable:
        backwards = hideable[0].backwards
        behind = sum(fabric.time(c.op, c.buffer(n), n) * c.calls for c in hideable) / backwards
        exposed -= min(behind, backward) * backwards
    return StepTime(compute, optimizer, total, exposed, by_op)


def trainer_time(collectives: list[Collective], fabric: Fabric, n: int, log_interval: int) -> float:
    """Seconds per step of the trainer's collectives (`trainer_collectives`): exposed, a
    logging step's spread over its interval."""
    return sum(
        fabric.time(c.op, c.buffer(n), n) * c.calls / (log_interval if c.phase == LOG_STEP else 1)
        for c in collectives
    )


def collective_rows(collectives: list[Collective]) -> list[dict[str, Any]]:
    return [
        {"op": c.op, "bytes": c.size, "calls": c.calls, "phase": c.phase, "what": c.what}
        for c in collectives
    ]
