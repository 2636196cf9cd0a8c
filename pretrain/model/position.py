"""Each layer's position settings, and the module that serves every layer its cos/sin.

A layer's positional information is a `LayerPosition`: RoPE on its first `rotary_dims` dims
of each head (0 = NoPE) with its theta and spectrum, the window its attention sees (None =
every earlier token; W = itself and the W - 1 before it, transformers' sliding-window rule
`kv > q - W`), and whether ALiBi biases its logits. The model's learned absolute positions
(`model.learned_pos_emb`) are added once at the embedding, not per layer. The config fields
(`rope_fraction`/`rotary_dims`, `rope_theta`, `rope_spectrum`, `nope_layers`/`nope_every`,
`sliding_window` with `sliding_window_pattern`/`layer_types`, `global_rope_theta`, `alibi`)
are read here and nowhere else: readers (planner, RoPE cache tool, model_info) ask
`Transformer.layer_positions()`.

**Which dims rotate, and at which frequency.** Always the first r = rotary_dims dims of a head,
in the GPT-NeoX / transformers "rotate_half" order: dim j and dim j + r/2 (j < r/2) form a
pair rotated at inverse frequency f_j. The dims past r pass through. The spectrum decides f_j:

- `neox` (the default, the paper, GPT-NeoX's rotary_pct): f_j = theta^(-2j/r), the whole
  range of RoPE's frequencies squeezed onto the r dims (the lowest is theta^(-(r-2)/r)).
- `p_rope` (Barbero et al., ICLR 2025, "Round and Round We Go!"): f_j = theta^(-2j/head_dim),
  full RoPE's frequencies for j < r/2: the r/2 highest are kept and the head_dim/2 - r/2
  lowest dropped (their dims pass through, as NoPE). p-RoPE at theta equals NeoX at
  theta^(r/head_dim) on the same dims; at r = head_dim both are full RoPE.

**Or which pairs rotate** (`model.rope_pairs`, docs/pair_selection.md): full RoPE's layout
and frequencies (pair j = dims j and j + head_dim/2 at theta^(-2j/head_dim)), of which each KV
head keeps the pairs its selection lists (its query heads follow it) and passes the others
through. The layer reads full RoPE's cache (rotary_dims = head_dim) and its attention holds a
bool mask of the kept dims (model/attention.py `PairMask`); a layer that keeps no pair is NoPE.

**One cache per distinct setting.** Layers with the same (rotary_dims, theta, spectrum) read
one `RotaryEmbedding` (fp32 cos/sin, pretrain/model/rope.py); a model with one setting (every
config before per-layer positions) holds exactly the one cache it held before, under the same
buffer names, and NoPE layers hold none. `Positions` is itself its first cache (the one every
layer of a uniform model reads), so code that reads `model.rope` as one cache still does.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from pretrain.model.config import ModelConfig
from pretrain.model.pairs import resolve_pairs
from pretrain.model.rope import RotaryEmbedding, inverse_frequencies, rope_cache_bytes


@dataclass(frozen=True)
class LayerPosition:
    """What one layer knows of positions; `Transformer.layer_positions()` lists them."""

    layer: int
    rotary_dims: int  # RoPE on the first rotary_dims dims of each head; 0 = NoPE
    theta: float
    spectrum: Literal["neox", "p_rope"]
    head_dim: int
    attention: Literal["full", "sliding"]
    window: int | None  # a query sees itself and window - 1 earlier tokens; None = all
    alibi: bool  # -slope_h x (i - j) on the logits (alibi_slopes)
    # A pair selection (model.rope_pairs): per KV head, the sorted pairs j that rotate, in
    # full RoPE's layout (dims j and j + head_dim/2 at theta^(-2j/head_dim)); query heads
    # follow their group; rotary_dims is then head_dim (the table it reads: full RoPE's), and
    # kv_rotary_dims says what each head rotates. None: the first rotary_dims dims rotate.
    pairs: tuple[tuple[int, ...], ...] | None = None

    @property
    def rope(self) -> bool:
        return self.rotary_dims > 0

    def kv_rotary_dims(self, n_kv_heads: int) -> tuple[int, ...]:
        """Rotary dims per KV head: 2 x its kept pairs under a selection, else rotary_dims
        for every head (0 on a NoPE layer)."""
        if self.pairs is None:
            return (self.rotary_dims,) * n_kv_heads
        if len(self.pairs) != n_kv_heads:
            raise ValueError(
                f"layer {self.layer} selects pairs for {len(self.pairs)} KV heads, not {n_kv_heads}"
            )
        return tuple(2 * len(kept) for kept in self.pairs)

    def cache_frequencies(self) -> int:
        """How many distinct inverse frequencies this layer's cos/sin table needs: its
        rotary_dims / 2, or under a selection the pairs kept by any of its KV heads (each
        kept pair keeps its own frequency of the full spectrum)."""
        if self.pairs is None:
            return self.rotary_dims // 2
        return len(set().union(*self.pairs))

    def kept_dims(self) -> torch.Tensor | None:
        """Under a selection, which dims of each KV head rotate: (KV heads, 1, head_dim)
        bool, on the CPU whatever device the model is built on (a meta build must hold it);
        None without one."""
        if self.pairs is None:
            return None
        half = self.head_dim // 2
        keep = torch.zeros(len(self.pairs), 1, self.head_dim, dtype=torch.bool, device="cpu")
        for g, kept in enumerate(self.pairs):
            index = torch.tensor(kept, dtype=torch.long, device="cpu")
            keep[g, 0, index] = True
            keep[g, 0, index + half] = True
        return keep

    @property
    def spectrum_dims(self) -> int | None:
        """The d of theta^(-2j/d): None = the rotary dims (NeoX), head_dim for p-RoPE."""
        return self.head_dim if self.spectrum == "p_rope" else None

    @property
    def cache_key(self) -> tuple[int, float, int | None]:
        """Layers with the same key share one cos/sin cache."""
        return (self.rotary_dims, self.theta, self.spectrum_dims)

    def inverse_frequencies(self) -> torch.Tensor:
        """The r/2 inverse frequencies of this layer's rotary pairs, fp32, highest first."""
        return inverse_frequencies(self.rotary_dims, self.theta, spectrum_dims=self.spectrum_dims)

    def describe(self) -> str:
        """One line: 'RoPE 16/64 (neox, theta 10000), sliding 512, ALiBi'; under a selection
        'RoPE pairs 8/32 per KV head (theta 10000)' (a range where the heads differ)."""
        if self.pairs is not None:
            counts = sorted({len(kept) for kept in self.pairs})
            n = f"{counts[0]}" if len(counts) == 1 else f"{counts[0]}-{counts[-1]}"
            pos = f"RoPE pairs {n}/{self.head_dim // 2} per KV head (theta {self.theta:g})"
        elif self.rope:
            pos = f"RoPE {self.rotary_dims}/{self.head_dim} ({self.spectrum}, theta {self.theta:g})"
        else:
            pos = "NoPE"
        att = f"sliding {self.window}" if self.window is not None else "full"
        return f"{pos}, {att}" + (", ALiBi" if self.alibi else "")


def layer_positions(cfg: ModelConfig) -> list[LayerPosition]:
    """Every layer's position settings from the config (the one place that reads them)."""
    nope, types = cfg.nope_layer_set, cfg.attention_types
    sliding_anywhere = "sliding" in types
    cfg = resolve_pairs(cfg)
    selected = cfg.rope_pairs.selected if cfg.rope_pairs is not None else None
    out = []
    for i in range(cfg.n_layers):
        sliding = types[i] == "sliding"
        theta = cfg.rope_theta
        if sliding_anywhere and not sliding and cfg.global_rope_theta is not None:
            theta = cfg.global_rope_theta
        pairs = None
        if selected is not None:
            # a layer whose KV heads keep no pair is NoPE (a selection's NoPE layers are such)
            if not any(selected[i]):
                nope = nope | {i}
            else:
                pairs = tuple(tuple(kept) for kept in selected[i])
        out.append(
            LayerPosition(
                layer=i,
                rotary_dims=0 if i in nope else cfg.rope_dims,
                theta=theta,
                spectrum=cfg.rope_spectrum,
                head_dim=cfg.head_dim,
                attention="sliding" if sliding else "full",
                window=cfg.sliding_window if sliding else None,
                alibi=cfg.alibi,
                pairs=pairs,
            )
        )
    return out


def alibi_slopes(n_heads: int) -> torch.Tensor:
    """Press et al. (2022) ALiBi slopes, fp32 (n_heads,): for n a power of 2 the geometric
    sequence 2^(-8h/n), h = 1..n; otherwise those of the nearest smaller power of 2, m, then
    every other one of the 2m-head sequence (the paper's repository; transformers' Bloom)."""

    def power_of_2(n: int) -> list[float]:
        return [2 ** (-8 * h / n) for h in range(1, n + 1)]

    m = 2 ** math.floor(math.log2(n_heads))
    slopes = power_of_2(m)
    if m != n_heads:
        slopes += power_of_2(2 * m)[0::2][: n_heads - m]
    # on the CPU whatever device the model is built on: a meta build (load_weights, export)
    # must still hold the slopes, which are not loaded from any file
    return torch.tensor(slopes, dtype=torch.float32, device="cpu")


def attended_pairs(seq_len: int, window: int | None) -> int:
    """(query, key) pairs a causal attention over seq_len tokens attends: sum over i of
    min(i + 1, window), T(T + 1)/2 without a window."""
    T = seq_len
    if window is None or window >= T:
        return T * (T + 1) // 2
    return window * (window + 1) // 2 + (T - window) * window


class Positions(RotaryEmbedding):
    """The model's RoPE caches, one per distinct layer setting, and which layer reads which.

    It is itself the first setting's cache (a `RotaryEmbedding`: `cos`, `sin`, `forward`,
    `at`, buffer names `rope.cos` / `rope.sin` as before per-layer positions), and holds one
    more `RotaryEmbedding` in `others` per further setting (a global theta, a second spectrum).
    `per_layer(start, length)` / `per_layer_at(position_ids)` give every layer its (cos, sin);
    a NoPE layer's have 0 columns, so apply_rope leaves its q and k alone.
    """

    def __init__(self, layers: list[LayerPosition], max_seq_len: int, scaling, original_len):
        keys: list[tuple] = []
        for p in layers:
            if p.rope and p.cache_key not in keys:
                keys.append(p.cache_key)
        if not keys:  # NoPE everywhere: one empty cache, as before (0 columns)
            keys.append((0, layers[0].theta if layers else 10000.0, None))
        (r, theta, d), *rest = keys
        super().__init__(r, max_seq_len, theta, scaling, original_len, spectrum_dims=d)
        self.layers = tuple(layers)
        self.others = nn.ModuleList(
            RotaryEmbedding(r, max_seq_len, theta, scaling, original_len, spectrum_dims=d)
            for r, theta, d in rest
        )
        # Per layer: the index of its cache (0 = this module, i = others[i - 1]), None = NoPE.
        self.layer_cache = tuple(keys.index(p.cache_key) if p.rope else None for p in layers)

    @classmethod
    def from_config(cls, cfg: ModelConfig) -> Positions:
        return cls(
            layer_positions(cfg), cfg.max_seq_len, cfg.rope_scaling, cfg.original_max_seq_len
        )

    @property
    def caches(self) -> list[RotaryEmbedding]:
        return [self, *self.others]

    def _per_layer(self, tables: list[tuple[torch.Tensor, torch.Tensor]]):
        empty = (tables[0][0][..., :0], tables[0][1][..., :0])
        return [empty if c is None else tables[c] for c in self.layer_cache]

    def per_layer(self, start: int, length: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(cos, sin) of positions start .. start + length - 1 for every layer, (T, r)."""
        tables = [self(start, length)] + [cache(start, length) for cache in self.others]
        return self._per_layer(tables)

    def per_layer_at(self, position_ids: torch.Tensor, max_position: int | None = None):
        """(cos, sin) (B, 1, T, r) of each token's own position for every layer."""
        tables = [self.at(position_ids, max_position)]
        tables += [cache.at(position_ids, max_position) for cache in self.others]
        return self._per_layer(tables)

    def cache_bytes(self, max_seq_len: int | None = None) -> int:
        """fp32 bytes of every cache at `max_seq_len` positions (default: as built). A pair
        selection's layers read full RoPE's table (T x head_dim), whatever they keep."""
        return sum(
            rope_cache_bytes(max_seq_len or c.max_seq_len, c.rotary_dims, 4) for c in self.caches
        )

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, layers={[p.describe() for p in self.layers]}"
