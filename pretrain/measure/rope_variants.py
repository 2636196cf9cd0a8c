"""Models at several rope_theta and rope fractions that share one set of weights: what
`tools/benchmark.py model` (pretrain/benchmarks/model.py) times step against step, and the
GPU check's science stage (pretrain/gpucheck/science.py) generates with, theta against theta.

Each variant is the same Transformer class at another theta/fraction, its parameters
assigned from the first model's (the same storage, no copy), its RoPE cache built for its own
theta where the weights are. A `Variant` carries the timing lists the benchmark fills.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from pretrain.config import ModelConfig
from pretrain.model.position import Positions
from pretrain.model.transformer import Transformer


@dataclass
class Variant:
    """One model of the set (its theta, fraction and rotary dims) and, as the benchmark
    fills them, its step times and their ratios to each round's median."""

    theta: float
    fraction: float
    rotary_dims: int
    model: torch.nn.Module
    samples: list[float] = dataclasses.field(default_factory=list)  # seconds per step
    wall: list[float] = dataclasses.field(default_factory=list)  # wall-clock seconds per step
    ratios: list[float] = dataclasses.field(default_factory=list)  # / round median


def build_variants(
    cfg: ModelConfig,
    thetas: list[float],
    fractions: list[float],
    device: torch.device,
    dtype: torch.dtype,
    seed: int,
) -> list[Variant]:
    """One model per (theta, fraction), all sharing the weights of the first one."""

    torch.manual_seed(seed)
    with torch.device(device):
        base = Transformer(cfg)
    base.to(dtype)
    state = base.state_dict()
    variants = []
    for fraction in fractions:
        for theta in thetas:
            c = cfg.replace(rope_theta=theta, rope_fraction=fraction, rotary_dims=None)
            with torch.device("meta"):
                m = Transformer(c)
            m.load_state_dict(state, strict=True, assign=True)  # same storage, no copy
            # Buffers (the RoPE cache) were built on meta; build them where the weights are,
            # as pretrain.weights.load_weights does.
            m.rope = Positions.from_config(c).to(device)
            left = [n for n, t in [*m.named_parameters(), *m.named_buffers()] if t.is_meta]
            if left:
                raise RuntimeError(f"rope variant left tensors on meta: {left}")
            variants.append(Variant(theta, fraction, c.rope_dims, m.train()))
    return variants
