"""Which RoPE frequencies a model uses: per layer, per head and per rotary pair, the mean over
real tokens of ||q_pair|| x ||k_pair|| and each pair's share of the head's total.

Barbero et al. (ICLR 2025, "Round and Round We Go! What makes Rotary Positional Encodings
useful?") read a trained model's frequency usage from the norms of q and k in each rotary
pair; MHA2MLA (Ji et al., 2025) ranks pairs by the same 2-norm contribution. Here, for layer
l, query head h (its key head g(h) = h // (H / KV), the head's KV group under GQA), pair j:

    use[l, h, j]   = (1 / N) sum_t ||q_t[h, pair j]|| ||k_t[g(h), pair j]||
    share[l, h, j] = use[l, h, j] / sum_j' use[l, h, j']

over the N real tokens t (padding masked out; every token of a window counts, whichever
document it belongs to). Pair j of a head is dims (j, j + r/2), r = the layer's rotary dims
(the first r dims of the head, GPT-NeoX / transformers "rotate_half" order,
pretrain/model/position.py), rotated at inverse frequency f_j, highest first (j = 0), as
`LayerPosition.inverse_frequencies()` gives it: theta^(-2j/r) for `neox`, theta^(-2j/head_dim)
for `p_rope`. Pair j adds q_pair . R(f_j (t - s)) k_pair to the logit of query t and key s,
at most ||q_pair|| ||k_pair|| whatever the distance: `use` is the mean of that bound with q and
k read at the same token.

q and k are the vectors RoPE rotates: the qkv projection's output after QK-Norm when the model
has it (`Attention.heads`). They are read before the rotation; a rotation leaves each pair's
norm unchanged, so before or after is the same number. The hooks are forward hooks on each
attention layer's `qkv` Linear and, with QK-Norm, its `q_norm` / `k_norm` modules; the
attention module's own forward hook closes the layer. Nothing in the model changes.

Heads pooled: `pooled[j]` = the mean of use[l, h, j] over the layer's heads, `pooled_share` =
pooled / its sum (so a head with larger q and k norms weighs more). NoPE layers have no pairs:
`rope` false, empty `inv_freq`, `pooled` and per-head lists. `passthrough_per_head` is the
same mean product over the dims past r (the pass-through dims of partial RoPE, the whole head
of a NoPE layer), as one block: how much of the head's q.k bound does not rotate.

Sums are kept in fp64 on the model's device, one batch at a time, under no_grad; a CPU is
enough.
"""

from __future__ import annotations

import io
import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from pretrain.model.position import LayerPosition
from pretrain.model.rope import scaled_frequencies
from pretrain.model.transformer import Transformer
from pretrain.run_layout import atomic_write
from pretrain.tables import text_table

JSON_NAME = "frequency_use.json"
LAYERS_PNG = "frequency_use_layers.png"
HEADS_PNG = "frequency_use_heads.png"


@dataclass(frozen=True)
class LayerFrequencyUse:
    """One layer's map; lists are plain floats so the record is JSON as it stands."""

    layer: int
    rope: bool
    rotary_dims: int
    head_dim: int
    theta: float
    spectrum: str
    heads: int
    kv_heads: int
    inv_freq: list[float]  # pair j's inverse frequency (LayerPosition), highest first
    # the model's scaled frequencies when it has a model.rope_scaling (factor != 1), else None
    scaled_inv_freq: list[float] | None
    per_head: list[list[float]]  # [head][pair]: mean ||q_pair|| ||k_pair|| over tokens
    share_per_head: list[list[float]]  # [head][pair]: per_head / its sum over pairs
    pooled: list[float]  # [pair]: the mean of per_head over heads
    pooled_share: list[float]  # [pair]: pooled / its sum
    passthrough_per_head: list[float]  # [head]: the mean ||q_rest|| ||k_rest|| of dims r..D

    @property
    def pairs(self) -> int:
        return self.rotary_dims // 2

    def wavelengths(self) -> list[float]:
        """2 pi / f_j in tokens: the distance over which pair j turns once."""
        return [2 * math.pi / f for f in self.inv_freq]


@dataclass(frozen=True)
class FrequencyUse:
    """The whole map: every layer, the real tokens it is the mean over, and where from."""

    layers: list[LayerFrequencyUse]
    tokens: int
    source: str
    info: dict[str, Any] = field(default_factory=dict)  # provenance: text, seq_len, dtype

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> FrequencyUse:
        return cls(
            layers=[LayerFrequencyUse(**layer) for layer in d["layers"]],
            tokens=int(d["tokens"]),
            source=str(d["source"]),
            info=dict(d.get("info") or {}),
        )


class _LayerSums:
    """The running fp64 sums of one attention layer, and the q/k of the forward in flight."""

    def __init__(self, position: LayerPosition, heads: int, kv_heads: int):
        self.position = position
        self.heads, self.kv_heads = heads, kv_heads
        self.use: torch.Tensor | None = None  # (H, r/2) fp64
        self.rest: torch.Tensor | None = None  # (H,) fp64
        self.q: torch.Tensor | None = None  # (B, T, H, D), as the forward has it
        self.k: torch.Tensor | None = None  # (B, T, KV, D)

    def add(self, mask: torch.Tensor) -> None:
        """Add this forward's q and k (set by the hooks) over the tokens where mask is 1."""
        q, k, self.q, self.k = self.q, self.k, None, None
        if q is None or k is None:
            return
        r, H, KV = self.position.rotary_dims, self.heads, self.kv_heads
        B, T = q.shape[:2]
        m = mask.to(device=q.device, dtype=torch.float64)
        q64, k64 = q.to(torch.float64), k.to(torch.float64)
        # Pair j = dims (j, j + r/2): its 2-norm, per token and head.
        qn = torch.hypot(q64[..., : r // 2], q64[..., r // 2 : r]).view(B, T, KV, H // KV, r // 2)
        kn = torch.hypot(k64[..., : r // 2], k64[..., r // 2 : r])
        use = torch.einsum("bt,btkgp,btkp->kgp", m, qn, kn).reshape(H, r // 2)
        qr = q64[..., r:].norm(dim=-1).view(B, T, KV, H // KV)
        kr = k64[..., r:].norm(dim=-1)
        rest = torch.einsum("bt,btkg,btk->kg", m, qr, kr).reshape(H)
        self.use = use if self.use is None else self.use + use
        self.rest = rest if self.rest is None else self.rest + rest


class FrequencyUseMeter:
    """Hooks on every attention layer of `model`; `add(input_ids, mask)` runs one forward
    and adds its tokens, `result()` gives the map. A context manager: the hooks come off at
    the end (or call `close()`)."""

    def __init__(self, model: Transformer):
        self.model = model
        self.tokens = 0
        self._mask: torch.Tensor | None = None
        self._handles: list[Any] = []
        cfg = model.cfg
        self.layers = [_LayerSums(p, cfg.n_heads, cfg.kv_heads) for p in model.layer_positions()]
        for block, sums in zip(model.blocks, self.layers, strict=True):
            attn = block.attn
            self._handles.append(attn.qkv.register_forward_hook(self._qkv_hook(sums, attn)))
            if attn.q_norm is not None:
                self._handles.append(attn.q_norm.register_forward_hook(self._norm_hook(sums, "q")))
                self._handles.append(attn.k_norm.register_forward_hook(self._norm_hook(sums, "k")))
            self._handles.append(attn.register_forward_hook(self._close_hook(sums)))

    @staticmethod
    def _qkv_hook(sums: _LayerSums, attn):
        def hook(module, args, out):
            B, T, _ = out.shape
            H, KV, D = attn.n_heads, attn.n_kv_heads, attn.head_dim
            q, k, _v = out.detach().split([H * D, KV * D, KV * D], dim=-1)
            sums.q, sums.k = q.reshape(B, T, H, D), k.reshape(B, T, KV, D)

        return hook

    @staticmethod
    def _norm_hook(sums: _LayerSums, which: str):
        def hook(module, args, out):
            setattr(sums, which, out.detach())

        return hook

    def _close_hook(self, sums: _LayerSums):
        def hook(module, args, out):
            if self._mask is not None:
                sums.add(self._mask)
            sums.q = sums.k = None  # a forward outside add() counts nothing

        return hook

    @torch.no_grad()
    def add(self, input_ids: torch.Tensor, mask: torch.Tensor | None = None) -> int:
        """Run the model on input_ids (B, T) and add the tokens where `mask` (B, T) is true
        (default: all); returns how many were added."""
        if mask is None:
            mask = torch.ones_like(input_ids, dtype=torch.bool)
        if mask.shape != input_ids.shape:
            raise ValueError(f"mask {tuple(mask.shape)} is not input_ids' {tuple(input_ids.shape)}")
        device = self.model.wte.weight.device
        self._mask = mask.to(device)
        try:
            self.model.hidden_states(input_ids.to(device))
        finally:
            self._mask = None
        n = int(mask.sum())
        self.tokens += n
        return n

    def result(self, source: str = "", info: dict[str, Any] | None = None) -> FrequencyUse:
        """The map over every token added so far."""
        if self.tokens == 0:
            raise ValueError("no tokens added: call add() with at least one real token")
        cfg = self.model.cfg
        rope = self.model.rope
        out = []
        for sums in self.layers:
            p = sums.position
            H, P = sums.heads, p.rotary_dims // 2
            use = (
                torch.zeros(H, P, dtype=torch.float64)
                if sums.use is None
                else sums.use.cpu() / self.tokens
            )
            rest = torch.zeros(H, dtype=torch.float64) if sums.rest is None else sums.rest.cpu()
            pooled = use.mean(0)  # over heads
            # dynamic_ntk's frequencies depend on the sequence: these are its original ones
            scaled = None
            scaling = cfg.rope_scaling
            if p.rope and scaling is not None and scaling.factor != 1.0:
                inv, _ = scaled_frequencies(
                    p.rotary_dims,
                    p.theta,
                    scaling,
                    rope.original_len,
                    spectrum_dims=p.spectrum_dims,
                )
                scaled = inv.double().tolist()
            out.append(
                LayerFrequencyUse(
                    layer=p.layer,
                    rope=p.rope,
                    rotary_dims=p.rotary_dims,
                    head_dim=p.head_dim,
                    theta=float(p.theta),
                    spectrum=p.spectrum,
                    heads=H,
                    kv_heads=sums.kv_heads,
                    inv_freq=p.inverse_frequencies().double().tolist(),
                    scaled_inv_freq=scaled,
                    per_head=use.tolist(),
                    share_per_head=_shares(use).tolist(),
                    pooled=pooled.tolist(),
                    pooled_share=_shares(pooled).tolist(),
                    passthrough_per_head=(rest / self.tokens).tolist(),
                )
            )
        return FrequencyUse(out, self.tokens, source, dict(info or {}))

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def __enter__(self) -> FrequencyUseMeter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _shares(x: torch.Tensor) -> torch.Tensor:
    """x / its sum over the last dim; 0 where that sum is 0 (no pairs, or q or k all zero)."""
    total = x.sum(-1, keepdim=True)
    return torch.where(total > 0, x / total.clamp_min(torch.finfo(x.dtype).tiny), 0.0)


def frequency_use(
    model: Transformer,
    batches: Iterable[torch.Tensor | tuple[torch.Tensor, torch.Tensor]],
    source: str = "",
    info: dict[str, Any] | None = None,
) -> FrequencyUse:
    """The map of `model` (as it is: put it in eval mode first) over `batches`: input_ids
    (B, T), or (input_ids, mask) with mask (B, T) true at real tokens (padding false)."""
    with FrequencyUseMeter(model) as meter:
        for batch in batches:
            ids, mask = batch if isinstance(batch, tuple) else (batch, None)
            meter.add(ids, mask)
        return meter.result(source, info)


# ----------------------------------------------------------------------------- reading it


def summary_table(use: FrequencyUse) -> str:
    """One line per layer: its positions, its most-used pair (frequency rank, wavelength,
    share, pooled over heads) and the share of its lower-frequency half of the pairs."""
    rows = []
    for layer in use.layers:
        if not layer.rope:
            rows.append([str(layer.layer), "NoPE", "0", "-", "-", "-", "-"])
            continue
        j = max(range(layer.pairs), key=lambda i: layer.pooled_share[i])
        low = sum(layer.pooled_share[layer.pairs // 2 :])
        rows.append(
            [
                str(layer.layer),
                f"RoPE {layer.rotary_dims}/{layer.head_dim} ({layer.spectrum}, "
                f"theta {layer.theta:g})",
                str(layer.pairs),
                str(j),
                _tokens(layer.wavelengths()[j]),
                f"{layer.pooled_share[j]:.3f}",
                f"{low:.3f}",
            ]
        )
    header = ["layer", "positions", "pairs", "top pair", "wavelength", "share", "low half"]
    return text_table(header, rows, ["right", "left", *["right"] * 5])


def _save(fig, path: Path) -> Path:
    import matplotlib.pyplot as plt

    buf = io.BytesIO()
    # Constrained layout sizes the margins for the tick labels of the axes it starts from; a
    # colorbar resized by it can pick longer ones (0.05 steps, not 0.1). One draw first lets
    # it measure the labels of the layout it chose, so none is cut at the canvas's edge.
    fig.draw_without_rendering()
    fig.savefig(buf, format="png", dpi=100)
    plt.close(fig)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, buf.getvalue(), fsync=False)
    return path


def _pair_axis_label(layers: Sequence[LayerFrequencyUse]) -> tuple[str, list[float] | None]:
    """The x label and, when every RoPE layer has the same frequencies, their wavelengths."""
    rope = [layer for layer in layers if layer.rope]
    same = rope and all(layer.inv_freq == rope[0].inv_freq for layer in rope)
    label = "rotary pair j = frequency rank (0 = highest frequency)"
    return label, rope[0].wavelengths() if same else None


def _tokens(v: float) -> str:
    """A wavelength in tokens, short: 6.3, 63, 628, 6.3k, 63k, 6.3M."""
    for scale, suffix in ((1e6, "M"), (1e3, "k")):
        if v >= scale:
            return f"{v / scale:.2g}{suffix}"
    return f"{v:.2g}" if v < 10 else f"{v:.0f}"


def _wavelength_axis(ax, wavelengths: list[float]) -> None:
    """A top axis with the wavelength 2 pi / f_j (tokens) at a few pairs."""
    n = len(wavelengths)
    ticks = sorted({0, n - 1, *range(0, n, max(1, math.ceil(n / 5)))})
    if len(ticks) > 2 and ticks[-1] - ticks[-2] < max(1, n / 10):
        ticks.pop(-2)  # two labels side by side would overlap
    top = ax.secondary_xaxis("top")
    top.set_xticks(ticks, [_tokens(wavelengths[j]) for j in ticks], fontsize=7)
    top.set_xlabel("wavelength 2π/f (tokens)", fontsize=8)


def plot_layers(use: FrequencyUse, path: str | Path) -> Path:
    """Heat map of each layer's pooled share (layers down, pairs across, high frequency
    left); NoPE layers grey and labelled."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    from matplotlib.ticker import MaxNLocator

    layers = use.layers
    P = max((layer.pairs for layer in layers), default=0)
    grid = np.full((len(layers), max(P, 1)), np.nan)
    for i, layer in enumerate(layers):
        grid[i, : layer.pairs] = layer.pooled_share
    fig, ax = plt.subplots(
        figsize=(5 + min(0.1 * P, 10), 2.4 + min(0.25 * len(layers), 12)), layout="constrained"
    )
    cmap = plt.get_cmap("viridis").with_extremes(bad="0.85")  # NoPE rows
    im = ax.imshow(grid, cmap=cmap, vmin=0.0, aspect="auto", interpolation="nearest")
    ax.set_yticks(
        range(len(layers)),
        [f"{layer.layer}" + ("" if layer.rope else " NoPE") for layer in layers],
        fontsize=7,
    )
    label, wavelengths = _pair_axis_label(layers)
    ax.set_xlabel(label, fontsize=8)
    ax.set_ylabel("layer", fontsize=8)
    ax.tick_params(axis="x", labelsize=7)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True, min_n_ticks=1))  # pairs are whole numbers
    if wavelengths:
        _wavelength_axis(ax, wavelengths)
    # The source on a line of its own: a run's name at a step fits the narrowest figure
    # alone, not after the rest (the title is centred on the map, left of the colour bar).
    ax.set_title(
        f"RoPE frequency use, heads pooled, {use.tokens:,} tokens\n{use.source or 'model'}\n"
        "share of mean ||q_pair|| ||k_pair|| per layer",
        fontsize=9,
    )
    fig.colorbar(im, ax=ax, label="share of the layer's total")
    return _save(fig, Path(path))


def plot_heads(use: FrequencyUse, path: str | Path) -> Path:
    """One small panel per RoPE layer: heads down, pairs across (high frequency left), each
    head's share; one colour scale for all panels."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    from matplotlib.ticker import MaxNLocator

    rope = [layer for layer in use.layers if layer.rope]
    n = max(len(rope), 1)
    cols = math.ceil(math.sqrt(n))
    rows = math.ceil(n / cols)
    top = max((max(map(max, layer.share_per_head)) for layer in rope), default=1.0)
    fig, axes = plt.subplots(
        rows,
        cols,
        figsize=(max(4.5, 1.0 + 2.4 * cols), 0.8 + 2.1 * rows),
        squeeze=False,
        layout="constrained",  # each panel's title clear of the ticks above it
    )
    im = None
    for ax in axes.flat[len(rope) :]:
        ax.axis("off")
    for ax, layer in zip(axes.flat, rope, strict=False):
        im = ax.imshow(
            np.asarray(layer.share_per_head),
            cmap="viridis",
            vmin=0.0,
            vmax=top,
            aspect="auto",
            interpolation="nearest",
        )
        ax.set_title(f"layer {layer.layer}", fontsize=8)
        ax.tick_params(labelsize=6)
        for axis in (ax.xaxis, ax.yaxis):  # pairs and heads are whole numbers
            axis.set_major_locator(MaxNLocator(integer=True, min_n_ticks=1))
    nope = [layer.layer for layer in use.layers if not layer.rope]
    note = f"\nNoPE layers (no pairs): {', '.join(map(str, nope))}" if nope else ""
    if not rope:
        axes.flat[0].text(0.5, 0.5, "no RoPE layer", ha="center", va="center")
    fig.supxlabel("rotary pair j = frequency rank (0 = highest frequency)", fontsize=8)
    fig.supylabel("query head", fontsize=8)
    fig.suptitle(
        f"RoPE frequency use per head, {use.tokens:,} tokens\n{use.source or 'model'}{note}",
        fontsize=9,
    )
    if im is not None:
        fig.colorbar(im, ax=axes.ravel().tolist(), label="share of the head's total", shrink=0.8)
    return _save(fig, Path(path))


def write_frequency_use(use: FrequencyUse, out_dir: str | Path) -> list[Path]:
    """frequency_use.json and the two heat maps in `out_dir` (created)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    record = json.dumps(use.to_dict(), indent=1, allow_nan=False) + "\n"
    atomic_write(out / JSON_NAME, record.encode(), fsync=False)
    return [out / JSON_NAME, plot_layers(use, out / LAYERS_PNG), plot_heads(use, out / HEADS_PNG)]
