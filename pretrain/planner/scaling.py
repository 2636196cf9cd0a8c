"""A run's step on N GPUs: compute, exposed communication and optimizer; how it scales.

    python tools/plan.py configs/paper/llama8b_rope10.yaml --gpus 256          # one count
    python tools/plan.py configs/paper/llama1b_rope10.yaml --scaling           # 8 to 1,024
    python tools/plan.py --paper-scaling --plot docs/img/scaling.png           # every paper run

The global batch stays the config's (the paper: 2^23 tokens a step at every length), so more
GPUs share a step: each GPU's compute shrinks as 1/N at the plan's MFU (measured on one GPU:
`make gpu-check`), the gradients to reduce stay the model's, and the optimizer's share of the
parameters shrinks under ZeRO. Efficiency = compute / step: the share of the step the model
computes, 1.0 at perfect scaling. A micro batch that cannot be filled (fewer sequences per GPU
than the config's micro batch) shrinks to what is there, and past one sequence per GPU the
run cannot be spread further. MFU is held at the plan's at every count (smaller micro
batches lower it on a real GPU: the table is an upper bound there).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from pretrain.config import Config, grad_accum_steps, load_config
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
    trainer_sums,
)
from pretrain.planner.gpus import GPU
from pretrain.planner.network import Fabric
from pretrain.planner.search import flops_per_token

COUNTS = (8, 16, 32, 64, 128, 256, 512, 1024)
EFFICIENCY_FLOOR = 0.9


@dataclass(frozen=True)
class ScalePoint:
    gpus: int
    micro_batch: int
    grad_accum: int
    collectives: tuple[Collective, ...]
    time: StepTime
    steps: int

    @property
    def run_hours(self) -> float:
        return self.steps * self.time.total / 3600


def at_scale(cfg: Config, n: int) -> Config | None:
    """`cfg` on n GPUs: the micro batch shrunk to the sequences each GPU gets where it has
    fewer; None where the global batch cannot be split over n GPUs."""
    t = cfg.train
    per_gpu, left = divmod(t.global_batch_size, n)
    if per_gpu == 0 or left:
        return None
    micro = min(t.micro_batch_size, per_gpu)
    while per_gpu % micro:
        micro -= 1
    return cfg.model_copy(update={"train": t.model_copy(update={"micro_batch_size": micro})})


def point(
    cfg: Config,
    gpu: GPU,
    n: int,
    fabric: Fabric,
    mfu: float,
    params: Params | None = None,
) -> ScalePoint | None:
    """The step of `cfg` on n GPUs of `fabric`, at `mfu` of `gpu`'s peak."""
    scaled = at_scale(cfg, n)
    if scaled is None:
        return None
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
    sums = trainer_sums(fabric, n)
    time = replace(time, communication=time.communication + sums, exposed=time.exposed + sums)
    return ScalePoint(
        n, scaled.train.micro_batch_size, accum, tuple(collectives), time, cfg.train.train_iters
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


__all__ = [
    "COUNTS",
    "EFFICIENCY_FLOOR",
    "ScalePoint",
    "at_scale",
    "first_below",
    "paper_scaling",
    "point",
    "scaling",
]
