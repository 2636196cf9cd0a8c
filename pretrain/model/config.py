"""The `model:` section: one transformer covering Llama-style (sequential) and Pythia-style
(parallel) models, with RoPE on any fraction of each head's dims, per-layer positions and
windows. A field's own bounds and choices are constraints of the field (the JSON Schema has
them too); the rules across fields are the section's validators; docs/configuration.md's
table of it is generated from the descriptions below (tools/config_schema.py).
"""

from __future__ import annotations

import math
from typing import Annotated, Literal

import annotated_types
from pydantic import Field, model_validator

from pretrain.schema import Bool, ConfigError, Float, Hint, Int, Section


def rotary_dims_from_fraction(fraction: float, head_dim: int) -> int:
    """The even number nearest `fraction * head_dim` (ties round up).

    Matches the paper's Appendix A: head_dim 256 -> 1%: 2, 10%: 26; head_dim 64 -> 4%: 2,
    10%: 6; head_dim 128 -> 10%: 12. GPT-NeoX truncates (int(256 * 0.1) = 25, odd), which is
    why the paper had to ask for 0.102 to get 26; rounding to the nearest even number needs
    no such trick.
    """
    if not 0.0 <= fraction <= 1.0:
        raise ConfigError(
            f"model.rope_fraction={fraction} is outside [0, 1]; use 0 for NoPE, 1 for full RoPE"
        )
    # The small epsilon keeps 0.1 * 256 = 25.600000000000001 from landing on a tie by accident.
    return 2 * math.floor(fraction * head_dim / 2 + 0.5 + 1e-9)


ROPE_SCALINGS = ("linear", "ntk", "yarn", "dynamic_ntk", "llama3")


def _need(cond: bool, msg: str) -> None:
    if not cond:
        raise ConfigError(msg)


class RopeScalingConfig(Section):
    """RoPE scaling for longer contexts, on the rotary dims only (pretrain/model/rope.py).

    linear: positions / factor (position interpolation). ntk: theta x factor^(r/(r-2)), r the
    rotary dims (NTK-aware). yarn: per frequency, interpolated below beta_slow rotations over
    the original length, kept above beta_fast, a ramp between; cos and sin x attention_factor.
    dynamic_ntk: ntk with the factor grown with the sequence, only past original_max_seq_len.
    llama3 (Llama 3.1's): frequencies whose wavelength is longer than original length /
    low_freq_factor are interpolated (/ factor), shorter than original / high_freq_factor
    kept, a smooth blend between.
    Transformers' rope_type names: linear, dynamic (= dynamic_ntk), yarn, llama3; ntk is the
    default RoPE with a larger theta. factor 1 is no scaling.
    """

    key = "model.rope_scaling"

    type: Literal["linear", "ntk", "yarn", "dynamic_ntk", "llama3"] = "yarn"
    """How positions are stretched: linear, ntk, yarn, dynamic_ntk or llama3."""
    factor: Annotated[
        Float, Hint("1 = no scaling; the factor is how many times longer than the trained length")
    ] = Field(1.0, ge=1)
    """How many times longer than the trained length (1 = no scaling)."""
    original_max_seq_len: Annotated[
        Int | None, Hint("the length the model was trained at; null = model.max_seq_len")
    ] = Field(None, gt=0)
    """The trained length; null = model.max_seq_len."""
    beta_fast: Float = Field(32.0, gt=0)
    """yarn: rotations over the original length above which a frequency is kept."""
    beta_slow: Float = Field(1.0, gt=0)
    """yarn: rotations below which a frequency is interpolated."""
    attention_factor: Float | None = None
    """yarn: the cos/sin multiplier; null = 0.1 ln(factor) + 1."""
    truncate: Bool = True
    """yarn: round the ramp's ends to whole dims (transformers' default)."""
    low_freq_factor: Float = Field(1.0, gt=0)
    """llama3: wavelengths past original length / this are interpolated (Llama 3.1: 1)."""
    high_freq_factor: Float = Field(4.0, gt=0)
    """llama3: wavelengths below original length / this are kept (Llama 3.1: 4)."""

    @model_validator(mode="after")
    def _check(self) -> RopeScalingConfig:
        _need(
            self.beta_fast > self.beta_slow,
            f"model.rope_scaling: beta_fast={self.beta_fast} must be > beta_slow={self.beta_slow}",
        )
        _need(
            self.high_freq_factor > self.low_freq_factor,
            f"model.rope_scaling: high_freq_factor={self.high_freq_factor} must be > "
            f"low_freq_factor={self.low_freq_factor}",
        )
        return self


PAIR_STRATEGIES = ("high", "low", "uniform", "usage")


def strategy_pairs(strategy: str, kept: int, pairs: int) -> list[int]:
    """The `kept` of `pairs` frequency pairs a fixed strategy keeps (pair 0 = the highest
    frequency): `high` 0..K-1, `low` P-K..P-1, `uniform` floor(i P / K) for i < K (the
    highest and every P/K-th after it: MHA2MLA's uniform choice when K divides P)."""
    if strategy == "high":
        return list(range(kept))
    if strategy == "low":
        return list(range(pairs - kept, pairs))
    if strategy == "uniform":
        return [i * pairs // kept for i in range(kept)]
    raise ValueError(f"strategy {strategy!r} is not a fixed one")


class RopePairsConfig(Section):
    """Which of each head's head_dim/2 frequency pairs rotate, per layer and KV head
    (docs/pair_selection.md). Full RoPE's layout: pair j is dims j and j + head_dim/2 at
    theta^(-2j/head_dim), so every kept pair keeps its own frequency; the other pairs pass
    through. A strategy is resolved into `selected` (`usage` when the model is built, from its
    map: pretrain/model/pairs.py); the resolved config records both, and a config with
    `selected` needs no map file."""

    key = "model.rope_pairs"

    strategy: Annotated[
        Literal["high", "low", "uniform", "usage"] | None, Hint("null = `selected` as given")
    ] = None
    """`high`: pairs 0..K-1 (the highest frequencies); `low`: the K lowest; `uniform`: floor(i P/K), i < K (P = head_dim/2 pairs); `usage`: per layer and KV head the K pairs of largest use in `usage_map` (summed over the group's query heads; ties: lower j). null: `selected` is the selection"""
    pairs: Int | None = Field(None, ge=0)
    """K, the pairs each KV head keeps (or `fraction`)"""
    fraction: Annotated[Float | None, Hint("of the head's dims, rounded as rope_fraction")] = Field(
        None, ge=0, le=1
    )
    """K as a fraction of the head's dims: the nearest even number of dims, as `rope_fraction` rounds, halved"""
    usage_map: str | None = None
    """`usage`: the frequency_use.json of a full-RoPE run of this shape (tools/frequency_use.py); read only while `selected` is null"""
    selected: list[list[list[Annotated[Int, annotated_types.Ge(0)]]]] | None = None
    """per layer, per KV head: the sorted pairs that rotate (written at load from the strategy); a layer of empty lists is NoPE"""

    @model_validator(mode="after")
    def _check(self) -> RopePairsConfig:
        k = self.key
        _need(
            self.pairs is None or self.fraction is None,
            f"{k}.pairs and {k}.fraction are both set; set only one",
        )
        if self.strategy is None:
            _need(
                self.selected is not None,
                f"{k} needs a strategy ({', '.join(PAIR_STRATEGIES)}) or the pairs themselves "
                f"in {k}.selected",
            )
            _need(
                self.pairs is None and self.fraction is None and self.usage_map is None,
                f"{k}.pairs, fraction and usage_map belong to a strategy; set {k}.strategy",
            )
        elif self.selected is None:
            _need(
                self.pairs is not None or self.fraction is not None,
                f"{k}.strategy={self.strategy} needs {k}.pairs (K per KV head) or {k}.fraction",
            )
        _need(
            (self.strategy == "usage") == (self.usage_map is not None),
            f"{k}.usage_map goes with strategy usage, and usage needs one: set both or neither",
        )
        for i, layer in enumerate(self.selected or ()):
            for g, kept in enumerate(layer):
                _need(
                    all(a < b for a, b in zip(kept, kept[1:], strict=False)),
                    f"{k}.selected[{i}][{g}]={kept} must list each pair once, in increasing order",
                )
        return self

    def kept(self, head_dim: int) -> int | None:
        """K of the strategy (pairs, or fraction of head_dim rounded as rope_fraction)."""
        if self.pairs is not None:
            return self.pairs
        if self.fraction is not None:
            return rotary_dims_from_fraction(self.fraction, head_dim) // 2
        return None


class ModelConfig(Section):
    """One transformer covering Llama-style (sequential) and Pythia-style (parallel) models."""

    key = "model"

    vocab_size: Int = Field(50277, gt=0)
    """the tokenizer's vocabulary; must be >= the data's tokenizer (checked at start)"""
    pad_vocab_to_multiple: Int = 128
    """embedding rows are padded to a multiple (50277 -> 50304), as GPT-NeoX"""
    n_layers: Int = Field(16, gt=0)
    """transformer blocks"""
    d_model: Int = Field(2048, gt=0)
    """hidden size"""
    n_heads: Int = Field(32, gt=0)
    """query heads"""
    n_kv_heads: Annotated[Int | None, Hint("null = n_heads")] = Field(None, gt=0)
    """null = n_heads (MHA); fewer = grouped-query attention"""
    head_dim_: Annotated[Int | None, Hint("null = d_model / n_heads")] = Field(
        None, alias="head_dim", gt=0
    )
    """dims per head; null = d_model / n_heads. Set to decouple it (Qwen3: 16 heads x 128 on d_model 1024): q, k, v are n_heads (n_kv_heads) x head_dim wide and the output projection maps n_heads x head_dim back to d_model"""
    d_ff: Int = Field(8192, gt=0)
    """MLP hidden size (per branch for SwiGLU)"""
    max_seq_len: Int = Field(2048, gt=0)
    """longest sequence: RoPE cache and learned positions"""
    block: Literal["sequential", "parallel"] = "sequential"
    """`sequential` (Llama: x + attn(norm x), then + mlp) or `parallel` (Pythia/GPT-J)"""
    norm: Literal["rmsnorm", "layernorm"] = "rmsnorm"
    """`rmsnorm` or `layernorm`"""
    norm_eps: Float = Field(1e-5, gt=0)
    """norm epsilon"""
    norm_bias: Bool = False
    """LayerNorm only: learn a bias (original Pythia)"""
    mlp: Literal["swiglu", "gelu"] = "swiglu"
    """`swiglu` or `gelu`"""
    mlp_bias: Bool = True
    """biases in the MLP (the paper's runs)"""
    attn_bias: Bool = False
    """biases in the attention projections"""
    rope_fraction: Annotated[Float | None, Hint("0 for NoPE, 1 for full RoPE")] = Field(
        1.0, ge=0, le=1
    )
    """fraction of each head's dims that rotate; the nearest even number of dims; 0 = NoPE"""
    rotary_dims: Int | None = Field(None, ge=0)
    """rotary dims given directly (then `rope_fraction: null`)"""
    rope_theta: Float = Field(10000.0, gt=0)
    """RoPE base"""
    rope_scaling: RopeScalingConfig | None = None
    """RoPE scaling for longer contexts (type, factor, original_max_seq_len, ...); null = none."""
    rope_pairs: RopePairsConfig | None = None
    """which frequency pairs rotate, per layer and KV head, in full RoPE's layout (strategy `high`, `low`, `uniform` or `usage` with `pairs`/`fraction`; resolved into `selected`); null = the first rotary dims rotate. Needs rope_fraction 1, no rope_scaling, spectrum neox. docs/pair_selection.md"""
    rope_spectrum: Literal["neox", "p_rope"] = "neox"
    """which frequencies the rotary dims carry: `neox` = theta^(-2i/r) over the r rotary dims (the paper, GPT-NeoX); `p_rope` = the r/2 highest of full RoPE's theta^(-2i/head_dim) (Barbero et al. 2025; not with `rope_scaling`). docs/model.md, "Positions by layer" """
    nope_layers: Annotated[
        list[Annotated[Int, annotated_types.Ge(0)]] | None, Hint("0-based layers")
    ] = None
    """0-based layers without RoPE among RoPE ones, e.g. `[3, 7, 11, 15]`"""
    nope_every: Int | None = Field(None, ge=2)
    """k: layer i is NoPE when (i + 1) % k == 0 (SmolLM3's `no_rope_layer_interval`; 4 = SmolLM3, Llama 4). Not with `nope_layers`"""
    sliding_window: Annotated[Int | None, Hint("tokens; null = full attention")] = Field(None, ge=1)
    """W: sliding layers attend to themselves and the W - 1 tokens before (transformers' rule); null = full attention everywhere"""
    sliding_window_pattern: Annotated[Int | None, Hint("null: all slide")] = Field(None, ge=2)
    """k: layer i is full attention when (i + 1) % k == 0, the others slide (Gemma 3: 6, Cohere 2: 4); null with `sliding_window` = every layer slides (Mistral)"""
    layer_types: list[Literal["full", "sliding"]] | None = None
    """one `full` / `sliding` per layer instead of the pattern"""
    global_rope_theta: Annotated[Float | None, Hint("null = rope_theta")] = Field(None, gt=0)
    """RoPE theta of the full layers when some slide (Gemma 3: 1e6, with `rope_theta: 10000` on the sliding ones); null = `rope_theta`. Global NoPE (Cohere 2): `nope_every` = `sliding_window_pattern`"""
    alibi: Bool = False
    """ALiBi (Press et al. 2022): -slope_h x (i - j) on every layer's logits, slopes 2^(-8h/n_heads); combine with `rope_fraction: 0` for the paper's ALiBi-only model. Not with `attn_logit_softcap`"""
    learned_pos_emb: Bool = False
    """add learned absolute position embeddings"""
    qk_norm: Bool = False
    """normalize q and k per head over head_dim, before RoPE"""
    attn_logit_softcap: Annotated[Float, Hint("0 = off")] = Field(0.0, ge=0)
    """attention-logit soft cap (Gemma 2): logits -> cap x tanh(logits / cap); 0 = off (the paper). On, attention runs unfused (no SDPA kernel); exports as remote code (docs/spikes.md)"""
    tie_embeddings: Bool = False
    """share input and output embedding matrices"""
    dropout: Float = Field(0.0, ge=0, lt=1)
    """embedding, attention and residual dropout"""
    init: Literal["normal", "scaled_normal", "small_init"] = "normal"
    """`normal` (N(0, init_std), the paper), `scaled_normal` (GPT-2 output scaling), `small_init` (GPT-NeoX small_init + wang_init)"""
    init_std: Float = 0.02
    """std of `normal` / `scaled_normal`"""

    # Derived sizes are properties, never stored, so they cannot disagree with the fields.
    @property
    def kv_heads(self) -> int:
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads if self.head_dim_ is None else self.head_dim_

    @property
    def head_dim_decoupled(self) -> bool:
        """Whether n_heads x head_dim differs from d_model (a class deriving head_dim cannot hold it)."""
        return self.n_heads * self.head_dim != self.d_model

    @property
    def padded_vocab_size(self) -> int:
        m = max(1, self.pad_vocab_to_multiple)
        return -(-self.vocab_size // m) * m

    @property
    def rope_dims(self) -> int:
        """Number of rotary dims per head (0 = NoPE)."""
        if self.rotary_dims is not None:
            return self.rotary_dims
        return rotary_dims_from_fraction(self.rope_fraction or 0.0, self.head_dim)

    @property
    def attention_types(self) -> list[str]:
        """Per layer, "full" or "sliding" (pretrain/model/position.py reads it)."""
        n = self.n_layers
        if self.sliding_window is None:
            return ["full"] * n
        if self.layer_types is not None:
            return list(self.layer_types)
        k = self.sliding_window_pattern
        return ["full" if k is not None and (i + 1) % k == 0 else "sliding" for i in range(n)]

    @property
    def nope_layer_set(self) -> frozenset[int]:
        """0-based layers without RoPE among RoPE layers (nope_layers or nope_every)."""
        if self.nope_layers is not None:
            return frozenset(self.nope_layers)
        k = self.nope_every
        return frozenset(i for i in range(self.n_layers) if k and (i + 1) % k == 0)

    @property
    def original_max_seq_len(self) -> int:
        """The length the positions were trained at (for scaling); model.max_seq_len unscaled."""
        s = self.rope_scaling
        if s is not None and s.original_max_seq_len:
            return s.original_max_seq_len
        return self.max_seq_len

    @model_validator(mode="after")
    def _check(self) -> ModelConfig:
        self.check()
        return self

    def check(self) -> None:
        """The shape and position rules (run when the section is built)."""
        need = _need
        if self.head_dim_ is None:
            need(
                self.d_model % self.n_heads == 0,
                f"model.d_model={self.d_model} is not divisible by model.n_heads={self.n_heads};"
                f" choose n_heads among the divisors of d_model, or set model.head_dim",
            )
        need(
            self.n_heads % self.kv_heads == 0,
            f"model.n_heads={self.n_heads} is not divisible by model.n_kv_heads={self.n_kv_heads}; "
            f"use a divisor of n_heads (e.g. {self.n_heads} for MHA, or 1 for multi-query)",
        )
        need(
            self.rotary_dims is None or self.rope_fraction in (None, 1.0),
            "model.rotary_dims and model.rope_fraction are both set; set only one "
            "(rope_fraction: null when giving rotary_dims)",
        )
        hd = self.head_dim
        if self.rotary_dims is not None:
            r = self.rotary_dims
            need(r <= hd, f"model.rotary_dims={r} must be in [0, head_dim={hd}]")
            need(
                r % 2 == 0,
                f"model.rotary_dims={r} is odd; rotary pairs need an even number: "
                f"use {r - 1} or {r + 1}",
            )
        else:
            f = self.rope_fraction if self.rope_fraction is not None else 0.0
            r = rotary_dims_from_fraction(f, hd)
            need(
                not (f > 0 and r == 0),
                f"model.rope_fraction={f} gives 0 rotary dims for head_dim {hd}; use "
                f"rope_fraction >= {1 / hd:.4g} (2 dims), or 0 for NoPE",
            )
        if self.rope_scaling is not None:
            self._check_scaling(self.rope_scaling, r)
        self._check_layers(r)
        if self.rope_pairs is not None:
            self._check_pairs(self.rope_pairs, r)

    def _check_layers(self, rotary_dims: int) -> None:
        """The per-layer position fields: NoPE layers, spectrum, windows, global theta, ALiBi."""
        need, n = _need, self.n_layers
        need(
            self.rope_spectrum == "neox" or self.rope_scaling is None,
            "model.rope_spectrum=p_rope with model.rope_scaling is not supported; remove one",
        )
        need(
            self.nope_layers is None or self.nope_every is None,
            "model.nope_layers and model.nope_every are both set; set only one",
        )
        if self.nope_layers is not None or self.nope_every is not None:
            name = "nope_layers" if self.nope_layers is not None else "nope_every"
            need(
                rotary_dims > 0,
                f"model.{name} with 0 rotary dims: every layer is NoPE already; remove model.{name}",
            )
        if self.nope_layers is not None:
            bad = [i for i in self.nope_layers if i >= n]
            need(not bad, f"model.nope_layers={self.nope_layers}: {bad} outside [0, n_layers={n})")
            need(
                len(set(self.nope_layers)) == len(self.nope_layers),
                f"model.nope_layers={self.nope_layers} repeats a layer; list each once",
            )
            need(
                len(self.nope_layers) < n,
                f"model.nope_layers lists all {n} layers; use rope_fraction: 0 for NoPE everywhere",
            )
        w = self.sliding_window
        for name in ("sliding_window_pattern", "layer_types", "global_rope_theta"):
            need(
                getattr(self, name) is None or w is not None,
                f"model.{name} needs model.sliding_window (the window of the sliding layers)",
            )
        need(
            self.sliding_window_pattern is None or self.layer_types is None,
            "model.sliding_window_pattern and model.layer_types are both set; set only one",
        )
        types = self.layer_types
        need(
            types is None or len(types) == n,
            f"model.layer_types has {len(types or [])} entries; give one per layer ({n})",
        )
        need(
            self.global_rope_theta is None or "full" in self.attention_types,
            "model.global_rope_theta is set but no layer is full attention; set "
            "model.sliding_window_pattern or model.layer_types, or remove it",
        )
        need(
            not (self.alibi and self.attn_logit_softcap > 0),
            "model.alibi with model.attn_logit_softcap is not supported; set one of them off",
        )

    def _check_pairs(self, p: RopePairsConfig, rotary_dims: int) -> None:
        """A pair selection lives in full RoPE's layout and spectrum; resolve its strategy."""
        k, hd = p.key, self.head_dim
        _need(
            rotary_dims == hd,
            f"{k} says which of full RoPE's pairs rotate, and model.rope_fraction/rotary_dims "
            f"give {rotary_dims} rotary dims of {hd}; leave rope_fraction at 1 and set the "
            f"number of pairs in {k}.pairs",
        )
        _need(
            self.rope_scaling is None and self.rope_spectrum == "neox",
            f"{k} with model.rope_scaling or rope_spectrum p_rope is not supported: a selection "
            f"keeps full RoPE's frequencies; remove one",
        )
        P, K, n, nope, KV = hd // 2, p.kept(hd), self.n_layers, self.nope_layer_set, self.kv_heads
        _need(K is None or K <= P, f"{k}.pairs={K} exceeds the head's {P} pairs")
        _need(
            p.fraction is None or p.fraction == 0 or K,
            f"{k}.fraction={p.fraction} gives 0 pairs for head_dim {hd}; use >= {2 / hd:.4g}",
        )
        if p.selected is None:
            if p.strategy != "usage":  # usage reads its map when the model is built (pairs.py)
                fixed = strategy_pairs(p.strategy, K or 0, P)
                sel = [[[] if i in nope else fixed for _ in range(KV)] for i in range(n)]
                self.rope_pairs = p.model_copy(update={"selected": sel})
            return
        sel = p.selected
        _need(
            len(sel) == self.n_layers and all(len(layer) == KV for layer in sel),
            f"{k}.selected must hold one list per KV head ({KV}) for each of the "
            f"{self.n_layers} layers",
        )
        for i, layer in enumerate(sel):
            for g, kept in enumerate(layer):
                where = f"{k}.selected[{i}][{g}]={kept}"
                _need(all(j < P for j in kept), f"{where}: a pair index is past the {P} pairs")
                _need(not (i in nope and kept), f"{where}: layer {i} is NoPE; leave it empty")
                if p.strategy is None or i in nope:
                    continue
                want = K if K is not None else len(sel[i][0])
                ok = len(kept) == want
                if p.strategy != "usage":
                    ok = ok and kept == strategy_pairs(p.strategy, want, P)
                _need(
                    ok,
                    f"{where} is not what strategy {p.strategy} with {want} pairs keeps; remove "
                    f"{k}.selected (it is written at load) or the strategy",
                )

    def _check_scaling(self, s: RopeScalingConfig, rotary_dims: int) -> None:
        _need(
            not self.learned_pos_emb,
            "model.rope_scaling does not apply to model.learned_pos_emb: learned positions "
            "have no frequencies to scale; remove one of the two",
        )
        _need(
            rotary_dims != 2 or s.type not in ("ntk", "dynamic_ntk") or s.factor == 1.0,
            f"model.rope_scaling.type={s.type} needs more than 2 rotary dims (its exponent is "
            f"r/(r-2)); with 2 use linear or yarn",
        )
