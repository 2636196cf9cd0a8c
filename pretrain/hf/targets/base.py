"""What every export target offers, and the pieces the native targets share.

A target is one transformers class an export can be written as. Its module says, for that
class only: which of our models it holds exactly (`unsupported`), its config (`hf_config`),
our config read back from its config (`model_config`) and where each of our tensors goes
(`tensor_map`). The dispatch over targets (`pretrain/hf/convert.py`) does the rest: choosing
a target, the toolkit's record in config.json, walking the state dicts.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from pretrain.config import ModelConfig, RopeScalingConfig
from pretrain.errors import UserError
from pretrain.model.pairs import describe
from pretrain.model.position import layer_positions


class HFConversionError(UserError, ValueError):
    """The model (or folder) cannot be converted exactly; the message names what and the fix."""


@dataclass(frozen=True)
class TensorMap:
    """Where one of our tensors lives in a target's state dict.

    One name: the tensor is copied, or passed through `to_hf` (and back through `from_hf`)
    when the target lays it out otherwise. Several names: ours (through `to_hf` first, and
    `from_hf` after) is their tensors concatenated along dim 0, in that order, of dim-0 sizes
    `sizes` (a fused projection they keep apart).
    """

    names: tuple[str, ...]
    sizes: tuple[int, ...] = ()
    to_hf: Callable[[torch.Tensor], torch.Tensor] | None = None
    from_hf: Callable[[torch.Tensor], torch.Tensor] | None = None


class Target:
    """One Hugging Face class an export can be written as (a subclass per module)."""

    name: ClassVar[str]  # config.json's model_type, and --target's value
    class_name: ClassVar[str]  # the class transformers instantiates: config.json's architectures
    native: ClassVar[bool] = True  # False: our own code, shipped in the folder (trust_remote_code)
    # Remote code only: the files copied into the folder, and config.json's auto_map.
    remote_files: ClassVar[tuple[str, ...]] = ()
    auto_map: ClassVar[dict[str, str]] = {}
    # Other names a checkpoint may give a tensor, read in their place on import.
    aliases: ClassVar[dict[str, tuple[str, ...]]] = {}

    def auto(self, cfg: ModelConfig) -> bool:
        """Whether `--target auto` may pick this class for `cfg` (when it holds it exactly);
        False leaves the model to the next target, as it was exported before this class came."""
        return True

    def unsupported(self, cfg: ModelConfig) -> list[str]:
        """What this class cannot represent of `cfg`, in words (empty: it holds it exactly)."""
        raise NotImplementedError

    def hf_config(self, cfg: ModelConfig, common: dict[str, Any]) -> Any:
        """The transformers config for `cfg`; `common` holds the fields every target shares
        (`convert.hf_config` writes them: sizes, vocabulary, tying, token ids, the record)."""
        raise NotImplementedError

    def model_config(self, hf_cfg: Any) -> ModelConfig:
        """Our config computed from this class's config fields alone (no record)."""
        raise NotImplementedError

    def tensor_map(self, cfg: ModelConfig, name: str) -> TensorMap:
        """Where our tensor `name` (a key of our state dict) goes in this class's."""
        raise NotImplementedError

    def absent(self, cfg: ModelConfig) -> set[str]:
        """Names of ours (tensor_map's) this class does not have, read as zeros on import: a
        bias it lacks (Qwen2's output projection), which is exact."""
        return set()

    def zero_filled(self, cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
        """Tensors this class always has, with their shapes: written as zeros where our model
        has none (a bias), which is exact. A class with every bias also reads a model without
        some, so importing compares such biases leniently (`convert._forward_differences`)."""
        return {}

    def config_class(self) -> Any:
        """The class that reads this target's config.json, running no code from the folder."""
        from transformers import AutoConfig

        return AutoConfig

    def empty_model(self, config: Any) -> Any:
        """A transformers model of `config` in fp32, for the in-memory conversion (`to_hf`)."""
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


# ----------------------------------------------------------------------------- shared parts


def native_limits(cfg: ModelConfig, class_name: str) -> list[str]:
    """What none of the native classes exported so far holds (each native target adds its own)."""
    problems = []
    if cfg.attn_logit_softcap:
        problems.append(
            f"{class_name} has no attention-logit soft cap (model.attn_logit_softcap: "
            f"{cfg.attn_logit_softcap})"
        )
    if cfg.qk_norm:
        problems.append("QK-Norm (model.qk_norm: true)")
    if cfg.learned_pos_emb:
        problems.append("learned absolute positions (model.learned_pos_emb: true)")
    if cfg.alibi:
        problems.append(f"{class_name} has no ALiBi (model.alibi: true)")
    return problems


def position_limits(
    cfg: ModelConfig, class_name: str, *, nope_layers: bool = False, sliding: bool = False
) -> list[str]:
    """What a native class cannot hold of the per-layer positions (`layer_positions`):
    NoPE layers among RoPE ones unless it has `nope_layers` (SmolLM3's no_rope_layers),
    sliding windows unless it has `sliding` ones, and RoPE layers of different thetas
    (model.global_rope_theta) or a pair selection (model.rope_pairs: per KV head, in full
    RoPE's layout), which no native class exported so far holds."""
    positions, problems = layer_positions(cfg), []
    if cfg.rope_pairs is not None:  # (its NoPE layers are the selection's: this line says it)
        problems.append(
            f"{class_name} rotates the same dims of every head; a pair selection "
            f"(model.rope_pairs: {describe(cfg.rope_pairs, cfg.head_dim)}) is not representable"
        )
    elif not nope_layers and cfg.rope_dims > 0 and any(not p.rope for p in positions):
        spelled = (
            f"nope_every: {cfg.nope_every}"
            if cfg.nope_every is not None
            else f"nope_layers: {cfg.nope_layers}"
        )
        problems.append(
            f"{class_name} applies RoPE in every layer; NoPE layers (model.{spelled}) are "
            f"not representable"
        )
    if not sliding and any(p.window is not None for p in positions):
        problems.append(
            f"{class_name} has no sliding-window attention (model.sliding_window: "
            f"{cfg.sliding_window})"
        )
    if len({p.theta for p in positions if p.rope}) > 1:
        problems.append(
            f"{class_name} has one RoPE theta for every layer (model.global_rope_theta: "
            f"{cfg.global_rope_theta:g} on the full-attention layers, rope_theta "
            f"{cfg.rope_theta:g} on the sliding ones)"
        )
    return problems


# our layer type -> transformers' layer_types
LAYER_TYPES = {"full": "full_attention", "sliding": "sliding_attention"}


def hf_windows(cfg: ModelConfig) -> dict[str, Any]:
    """The sliding-window fields of a class with per-layer layer_types (SmolLM3, Qwen2/3)."""
    positions = layer_positions(cfg)
    sliding = any(p.window is not None for p in positions)
    return dict(
        use_sliding_window=sliding,
        sliding_window=cfg.sliding_window if sliding else None,
        layer_types=[LAYER_TYPES[p.attention] for p in positions],
    )


def windows_from_hf(hf_cfg: Any) -> dict[str, Any]:
    """Our sliding_window and layer_types of a config with layer_types: transformers' masks
    follow layer_types (and the window) for every layer."""
    n = hf_cfg.num_hidden_layers
    types = list(getattr(hf_cfg, "layer_types", None) or ["full_attention"] * n)[:n]
    unknown = sorted(set(types) - set(LAYER_TYPES.values()))
    if unknown:
        raise HFConversionError(
            f"layer_types {unknown}: only full_attention and sliding_attention convert"
        )
    window = hf_cfg.sliding_window if "sliding_attention" in types else None
    return dict(
        sliding_window=window,
        layer_types=None if window is None else [t.split("_")[0] for t in types],
    )


def neox_theta(cfg: ModelConfig) -> float:
    """The theta at which NeoX's spectrum over the rotary dims (theta^(-2j/r), what every
    native class computes) carries `cfg`'s frequencies: rope_theta, or for p-RoPE on r of
    head_dim dims theta^(r/head_dim), since (theta^(r/d))^(-2j/r) = theta^(-2j/d)
    (docs/hf.md). Exact in the arithmetic; in fp32 the two differ in the last bits."""
    r, d = cfg.rope_dims, cfg.head_dim
    if cfg.rope_spectrum == "p_rope" and 0 < r < d:
        return float(cfg.rope_theta) ** (r / d)
    return float(cfg.rope_theta)


def block_name(name: str) -> tuple[str | None, str, str]:
    """(layer index or None outside the blocks, module, weight/bias) of one of our tensor
    names: "blocks.3.attn.qkv.weight" -> ("3", "attn.qkv", "weight"); "wte.weight" ->
    (None, "wte", "weight")."""
    m = re.fullmatch(r"blocks\.(\d+)\.(.+)\.(weight|bias)", name)
    if m is None:
        module, leaf = name.rsplit(".", 1)
        return None, module, leaf
    i, module, leaf = m.groups()
    return i, module, leaf


def common_model_fields(
    hf_cfg: Any, theta: float, scaling: RopeScalingConfig | None
) -> dict[str, Any]:
    """The ModelConfig fields every target's config spells the same way."""
    return dict(
        vocab_size=hf_cfg.vocab_size,
        pad_vocab_to_multiple=1,
        n_layers=hf_cfg.num_hidden_layers,
        d_model=hf_cfg.hidden_size,
        n_heads=hf_cfg.num_attention_heads,
        head_dim=decoupled_head_dim(hf_cfg),
        d_ff=hf_cfg.intermediate_size,
        max_seq_len=hf_cfg.max_position_embeddings,
        rope_theta=theta,
        rope_scaling=scaling,
        rope_fraction=None,
        tie_embeddings=bool(hf_cfg.tie_word_embeddings),
        init_std=hf_cfg.initializer_range,
    )


def decoupled_head_dim(hf_cfg: Any) -> int | None:
    """The config's head_dim where it is not hidden_size / heads (Qwen3's), else None (our
    model.head_dim's null), so that a folder of the usual shape resolves as it always did."""
    head_dim = getattr(hf_cfg, "head_dim", None)
    heads = hf_cfg.num_attention_heads
    return None if head_dim is None or head_dim * heads == hf_cfg.hidden_size else int(head_dim)


def rotary_factor(rotary_dims: int, head_dim: int) -> float:
    """A partial_rotary_factor f with int(head_dim * f) == rotary_dims (what HF computes)."""
    f = rotary_dims / head_dim
    if int(head_dim * f) != rotary_dims:  # float rounding landed just below: nudge up
        f = (rotary_dims + 0.5) / head_dim
    return f


def hf_rope_parameters(cfg: ModelConfig) -> dict[str, Any]:
    """transformers' rope_parameters for our RoPE and its scaling (the native classes).

    linear, yarn and dynamic_ntk have a rope_type of the same formula; static ntk is plain
    RoPE with the larger theta it amounts to (theta x factor^(r / (r - 2)))."""
    theta, s = neox_theta(cfg), cfg.rope_scaling  # p-RoPE has no scaling (config.py)
    if s is None or s.factor == 1.0:
        return {"rope_type": "default", "rope_theta": theta}
    if s.type == "ntk":
        r = cfg.rope_dims
        return {"rope_type": "default", "rope_theta": theta * s.factor ** (r / (r - 2))}
    if s.type == "linear":
        return {"rope_type": "linear", "rope_theta": theta, "factor": s.factor}
    if s.type == "dynamic_ntk":  # its original length is max_position_embeddings (hf_config)
        return {"rope_type": "dynamic", "rope_theta": theta, "factor": s.factor}
    if s.type == "llama3":
        return {
            "rope_type": "llama3",
            "rope_theta": theta,
            "factor": s.factor,
            "low_freq_factor": s.low_freq_factor,
            "high_freq_factor": s.high_freq_factor,
            "original_max_position_embeddings": cfg.original_max_seq_len,
        }
    out = {
        "rope_type": "yarn",
        "rope_theta": theta,
        "factor": s.factor,
        "original_max_position_embeddings": cfg.original_max_seq_len,
        "beta_fast": s.beta_fast,
        "beta_slow": s.beta_slow,
        "truncate": s.truncate,
    }
    if s.attention_factor is not None:
        out["attention_factor"] = s.attention_factor
    return out


def rope_from_hf(hf_cfg: Any) -> tuple[float, RopeScalingConfig | None]:
    """(theta, scaling) of a native config's rope_parameters (the inverse of the above)."""
    rope = dict(getattr(hf_cfg, "rope_parameters", None) or {})
    theta = float(rope.get("rope_theta", 10000.0))
    kind = rope.get("rope_type", "default")
    if kind in ("default", "proportional"):  # proportional: p-RoPE (llama.rotary_fields)
        return theta, None
    if kind == "linear":
        return theta, RopeScalingConfig(type="linear", factor=float(rope["factor"]))
    if kind == "dynamic":
        return theta, RopeScalingConfig(
            type="dynamic_ntk",
            factor=float(rope["factor"]),
            original_max_seq_len=hf_cfg.max_position_embeddings,
        )
    if kind == "llama3":
        return theta, RopeScalingConfig(
            type="llama3",
            factor=float(rope["factor"]),
            original_max_seq_len=int(rope["original_max_position_embeddings"]),
            low_freq_factor=float(rope["low_freq_factor"]),
            high_freq_factor=float(rope["high_freq_factor"]),
        )
    if kind == "yarn":
        if rope.get("mscale") or rope.get("mscale_all_dim"):
            raise HFConversionError(
                "rope_type 'yarn' with mscale/mscale_all_dim (DeepSeek's variant) is not "
                "supported; only transformers' plain YaRN converts exactly"
            )
        return theta, RopeScalingConfig(
            type="yarn",
            factor=float(rope.get("factor") or 1.0),
            original_max_seq_len=int(rope["original_max_position_embeddings"]),
            beta_fast=float(rope.get("beta_fast") or 32.0),
            beta_slow=float(rope.get("beta_slow") or 1.0),
            attention_factor=rope.get("attention_factor"),
            truncate=bool(rope.get("truncate", True)),
        )
    raise HFConversionError(
        f"rope_type {kind!r} (RoPE scaling) is not supported; linear, dynamic, yarn and "
        f"llama3 convert exactly"
    )
