"""Sizes of a model config: parameters, rotary dims, FLOPs per token, RoPE cache bytes.

Everything comes from a Transformer built on the meta device (no memory, no init time),
so the figures are the model's own counts, never a second formula that could disagree.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pretrain.analysis.rope_cache import human_bytes
from pretrain.config import ModelConfig
from pretrain.model.rope import inverse_frequencies, rope_cache_bytes
from pretrain.model.transformer import Transformer
from pretrain.tables import pipe_table, text_table


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
    rope_cache_bytes: int  # the model's fp32 cos/sin caches (one per distinct layer setting)
    per_layer_rope_cache_bytes: int  # a cache kept in every RoPE layer (GPT-NeoX layout)
    rope_spectrum: str = "neox"
    # (highest, lowest) inverse frequency of the rotary dims under each spectrum
    spectra: tuple[tuple[str, float, float], ...] = ()
    layers: tuple[str, ...] = ()  # each layer's positions, LayerPosition.describe()


def model_info(cfg: ModelConfig, name: str = "", seq_len: int | None = None) -> ModelInfo:
    with torch.device("meta"):
        model = Transformer(cfg)
    T = seq_len or cfg.max_seq_len
    # The model's own position modules, not the config's flags (pretrain/model/position.py).
    positions = model.layer_positions()
    main = next((p for p in positions if p.rope), positions[0])
    per_layer = sum(rope_cache_bytes(cfg.max_seq_len, p.rotary_dims, 4) for p in positions)
    spectra = []
    if main.rope:
        for spectrum, d in (("neox", main.rotary_dims), ("p_rope", main.head_dim)):
            inv = inverse_frequencies(main.rotary_dims, main.theta, spectrum_dims=d)
            spectra.append((spectrum, float(inv[0]), float(inv[-1])))
    return ModelInfo(
        name=name,
        params=model.num_params(),
        params_no_embeddings=model.num_params(True),
        n_layers=cfg.n_layers,
        d_model=cfg.d_model,
        n_heads=cfg.n_heads,
        kv_heads=cfg.kv_heads,
        head_dim=cfg.head_dim,
        rotary_dims=main.rotary_dims,
        rope_theta=main.theta,
        seq_len=T,
        flops_per_token=model.flops_per_token(T),
        rope_cache_bytes=model.rope.cache_bytes(),
        per_layer_rope_cache_bytes=per_layer,
        rope_spectrum=main.spectrum,
        spectra=tuple(spectra),
        layers=tuple(p.describe() for p in positions),
    )


def _layer_rows(layers: tuple[str, ...]) -> list[tuple[str, str]]:
    """Runs of equal layers: ('layers 0-2', 'RoPE 64/64 (neox, theta 10000), full')."""
    rows, start = [], 0
    for i in range(1, len(layers) + 1):
        if i == len(layers) or layers[i] != layers[start]:
            span = f"{start}" if i - 1 == start else f"{start}-{i - 1}"
            rows.append((f"  layer {span}", layers[start]))
            start = i
    return rows


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
        *[
            (
                f"  {name} spectrum" + (" (used)" if name == info.rope_spectrum else ""),
                f"inverse frequencies {hi:.4g} .. {lo:.4g}",
            )
            for name, hi, lo in info.spectra
        ],
        ("positions by layer", ""),
        *_layer_rows(info.layers),
        (f"training FLOPs per token (seq {info.seq_len})", f"{info.flops_per_token:.4g}"),
        (
            "RoPE cache (fp32)",
            f"{info.rope_cache_bytes:,} bytes ({human_bytes(info.rope_cache_bytes)})",
        ),
        (
            f"  per-layer layout ({info.n_layers} copies)",
            f"{info.per_layer_rope_cache_bytes:,} bytes ({human_bytes(info.per_layer_rope_cache_bytes)})",
        ),
    ]
    head = [f"model {info.name}"] if info.name else []
    # A list of names and values, no header: its first row takes the header's place.
    table = text_table(rows[0], rows[1:], align=["left", "left"])
    return "\n".join(head + [f"  {line}" for line in table.splitlines()])


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
    rows = [
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
        for i in infos
    ]
    return pipe_table(header, rows)
