"""Configuration: dataclasses for every section, YAML loading with `inherit:`, overrides.

Every field is typed; loading a dict into a dataclass checks unknown keys and types and
raises `ConfigError` with the dotted key and the fix, so a typo in a 100-GPU job fails in
the first second instead of after the model is built.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TypeVar, get_args, get_origin

import yaml

from pretrain.errors import UserError


class ConfigError(UserError, ValueError):
    """A configuration value is wrong; the message names the key and the fix."""

    label = "config error"


# ----------------------------------------------------------------------------- model


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


ROPE_SCALINGS = ("linear", "ntk", "yarn", "dynamic_ntk")


@dataclass
class RopeScalingConfig:
    """RoPE scaling for longer contexts, on the rotary dims only (pretrain/model/rope.py).

    linear: positions / factor (position interpolation). ntk: theta x factor^(r/(r-2)), r the
    rotary dims (NTK-aware). yarn: per frequency, interpolated below beta_slow rotations over
    the original length, kept above beta_fast, a ramp between; cos and sin x attention_factor.
    dynamic_ntk: ntk with the factor grown with the sequence, only past original_max_seq_len.
    Transformers' rope_type names: linear, dynamic (= dynamic_ntk), yarn; ntk is the default
    RoPE with a larger theta. factor 1 is no scaling.
    """

    type: Literal["linear", "ntk", "yarn", "dynamic_ntk"] = "yarn"
    factor: float = 1.0
    original_max_seq_len: int | None = None  # the trained length; null = model.max_seq_len
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0  # yarn
    attention_factor: float | None = None  # yarn; null = 0.1 ln(factor) + 1
    truncate: bool = True  # yarn: round the ramp's ends to whole dims (transformers' default)


@dataclass
class ModelConfig:
    """One transformer covering Llama-style (sequential) and Pythia-style (parallel) models."""

    vocab_size: int = 50277  # the tokenizer's; the embedding is padded (below)
    pad_vocab_to_multiple: int = 128  # 50277 -> 50304, as GPT-NeoX does for fast matmuls
    n_layers: int = 16
    d_model: int = 2048
    n_heads: int = 32
    n_kv_heads: int | None = None  # None: = n_heads (MHA); fewer: grouped-query attention
    d_ff: int = 8192  # hidden size of the MLP (per branch for SwiGLU)
    max_seq_len: int = 2048  # longest sequence; sizes the RoPE cache and learned positions
    block: Literal["sequential", "parallel"] = "sequential"
    norm: Literal["rmsnorm", "layernorm"] = "rmsnorm"
    norm_eps: float = 1e-5
    norm_bias: bool = False  # LayerNorm only: learn a bias (original Pythia: true)
    mlp: Literal["swiglu", "gelu"] = "swiglu"
    mlp_bias: bool = True  # the paper's GPT-NeoX runs had MLP biases on
    attn_bias: bool = False
    # Positions. Give `rope_fraction` (turned into the nearest even number of dims) or
    # `rotary_dims` directly, not both. 0 means NoPE.
    rope_fraction: float | None = 1.0
    rotary_dims: int | None = None
    rope_theta: float = 10000.0
    # null = none; {type, factor, original_max_seq_len, ...}: RopeScalingConfig above.
    rope_scaling: RopeScalingConfig | None = None
    # Which frequencies the rotary dims carry (pretrain/model/position.py): "neox" =
    # theta^(-2i/r) over the r rotary dims (GPT-NeoX's rotary_pct, the paper); "p_rope" = the
    # r/2 highest of full RoPE's theta^(-2i/head_dim), the lowest dropped (Barbero et al. 2025).
    rope_spectrum: Literal["neox", "p_rope"] = "neox"
    # NoPE layers among RoPE ones (SmolLM3, Llama 4): `nope_layers` lists 0-based layers
    # without RoPE, or `nope_every: k` makes layer i NoPE when (i + 1) % k == 0 (SmolLM3's
    # no_rope_layer_interval). Not both; null = every layer as rope_fraction says.
    nope_layers: list[int] | None = None
    nope_every: int | None = None
    # Sliding-window attention (Mistral, Gemma 2/3, Cohere 2): a query sees itself and the
    # W - 1 tokens before it. Which layers slide: `layer_types` (one "full" / "sliding" per
    # layer), or `sliding_window_pattern: k` (layer i full when (i + 1) % k == 0: Gemma 3 k=6,
    # Cohere 2 k=4), or neither: every layer slides (Mistral).
    sliding_window: int | None = None
    sliding_window_pattern: int | None = None
    layer_types: list[Literal["full", "sliding"]] | None = None
    # RoPE theta of the full-attention layers when some layers slide (Gemma 3: 1e6 global,
    # rope_theta 1e4 local); null = rope_theta everywhere.
    global_rope_theta: float | None = None
    # ALiBi (Press et al. 2022): -slope_h x (i - j) on every layer's attention logits, slopes
    # 2^(-8h/n_heads); composes with RoPE, NoPE layers, windows and document masks.
    alibi: bool = False
    learned_pos_emb: bool = False  # absolute learned positions, added to token embeddings
    qk_norm: bool = False  # normalize q and k per head over head_dim, before RoPE
    # Attention-logit soft cap (Gemma 2): logits -> cap * tanh(logits / cap), bounding them
    # by +-cap. 0 = off (the paper). On, attention runs unfused (no SDPA kernel).
    attn_logit_softcap: float = 0.0
    tie_embeddings: bool = False
    dropout: float = 0.0  # embedding, attention and residual dropout
    # normal: N(0, init_std) everywhere (the paper's runs).
    # scaled_normal: as normal, output projections std / sqrt(2 * n_layers) (GPT-2, nanoGPT).
    # small_init: GPT-NeoX small_init sqrt(2 / (5 d)) everywhere and wang_init
    #   2 / (n_layers * sqrt(d)) on output projections (original Pythia).
    init: Literal["normal", "scaled_normal", "small_init"] = "normal"
    init_std: float = 0.02

    def __post_init__(self) -> None:
        self.validate()

    # Derived sizes are properties, never stored, so they cannot disagree with the fields.
    @property
    def kv_heads(self) -> int:
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

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

    def validate(self) -> None:
        def need(cond: bool, msg: str) -> None:
            if not cond:
                raise ConfigError(msg)

        for name in ("vocab_size", "n_layers", "d_model", "n_heads", "d_ff", "max_seq_len"):
            value = getattr(self, name)
            need(value > 0, f"model.{name}={value} must be a positive integer")
        need(
            self.d_model % self.n_heads == 0,
            f"model.d_model={self.d_model} is not divisible by model.n_heads={self.n_heads}; "
            f"choose n_heads among the divisors of d_model",
        )
        need(
            self.kv_heads > 0 and self.n_heads % self.kv_heads == 0,
            f"model.n_heads={self.n_heads} is not divisible by model.n_kv_heads={self.n_kv_heads}; "
            f"use a divisor of n_heads (e.g. {self.n_heads} for MHA, or 1 for multi-query)",
        )
        need(
            self.block in ("sequential", "parallel"),
            f"model.block={self.block!r} is unknown; use 'sequential' (Llama) or 'parallel' (Pythia)",
        )
        need(
            self.norm in ("rmsnorm", "layernorm"),
            f"model.norm={self.norm!r} is unknown; use 'rmsnorm' or 'layernorm'",
        )
        need(
            self.mlp in ("swiglu", "gelu"),
            f"model.mlp={self.mlp!r} is unknown; use 'swiglu' or 'gelu'",
        )
        need(
            self.init in ("normal", "scaled_normal", "small_init"),
            f"model.init={self.init!r} is unknown; use 'normal', 'scaled_normal' or 'small_init'",
        )
        need(self.norm_eps > 0, f"model.norm_eps={self.norm_eps} must be > 0")
        need(0.0 <= self.dropout < 1.0, f"model.dropout={self.dropout} must be in [0, 1)")
        need(
            self.attn_logit_softcap >= 0.0,
            f"model.attn_logit_softcap={self.attn_logit_softcap} must be >= 0 (0 = off)",
        )
        need(self.rope_theta > 0, f"model.rope_theta={self.rope_theta} must be a positive number")
        need(
            self.rotary_dims is None or self.rope_fraction in (None, 1.0),
            "model.rotary_dims and model.rope_fraction are both set; set only one "
            "(rope_fraction: null when giving rotary_dims)",
        )
        hd = self.head_dim
        if self.rotary_dims is not None:
            r = self.rotary_dims
            need(0 <= r <= hd, f"model.rotary_dims={r} must be in [0, head_dim={hd}]")
            need(
                r % 2 == 0,
                f"model.rotary_dims={r} is odd; rotary pairs need an even number: "
                f"use {r - 1} or {r + 1}",
            )
        else:
            f = self.rope_fraction if self.rope_fraction is not None else 0.0
            r = rotary_dims_from_fraction(f, hd)  # raises for f outside [0, 1]
            need(
                not (f > 0 and r == 0),
                f"model.rope_fraction={f} gives 0 rotary dims for head_dim {hd}; use "
                f"rope_fraction >= {1 / hd:.4g} (2 dims), or 0 for NoPE",
            )
        if self.rope_scaling is not None:
            self._validate_scaling(self.rope_scaling, r, need)
        self._validate_layers(r, need)

    def _validate_layers(self, rotary_dims: int, need) -> None:
        """The per-layer position fields: NoPE layers, spectrum, windows, global theta, ALiBi."""
        n = self.n_layers
        need(
            self.rope_spectrum in ("neox", "p_rope"),
            f"model.rope_spectrum={self.rope_spectrum!r} is unknown; use 'neox' or 'p_rope'",
        )
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
            bad = [i for i in self.nope_layers if not 0 <= i < n]
            need(not bad, f"model.nope_layers={self.nope_layers}: {bad} outside [0, n_layers={n})")
            need(
                len(set(self.nope_layers)) == len(self.nope_layers),
                f"model.nope_layers={self.nope_layers} repeats a layer; list each once",
            )
            need(
                len(self.nope_layers) < n,
                f"model.nope_layers lists all {n} layers; use rope_fraction: 0 for NoPE everywhere",
            )
        if self.nope_every is not None:
            need(
                self.nope_every >= 2,
                f"model.nope_every={self.nope_every} must be >= 2 (k: every k-th layer is NoPE; "
                f"rope_fraction: 0 for all)",
            )
        w = self.sliding_window
        need(w is None or w >= 1, f"model.sliding_window={w} must be >= 1 tokens, or null")
        for name in ("sliding_window_pattern", "layer_types", "global_rope_theta"):
            need(
                getattr(self, name) is None or w is not None,
                f"model.{name} needs model.sliding_window (the window of the sliding layers)",
            )
        need(
            self.sliding_window_pattern is None or self.layer_types is None,
            "model.sliding_window_pattern and model.layer_types are both set; set only one",
        )
        k = self.sliding_window_pattern
        need(
            k is None or k >= 2, f"model.sliding_window_pattern={k} must be >= 2 (null: all slide)"
        )
        types = self.layer_types
        need(
            types is None or len(types) == n,
            f"model.layer_types has {len(types or [])} entries; give one per layer ({n})",
        )
        need(
            types is None or set(types) <= {"full", "sliding"},
            f"model.layer_types={types}: each entry must be 'full' or 'sliding'",
        )
        g = self.global_rope_theta
        need(g is None or g > 0, f"model.global_rope_theta={g} must be a positive number, or null")
        need(
            g is None or "full" in self.attention_types,
            "model.global_rope_theta is set but no layer is full attention; set "
            "model.sliding_window_pattern or model.layer_types, or remove it",
        )
        need(
            not (self.alibi and self.attn_logit_softcap > 0),
            "model.alibi with model.attn_logit_softcap is not supported; set one of them off",
        )

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

    def _validate_scaling(self, s: RopeScalingConfig, rotary_dims: int, need) -> None:
        need(
            s.type in ROPE_SCALINGS,
            f"model.rope_scaling.type={s.type!r} is unknown; use one of {', '.join(ROPE_SCALINGS)}",
        )
        need(
            s.factor >= 1.0,
            f"model.rope_scaling.factor={s.factor} must be >= 1 (1 = no scaling; the factor "
            f"is how many times longer than the trained length)",
        )
        need(
            s.original_max_seq_len is None or s.original_max_seq_len > 0,
            f"model.rope_scaling.original_max_seq_len={s.original_max_seq_len} must be a "
            f"positive integer (the length the model was trained at), or null",
        )
        need(
            not self.learned_pos_emb,
            "model.rope_scaling does not apply to model.learned_pos_emb: learned positions "
            "have no frequencies to scale; remove one of the two",
        )
        need(
            rotary_dims != 2 or s.type not in ("ntk", "dynamic_ntk") or s.factor == 1.0,
            f"model.rope_scaling.type={s.type} needs more than 2 rotary dims (its exponent is "
            f"r/(r-2)); with 2 use linear or yarn",
        )
        need(
            s.beta_fast > s.beta_slow > 0,
            f"model.rope_scaling: beta_fast={s.beta_fast} must be > beta_slow={s.beta_slow} > 0",
        )

    @property
    def original_max_seq_len(self) -> int:
        """The length the positions were trained at (for scaling); model.max_seq_len unscaled."""
        s = self.rope_scaling
        if s is not None and s.original_max_seq_len:
            return s.original_max_seq_len
        return self.max_seq_len


# ----------------------------------------------------------------------------- run sections


@dataclass
class DataConfig:
    """What to train on: prepared indexed datasets (tools/prepare_data.py or Megatron/NeoX)."""

    # Each entry is a prepared output folder (holding shards and a manifest) or a
    # megatron-core path prefix (PREFIX.bin + PREFIX.idx).
    train: list[str] = field(default_factory=list)
    # Blend weights, one per `train` entry; null = proportional to their sizes.
    train_weights: list[float] | None = None
    valid: list[str] = field(default_factory=list)  # empty = no validation
    # Tokenizer spec (see pretrain.data.tokenizer.load_tokenizer); null = the one recorded in
    # the first train dataset's manifest.
    tokenizer: str | None = None
    # Where megatron-core caches its sample indices; null = beside the data.
    cache_dir: str | None = None
    num_workers: int = 1  # DataLoader workers per rank
    # How samples are read from the .bin files: "random" = memory-mapped with
    # madvise(MADV_RANDOM), so a cold read pulls in only the pages a sample covers (the
    # kernel's read-ahead would pull ~MiBs per sample); "readahead" = memory-mapped with the
    # kernel's default read-ahead (the old behaviour: best when the data sits in the page
    # cache or is read in order); "file" = megatron-core's file reader (open, seek, read per
    # sample; no mapping). The same samples either way (docs/performance.md).
    read_mode: Literal["random", "readahead", "file"] = "random"
    # Build data.train[0] with this ready-made recipe when it does not exist yet (rank 0,
    # before training): "stdlib" = byte-level text of the installed Python standard library
    # (the quickstart; no download). null = the data must already be prepared.
    recipe: Literal["stdlib"] | None = None
    # Packed documents (docs/training.md, "Document masking"); independent switches, all off
    # as in the paper's runs. document_mask: no token attends across an end-of-document token.
    # position_reset: positions (RoPE, learned) restart at 0 after each one. eod_mask_loss: the
    # token after one (the next document's first) is not a training target.
    document_mask: bool = False
    position_reset: bool = False
    eod_mask_loss: bool = False


@dataclass
class OptimConfig:
    """AdamW, as the paper (GPT-NeoX): lr 4e-4, betas (0.9, 0.95), eps 1e-8, wd 0.1, clip 1."""

    lr: float = 4e-4
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 0.1
    grad_clip: float = 1.0  # 0 = no clipping
    decay_norms_and_biases: bool = False  # GPT-NeoX: no weight decay on norms and biases
    decay_embeddings: bool = True
    # Which AdamW runs the step (the same update to fp32 rounding): "auto" = DeepSpeed's
    # FusedAdam on CUDA, torch's fused AdamW elsewhere where the device has it (CPU does),
    # else "foreach"; "fused"/"foreach" = torch's AdamW with that implementation, handed to
    # DeepSpeed as the client optimizer; "deepspeed" = the optimizer DeepSpeed builds from
    # its config (FusedAdam on CUDA, torch's single-tensor AdamW elsewhere: the old path).
    impl: Literal["auto", "fused", "foreach", "deepspeed"] = "auto"


@dataclass
class ScheduleConfig:
    """Linear warmup, then decay to min_lr_ratio x lr at train.train_iters."""

    kind: Literal["cosine", "linear", "constant"] = "cosine"
    warmup_fraction: float | None = 0.05  # of train_iters; or give warmup_steps
    warmup_steps: int | None = None
    min_lr_ratio: float = 0.1  # the paper: 4e-5 / 4e-4


@dataclass
class TrainConfig:
    train_iters: int = 12000
    global_batch_size: int = 4096  # sequences per optimizer step, over all ranks
    micro_batch_size: int = 64  # sequences per rank per forward
    seq_len: int | None = None  # null = model.max_seq_len
    precision: Literal["bf16", "fp32"] = "bf16"
    # BF16 compute with FP32 gradient accumulation and FP32 all-reduce, as the paper.
    grad_accum_dtype: Literal["fp32", "bf16"] = "fp32"
    zero_stage: int = 1
    seed: int = 1234
    eval_interval: int = 2000
    eval_iters: int = 10
    # Recompute blocks in the backward: false/'none', true/'full', N = the first N blocks, or
    # 'auto' = the planner's least recompute that fits (pretrain/model/recompute.py).
    activation_checkpointing: bool | int | Literal["none", "full", "auto"] = False
    # torch.compile the model (inductor): true, false, or 'auto' = compiled on CUDA where the
    # planner's compiled step fits the GPU (pretrain/train/engine.py resolve_compile), eager
    # on CPU, where inductor's build takes minutes for little gain on a few cores.
    compile: bool | Literal["auto"] = "auto"
    # What torch.compile compiles: the whole model (DeepSpeed's engine.compile()) or each block
    # on its own ('blocks': regional compilation, as torchtitan does; identical blocks share
    # one compiled graph, so compile time is about one block's). gpu-check's compile stage
    # times both; the default stays 'model' until a GPU has measured 'blocks'.
    compile_regions: Literal["model", "blocks"] = "model"
    # FP8 matmuls in the blocks' linears (torchao float8 training, pretrain/train/fp8.py):
    # off, tensorwise or rowwise scales. Needs a GPU of compute capability 8.9+ (H100, H200);
    # `fp8_emulate` runs torchao's emulation anywhere (fp8 numerics, not speed: CPU tests).
    fp8: Literal["off", "tensorwise", "rowwise"] = "off"
    fp8_emulate: bool = False
    # z-loss (PaLM): adds z_loss x mean(log Z)^2 to the loss (log Z: the log-sum-exp of a
    # token's logits), keeping the softmax normaliser near 1. 0 = off (the paper); PaLM 1e-4.
    z_loss: float = 0.0
    # The output layer + cross-entropy: "chunked" (pretrain/model/loss.py, any device, never
    # the whole logits) or "liger" (liger-kernel's fused Triton kernel, CUDA, opt-in).
    loss_backend: Literal["chunked", "liger"] = "chunked"
    # Extra DeepSpeed config keys, merged over the generated config (advanced users).
    deepspeed: dict[str, Any] = field(default_factory=dict)
    # The hang watchdog (docs/training.md, "Hangs and stragglers"): when no step completes for
    # `hang_timeout` seconds on any rank, every rank writes its stacks to RUN/hang/ and the
    # job exits 124 (slurm/launch.sh requeues it). 300 s is 9x a Llama-8B paper step at 40%
    # MFU (34 s) and 60x a 1B one. `hang_timeout_long` (null = 4 x hang_timeout) holds until
    # the first step of a start completes (compile, data workers) and while a rank saves,
    # evaluates or rolls back. 0 or null = no watchdog.
    hang_timeout: float | None = 300.0
    hang_timeout_long: float | None = None


@dataclass
class CheckpointConfig:
    dir: str | None = None  # null = RUN_DIR/checkpoints
    interval: int = 1000  # save every N steps (and at the end, and on SIGTERM/SIGUSR1)
    keep_last: int = 3
    resume: bool = True  # continue from the newest good checkpoint when one exists
    # Before resuming, check the checkpoint's files against the sizes and CRC-32s its marker
    # recorded ("size": sizes only; "none": trust it); a damaged one falls back to the previous.
    verify: Literal["checksum", "size", "none"] = "checksum"
    # Start a new run from another run's weights: "RUN" (its newest checkpoint), "RUN@STEP",
    # or a checkpoint/weights folder. Fresh optimizer, schedule and data position; the model
    # may differ in positions only (max_seq_len, RoPE fraction, theta, scaling), dropout and
    # init. A checkpoint of this run, when there is one, is resumed instead.
    init_from: str | None = None
    # `async` in YAML and --set (a Python keyword, hence the field's name): copy the state to
    # host memory at the save step and write it in the background while training goes on
    # (pretrain/train/async_save.py; docs/training.md "Asynchronous checkpoints").
    async_: bool = field(default=False, metadata={"key": "async"})


@dataclass
class LoggingConfig:
    run_dir: str = "runs/default"
    log_interval: int = 10
    tensorboard: bool = True
    peak_tflops: float = 989.0  # per device, for MFU (H200 dense BF16)
    max_logit_interval: int = 100  # sample max attention logit every N steps (0 = off)
    sample_prompts: list[str] = field(default_factory=list)  # generated from at the end


@dataclass
class FaultConfig:
    """A fault injected on purpose (tests and demos of `spikes` and of the hang watchdog), at
    data step `step`, the step that reads it when no data is skipped. A data fault corrupts
    that step's batch on every rank; it travels with the batch, like bad data: a rollback
    that skips the batch avoids it. A rank fault (hang, slow) stops or slows one rank."""

    step: int
    last: int | None = None  # data steps step..last (null = step only); not for hang
    # nan: the loss (and so every gradient) is NaN; scale_loss: the loss and its gradients are
    # multiplied by `factor`; scale_grads: the gradients only (the loss reads normal);
    # noise: the batch is replaced by uniformly random token ids (bad data: it is learned).
    # hang: rank `rank` blocks for good before the step's first forward, once per run folder
    # (it leaves RUN/hang/injected_rank_R_step_S, so a requeued run trains through);
    # slow: rank `rank` sleeps `seconds` before the forward of each of its steps.
    kind: Literal["nan", "scale_loss", "scale_grads", "noise", "hang", "slow"] = "scale_loss"
    factor: float = 100.0
    rank: int | None = None  # hang and slow only: the rank that stalls
    seconds: float | None = None  # slow only: the delay per step


@dataclass
class SpikesConfig:
    """Loss spikes (docs/training.md, "Loss spikes"): always detected and logged; skipped or
    rolled back only when asked (the paper's runs did neither)."""

    # Detection: a robust z-score (median / MAD over the last `window` steps) of the loss and
    # of the grad norm; above `threshold` (loss) or `grad_norm_threshold` the step is flagged.
    # NaN/Inf is always flagged. Grad norms are heavy-tailed: on clean quickstart data
    # most outliers score 6-8, a few 10-15 (docs/training.md, "Loss spikes").
    window: int = 100
    threshold: float = 6.0
    grad_norm_threshold: float = 10.0
    # Mitigation, off by default. skip_step: a flagged step applies no update (parameters,
    # optimizer moments and step count untouched; the LR schedule and the data move on).
    skip_step: bool = False
    # Roll back to the newest checkpoint before the first flagged step once `rollback_after`
    # of the last `rollback_within` steps were flagged (0 = never), and never train on the
    # data steps from the first flagged one - `rollback_skip_before` to the current one +
    # `rollback_skip_after`. At most `max_rollbacks` per run.
    rollback_after: int = 0
    rollback_within: int = 10
    rollback_skip_before: int = 0
    rollback_skip_after: int = 0
    max_rollbacks: int = 5
    # Data steps never trained on, [first, last] inclusive (as PaLM skipped batches by hand).
    skip_data: list[tuple[int, int]] = field(default_factory=list)
    faults: list[FaultConfig] = field(default_factory=list)


@dataclass
class WandbConfig:
    """Log the run's scalars to Weights & Biases too (the paper's runs did); off by default.

    Needs `pip install wandb`. WANDB_MODE=offline (or mode: offline) writes locally for a later
    `wandb sync`."""

    enabled: bool = False
    project: str = "pretrain"
    entity: str | None = None
    name: str | None = None  # null = the run folder's name
    group: str | None = None
    tags: list[str] = field(default_factory=list)
    mode: Literal["online", "offline", "disabled"] | None = None  # null = WANDB_MODE or online


@dataclass
class DownstreamConfig:
    """In-loop downstream evaluation (docs/evaluation.md, "In-loop downstream evaluation"):
    the offline tool's tasks, scored by the training model between steps. Off while `tasks`
    is empty (the paper's runs evaluated offline only)."""

    # Task names or suites, as tools/evaluate.py --tasks (any task with local data).
    tasks: list[str] = field(default_factory=list)
    data_dir: str | None = None  # the local task data, as tools/evaluate.py --data-dir
    # The same examples every time: `examples` per task (all when fewer), drawn with `seed`
    # and recorded in RUN/downstream/examples.json, so tools/evaluate.py can score them too.
    examples: int = 500
    seed: int = 1234
    interval: int = 1000  # every N steps and at the end; 0 = at the end only
    batch_size: int = 64  # sequences per forward, as the offline adapter's batch_size
    max_batch_tokens: int | None = None  # padded tokens per forward; null = the adapter's


@dataclass
class Config:
    """One training run. YAML sections map to these fields; see docs/configuration.md."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    spikes: SpikesConfig = field(default_factory=SpikesConfig)
    wandb: WandbConfig = field(default_factory=WandbConfig)
    downstream: DownstreamConfig = field(default_factory=DownstreamConfig)
    # Your own callbacks (docs/training.md, "Callbacks"): each entry names a class by its
    # dotted path under `class:`; the other keys are passed to its constructor.
    #   callbacks: [{class: mylab.probes.GradHistogram, every: 100}]
    callbacks: list[dict[str, Any]] = field(default_factory=list)

    @property
    def seq_len(self) -> int:
        return self.train.seq_len or self.model.max_seq_len


# ----------------------------------------------------------------------------- loading

T = TypeVar("T")


def config_key(f: dataclasses.Field) -> str:
    """A field's key in YAML and --set: its name, or metadata["key"] where the name cannot be
    one (`checkpoint.async` is the field `async_`: `async` is a Python keyword)."""
    return f.metadata.get("key", f.name)


def _type_name(tp: Any) -> str:
    """The annotation as a user reads it: "bool or 'auto'", not "Union"."""
    origin = get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in get_args(tp) if a is not type(None))
    if origin is Literal:
        return " or ".join(map(repr, get_args(tp)))
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """Check `value` against the annotation `tp`; convert the few safe cases (int -> float)."""
    origin = get_origin(tp)
    if tp is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        args = get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, key)
            except ConfigError as e:
                errors.append(e)
        if len(errors) == 1:  # X | None: say what X wants
            raise ConfigError(
                f"{errors[0]} (or null)" if type(None) in args else str(errors[0])
            ) from None
        raise ConfigError(f"{key}={value!r} has the wrong type; expected {_type_name(tp)}")
    if origin is Literal:
        choices = get_args(tp)
        if value not in choices:
            raise ConfigError(
                f"{key}={value!r} is not allowed; use one of {', '.join(map(repr, choices))}"
            )
        return value
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key}={value!r} must be a list")
        args = get_args(tp)
        if origin is tuple and args and args[-1] is not Ellipsis:
            if len(value) != len(args):
                raise ConfigError(f"{key}={value!r} must have {len(args)} items")
            return tuple(
                _coerce(v, a, f"{key}[{i}]")
                for i, (v, a) in enumerate(zip(value, args, strict=True))
            )
        inner = args[0] if args else Any
        items = [_coerce(v, inner, f"{key}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key}={value!r} must be a mapping")
        return dict(value)
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        return from_dict(tp, value, key)
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{key}={value!r} must be true or false")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise ConfigError(f"{key}={value!r} must be an integer")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML reads 4e-4 (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
        raise ConfigError(f"{key}={value!r} must be a number")
    if tp is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"{key}={value!r} must be a string")
    return value


# Keys that moved, old -> new: a config using the old name gets told the new one.
MOVED = {"logging.spike_window": "spikes.window", "logging.spike_threshold": "spikes.threshold"}


def from_dict(cls: type[T], data: dict[str, Any] | None, prefix: str = "") -> T:
    """Build dataclass `cls` from `data`, refusing unknown keys and wrong types."""
    data = data or {}
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix or 'config'} must be a mapping, got {data!r}")
    hints = typing.get_type_hints(cls)
    fields = {config_key(f): f for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(data) - set(fields))
    where = f"{prefix}." if prefix else ""
    for k in unknown:
        if f"{where}{k}" in MOVED:
            raise ConfigError(f"{where}{k} is now {MOVED[where + k]}; rename it in your config")
    if unknown:
        import difflib

        where = f"{prefix}." if prefix else ""
        parts = []
        for k in unknown:
            close = difflib.get_close_matches(k, fields, n=1)
            parts.append(f"{where}{k}" + (f" (did you mean {where}{close[0]}?)" if close else ""))
        raise ConfigError(
            f"unknown key {', '.join(parts)}; known keys of {prefix or 'the config'}: "
            f"{', '.join(fields)}"
        )
    kwargs = {}
    for name, value in data.items():
        key = f"{prefix}.{name}" if prefix else name
        kwargs[fields[name].name] = _coerce(value, hints[fields[name].name], key)
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except TypeError as e:
        raise ConfigError(f"{prefix or 'config'}: {e}") from None


def to_dict(obj: Any) -> Any:
    """Dataclass -> plain dict (YAML-safe: tuples become lists)."""
    if dataclasses.is_dataclass(obj):
        return {config_key(f): to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (list, tuple)):
        return [to_dict(v) for v in obj]
    if isinstance(obj, dict):
        return {k: to_dict(v) for k, v in obj.items()}
    return obj


def deep_merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = deep_merge(out[k], v)
        else:
            out[k] = v
    return out


def yaml_error_message(e: BaseException, path: Any = None) -> str:
    """`FILE:LINE:COLUMN: not valid YAML: PROBLEM` for a yaml.MarkedYAMLError (1-based)."""
    mark = getattr(e, "problem_mark", None) or getattr(e, "context_mark", None)
    problem = getattr(e, "problem", None) or getattr(e, "context", None) or str(e)
    name = path if path is not None else getattr(mark, "name", None) or "<yaml>"
    where = f"{name}:{mark.line + 1}:{mark.column + 1}" if mark is not None else f"{name}"
    return f"{where}: not valid YAML: {problem}; fix the file's syntax"


def load_yaml(path: str | Path, _seen: tuple[Path, ...] = ()) -> dict[str, Any]:
    """Read a YAML config, resolving `inherit:` (a path or list of paths, relative to the file).

    Inherited files are merged first, in order; the file's own keys win. A model preset
    (configs/models/*.yaml) holds only model fields; inherit it under `model:` with
    `inherit: {model: ../models/llama1b.yaml}`.
    """
    path = Path(path).resolve()
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    if path in _seen:
        raise ConfigError(f"config inherit cycle: {' -> '.join(map(str, _seen + (path,)))}")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(yaml_error_message(e, path)) from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of keys")
    parents = data.pop("inherit", None)
    if parents is None:
        return data
    merged: dict[str, Any] = {}
    # `inherit: file` or `inherit: [a, b]` merges at the top; `inherit: {model: file}` puts
    # the file's content under that section.
    if isinstance(parents, (str, list)):
        for p in [parents] if isinstance(parents, str) else parents:
            merged = deep_merge(merged, load_yaml(path.parent / p, _seen + (path,)))
    elif isinstance(parents, dict):
        for section, p in parents.items():
            merged = deep_merge(merged, {section: load_yaml(path.parent / p, _seen + (path,))})
    else:
        raise ConfigError(f"{path}: inherit must be a path, a list of paths or a mapping")
    return deep_merge(merged, data)


def parse_override(text: str) -> tuple[list[str], Any]:
    """'optim.lr=3e-4' -> (['optim', 'lr'], 0.0003). The value is read as YAML."""
    if "=" not in text:
        raise ConfigError(f"--set {text!r} must look like section.key=value (e.g. optim.lr=3e-4)")
    key, raw = text.split("=", 1)
    parts = key.strip().split(".")
    if not all(parts):
        raise ConfigError(f"--set {text!r}: bad key {key!r}")
    try:
        value = yaml.safe_load(raw)
    except yaml.YAMLError:
        value = raw
    return parts, value


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    data = dict(data)
    for text in overrides:
        parts, value = parse_override(text)
        node = data
        for p in parts[:-1]:
            child = node.get(p)
            child = dict(child) if isinstance(child, dict) else {}
            node[p] = child
            node = child
        node[parts[-1]] = value
    return data


def load_config(path: str | Path, overrides: list[str] | None = None) -> Config:
    """Load a run config (YAML with inherit) and apply `--set a.b=c` overrides."""
    data = apply_overrides(load_yaml(path), overrides or [])
    return from_dict(Config, data)


def load_model_config(path: str | Path, overrides: list[str] | None = None) -> ModelConfig:
    """Load a model preset (a YAML of model fields only), e.g. configs/models/llama1b.yaml."""
    data = load_yaml(path)
    if "model" in data and isinstance(data["model"], dict):
        data = data["model"]
    data = apply_overrides(data, overrides or [])
    return from_dict(ModelConfig, data, "model")


def add_set_option(parser: argparse.ArgumentParser, example: str = "optim.lr=3e-4") -> None:
    """`--set KEY=VALUE` (repeatable) into `args.overrides`: the one config override flag of
    every program, read as YAML like the config file (pretrain/config.py apply_overrides)."""
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help=f"override one config value, e.g. --set {example} (repeatable; values are read "
        f"as YAML)",
    )


__all__ = [
    "add_set_option",
    "CheckpointConfig",
    "config_key",
    "Config",
    "ConfigError",
    "DataConfig",
    "DownstreamConfig",
    "FaultConfig",
    "LoggingConfig",
    "ModelConfig",
    "OptimConfig",
    "ScheduleConfig",
    "TrainConfig",
    "WandbConfig",
    "apply_overrides",
    "deep_merge",
    "field",
    "from_dict",
    "load_config",
    "load_model_config",
    "load_yaml",
    "yaml_error_message",
    "rotary_dims_from_fraction",
    "to_dict",
]
