"""Our model <-> Hugging Face transformers: the dispatch over export targets.

Each target (one transformers class) is a module of `pretrain/hf/targets/`: what it holds,
its config, its weights' names and layouts. Here, for any target:

    choose_target         the native class that holds the model exactly (llama, gpt_neox,
                          then smollm3 for NoPE layers / sliding windows), else rope_lm
                          (remote code); a forced native target that
                          cannot represent a feature is refused with `HFConversionError`
                          naming it; nothing is dropped silently
    hf_config             the fields every target shares, the toolkit's record, the class
                          name in `architectures` (what vLLM and llama.cpp pick the class by)
    config_from_hf        our config back: the class's fields decide, the record fills in
    to/from_hf_state_dict our state dict under the target's names, with no model built on
                          either side; missing biases are written as zeros, which is exact
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import torch

from pretrain.config import ConfigError, ModelConfig, from_dict, to_dict
from pretrain.hf.targets import BY_NAME, NATIVE_TARGETS, REMOTE_TARGET, get_target
from pretrain.hf.targets.base import HFConversionError, neox_theta
from pretrain.model.position import layer_positions
from pretrain.model.transformer import Transformer

log = logging.getLogger(__name__)

NATIVE = tuple(t.name for t in NATIVE_TARGETS)
REMOTE = REMOTE_TARGET.name
TARGETS = tuple(BY_NAME)
CLASS_NAMES = {name: t.class_name for name, t in BY_NAME.items()}
# Where config.json keeps the toolkit's own record of the model (and tokenizer, provenance).
RECORD_KEY = "pretrain"


# ----------------------------------------------------------------------------- targets


def unsupported_features(cfg: ModelConfig, target: str) -> list[str]:
    """What `target` cannot represent of `cfg` (empty = it holds the model exactly)."""
    return get_target(target).unsupported(cfg)


def choose_target(cfg: ModelConfig, target: str | None = None) -> str:
    """`target` if it holds `cfg` exactly (raises otherwise); None or "auto": the first native
    class that holds it exactly and takes it (`Target.auto`: llama, gpt_neox, smollm3), else
    rope_lm (remote code)."""
    if target in (None, "auto"):
        return next(
            (t.name for t in NATIVE_TARGETS if t.auto(cfg) and not t.unsupported(cfg)), REMOTE
        )
    problems = unsupported_features(cfg, target)
    if problems:
        raise HFConversionError(
            f"cannot export to {CLASS_NAMES[target]}: "
            + "; ".join(problems)
            + f". Use --target auto (or {REMOTE}): a remote-code model holds every feature"
        )
    return target


# ----------------------------------------------------------------------------- configs


def hf_config(
    cfg: ModelConfig,
    target: str | None = None,
    *,
    eos_token_id: int | None = None,
    record: dict[str, Any] | None = None,
):
    """The transformers config object for `cfg` exported as `target` (see `choose_target`).

    `record` (the toolkit's own description: model config, tokenizer, provenance) is kept in
    config.json under "pretrain", so importing the folder back restores the exact config.
    """
    t = get_target(choose_target(cfg, target))
    common: dict[str, Any] = dict(
        vocab_size=cfg.padded_vocab_size,
        hidden_size=cfg.d_model,
        num_hidden_layers=cfg.n_layers,
        num_attention_heads=cfg.n_heads,
        intermediate_size=cfg.d_ff,
        # transformers' dynamic NTK scales from max_position_embeddings: the trained length.
        max_position_embeddings=cfg.original_max_seq_len
        if cfg.rope_scaling is not None and cfg.rope_scaling.type == "dynamic_ntk"
        else cfg.max_seq_len,
        tie_word_embeddings=cfg.tie_embeddings,
        bos_token_id=eos_token_id,
        eos_token_id=eos_token_id,
        initializer_range=cfg.init_std,
    )
    if record is not None:
        common[RECORD_KEY] = record
    config = t.hf_config(cfg, common)
    # Tools that pick the model class by this list (vLLM, llama.cpp's converter) refuse a
    # folder without it; transformers itself goes by model_type (or auto_map).
    config.architectures = [t.class_name]
    return config


def config_from_hf(hf_cfg) -> ModelConfig:
    """Our ModelConfig for a transformers config (Llama, GPT-NeoX or RopeLM).

    What the config's own fields say is what transformers computes, so they decide. When the
    folder was exported by this toolkit, its record (config.json "pretrain": {"model": ...})
    adds what those fields do not hold (the tokenizer's unpadded vocabulary, the
    initialisation, the rope_fraction spelling) provided it describes the same network;
    a record that disagrees (config.json edited after export) is ignored with a warning.
    """
    kind = getattr(hf_cfg, "model_type", None)
    if kind not in BY_NAME:
        raise HFConversionError(
            f"model_type {kind!r} is not supported; use one of {', '.join(TARGETS)}"
        )
    target = BY_NAME[kind]
    try:
        derived = target.model_config(hf_cfg)
    except ConfigError as e:
        raise HFConversionError(
            f"the {kind} config does not describe a model of this toolkit: {e}"
        ) from None
    record = (getattr(hf_cfg, RECORD_KEY, None) or {}).get("model")
    if not record:
        return derived
    try:
        recorded = from_dict(ModelConfig, record, "model")
    except ConfigError as e:
        log.warning("ignoring the toolkit's record in config.json (%s)", e)
        return derived
    diff = _forward_differences(derived, recorded, always_biased=bool(target.zero_filled(derived)))
    if diff:
        log.warning(
            "config.json disagrees with the toolkit's record of the model on %s; using config.json",
            ", ".join(diff),
        )
        return derived
    return recorded


def _forward_differences(
    derived: ModelConfig, recorded: ModelConfig, always_biased: bool
) -> list[str]:
    """Fields that change what the network computes and differ between the two configs.
    A class with every bias (GPT-NeoX) holds a model without some as zeros: allowed here,
    and `from_hf_state_dict` checks that those tensors are zero."""
    props = (
        "padded_vocab_size",
        "n_layers",
        "d_model",
        "n_heads",
        "kv_heads",
        "d_ff",
        "block",
        "norm",
        "norm_eps",
        "mlp",
        "rope_dims",
        "rope_theta",
        "learned_pos_emb",
        "qk_norm",
        "attn_logit_softcap",
        "tie_embeddings",
    )
    out = [p for p in props if p != "rope_theta" and getattr(derived, p) != getattr(recorded, p)]
    if _effective_rope(derived) != _effective_rope(recorded):
        out.append("rope_theta/rope_scaling")
    if _layer_signature(derived) != _layer_signature(recorded):
        out.append(
            "positions by layer (nope_*, sliding_*, layer_types, global_rope_theta, alibi, "
            "rope_pairs)"
        )
    if derived.learned_pos_emb and derived.max_seq_len != recorded.max_seq_len:
        out.append("max_seq_len")
    for b in ("norm_bias", "mlp_bias", "attn_bias"):
        if b == "norm_bias" and derived.norm != "layernorm":
            continue  # RMSNorm has no bias either way
        d, r = getattr(derived, b), getattr(recorded, b)
        if d != r and not (d and always_biased):
            out.append(b)
    return out


def _layer_signature(cfg: ModelConfig) -> list[tuple]:
    """Per layer what its positions compute: rotary dims, window, ALiBi, the pair selection
    and its theta as NeoX's spectrum sees it (p-RoPE at theta = NeoX at theta^(r/head_dim))
    relative to the model's, so a GPT-NeoX folder of a p-RoPE model, or a static-ntk one,
    reads as the same network."""
    base = neox_theta(cfg)
    out = []
    for p in layer_positions(cfg):
        theta = p.theta ** (p.rotary_dims / p.head_dim) if p.spectrum == "p_rope" else p.theta
        ratio = f"{theta / base:.9g}" if p.rope else None
        out.append((p.rotary_dims, ratio, p.window, p.alibi, p.pairs))
    return out


def _effective_rope(cfg: ModelConfig) -> tuple[str, dict[str, Any] | None]:
    """(theta, scaling) as the frequencies see them: static ntk is a larger theta, a factor of 1
    is none, the original length is spelled out, and p-RoPE is NeoX at its own theta (to 9
    digits: theta^(r/d) of a theta^(d/r) written by the proportional rope_type is not bit-equal)."""
    theta, s = neox_theta(cfg), cfg.rope_scaling
    if s is None or s.factor == 1.0:
        return f"{theta:.9g}", None
    if s.type == "ntk":
        return f"{theta * s.factor ** (cfg.rope_dims / (cfg.rope_dims - 2)):.9g}", None
    scaling = to_dict(s)
    scaling["original_max_seq_len"] = cfg.original_max_seq_len
    if s.type != "yarn":
        for k in ("beta_fast", "beta_slow", "attention_factor", "truncate"):
            scaling.pop(k)
    if s.type != "llama3":
        for k in ("low_freq_factor", "high_freq_factor"):
            scaling.pop(k)
    if s.type == "linear":
        scaling.pop("original_max_seq_len")
    return f"{theta:.9g}", scaling


# ----------------------------------------------------------------------------- weights


def _shapes(cfg: ModelConfig) -> dict[str, torch.Size]:
    """Our model's state dict for `cfg`: names and shapes (built on meta, no memory)."""
    with torch.device("meta"):
        return {k: v.shape for k, v in Transformer(cfg).state_dict().items()}


def our_tensor_names(cfg: ModelConfig) -> list[str]:
    """The names of our model's state dict for `cfg` (lm_head left out when tied)."""
    return [n for n in _shapes(cfg) if not (cfg.tie_embeddings and n == "lm_head.weight")]


def to_hf_state_dict(
    state: dict[str, torch.Tensor], cfg: ModelConfig, target: str | None = None
) -> dict[str, torch.Tensor]:
    """Our state dict under the target's names and layouts (views where possible).

    Biases and norm biases the target always has (GPT-NeoX) are written as zeros when our
    model has none; a tied output matrix is left out (transformers ties it on load).
    """
    t = get_target(choose_target(cfg, target))
    out: dict[str, torch.Tensor] = {}
    for name in our_tensor_names(cfg):
        tensor = state[name].detach()
        m = t.tensor_map(cfg, name)
        if len(m.names) > 1:
            fused = m.to_hf(tensor) if m.to_hf else tensor
            out.update(zip(m.names, fused.split(m.sizes), strict=True))
        else:
            out[m.names[0]] = m.to_hf(tensor) if m.to_hf else tensor
    for hf_name, shape in t.zero_filled(cfg).items():
        if hf_name not in out:
            out[hf_name] = torch.zeros(shape, dtype=state["wte.weight"].dtype)
    return {k: v.contiguous() for k, v in out.items()}


def from_hf_state_dict(
    hf_state: Mapping[str, torch.Tensor], cfg: ModelConfig, target: str
) -> dict[str, torch.Tensor]:
    """Our state dict from a target's state dict (the inverse of `to_hf_state_dict`).

    Every tensor of theirs must find a place: a bias our model lacks must be zero, and a
    separate output matrix of a tied model must equal the embedding; else HFConversionError.
    """
    t = get_target(target)

    def take(hf_name: str) -> torch.Tensor:
        for n in (hf_name, *t.aliases.get(hf_name, ())):
            if n in hf_state:
                used.add(n)
                return hf_state[n]
        raise HFConversionError(f"{hf_name} is missing from the Hugging Face weights")

    used: set[str] = set()
    ours: dict[str, torch.Tensor] = {}
    absent = t.absent(cfg)
    shapes = _shapes(cfg) if absent else {}
    dtype = next(iter(hf_state.values())).dtype
    for name in our_tensor_names(cfg):
        m = t.tensor_map(cfg, name)
        if m.names[0] in absent:
            ours[name] = torch.zeros(shapes[name], dtype=dtype)
        elif len(m.names) > 1:
            fused = torch.cat([take(n) for n in m.names])
            ours[name] = m.from_hf(fused) if m.from_hf else fused
        else:
            ours[name] = m.from_hf(take(m.names[0])) if m.from_hf else take(m.names[0])
    # a tied model's output matrix, if the folder holds one anyway, under any of its names
    (output,) = t.tensor_map(cfg, "lm_head.weight").names
    outputs = {output, *t.aliases.get(output, ())}
    for n in sorted(set(hf_state) - used):
        tensor = hf_state[n]
        if n.endswith(".bias") and not tensor.any():
            continue  # a bias the target always has, zero: exactly our model without it
        if cfg.tie_embeddings and n in outputs and torch.equal(tensor, ours["wte.weight"]):
            continue
        raise HFConversionError(
            f"{n} has no place in our model for this config (a non-zero bias our "
            f"model lacks, an untied output matrix, or another architecture)"
        )
    return ours


__all__ = [
    "CLASS_NAMES",
    "NATIVE",
    "RECORD_KEY",
    "REMOTE",
    "TARGETS",
    "HFConversionError",
    "choose_target",
    "config_from_hf",
    "from_hf_state_dict",
    "hf_config",
    "our_tensor_names",
    "to_hf_state_dict",
    "unsupported_features",
]
