"""LlamaForCausalLM: sequential block, RMSNorm, SwiGLU, RoPE on the whole head, grouped-query
attention; no QK-Norm, no learned positions, no dropout but the attention's.

Weights: our attention's fused projection [q heads | k heads | v heads] is split into q_proj,
k_proj and v_proj; our SwiGLU w_in [gate; up] into gate_proj and up_proj; every other tensor
is copied under Llama's name (the tables below). Biases are written where our model has them
(attention_bias, mlp_bias).
"""

from __future__ import annotations

from typing import Any

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
)

# Our module names inside a block -> Llama's, where the tensor is only renamed.
LAYER_NAMES = {
    "norm1": "input_layernorm",
    "norm2": "post_attention_layernorm",
    "attn.proj": "self_attn.o_proj",
    "mlp.w_out": "mlp.down_proj",
}
# Our modules outside the blocks -> Llama's.
TOP_NAMES = {
    "wte": "model.embed_tokens",
    "norm_f": "model.norm",
    "lm_head": "lm_head",
}


def llama_tensor_map(
    cfg: ModelConfig,
    name: str,
    layer_names: dict[str, str] = LAYER_NAMES,
    top_names: dict[str, str] = TOP_NAMES,
) -> TensorMap:
    """Where our tensor `name` goes in a Llama-named state dict. Classes that name their
    weights as Llama does and add some (RopeLM: QK-Norm, learned positions) pass wider tables."""
    i, module, leaf = block_name(name)
    if i is None:
        return TensorMap((f"{top_names[module]}.{leaf}",))
    p = f"model.layers.{i}"
    if module == "attn.qkv":
        q, kv = cfg.n_heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
        return TensorMap(tuple(f"{p}.self_attn.{x}_proj.{leaf}" for x in "qkv"), (q, kv, kv))
    if module == "mlp.w_in":
        if cfg.mlp == "swiglu":
            return TensorMap(
                (f"{p}.mlp.gate_proj.{leaf}", f"{p}.mlp.up_proj.{leaf}"), (cfg.d_ff, cfg.d_ff)
            )
        return TensorMap((f"{p}.mlp.up_proj.{leaf}",))  # a GeLU MLP (RopeLM): one input matrix
    return TensorMap((f"{p}.{layer_names[module]}.{leaf}",))


class Llama(Target):
    name = "llama"
    class_name = "LlamaForCausalLM"

    def unsupported(self, cfg: ModelConfig) -> list[str]:
        cls = self.class_name
        problems = self.layer_problems(cfg)
        if cfg.rope_dims != cfg.head_dim:
            problems.append(
                f"{cls} applies RoPE to the whole head; partial RoPE or NoPE "
                f"(rotary_dims {cfg.rope_dims} of head_dim {cfg.head_dim}) is not representable"
            )
        return problems + position_limits(cfg, cls)

    def layer_problems(self, cfg: ModelConfig) -> list[str]:
        """What Llama's layers (and SmolLM3's, the same layers) cannot hold, positions aside."""
        cls = self.class_name
        problems = native_limits(cfg, cls)
        if cfg.block != "sequential":
            problems.append(f"{cls} has no parallel block (model.block: {cfg.block})")
        if cfg.norm != "rmsnorm":
            problems.append(f"{cls} has RMSNorm only (model.norm: {cfg.norm})")
        if cfg.mlp != "swiglu":
            problems.append(f"{cls} has SwiGLU only (model.mlp: {cfg.mlp})")
        if cfg.dropout:
            problems.append(
                f"{cls} has attention dropout only (model.dropout: {cfg.dropout} "
                f"also drops embeddings and residual branches)"
            )
        return problems

    def hf_config(self, cfg: ModelConfig, common: dict[str, Any]) -> Any:
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

    def model_config(self, hf_cfg: Any) -> ModelConfig:
        return ModelConfig(**self.layer_fields(hf_cfg), rotary_dims=self.head_dim(hf_cfg))

    @staticmethod
    def head_dim(hf_cfg: Any) -> int:
        head_dim = hf_cfg.hidden_size // hf_cfg.num_attention_heads
        if getattr(hf_cfg, "head_dim", None) not in (None, head_dim):
            raise HFConversionError(
                f"head_dim {hf_cfg.head_dim} != hidden_size / heads ({head_dim}); "
                f"our model has no separate head_dim"
            )
        return head_dim

    @staticmethod
    def layer_fields(hf_cfg: Any) -> dict[str, Any]:
        """Our model fields of Llama's layers (SmolLM3's too), positions aside but theta."""
        theta, scaling = rope_from_hf(hf_cfg)
        if hf_cfg.hidden_act != "silu":
            raise HFConversionError(
                f"hidden_act {hf_cfg.hidden_act!r}: only silu (SwiGLU) converts exactly"
            )
        return dict(
            **common_model_fields(hf_cfg, theta, scaling),
            n_kv_heads=hf_cfg.num_key_value_heads,
            block="sequential",
            norm="rmsnorm",
            norm_eps=hf_cfg.rms_norm_eps,
            mlp="swiglu",
            mlp_bias=bool(hf_cfg.mlp_bias),
            attn_bias=bool(hf_cfg.attention_bias),
            dropout=float(hf_cfg.attention_dropout),
        )

    def tensor_map(self, cfg: ModelConfig, name: str) -> TensorMap:
        return llama_tensor_map(cfg, name)


__all__ = ["LAYER_NAMES", "TOP_NAMES", "Llama", "llama_tensor_map"]
