"""A run's step on N GPUs: compute, exposed communication and optimizer; how it scales.

    python tools/plan.py configs/paper/llama8b_rope10.yaml --gpus 256          # one count
    python tools/plan.py configs/paper/llama1b_rope10.yaml --scaling           # 8 to 1,024
    python tools/plan.py --paper-scaling --plot docs/img/scaling_paper.png     # every paper run

The global batch stays the config's (the paper: 2^23 tokens a step at every length), so more
GPUs share a step: each GPU's compute shrinks as 1/N at the plan's MFU (measured on one GPU:
`make gpu-check`), the gradients to reduce stay the model's, and the optimizer's share of the
parameters shrinks under ZeRO. Efficiency = compute / step: the share of the step the model
computes, 1.0 at perfect scaling. A micro batch that cannot be filled (fewer sequences per GPU
than the config's micro batch, or a share it does not divide) shrinks to the largest that
divides the share (`micro_batch_on`, the rule `--gpus N` follows too; each point says why),
and past one sequence per GPU the run cannot be spread further. MFU is held at the plan's at
every count (smaller micro batches lower it on a real GPU: the table is an upper bound
there). The step's communication: DeepSpeed's collectives and the trainer's own
(pretrain/planner/comms.py), a logging step's spread over its interval.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from pretrain.config import Config, ConfigError, grad_accum_steps, load_config
from pretrain.planner.comms import (
    ADAM_BYTES,
    Collective,
    Params,
    StepTime,
    engine_collectives,
    engine_comms,
    model_params,
    padded,
    step_time,
    trainer_collectives,
    trainer_time,
)
from pretrain.planner.gpus import GPU
from pretrain.planner.network import Fabric
from pretrain.planner.search import flops_per_token, micro_batch_on, with_micro_batch

COUNTS = (8, 16, 32, 64, 128, 256, 512, 1024)
EFFICIENCY_FLOOR = 0.9


@dataclass(frozen=True)
class ScalePoint:
    gpus: int
    micro_batch: int
    grad_accum: int
    collectives: tuple[Collective, ...]  # DeepSpeed's
    time: StepTime
    steps: int
    trainer: tuple[Collective, ...] = ()  # the trainer's own (per step and per logging step)
    log_interval: int = 1
    note: str | None = None  # why the micro batch is not the config's

    @property
    def run_hours(self) -> float:
        return self.steps * self.time.total / 3600


def at_scale(cfg: Config, n: int) -> Config | None:
    """`cfg` on n GPUs at the micro batch `micro_batch_on` gives; None where the global batch
    cannot be split over n GPUs."""
    try:
        micro, _ = micro_batch_on(cfg, n)
    except ConfigError:
        return None
    return with_micro_batch(cfg, micro)


def point(
    cfg: Config,
    gpu: GPU,
    n: int,
    fabric: Fabric,
    mfu: float,
    params: Params | None = None,
) -> ScalePoint | None:
    """The step of `cfg` on n GPUs of `fabric`, at `mfu` of `gpu`'s peak."""
    try:
        micro, note = micro_batch_on(cfg, n)
    except ConfigError:
        return None
    scaled = with_micro_batch(cfg, micro)
    params = params or model_params(cfg)
    e = engine_comms(scaled, n)
    collectives = engine_collectives(e, params, n)
    model_flops, _ = flops_per_token(cfg.model, cfg.seq_len, 0)
    tokens = cfg.train.global_batch_size * cfg.seq_len
    compute = model_flops * tokens / (n * gpu.peak_flops * mfu)
    # ZeRO 1 and 2 (BF16_Optimizer is ZeRO 1) update the rank's partition; ZeRO 0 everything
    partition = sum(padded(sum(g), n) // n if e.stage else sum(g) for g in params.groups)
    optimizer = partition * ADAM_BYTES / gpu.memory_bandwidth
    accum = grad_accum_steps(scaled, n)
    time = step_time(collectives, fabric, n, compute, accum, optimizer)
    trainer = trainer_collectives(scaled, n)
    interval = cfg.logging.log_interval
    own = trainer_time(trainer, fabric, n, interval)
    time = replace(time, communication=time.communication + own, exposed=time.exposed + own)
    return ScalePoint(
        n,
        micro,
        accum,
        tuple(collectives),
        time,
        cfg.train.train_iters,
        tuple(trainer),
        interval,
        note,
    )


def scaling(
    cfg: Config,
    gpu: GPU,
    fabric: Fabric,
    mfu: float,
    counts: Sequence[int] = COUNTS,
    params: Params | None = None,
) -> list[ScalePoint]:
    params = params or model_params(cfg)
    points = (point(cfg, gpu, n, fabric, mfu, params) for n in counts)
    return [p for p in points if p is not None]


def first_below(points: Sequence[ScalePoint], floor: float = EFFICIENCY_FLOOR) -> int | None:
    """The fewest GPUs at which efficiency falls under `floor` (None: never, in the counts)."""
    return next((p.gpus for p in points if p.time.efficiency < floor), None)


def _shape_key(cfg: Config) -> tuple[Any, ...]:
    """What the collectives depend on: the parameters (not where RoPE rotates)."""
    m = cfg.model
    return (
        m.n_layers,
        m.d_model,
        m.n_heads,
        m.kv_heads,
        m.head_dim,
        m.d_ff,
        m.padded_vocab_size,
        m.block,
        m.norm,
        m.norm_bias,
        m.mlp,
        m.mlp_bias,
        m.attn_bias,
        m.qk_norm,
        m.tie_embeddings,
        m.learned_pos_emb,
        m.max_seq_len if m.learned_pos_emb else 0,
        cfg.optim.decay_embeddings,
        cfg.optim.decay_norms_and_biases,
    )


def paper_scaling(
    configs: Sequence[str | Path],
    gpu: GPU,
    fabric: Fabric,
    mfu: float,
    counts: Sequence[int] = COUNTS,
) -> dict[str, list[ScalePoint]]:
    """`scaling` of every config (the paper's grid), parameters built once per shape."""
    shapes: dict[tuple[Any, ...], Params] = {}
    out = {}
    for path in configs:
        cfg = load_config(path)
        key = _shape_key(cfg)
        if key not in shapes:
            shapes[key] = model_params(cfg)
        out[Path(path).stem] = scaling(cfg, gpu, fabric, mfu, counts, shapes[key])
    return out
