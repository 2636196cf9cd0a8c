"""Sizes of a model config: parameters, rotary dims, FLOPs per token, RoPE cache bytes.

Everything comes from a Transformer built on the meta device (no memory, no init time),
so the figures are the model's own counts, never a second formula that could disagree.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pretrain.analysis.rope_cache import human_bytes
from pretrain.config import ModelConfig
from pretrain.model.rope import rope_cache_bytes
from pretrain.model.transformer import Transformer


@dataclass(frozen=True)
class ModelInfo:
    name: str
    params: int
    params_no_embeddings: int
    n_layers: int
    d_model: int
    n_heads: int
    kv_heads: int
    head_dim: int
    rotary_dims: int
    rope_theta: float
    seq_len: int
    flops_per_token: float  # training (forward + backward) at seq_len
    rope_cache_bytes: int  # the model's one fp32 cos/sin cache (max_seq_len positions)
    per_layer_rope_cache_bytes: int  # the same cache kept in every layer (GPT-NeoX layout)


def model_info(cfg: ModelConfig, name: str = "", seq_len: int | None = None) -> ModelInfo:
    with torch.device("meta"):
        model = Transformer(cfg)
    T = seq_len or cfg.max_seq_len
    cache = rope_cache_bytes(cfg.max_seq_len, cfg.rope_dims, 4)
    return ModelInfo(
        name=name,
        params=model.num_params(),
        params_no_embeddings=model.num_params(True),
        n_layers=cfg.n_layers,
        d_model=cfg.d_model,
        n_heads=cfg.n_heads,
        kv_heads=cfg.kv_heads,
        head_dim=cfg.head_dim,
        rotary_dims=cfg.rope_dims,
        rope_theta=cfg.rope_theta,
        seq_len=T,
        flops_per_token=model.flops_per_token(T),
        rope_cache_bytes=cache,
        per_layer_rope_cache_bytes=cfg.n_layers * cache,
    )


def format_info(info: ModelInfo) -> str:

    frac = info.rotary_dims / info.head_dim
    rows = [
        ("parameters", f"{info.params:,} ({info.params / 1e9:.3f}B)"),
        (
            "parameters without embeddings",
            f"{info.params_no_embeddings:,} ({info.params_no_embeddings / 1e9:.3f}B)",
        ),
        ("layers x d_model", f"{info.n_layers} x {info.d_model}"),
        ("heads / kv heads / head_dim", f"{info.n_heads} / {info.kv_heads} / {info.head_dim}"),
        (
            "rotary dims",
            f"{info.rotary_dims} of {info.head_dim} ({100 * frac:.1f}%), theta {info.rope_theta:g}",
        ),
        (f"training FLOPs per token (seq {info.seq_len})", f"{info.flops_per_token:.4g}"),
        (
            "RoPE cache (one, fp32)",
            f"{info.rope_cache_bytes:,} bytes ({human_bytes(info.rope_cache_bytes)})",
        ),
        (
            f"  per-layer layout ({info.n_layers} copies)",
            f"{info.per_layer_rope_cache_bytes:,} bytes ({human_bytes(info.per_layer_rope_cache_bytes)})",
        ),
    ]
    width = max(len(k) for k, _ in rows)
    head = [f"model {info.name}"] if info.name else []
    return "\n".join(head + [f"  {k.ljust(width)}  {v}" for k, v in rows])


def format_info_table(infos: list[ModelInfo]) -> str:
    """One markdown row per model (for docs and comparisons)."""

    header = [
        "preset",
        "params",
        "non-embedding",
        "layers",
        "d_model",
        "heads/kv",
        "head_dim",
        "rotary dims",
        "FLOPs/token",
        "RoPE cache",
    ]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for i in infos:
        lines.append(
            "| "
            + " | ".join(
                [
                    i.name,
                    f"{i.params:,}",
                    f"{i.params_no_embeddings:,}",
                    str(i.n_layers),
                    str(i.d_model),
                    f"{i.n_heads}/{i.kv_heads}",
                    str(i.head_dim),
                    str(i.rotary_dims),
                    f"{i.flops_per_token:.4g} (T={i.seq_len})",
                    human_bytes(i.rope_cache_bytes),
                ]
            )
            + " |"
        )
    return "\n".join(lines)
