"""Our model <-> Hugging Face transformers: which class, its config, and the weights' names.

Three targets, the first two native to transformers, the third our own code shipped in
the export folder (`pretrain/hf/remote_code/`, loaded with trust_remote_code=True):

    llama     LlamaForCausalLM:   sequential block, RMSNorm, SwiGLU, RoPE on the whole head,
                                  no QK-Norm, no learned positions, no dropout
    gpt_neox  GPTNeoXForCausalLM: LayerNorm, GeLU, MHA, RoPE on >= 2 dims (partial is fine),
                                  no QK-Norm, no learned positions; parallel or sequential
    rope_lm   RopeLMForCausalLM:  everything `ModelConfig` can express

`choose_target` takes the native class when it holds the model exactly, else rope_lm. A
forced native target that cannot represent a feature is refused with `HFConversionError`
naming it; nothing is dropped silently. Missing biases are written as zeros, which is exact.

Weights are converted as state dicts, with no model built on either side. Layouts: our
attention has one fused projection [q heads | k heads | v heads]; GPT-NeoX fuses per head
([q_h, k_h, v_h] for each head h); Llama and RopeLM keep q/k/v apart. Our SwiGLU w_in is
[gate; up]; Llama and RopeLM have gate_proj and up_proj. Every other tensor is copied.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from typing import Any

import torch

from pretrain.config import ConfigError, ModelConfig, RopeScalingConfig, from_dict, to_dict
from pretrain.errors import UserError
from pretrain.model.transformer import Transformer

log = logging.getLogger(__name__)

NATIVE = ("llama", "gpt_neox")
REMOTE = "rope_lm"
TARGETS = (*NATIVE, REMOTE)
CLASS_NAMES = {
    "llama": "LlamaForCausalLM",
    "gpt_neox": "GPTNeoXForCausalLM",
    REMOTE: "RopeLMForCausalLM",
}
# Where config.json keeps the toolkit's own record of the model (and tokenizer, provenance).
RECORD_KEY = "pretrain"


class HFConversionError(UserError, ValueError):
    """The model (or folder) cannot be converted exactly; the message names what and the fix."""


# ----------------------------------------------------------------------------- targets


def unsupported_features(cfg: ModelConfig, target: str) -> list[str]:
    """What `target` cannot represent of `cfg` (empty = it holds the model exactly)."""
    if target not in TARGETS:
        raise HFConversionError(
            f"unknown Hugging Face target {target!r}; use one of {', '.join(TARGETS)}"
        )
    if target == REMOTE:
        return []
    cls = CLASS_NAMES[target]
    problems = []
    if cfg.attn_logit_softcap:
        problems.append(
            f"{cls} has no attention-logit soft cap (model.attn_logit_softcap: "
            f"{cfg.attn_logit_softcap})"
        )
    if cfg.qk_norm:
        problems.append("QK-Norm (model.qk_norm: true)")
    if cfg.learned_pos_emb:
        problems.append("learned absolute positions (model.learned_pos_emb: true)")
    if target == "llama":
        if cfg.block != "sequential":
            problems.append(f"{cls} has no parallel block (model.block: {cfg.block})")
        if cfg.norm != "rmsnorm":
            problems.append(f"{cls} has RMSNorm only (model.norm: {cfg.norm})")
        if cfg.mlp != "swiglu":
            problems.append(f"{cls} has SwiGLU only (model.mlp: {cfg.mlp})")
        if cfg.rope_dims != cfg.head_dim:
            problems.append(
                f"{cls} applies RoPE to the whole head; partial RoPE or NoPE "
                f"(rotary_dims {cfg.rope_dims} of head_dim {cfg.head_dim}) is not representable"
            )
        if cfg.dropout:
            problems.append(
                f"{cls} has attention dropout only (model.dropout: {cfg.dropout} "
                f"also drops embeddings and residual branches)"
            )
    else:
        if cfg.norm != "layernorm":
            problems.append(f"{cls} has LayerNorm only (model.norm: {cfg.norm})")
        if cfg.mlp != "gelu":
            problems.append(f"{cls} has a GeLU MLP only (model.mlp: {cfg.mlp})")
        if cfg.kv_heads != cfg.n_heads:
            problems.append(
                f"{cls} has no grouped-query attention (model.n_kv_heads: {cfg.n_kv_heads})"
            )
        if cfg.rope_dims == 0:
            problems.append(
                f"{cls} always rotates some dims; NoPE (rotary_dims 0) is not representable"
            )
    return problems


def choose_target(cfg: ModelConfig, target: str | None = None) -> str:
    """`target` if it holds `cfg` exactly (raises otherwise); None or "auto": the native class
    that holds it exactly (llama, then gpt_neox), else rope_lm (remote code)."""
    if target in (None, "auto"):
        return next((t for t in NATIVE if not unsupported_features(cfg, t)), REMOTE)
    problems = unsupported_features(cfg, target)
    if problems:
        raise HFConversionError(
            f"cannot export to {CLASS_NAMES[target]}: "
            + "; ".join(problems)
            + f". Use --target auto (or {REMOTE}): a remote-code model holds every feature"
        )
    return target


# ----------------------------------------------------------------------------- configs


def _rotary_factor(rotary_dims: int, head_dim: int) -> float:
    """A partial_rotary_factor f with int(head_dim * f) == rotary_dims (what HF computes)."""
    f = rotary_dims / head_dim
    if int(head_dim * f) != rotary_dims:  # float rounding landed just below: nudge up
        f = (rotary_dims + 0.5) / head_dim
    return f


def hf_rope_parameters(cfg: ModelConfig) -> dict[str, Any]:
    """transformers' rope_parameters for our RoPE and its scaling (Llama, GPT-NeoX).

    linear, yarn and dynamic_ntk have a rope_type of the same formula; static ntk is plain
    RoPE with the larger theta it amounts to (theta x factor^(r / (r - 2)))."""
    theta, s = float(cfg.rope_theta), cfg.rope_scaling
    if s is None or s.factor == 1.0:
        return {"rope_type": "default", "rope_theta": theta}
    if s.type == "ntk":
        r = cfg.rope_dims
        return {"rope_type": "default", "rope_theta": theta * s.factor ** (r / (r - 2))}
    if s.type == "linear":
        return {"rope_type": "linear", "rope_theta": theta, "factor": s.factor}
    if s.type == "dynamic_ntk":  # its original length is max_position_embeddings (hf_config)
        return {"rope_type": "dynamic", "rope_theta": theta, "factor": s.factor}
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


def _scaling_from_hf(rope: dict[str, Any], max_positions: int) -> RopeScalingConfig | None:
    kind = rope.get("rope_type", "default")
    if kind == "default":
        return None
    if kind == "linear":
        return RopeScalingConfig("linear", float(rope["factor"]))
    if kind == "dynamic":
        return RopeScalingConfig("dynamic_ntk", float(rope["factor"]), max_positions)
    if kind == "yarn":
        if rope.get("mscale") or rope.get("mscale_all_dim"):
            raise HFConversionError(
                "rope_type 'yarn' with mscale/mscale_all_dim (DeepSeek's variant) is not "
                "supported; only transformers' plain YaRN converts exactly"
            )
        return RopeScalingConfig(
            "yarn",
            float(rope.get("factor") or 1.0),
            int(rope["original_max_position_embeddings"]),
            float(rope.get("beta_fast") or 32.0),
            float(rope.get("beta_slow") or 1.0),
            rope.get("attention_factor"),
            bool(rope.get("truncate", True)),
        )
    raise HFConversionError(
        f"rope_type {kind!r} (RoPE scaling) is not supported; linear, dynamic and yarn "
        f"convert exactly"
    )


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
    target = choose_target(cfg, target)
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
    if target == "llama":
        from transformers import LlamaConfig

        return LlamaConfig(
            **common,
            num_key_value_heads=cfg.kv_heads,
            hidden_act="silu",
            rms_norm_eps=cfg.norm_eps,
            attention_bias=cfg.attn_bias,
            mlp_bias=cfg.mlp_bias,
            attention_dropout=cfg.dropout,
            head_dim=cfg.head_dim,
            rope_parameters=hf_rope_parameters(cfg),
        )
    if target == "gpt_neox":
        from transformers import GPTNeoXConfig

        factor = _rotary_factor(cfg.rope_dims, cfg.head_dim)
        config = GPTNeoXConfig(
            **common,
            hidden_act="gelu",
            layer_norm_eps=cfg.norm_eps,
            use_parallel_residual=cfg.block == "parallel",
            attention_bias=True,
            attention_dropout=cfg.dropout,
            hidden_dropout=cfg.dropout,
            rope_parameters={**hf_rope_parameters(cfg), "partial_rotary_factor": factor},
        )
        # transformers 5.0 reads the factor from the legacy `rotary_pct` (default 0.25) and
        # overwrites rope_parameters' with it; later 5.x prefer rope_parameters. Written in
        # config.json too, one folder loads right in every 5.x (tests/test_hf_export.py).
        config.rotary_pct = factor
        return config
    from pretrain.hf.remote_code.configuration_rope_lm import RopeLMConfig

    config = RopeLMConfig(
        **common,
        num_key_value_heads=cfg.kv_heads,
        block=cfg.block,
        norm=cfg.norm,
        norm_eps=cfg.norm_eps,
        norm_bias=cfg.norm_bias,
        mlp=cfg.mlp,
        mlp_bias=cfg.mlp_bias,
        attention_bias=cfg.attn_bias,
        rotary_dims=cfg.rope_dims,
        rope_theta=cfg.rope_theta,
        rotary_scaling=to_dict(cfg.rope_scaling),
        learned_pos_emb=cfg.learned_pos_emb,
        qk_norm=cfg.qk_norm,
        attn_logit_softcap=cfg.attn_logit_softcap,
        dropout=cfg.dropout,
    )
    config.architectures = [CLASS_NAMES[REMOTE]]
    return config


def config_from_hf(hf_cfg) -> ModelConfig:
    """Our ModelConfig for a transformers config (Llama, GPT-NeoX or RopeLM).

    What the config's own fields say is what transformers computes, so they decide. When the
    folder was exported by this toolkit, its record (config.json "pretrain": {"model": ...})
    adds what those fields do not hold (the tokenizer's unpadded vocabulary, the
    initialisation, the rope_fraction spelling) provided it describes the same network;
    a record that disagrees (config.json edited after export) is ignored with a warning.
    """
    derived = _derived_config(hf_cfg)
    record = (getattr(hf_cfg, RECORD_KEY, None) or {}).get("model")
    if not record:
        return derived
    try:
        recorded = from_dict(ModelConfig, record, "model")
    except ConfigError as e:
        log.warning("ignoring the toolkit's record in config.json (%s)", e)
        return derived
    diff = _forward_differences(derived, recorded, always_biased=hf_cfg.model_type == "gpt_neox")
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
    if derived.learned_pos_emb and derived.max_seq_len != recorded.max_seq_len:
        out.append("max_seq_len")
    for b in ("norm_bias", "mlp_bias", "attn_bias"):
        if b == "norm_bias" and derived.norm != "layernorm":
            continue  # RMSNorm has no bias either way
        d, r = getattr(derived, b), getattr(recorded, b)
        if d != r and not (d and always_biased):
            out.append(b)
    return out


def _effective_rope(cfg: ModelConfig) -> tuple[float, dict[str, Any] | None]:
    """(theta, scaling) as the frequencies see them: static ntk is a larger theta, a factor of 1
    is none, and the original length is spelled out."""
    theta, s = float(cfg.rope_theta), cfg.rope_scaling
    if s is None or s.factor == 1.0:
        return theta, None
    if s.type == "ntk":
        return theta * s.factor ** (cfg.rope_dims / (cfg.rope_dims - 2)), None
    scaling = to_dict(s)
    scaling["original_max_seq_len"] = cfg.original_max_seq_len
    if s.type != "yarn":
        for k in ("beta_fast", "beta_slow", "attention_factor", "truncate"):
            scaling.pop(k)
    if s.type == "linear":
        scaling.pop("original_max_seq_len")
    return theta, scaling


def _derived_config(hf_cfg) -> ModelConfig:
    kind = getattr(hf_cfg, "model_type", None)
    n_heads = hf_cfg.num_attention_heads
    head_dim = hf_cfg.hidden_size // n_heads
    if kind == REMOTE:
        theta = float(hf_cfg.rope_theta)
        raw = getattr(hf_cfg, "rotary_scaling", None)
        scaling = from_dict(RopeScalingConfig, raw, "rotary_scaling") if raw else None
    else:
        rope = dict(getattr(hf_cfg, "rope_parameters", None) or {})
        scaling = _scaling_from_hf(rope, hf_cfg.max_position_embeddings)
        theta = float(rope.get("rope_theta", 10000.0))
    common = dict(
        vocab_size=hf_cfg.vocab_size,
        pad_vocab_to_multiple=1,
        n_layers=hf_cfg.num_hidden_layers,
        d_model=hf_cfg.hidden_size,
        n_heads=n_heads,
        d_ff=hf_cfg.intermediate_size,
        max_seq_len=hf_cfg.max_position_embeddings,
        rope_theta=theta,
        rope_scaling=scaling,
        rope_fraction=None,
        tie_embeddings=bool(hf_cfg.tie_word_embeddings),
        init_std=hf_cfg.initializer_range,
    )
    try:
        if kind == "llama":
            if getattr(hf_cfg, "head_dim", None) not in (None, head_dim):
                raise HFConversionError(
                    f"head_dim {hf_cfg.head_dim} != hidden_size / heads ({head_dim}); "
                    f"our model has no separate head_dim"
                )
            if hf_cfg.hidden_act != "silu":
                raise HFConversionError(
                    f"hidden_act {hf_cfg.hidden_act!r}: only silu (SwiGLU) converts exactly"
                )
            return ModelConfig(
                **common,
                n_kv_heads=hf_cfg.num_key_value_heads,
                block="sequential",
                norm="rmsnorm",
                norm_eps=hf_cfg.rms_norm_eps,
                mlp="swiglu",
                mlp_bias=bool(hf_cfg.mlp_bias),
                attn_bias=bool(hf_cfg.attention_bias),
                rotary_dims=head_dim,
                dropout=float(hf_cfg.attention_dropout),
            )
        if kind == "gpt_neox":
            if hf_cfg.hidden_act != "gelu":
                raise HFConversionError(
                    f"hidden_act {hf_cfg.hidden_act!r}: only exact gelu converts exactly"
                )
            if hf_cfg.attention_dropout != hf_cfg.hidden_dropout:  # training only
                log.warning(
                    "attention_dropout %s != hidden_dropout %s: our model has one dropout "
                    "rate; using hidden_dropout",
                    hf_cfg.attention_dropout,
                    hf_cfg.hidden_dropout,
                )
            factor = rope.get("partial_rotary_factor", 1.0)
            return ModelConfig(
                **common,
                n_kv_heads=None,
                block="parallel" if hf_cfg.use_parallel_residual else "sequential",
                norm="layernorm",
                norm_bias=True,
                norm_eps=hf_cfg.layer_norm_eps,
                mlp="gelu",
                mlp_bias=True,
                attn_bias=True,
                rotary_dims=int(head_dim * factor),
                dropout=float(hf_cfg.hidden_dropout),
            )
        if kind == REMOTE:
            return ModelConfig(
                **common,
                n_kv_heads=hf_cfg.num_key_value_heads,
                block=hf_cfg.block,
                norm=hf_cfg.norm,
                norm_eps=hf_cfg.norm_eps,
                norm_bias=bool(hf_cfg.norm_bias),
                mlp=hf_cfg.mlp,
                mlp_bias=bool(hf_cfg.mlp_bias),
                attn_bias=bool(hf_cfg.attention_bias),
                rotary_dims=hf_cfg.rotary_dims,
                learned_pos_emb=bool(hf_cfg.learned_pos_emb),
                qk_norm=bool(hf_cfg.qk_norm),
                attn_logit_softcap=float(getattr(hf_cfg, "attn_logit_softcap", 0.0)),
                dropout=float(hf_cfg.dropout),
            )
    except ConfigError as e:
        raise HFConversionError(
            f"the {kind} config does not describe a model of this toolkit: {e}"
        ) from None
    raise HFConversionError(
        f"model_type {kind!r} is not supported; use one of {', '.join(TARGETS)}"
    )


# ----------------------------------------------------------------------------- weights

# Our module names inside a block -> the target's, where the tensor is only renamed. RopeLM
# uses Llama's names (and adds embed_positions, q_norm, k_norm, up_proj alone for GeLU).
_LLAMA_LAYER = {
    "norm1": "input_layernorm",
    "norm2": "post_attention_layernorm",
    "attn.proj": "self_attn.o_proj",
    "attn.q_norm": "self_attn.q_norm",
    "attn.k_norm": "self_attn.k_norm",
    "mlp.w_out": "mlp.down_proj",
}
_NEOX_LAYER = {
    "norm1": "input_layernorm",
    "norm2": "post_attention_layernorm",
    "attn.qkv": "attention.query_key_value",
    "attn.proj": "attention.dense",
    "mlp.w_in": "mlp.dense_h_to_4h",
    "mlp.w_out": "mlp.dense_4h_to_h",
}
_LLAMA_TOP = {
    "wte": "model.embed_tokens",
    "wpe": "model.embed_positions",
    "norm_f": "model.norm",
    "lm_head": "lm_head",
}
# GPT-NeoX's output matrix is `embed_out` in saved checkpoints (the hub's Pythia folders;
# transformers 4 and 5 both load it) but `lm_head` inside transformers 5's module tree.
_NEOX_TOP = {
    "wte": "gpt_neox.embed_in",
    "norm_f": "gpt_neox.final_layer_norm",
    "lm_head": "embed_out",
}
_ALIASES = {"embed_out.weight": ("lm_head.weight",)}


def _parts(cfg: ModelConfig, target: str, name: str) -> tuple[list[str], str]:
    """The target's tensor names that hold our tensor `name`, and how: "copy" (one name),
    "cat" (ours = their tensors concatenated along dim 0), or "neox_qkv" (per-head order)."""
    m = re.fullmatch(r"blocks\.(\d+)\.(.+)\.(weight|bias)", name)
    if m is None:
        module, leaf = name.rsplit(".", 1)
        top = _NEOX_TOP if target == "gpt_neox" else _LLAMA_TOP
        return [f"{top[module]}.{leaf}"], "copy"
    i, module, leaf = m.groups()
    if target == "gpt_neox":
        kind = "neox_qkv" if module == "attn.qkv" else "copy"
        return [f"gpt_neox.layers.{i}.{_NEOX_LAYER[module]}.{leaf}"], kind
    p = f"model.layers.{i}"
    if module == "attn.qkv":
        return [f"{p}.self_attn.{x}_proj.{leaf}" for x in "qkv"], "cat"
    if module == "mlp.w_in":
        if cfg.mlp == "swiglu":
            return [f"{p}.mlp.gate_proj.{leaf}", f"{p}.mlp.up_proj.{leaf}"], "cat"
        return [f"{p}.mlp.up_proj.{leaf}"], "copy"
    return [f"{p}.{_LLAMA_LAYER[module]}.{leaf}"], "copy"


def _split_sizes(cfg: ModelConfig, names: list[str]) -> list[int]:
    if len(names) == 3:  # q, k, v
        return [
            cfg.n_heads * cfg.head_dim,
            cfg.kv_heads * cfg.head_dim,
            cfg.kv_heads * cfg.head_dim,
        ]
    return [cfg.d_ff, cfg.d_ff]  # gate, up


def _neox_qkv(t: torch.Tensor, cfg: ModelConfig, to_hf: bool) -> torch.Tensor:
    """[q heads | k heads | v heads] <-> per head [q_h, k_h, v_h] (weight or bias)."""
    H, D = cfg.n_heads, cfg.head_dim
    rest = t.shape[1:]
    if to_hf:
        return t.reshape(3, H, D, *rest).transpose(0, 1).reshape(3 * H * D, *rest)
    return t.reshape(H, 3, D, *rest).transpose(0, 1).reshape(3 * H * D, *rest)


def our_tensor_names(cfg: ModelConfig) -> list[str]:
    """The names of our model's state dict for `cfg` (lm_head left out when tied)."""

    with torch.device("meta"):
        names = list(Transformer(cfg).state_dict())
    return [n for n in names if not (cfg.tie_embeddings and n == "lm_head.weight")]


def to_hf_state_dict(
    state: dict[str, torch.Tensor], cfg: ModelConfig, target: str | None = None
) -> dict[str, torch.Tensor]:
    """Our state dict under the target's names and layouts (views where possible).

    Biases and norm biases the target always has (GPT-NeoX) are written as zeros when our
    model has none; a tied output matrix is left out (transformers ties it on load).
    """
    target = choose_target(cfg, target)
    out: dict[str, torch.Tensor] = {}
    for name in our_tensor_names(cfg):
        t = state[name].detach()
        names, how = _parts(cfg, target, name)
        if how == "cat":
            out.update(zip(names, t.split(_split_sizes(cfg, names)), strict=True))
        elif how == "neox_qkv":
            out[names[0]] = _neox_qkv(t, cfg, to_hf=True)
        else:
            out[names[0]] = t
    if target == "gpt_neox":
        for hf_name, shape in _neox_zero_biases(cfg).items():
            if hf_name not in out:
                out[hf_name] = torch.zeros(shape, dtype=state["wte.weight"].dtype)
    return {k: v.contiguous() for k, v in out.items()}


def _neox_zero_biases(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every bias GPT-NeoX has, with its shape."""
    d, out = cfg.d_model, {}
    for i in range(cfg.n_layers):
        p = f"gpt_neox.layers.{i}"
        out.update(
            {
                f"{p}.input_layernorm.bias": (d,),
                f"{p}.post_attention_layernorm.bias": (d,),
                f"{p}.attention.query_key_value.bias": (3 * d,),
                f"{p}.attention.dense.bias": (d,),
                f"{p}.mlp.dense_h_to_4h.bias": (cfg.d_ff,),
                f"{p}.mlp.dense_4h_to_h.bias": (d,),
            }
        )
    out["gpt_neox.final_layer_norm.bias"] = (d,)
    return out


def from_hf_state_dict(
    hf_state: Mapping[str, torch.Tensor], cfg: ModelConfig, target: str
) -> dict[str, torch.Tensor]:
    """Our state dict from a target's state dict (the inverse of `to_hf_state_dict`).

    Every tensor of theirs must find a place: a bias our model lacks must be zero, and a
    separate output matrix of a tied model must equal the embedding; else HFConversionError.
    """

    def take(hf_name: str) -> torch.Tensor:
        for n in (hf_name, *_ALIASES.get(hf_name, ())):
            if n in hf_state:
                used.add(n)
                return hf_state[n]
        raise HFConversionError(f"{hf_name} is missing from the Hugging Face weights")

    used: set[str] = set()
    ours: dict[str, torch.Tensor] = {}
    for name in our_tensor_names(cfg):
        names, how = _parts(cfg, target, name)
        if how == "cat":
            ours[name] = torch.cat([take(n) for n in names])
        elif how == "neox_qkv":
            ours[name] = _neox_qkv(take(names[0]), cfg, to_hf=False)
        else:
            ours[name] = take(names[0])
    for n in sorted(set(hf_state) - used):
        t = hf_state[n]
        if n.endswith(".bias") and not t.any():
            continue  # a bias the target always has, zero: exactly our model without it
        if (
            cfg.tie_embeddings
            and n in ("lm_head.weight", "embed_out.weight")
            and torch.equal(t, ours["wte.weight"])
        ):
            continue
        raise HFConversionError(
            f"{n} has no place in our model for this config (a non-zero bias our "
            f"model lacks, an untied output matrix, or another architecture)"
        )
    return ours
