"""The KV cache of a sequence, the part of each key that partial RoPE leaves position-free, and
the MLA-style cache a low-rank latent makes of it (MHA2MLA, Ji et al. 2025, "Towards
Economical Inference: Enabling DeepSeek's Multi-Head Latent Attention in Any Transformer-based
LLMs").

Per sequence (batch 1), e = bytes per element of K and V (bf16: 2), for layer l with n_kv KV
heads of head_dim dims, of which head h rotates r[l, h] (`LayerPosition.kv_rotary_dims`),
keeping c_l(T) tokens of a context of T (T; min(T, W - 1) for a sliding layer of window W, as
our KVCache and transformers' DynamicCache keep):

    K+V cache         = sum_l 2 x n_kv x head_dim x c_l(T) x e
    position-free key = head_dim - r[l, h] dims of head h (RoPE never touches them)
    latent cache      = sum_l (min(n_kv x d_kv, sum_h (2 head_dim - r[l, h])) + sum_h r[l, h])
                            x c_l(T) x e
    cos/sin tables    = sum over the distinct tables t: 2 x T x dims_t x 4    (fp32, per model)
    of kept pairs     = sum over the distinct tables t: 2 x T x 2 |K_t| x 4

The latent cache is MHA2MLA's: each layer's position-free key dims and its values are
compressed jointly (one SVD of [W_k,nope; W_v]) to a latent of n_kv x d_kv dims per token (its
code: `d_kv_mid = low_rank * num_key_value_heads`; d_kv is the rank per KV head, `--latent-rank`),
and the rotary dims of every KV head's key are cached as they are, per KV head: a pair
selection may keep different pairs in each head, so they cannot be shared. (DeepSeek's own MLA
caches one decoupled rotary key k^R of d_h^R dims per token and layer, shared by every head:
that is the n_kv = 1 case of the rotary term.) A latent wider than what it replaces replaces
nothing: hence the min. With MHA2MLA's choices, r = head_dim / 8 rotary dims per KV head (a
1/8 pair selection; its `rope_dim_for_mla`: 8 of 64, 16 of 128) and d_kv = head_dim / 2, / 4,
/ 8, the latent cache is (d_kv + r) / (2 head_dim) = 31.25%, 18.75%, 12.5% of the K+V cache:
its paper's -68.75%, -81.25%, -87.5%.

Layers with the same `cache_key` read one table t (pretrain/model/position.py) of dims_t dims a
position: their rotary dims, and head_dim under a pair selection, whose layers read full
RoPE's table whatever they keep (`Positions.cache_bytes`; `--check` compares with the built
model's buffers). K_t is the union of the pairs the layers reading t rotate with (each layer's
count is `LayerPosition.cache_frequencies`: r / 2, or the pairs its KV heads keep): what a
table of only the frequencies in use would hold. Partial RoPE alone frees no K+V byte: every
key dim is still cached. What it frees is the part of the cache a latent can absorb.
"""

from __future__ import annotations

import io
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from pretrain.analysis.rope_cache import (
    KI,
    MI,
    PRECISION_BYTES,
    CheckResult,
    human_bytes,
    measure_rope_bytes,
)
from pretrain.config import ConfigError, ModelConfig
from pretrain.model.attention import KVCache
from pretrain.model.pairs import describe
from pretrain.model.position import LayerPosition, layer_positions
from pretrain.model.rope import rope_cache_bytes
from pretrain.model.transformer import Transformer
from pretrain.run_layout import atomic_write
from pretrain.tables import pipe_table, text_table

# The paper's three models: Llama-3.2-1B shape, Pythia-1B (as the paper ran it), Llama-3.1-8B
# with 36 layers.
DEFAULT_MODELS = ("llama1b", "pythia1b_paper", "llama8b")
DEFAULT_KV_SEQ_LENS = (4 * KI, 32 * KI, 128 * KI, MI)
TABLE_BYTES = PRECISION_BYTES["fp32"]
AS_CONFIGURED = "as configured"  # the cos/sin tables are fp32 whatever the model's dtype


@dataclass(frozen=True)
class LayerKV:
    """What one layer caches per token: K and V of every KV head, and its cos/sin table."""

    layer: int
    kv_heads: int
    head_dim: int
    rotary_dims: tuple[int, ...]  # per KV head
    table: Hashable | None  # layers with one key read one cos/sin table; None = NoPE
    table_dims: int  # the dims of each position that table holds (a selection: head_dim)
    frequencies: frozenset[int]  # the table's pairs this layer rotates with (any KV head)
    window: int | None

    def cached_tokens(self, seq_len: int) -> int:
        return seq_len if self.window is None else min(seq_len, max(self.window - 1, 0))

    @property
    def kv_elements(self) -> int:
        return 2 * self.kv_heads * self.head_dim

    @property
    def free_key_dims(self) -> tuple[int, ...]:
        return tuple(self.head_dim - r for r in self.rotary_dims)

    def latent_elements(self, d_kv: int) -> int:
        compressible = sum(2 * self.head_dim - r for r in self.rotary_dims)
        return min(self.kv_heads * d_kv, compressible) + sum(self.rotary_dims)


def layer_kv(cfg: ModelConfig) -> tuple[LayerKV, ...]:
    """Every layer's cache shape, from the model's own per-layer position settings."""
    return tuple(_layer_kv(p, cfg.kv_heads) for p in layer_positions(cfg))


def _layer_kv(p: LayerPosition, kv_heads: int) -> LayerKV:
    # Which of the table's pairs: a selection names them (pair j = frequency j of full RoPE,
    # the table's j-th); otherwise the layer rotates with all of its table's.
    kept = frozenset(range(p.cache_frequencies()))
    if p.pairs is not None:
        kept = frozenset().union(*p.pairs)
        if len(kept) != p.cache_frequencies():
            raise AssertionError(f"layer {p.layer}: {len(kept)} kept pairs, not cache_frequencies")
    return LayerKV(
        layer=p.layer,
        kv_heads=kv_heads,
        head_dim=p.head_dim,
        rotary_dims=p.kv_rotary_dims(kv_heads),
        table=p.cache_key if p.rope else None,
        table_dims=p.rotary_dims,
        frequencies=kept,
        window=p.window,
    )


@dataclass(frozen=True)
class ModelKV:
    """A model's caches as formulas of the context length (the module docstring's)."""

    name: str
    position: str  # the row's label: "100% RoPE", "1/8 of pairs", "NoPE", ...
    layers: tuple[LayerKV, ...]

    def kv_bytes(self, seq_len: int, elem: int) -> int:
        return sum(ly.kv_elements * ly.cached_tokens(seq_len) for ly in self.layers) * elem

    def latent_bytes(self, seq_len: int, d_kv: int, elem: int) -> int:
        return sum(ly.latent_elements(d_kv) * ly.cached_tokens(seq_len) for ly in self.layers) * (
            elem
        )

    def table_bytes(self, seq_len: int) -> int:
        """The cos/sin tables our model holds: one per distinct setting, all its dims."""
        tables = {ly.table: ly.table_dims for ly in self.layers if ly.table is not None}
        return sum(rope_cache_bytes(seq_len, r, TABLE_BYTES) for r in tables.values())

    def kept_table_bytes(self, seq_len: int) -> int:
        """The cos/sin tables of the frequencies some layer rotates with, and no others."""
        kept: dict[Hashable, set[int]] = {}
        for ly in self.layers:
            if ly.table is not None:
                kept.setdefault(ly.table, set()).update(ly.frequencies)
        return sum(rope_cache_bytes(seq_len, 2 * len(f), TABLE_BYTES) for f in kept.values())

    @property
    def rotary_dims(self) -> list[int]:
        return [r for ly in self.layers for r in ly.rotary_dims]

    @property
    def free_key_dims(self) -> list[int]:
        return [d for ly in self.layers for d in ly.free_key_dims]


def model_kv(cfg: ModelConfig, name: str, position: str) -> ModelKV:
    return ModelKV(name, position, layer_kv(cfg))


# ----------------------------------------------------------------------------- variants


def position_variants(cfg: ModelConfig) -> list[tuple[str, ModelConfig]]:
    """The config as written, then full RoPE, a 1/4 and a 1/8 pair selection, 10% RoPE and
    NoPE of the same shape (most rotary dims first); the config's own row is left out when it
    caches what one of those caches."""
    variants = [
        ("100% RoPE", _fraction(cfg, 1.0)),
        ("1/4 of pairs", _pair_share(cfg, 4)),
        ("1/8 of pairs", _pair_share(cfg, 8)),
        ("10% RoPE", _fraction(cfg, 0.1)),
        ("NoPE", _fraction(cfg, 0.0)),
    ]
    variants = [(label, c) for label, c in variants if c is not None]
    own = layer_kv(cfg)
    if all(layer_kv(c) != own for _, c in variants):
        variants.insert(0, (AS_CONFIGURED, cfg))
    return variants


def _fraction(cfg: ModelConfig, fraction: float) -> ModelConfig | None:
    try:
        return cfg.replace(rope_fraction=fraction, rotary_dims=None, rope_pairs=None)
    except ConfigError:
        return None  # a fraction that rounds to 0 dims of this head_dim


def _pair_share(cfg: ModelConfig, one_in: int) -> ModelConfig | None:
    """head_dim / (2 one_in) of each KV head's head_dim / 2 pairs, the highest frequencies in
    every head (model.rope_pairs strategy `high`, MHA2MLA's S_high). Any selection of that
    many pairs per head caches the same K+V and latent bytes; only the kept frequencies'
    union (`cos/sin of kept pairs`) depends on which."""
    pairs = cfg.head_dim // (2 * one_in)
    if pairs == 0:
        return None
    try:
        return cfg.replace(
            rope_fraction=1.0,
            rotary_dims=None,
            rope_pairs={"strategy": "high", "pairs": pairs},
        )
    except ConfigError:
        return None  # a selection this config refuses (rope_scaling, p-RoPE)


def _describe(cfg: ModelConfig) -> str:
    hd = cfg.head_dim
    if cfg.rope_pairs is not None:
        return describe(cfg.rope_pairs, hd)
    r = cfg.rope_dims
    return "NoPE" if r == 0 else f"RoPE {r}/{hd}"


# ----------------------------------------------------------------------------- rows


@dataclass(frozen=True)
class KVRow:
    position: str
    rotary_dims: str  # per KV head, over layers and heads
    free_key_dims: str
    d_kv: int
    table_per_position: int  # the cos/sin our model holds
    kept_table_per_position: int  # of the kept frequencies only
    kv_per_token: int
    latent_per_token: int
    kv: tuple[int, ...]  # at each length
    latent: tuple[int, ...]
    tables: tuple[int, ...]
    kept_tables: tuple[int, ...]

    @property
    def ratio(self) -> float:
        return self.latent_per_token / self.kv_per_token


def kv_rows(
    models: Sequence[ModelKV], seq_lens: Sequence[int], d_kvs: Sequence[int], elem: int
) -> list[KVRow]:
    """One row per position variant and latent rank."""
    rows = []
    for m in models:
        for d_kv in d_kvs:
            rows.append(
                KVRow(
                    position=m.position,
                    rotary_dims=_spread(m.rotary_dims),
                    free_key_dims=_spread(m.free_key_dims),
                    d_kv=d_kv,
                    table_per_position=m.table_bytes(1),
                    kept_table_per_position=m.kept_table_bytes(1),
                    kv_per_token=m.kv_bytes(1, elem),
                    latent_per_token=m.latent_bytes(1, d_kv, elem),
                    kv=tuple(m.kv_bytes(T, elem) for T in seq_lens),
                    latent=tuple(m.latent_bytes(T, d_kv, elem) for T in seq_lens),
                    tables=tuple(m.table_bytes(T) for T in seq_lens),
                    kept_tables=tuple(m.kept_table_bytes(T) for T in seq_lens),
                )
            )
    return rows


def _spread(values: Sequence[int]) -> str:
    lo, hi = min(values), max(values)
    return str(lo) if lo == hi else f"{lo}..{hi} (mean {sum(values) / len(values):.3g})"


def parse_latent_ranks(text: str | None, head_dim: int) -> list[int]:
    """'8,16,32' -> [8, 16, 32]; None -> [head_dim / 4] (MHA2MLA's middle choice)."""
    if text is None:
        return [max(1, head_dim // 4)]
    out = []
    for item in (s.strip() for s in text.split(",")):
        if not item:
            continue
        if not item.isdigit() or int(item) < 1:
            raise ConfigError(
                f"--latent-rank: {item!r} is not a positive whole number; use e.g. 16 or 8,16,32"
            )
        out.append(int(item))
    if not out:
        raise ConfigError("--latent-rank is empty; use e.g. 16 or 8,16,32")
    return out


# ----------------------------------------------------------------------------- printing


def format_kv_tables(
    cfg: ModelConfig,
    name: str,
    rows: Sequence[KVRow],
    seq_lens: Sequence[int],
    precision: str,
    units: str = "auto",
    markdown: bool = False,
) -> str:
    """The per-token table and the table at each length of one model."""
    fmt = (lambda b: str(b)) if units == "bytes" else human_bytes
    elem = PRECISION_BYTES[precision]
    draw = pipe_table if markdown else text_table
    title = (
        f"{name}: {cfg.n_layers} layers x {cfg.kv_heads} KV heads x head_dim {cfg.head_dim}, "
        f"K and V in {precision} ({elem} bytes), batch 1; cos/sin tables fp32, one per model"
    )
    if any(r.position == AS_CONFIGURED for r in rows):
        title += f"; {AS_CONFIGURED}: {_describe(cfg)}"
    per_token = draw(
        [
            "position",
            "rotary dims / KV head",
            "position-free key dims",
            "cos/sin per position",
            "cos/sin of kept pairs",
            "K+V per token",
            "d_kv",
            "latent + rotary keys per token",
            "vs K+V",
        ],
        [
            [
                r.position,
                r.rotary_dims,
                r.free_key_dims,
                fmt(r.table_per_position),
                fmt(r.kept_table_per_position),
                fmt(r.kv_per_token),
                str(r.d_kv),
                fmt(r.latent_per_token),
                f"{100 * r.ratio:.2f}%",
            ]
            for r in rows
        ],
    )
    kv = {r.kv for r in rows}
    if len(kv) != 1:
        raise AssertionError(f"the K+V cache differs between position variants: {kv}")
    body = [["every variant", "K+V", *[fmt(b) for b in rows[0].kv]]]
    body += [[r.position, f"latent d_kv={r.d_kv}", *[fmt(b) for b in r.latent]] for r in rows]
    seen = set()
    for r in rows:
        if r.position not in seen:
            seen.add(r.position)
            body.append([r.position, "cos/sin tables", *[fmt(b) for b in r.tables]])
            if r.kept_tables != r.tables:
                body.append([r.position, "cos/sin of kept pairs", *[fmt(b) for b in r.kept_tables]])
    at_lengths = draw(["position", "cache", *[f"T={_tokens(T)}" for T in seq_lens]], body)
    if markdown:  # a paragraph before each table, blank lines between (markdown's blocks)
        return "\n\n".join(
            [f"**{title}**", "Per token:", per_token, "At each context length:", at_lengths]
        )
    return "\n".join(
        [title, "", "Per token:", per_token, "", "At each context length:", at_lengths]
    )


def _tokens(v: int) -> str:
    if v % MI == 0:
        return f"{v // MI}M"
    if v % KI == 0:
        return f"{v // KI}K"
    return f"{v:,}"


def plot_kv(
    panels: Sequence[tuple[str, ModelConfig, Sequence[ModelKV]]],
    d_kv: int | None,
    precision: str,
    max_seq_len: int,
    path: str | Path,
) -> Path:
    """One log-log panel per model: the K+V cache (one line: every position variant caches
    the same), each variant's latent cache (d_kv: None = head_dim / 4 of each model) and its
    cos/sin tables, against context length; PNG at `path`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    elem = PRECISION_BYTES[precision]
    top = max(max_seq_len, 4 * KI)
    T = np.unique(np.geomspace(KI, top, 48).round().astype(np.int64))
    fig, axes = plt.subplots(
        1, len(panels), figsize=(5.2 * len(panels), 5.2), dpi=100, squeeze=False
    )
    colors = plt.get_cmap("viridis")
    for ax, (name, cfg, models) in zip(axes[0], panels, strict=True):
        rank = d_kv or max(1, cfg.head_dim // 4)
        kv = np.array([models[0].kv_bytes(int(t), elem) for t in T], dtype=float)
        ax.plot(T, kv, color="black", lw=2.2, label=f"K+V, any position: {human_bytes(kv[-1])}")
        for i, m in enumerate(models):
            c = colors(0.9 * i / max(1, len(models) - 1))
            lat = np.array([m.latent_bytes(int(t), rank, elem) for t in T], dtype=float)
            ax.plot(T, lat, color=c, lw=1.8, ls="--", label=f"{m.position}: {human_bytes(lat[-1])}")
            tab = np.array([m.table_bytes(int(t)) for t in T], dtype=float)
            if tab[-1] > 0:
                ax.plot(T, tab, color=c, lw=1.0, ls=":")
        ax.set_xscale("log")
        ax.set_yscale("log")
        xt = [v for v in (4**k * KI for k in range(12)) if v <= top]
        ax.set_xticks(xt, [_tokens(v) for v in xt])
        ax.minorticks_off()
        ax.set_xlim(T[0], T[-1])
        # Binary ticks (1 KiB, 16 KiB, ...) read better than 10^k bytes.
        lo, hi = ax.get_ylim()
        yt = [16.0**k for k in range(16) if lo <= 16.0**k <= hi]
        ax.set_yticks(yt, [human_bytes(v).replace(".0 ", " ") for v in yt])
        ax.set_xlabel("context length (tokens, K = 1024)")
        ax.set_ylabel(f"bytes per sequence ({precision} K/V; fp32 cos/sin)")
        ax.set_title(
            f"{name}: {cfg.n_layers} x {cfg.kv_heads} KV heads x {cfg.head_dim}\n"
            f"dashed: latent d_kv={rank} + rotary keys; dotted: cos/sin",
            fontsize=9,
        )
        ax.grid(True, which="major", alpha=0.3)
        ax.legend(fontsize=7, loc="upper left", title=f"at {_tokens(top)}", title_fontsize=7)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    plt.close(fig)
    atomic_write(path, buf.getvalue(), fsync=False)
    return path


# ----------------------------------------------------------------------------- check


@dataclass(frozen=True)
class KVCheck:
    name: str
    seq_len: int
    expected_bytes: int
    allocated_bytes: int

    @property
    def ok(self) -> bool:
        return self.expected_bytes == self.allocated_bytes


def check_kv_cache(cfg: ModelConfig, name: str, precision: str = "bf16") -> KVCheck:
    """The formula against the bytes our KVCache allocates for `cfg` (batch 1, max_seq_len,
    on the meta device: nothing is really allocated). Sliding layers start empty and grow as
    they decode, so only full layers are compared."""
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    T = cfg.max_seq_len
    cache = KVCache(cfg, 1, T, device="meta", dtype=dtype)
    full = [i for i, w in enumerate(cache.windows) if w is None]
    allocated = sum(cache.k[i].nbytes + cache.v[i].nbytes for i in full)
    layers = tuple(ly for ly in layer_kv(cfg) if ly.layer in full)
    expected = ModelKV(name, "as configured", layers).kv_bytes(T, PRECISION_BYTES[precision])
    return KVCheck(name, T, expected, allocated)


def format_kv_check(results: Sequence[KVCheck]) -> str:
    header = ["model", "max_seq_len", "formula_bytes", "KVCache_bytes", "ok"]
    body = [
        [r.name, str(r.seq_len), str(r.expected_bytes), str(r.allocated_bytes), _ok(r.ok)]
        for r in results
    ]
    return "\n".join(
        [
            "K+V bytes of our KVCache (batch 1, max_seq_len, bf16, on meta) against "
            "2 x n_layers x n_kv x head_dim x T x 2",
            *text_table(header, body).splitlines(),
        ]
    )


def selection_variants(cfg: ModelConfig) -> list[tuple[str, ModelConfig]]:
    """Pair selections of `cfg`'s shape for the check: the highest 1/8 of the pairs in every
    head, and as many pairs per head chosen apart (KV head g keeps pairs g K .. g K + K - 1,
    mod P: the union of the heads' is min(KV heads x K, P))."""
    out = []
    high = _pair_share(cfg, 8)
    if high is None:
        return out
    out.append(("rope_pairs=high 1/8", high))
    P, K = cfg.head_dim // 2, cfg.head_dim // 16
    nope = cfg.nope_layer_set
    selected = [
        [
            [] if i in nope else sorted({(g * K + j) % P for j in range(K)})
            for g in range(cfg.kv_heads)
        ]
        for i in range(cfg.n_layers)
    ]
    apart = cfg.replace(rope_fraction=1.0, rotary_dims=None, rope_pairs={"selected": selected})
    out.append(("rope_pairs=apart 1/8", apart))
    return out


def check_selection_tables(cfg: ModelConfig, name: str) -> list[CheckResult]:
    """The cos/sin bytes the tool reports for `cfg`'s pair selections against the rope buffers
    of the full model built on meta (one fp32 table of head_dim dims per position)."""
    out = []
    for label, c in selection_variants(cfg):
        with torch.device("meta"):
            model = Transformer(c)
        measured, dtypes, n = measure_rope_bytes(model)
        expected = model_kv(c, name, label).table_bytes(c.max_seq_len)
        dims = max(ly.table_dims for ly in layer_kv(c))
        variant = f"{name} {label}"
        out.append(
            CheckResult(variant, "meta fp32", dims, c.max_seq_len, expected, measured, dtypes, n)
        )
    return out


def _ok(ok: bool) -> str:
    return "ok" if ok else "MISMATCH"
