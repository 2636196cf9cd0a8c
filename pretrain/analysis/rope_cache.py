"""RoPE cos/sin cache memory against context length and rotary fraction (the paper's Figure 1).

The cache holds cos and sin for every position and rotary dim:
    bytes = 2 x max_seq_len x rotary_dims x bytes_per_element      (rope.rope_cache_bytes)
Our model keeps one such cache in fp32, shared by every layer. A per-layer layout (a
RotaryEmbedding inside each attention layer, as GPT-NeoX builds it) holds n_layers of them.

`check_model` measures the buffers a built Transformer really allocates and compares them
with the formula, so the table cannot drift from the code.
"""

from __future__ import annotations

import io
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from pretrain.analysis.presets import load_preset
from pretrain.config import ConfigError, ModelConfig, rotary_dims_from_fraction
from pretrain.model.rope import inverse_frequencies, rope_cache_bytes
from pretrain.model.transformer import Transformer
from pretrain.run_layout import atomic_write
from pretrain.tables import pipe_table, text_table

PRECISION_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
# The paper's fractions: NoPE, the 1% / 4% minimum (2 dims), 10%, 25%, ..., full RoPE.
DEFAULT_FRACTIONS = (0.0, 0.01, 0.04, 0.10, 0.25, 0.50, 0.75, 1.0)
CHECK_FRACTIONS = (0.0, 0.10, 0.25, 0.50, 1.0)
KI, MI = 1024, 1024 * 1024
DEFAULT_SEQ_LENS = (2 * KI, 8 * KI, 32 * KI, 128 * KI, MI, 10 * MI)


@dataclass(frozen=True)
class CacheRow:
    fraction: float
    rotary_dims: int | None  # None: a positive fraction that rounds to 0 dims (not allowed)
    shared_bytes: tuple[int, ...]  # one model-wide cache, per sequence length
    per_layer_bytes: tuple[int, ...]  # n_layers caches (GPT-NeoX layout), per sequence length
    saving: float  # full-RoPE cache / this cache (inf for NoPE, nan when not allowed)


def parse_seq_len(text: str) -> int:
    """'2048', '8k', '128K', '1M', '10M' -> tokens (k = 1024, M = 1024^2, as context sizes go)."""
    t = text.strip().replace("_", "").replace(",", "")
    scale = {"k": KI, "m": MI}.get(t[-1:].lower(), 1)
    if scale != 1:
        t = t[:-1]
    try:
        value = float(t) * scale
    except ValueError:
        raise ConfigError(f"--seq-lens: {text!r} is not a length; use e.g. 2048, 8k, 1M") from None
    if value < 1 or not value.is_integer():
        raise ConfigError(f"--seq-lens: {text!r} must be a positive whole number of tokens")
    return int(value)


def parse_fraction(text: str) -> float:
    """'10%', '0.1', '10' -> 0.1 (a bare number above 1 is read as a percentage)."""
    t = text.strip()
    pct = t.endswith("%")
    try:
        value = float(t.rstrip("%"))
    except ValueError:
        raise ConfigError(f"--fractions: {text!r} is not a number; use e.g. 0.1 or 10%") from None
    if pct or value > 1:
        value /= 100
    if not 0 <= value <= 1:
        raise ConfigError(f"--fractions: {text!r} is outside 0..100%")
    return value


def cache_table(
    head_dim: int,
    seq_lens: Sequence[int],
    fractions: Sequence[float],
    precision: str = "fp32",
    n_layers: int = 16,
) -> list[CacheRow]:
    """One row per fraction: rotary dims, shared and per-layer cache bytes, saving vs full."""
    if precision not in PRECISION_BYTES:
        raise ConfigError(f"--precision={precision!r}; use one of {', '.join(PRECISION_BYTES)}")
    elem = PRECISION_BYTES[precision]
    rows = []
    for f in fractions:
        dims = rotary_dims_from_fraction(f, head_dim)
        if f > 0 and dims == 0:
            zeros = (0,) * len(seq_lens)
            rows.append(CacheRow(f, None, zeros, zeros, math.nan))
            continue
        shared = tuple(rope_cache_bytes(T, dims, elem) for T in seq_lens)
        rows.append(
            CacheRow(
                f,
                dims,
                shared,
                tuple(n_layers * b for b in shared),
                head_dim / dims if dims else math.inf,
            )
        )
    return rows


# ----------------------------------------------------------------------------- printing


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def _fraction_label(f: float) -> str:
    return f"{100 * f:g}%"


def format_cache_table(
    rows: Sequence[CacheRow],
    seq_lens: Sequence[int],
    head_dim: int,
    precision: str,
    n_layers: int,
    units: str = "auto",
) -> str:
    """Two tables (shared cache, per-layer layout) as aligned text."""
    fmt = (lambda b: str(b)) if units == "bytes" else human_bytes
    elem = PRECISION_BYTES[precision]
    seq_head = [f"T={T:,}" for T in seq_lens]

    def block(title: str, per_layer: bool) -> list[str]:
        header = ["fraction", "rotary_dims", *seq_head, "vs_full"]
        body = []
        for r in rows:
            if r.rotary_dims is None:
                body.append(
                    [
                        _fraction_label(r.fraction),
                        "-",
                        *["-"] * len(seq_lens),
                        "refused: rounds to 0 dims",
                    ]
                )
                continue
            values = r.per_layer_bytes if per_layer else r.shared_bytes
            saving = "no cache" if math.isinf(r.saving) else f"{r.saving:.2f}x"
            body.append(
                [_fraction_label(r.fraction), str(r.rotary_dims), *[fmt(v) for v in values], saving]
            )
        return [title, *text_table(header, body, align=["right"] * len(header)).splitlines()]

    out = block(
        f"RoPE cos/sin cache, one per model (ours): head_dim {head_dim}, {precision} "
        f"({elem} bytes), bytes = 2 x T x rotary_dims x {elem}",
        per_layer=False,
    )
    out.append("")
    out += block(
        f"Per-layer layout (a cache in each of {n_layers} attention layers, as GPT-NeoX "
        f"builds it): {n_layers}x the above",
        per_layer=True,
    )
    full = next((r for r in rows if r.rotary_dims == head_dim), None)
    best = [r for r in rows if r.rotary_dims and r.rotary_dims < head_dim]
    if full is not None and best:
        r = min(best, key=lambda r: abs(r.fraction - 0.10))
        out += [
            "",
            f"Sharing one cache saves {n_layers}x; {_fraction_label(r.fraction)} RoPE "
            f"({r.rotary_dims} dims) saves {r.saving:.2f}x more: "
            f"{n_layers * r.saving:.1f}x below a per-layer full-RoPE cache.",
        ]
    return "\n".join(out)


def plot_cache(
    head_dim: int,
    fractions: Sequence[float],
    precision: str,
    n_layers: int,
    max_seq_len: int,
    path: str | Path,
) -> Path:
    """Log-log lines of cache bytes against context length, one per fraction; PNG at `path`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    elem = PRECISION_BYTES[precision]
    top = max(max_seq_len, 4 * KI)
    T = np.unique(np.geomspace(KI, top, 64).round().astype(np.int64))
    fig, ax = plt.subplots(figsize=(10, 4.8), dpi=100)
    colors = plt.get_cmap("viridis")
    drawn = [(f, rotary_dims_from_fraction(f, head_dim)) for f in fractions]
    drawn = [(f, d) for f, d in drawn if d > 0]
    at = f"at {_tokens_label(top)}"
    # Largest first, so the legend reads top to bottom like the lines.
    for i, (f, dims) in enumerate(sorted(drawn, key=lambda x: -x[1])):
        y = 2.0 * T * dims * elem
        ax.plot(
            T,
            y,
            color=colors(0.9 * i / max(1, len(drawn) - 1)),
            lw=2,
            label=f"{_fraction_label(f):>4} ({dims} dims): {human_bytes(y[-1])} {at}",
        )
    full = 2.0 * T * head_dim * elem * n_layers
    ax.plot(
        T,
        full,
        color="0.5",
        lw=1.5,
        ls="--",
        label=f"100%, per-layer layout\n({n_layers} layers): {human_bytes(full[-1])} {at}",
    )
    ax.set_xscale("log")
    ax.set_yscale("log")
    # Binary ticks: 1K, 4K, ... tokens and 1 KiB, 16 KiB, ... bytes read better than 10^k.
    xt = [v for v in (4**k * KI for k in range(12)) if v <= top]
    if top / xt[-1] > 1.5:
        xt.append(top)
    ax.set_xticks(xt, [_tokens_label(v) for v in xt])
    ax.minorticks_off()
    lo, hi = ax.get_ylim()
    yt = [16.0**k for k in range(16) if lo <= 16.0**k <= hi]
    ax.set_yticks(yt, [human_bytes(v).replace(".0 ", " ") for v in yt])
    ax.set_xlim(T[0], T[-1])
    ax.set_xlabel("context length (tokens, K = 1024, M = 1024^2)")
    ax.set_ylabel(f"cos + sin cache bytes ({precision})")
    nope = " 0% (NoPE) has none." if any(f == 0 for f in fractions) else ""
    ax.set_title(f"RoPE cache memory, head_dim {head_dim}, one cache per model.{nope}", fontsize=10)
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(
        fontsize=8,
        loc="upper left",
        bbox_to_anchor=(1.01, 1.0),
        frameon=False,
        title="rotary fraction",
        title_fontsize=8,
    )
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    plt.close(fig)
    atomic_write(path, buf.getvalue(), fsync=False)
    return path


def _tokens_label(v: float) -> str:
    if v >= MI:
        return f"{v / MI:g}M"
    if v >= KI:
        return f"{v / KI:g}K"
    return f"{v:g}"


# ----------------------------------------------------------------------------- check


@dataclass(frozen=True)
class CheckResult:
    variant: str  # preset and change, e.g. "llama1b rope_fraction=0.1"
    build: str  # "meta fp32", "meta ->bf16", "cpu fp32", "cpu ->bf16"
    rotary_dims: int
    max_seq_len: int
    expected_bytes: int
    measured_bytes: int
    dtypes: tuple[str, ...]  # of the rope buffers
    n_buffers: int

    @property
    def ok(self) -> bool:
        return self.expected_bytes == self.measured_bytes and all(
            d == "torch.float32" for d in self.dtypes
        )


def rope_buffers(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every buffer whose name mentions rope (each tensor once, as named_buffers gives them)."""
    return {n: b for n, b in model.named_buffers() if "rope" in n.lower()}


def measure_rope_bytes(model: torch.nn.Module) -> tuple[int, tuple[str, ...], int]:
    """(bytes of the storages behind the rope buffers, their dtypes, how many buffers).

    Storage bytes, not numel x element size, so a buffer that is a slice of a larger
    allocation counts what it really keeps alive.
    """
    bufs = rope_buffers(model)
    seen: set[int] = set()
    total = 0
    for b in bufs.values():
        storage = b.untyped_storage()
        # Meta tensors have no addresses; named_buffers already lists each tensor once.
        key = id(b) if b.device.type == "meta" else storage.data_ptr()
        if key in seen:
            continue
        seen.add(key)
        total += storage.nbytes()
    return total, tuple(sorted({str(b.dtype) for b in bufs.values()})), len(bufs)


Formula = Callable[[int, int, int], int]


def check_model(
    model: Transformer, variant: str, build: str, formula: Formula = rope_cache_bytes
) -> CheckResult:
    """Compare the rope buffers of `model` with formula(max_seq_len, rotary_dims, 4 bytes),
    summed over the caches the model says it keeps (one per distinct layer setting:
    pretrain/model/position.py; one for every model without per-layer settings)."""
    cfg = model.cfg
    measured, dtypes, n = measure_rope_bytes(model)
    elem = PRECISION_BYTES["fp32"]
    expected = sum(formula(cfg.max_seq_len, c.rotary_dims, elem) for c in model.rope.caches)
    dims = model.rope.rotary_dims
    return CheckResult(variant, build, dims, cfg.max_seq_len, expected, measured, dtypes, n)


@dataclass(frozen=True)
class SpectrumRow:
    fraction: float
    rotary_dims: int
    neox: tuple[float, float]  # (shortest, longest) wavelength in tokens, 2 pi / frequency
    p_rope: tuple[float, float]


def spectrum_rows(head_dim: int, theta: float, fractions: Sequence[float]) -> list[SpectrumRow]:
    """The two spectra a partial-RoPE model can carry on the same rotary dims (its cache is
    the same size either way): NeoX's frequencies rescaled over the r dims, and p-RoPE's, the
    r/2 highest of full RoPE's (pretrain/model/position.py). Wavelengths in tokens."""

    rows = []
    for f in fractions:
        r = rotary_dims_from_fraction(f, head_dim)
        if r == 0:
            continue
        waves = []
        for d in (r, head_dim):
            inv = inverse_frequencies(r, theta, spectrum_dims=d).double()
            waves.append((2 * math.pi / float(inv[0]), 2 * math.pi / float(inv[-1])))
        rows.append(SpectrumRow(f, r, waves[0], waves[1]))
    return rows


def format_spectrum_table(rows: list[SpectrumRow], head_dim: int, theta: float) -> str:
    title = (
        f"RoPE spectra, head_dim {head_dim}, theta {theta:g}: wavelengths in tokens "
        f"(2 pi / frequency) of the rotary pairs, shortest .. longest"
    )
    header = ["fraction", "rotary dims", "neox (model.rope_spectrum: neox)", "p-RoPE (p_rope)"]
    body = [
        [
            _fraction_label(r.fraction),
            str(r.rotary_dims),
            f"{r.neox[0]:.3g} .. {r.neox[1]:.4g}",
            f"{r.p_rope[0]:.3g} .. {r.p_rope[1]:.4g}",
        ]
        for r in rows
    ]
    return title + "\n" + pipe_table(header, body)


def _small_variant(cfg: ModelConfig) -> ModelConfig:
    """Same head_dim, rotary dims, theta and max_seq_len, one head and tiny widths: cheap on CPU."""
    return cfg.replace(
        n_layers=2,
        n_heads=1,
        n_kv_heads=None,
        d_model=cfg.head_dim,
        d_ff=32,
        vocab_size=128,
        pad_vocab_to_multiple=1,
    )


def check_cache_formula(
    cfg: ModelConfig, name: str, formula: Formula = rope_cache_bytes
) -> list[CheckResult]:
    """Four builds of `cfg`: the full model on meta (fp32 and cast to bf16) and a one-head
    model with the same RoPE settings really allocated on CPU (fp32 and cast to bf16)."""
    results = []
    with torch.device("meta"):
        model = Transformer(cfg)
    results.append(check_model(model, name, "meta fp32", formula))
    results.append(check_model(model.to(torch.bfloat16), name, "meta ->bf16", formula))
    small = Transformer(_small_variant(cfg))
    results.append(check_model(small, name, "cpu fp32", formula))
    results.append(check_model(small.to(torch.bfloat16), name, "cpu ->bf16", formula))
    return results


def check_presets(
    presets: Sequence[str], fractions: Sequence[float], formula: Formula = rope_cache_bytes
) -> list[CheckResult]:
    """check_cache_formula for each preset as written and at each fraction its head_dim allows."""

    results = []
    for preset in presets:
        base = load_preset(preset)
        variants = [(f"{preset}", base)]
        for f in fractions:
            if f > 0 and rotary_dims_from_fraction(f, base.head_dim) == 0:
                continue  # the config refuses it (0 dims); nothing to build
            cfg = base.replace(rope_fraction=f, rotary_dims=None)
            variants.append((f"{preset} rope_fraction={f:g}", cfg))
        for name, cfg in variants:
            results.extend(check_cache_formula(cfg, name, formula))
    return results


def format_check(results: Sequence[CheckResult]) -> str:
    """One line per model variant: formula bytes, then the buffer bytes of each build."""
    builds = list(dict.fromkeys(r.build for r in results))
    variants: dict[str, dict[str, CheckResult]] = {}
    for r in results:
        variants.setdefault(r.variant, {})[r.build] = r
    header = ["model", "rotary_dims", "max_seq_len", "formula_bytes", *builds, "dtype", "ok"]
    body = []
    for name, by_build in variants.items():
        first = next(iter(by_build.values()))
        dtypes = sorted({d.replace("torch.", "") for r in by_build.values() for d in r.dtypes})
        ok = all(r.ok for r in by_build.values())
        body.append(
            [
                name,
                str(first.rotary_dims),
                str(first.max_seq_len),
                str(first.expected_bytes),
                *[str(by_build[b].measured_bytes) if b in by_build else "-" for b in builds],
                ",".join(dtypes),
                "ok" if ok else "MISMATCH",
            ]
        )
    lines = [
        "Bytes of the rope buffers of built Transformers against 2 x max_seq_len x "
        "rotary_dims x 4 (fp32); '->bf16' = model.to(bfloat16), the cache must stay fp32",
        *text_table(header, body).splitlines(),
    ]
    bad = sum(not r.ok for r in results)
    lines.append(
        f"{len(results) - bad}/{len(results)} builds match the formula"
        + ("" if not bad else f"; {bad} MISMATCH (buffer bytes or dtype differ)")
    )
    return "\n".join(lines)
