"""GPTNeoXForCausalLM (Pythia): LayerNorm, GeLU MLP, multi-head attention, RoPE on >= 2 dims of
each head (partial RoPE is its `partial_rotary_factor`), parallel or sequential block, every
bias; no QK-Norm, no learned positions, no NoPE layers, windows or ALiBi. p-RoPE (the highest
frequencies of full RoPE on r dims) is NeoX's partial RoPE at theta^(r/head_dim): exported so.

Weights: GPT-NeoX fuses q, k and v per head ([q_h, k_h, v_h] for each head h) where ours is
[q heads | k heads | v heads]: `neox_qkv` reorders (weight and bias). Every other tensor is
copied under GPT-NeoX's name (the tables below). GPT-NeoX has every bias: the ones our model
lacks are written as zeros, which is exact, and read back only if they are zero.
"""

from __future__ import annotations

import logging
from functools import partial
from typing import Any

import torch

from pretrain.config import ModelConfig
from pretrain.hf.targets.base import (
    HFConversionError,
    Target,
    TensorMap,
    block_name,
    common_model_fields,
    hf_rope_parameters,
    native_limits,
    position_limits,
    rope_from_hf,
    rotary_factor,
)

log = logging.getLogger(__name__)

# Our module names inside a block -> GPT-NeoX's.
LAYER_NAMES = {
    "norm1": "input_layernorm",
    "norm2": "post_attention_layernorm",
    "attn.qkv": "attention.query_key_value",
    "attn.proj": "attention.dense",
    "mlp.w_in": "mlp.dense_h_to_4h",
    "mlp.w_out": "mlp.dense_4h_to_h",
}
# Our modules outside the blocks -> GPT-NeoX's. The output matrix is `embed_out` in saved
# checkpoints (the hub's Pythia folders; transformers 4 and 5 both load it) but `lm_head`
# inside transformers 5's module tree.
TOP_NAMES = {
    "wte": "gpt_neox.embed_in",
    "norm_f": "gpt_neox.final_layer_norm",
    "lm_head": "embed_out",
}


def neox_qkv(t: torch.Tensor, cfg: ModelConfig, to_hf: bool) -> torch.Tensor:
    """[q heads | k heads | v heads] <-> per head [q_h, k_h, v_h] (weight or bias)."""
    H, D = cfg.n_heads, cfg.head_dim
    rest = t.shape[1:]
    if to_hf:
        return t.reshape(3, H, D, *rest).transpose(0, 1).reshape(3 * H * D, *rest)
    return t.reshape(H, 3, D, *rest).transpose(0, 1).reshape(3 * H * D, *rest)


class GPTNeoX(Target):
    name = "gpt_neox"
    class_name = "GPTNeoXForCausalLM"
    aliases = {"embed_out.weight": ("lm_head.weight",)}

    def unsupported(self, cfg: ModelConfig) -> list[str]:
        cls = self.class_name
        problems = native_limits(cfg, cls)
        if cfg.norm != "layernorm":
            problems.append(f"{cls} has LayerNorm only (model.norm: {cfg.norm})")
        if cfg.mlp != "gelu":
            problems.append(f"{cls} has a GeLU MLP only (model.mlp: {cfg.mlp})")
        if cfg.kv_heads != cfg.n_heads:
            problems.append(
                f"{cls} has no grouped-query attention (model.n_kv_heads: {cfg.n_kv_heads})"
            )
        if cfg.head_dim_decoupled:
            problems.append(
                f"{cls}'s heads are hidden_size / heads wide (model.head_dim: {cfg.head_dim} "
                f"x {cfg.n_heads} heads != d_model {cfg.d_model})"
            )
        if cfg.rope_dims == 0:
            problems.append(
                f"{cls} always rotates some dims; NoPE (rotary_dims 0) is not representable"
            )
        # p-RoPE is NeoX's spectrum at another theta (base.neox_theta): it holds it exactly
        problems += position_limits(cfg, cls)
        return problems

    def hf_config(self, cfg: ModelConfig, common: dict[str, Any]) -> Any:
        from transformers import GPTNeoXConfig

        factor = rotary_factor(cfg.rope_dims, cfg.head_dim)
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

    def model_config(self, hf_cfg: Any) -> ModelConfig:
        theta, scaling = rope_from_hf(hf_cfg)
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
        factor = (getattr(hf_cfg, "rope_parameters", None) or {}).get("partial_rotary_factor", 1.0)
        head_dim = hf_cfg.hidden_size // hf_cfg.num_attention_heads  # its attention's rule
        return ModelConfig(
            **{**common_model_fields(hf_cfg, theta, scaling), "head_dim": None},
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

    def tensor_map(self, cfg: ModelConfig, name: str) -> TensorMap:
        i, module, leaf = block_name(name)
        if i is None:
            return TensorMap((f"{TOP_NAMES[module]}.{leaf}",))
        hf_name = f"gpt_neox.layers.{i}.{LAYER_NAMES[module]}.{leaf}"
        if module == "attn.qkv":
            return TensorMap(
                (hf_name,),
                to_hf=partial(neox_qkv, cfg=cfg, to_hf=True),
                from_hf=partial(neox_qkv, cfg=cfg, to_hf=False),
            )
        return TensorMap((hf_name,))

    def zero_filled(self, cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
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
