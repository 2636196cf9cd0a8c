"""Phi3ForCausalLM: Llama's layers without biases, with fused projections (qkv_proj: [q heads |
k heads | v heads], gate_up_proj: [gate; up], our own layouts) and RoPE on the first
int(head_dim x partial_rotary_factor) dims of each head with NeoX's spectrum over them
(theta^(-2j/r)), rotate-half within them, as ours (`q_rot, q_pass = q[..., :rotary_dim],
q[..., rotary_dim:]` in transformers' modeling_phi3.py). So it holds our partial-RoPE models
without biases at any fraction, with no reordering and no fp32 limit on the spectrum (the
proportional rope_type of llama.py needs theta^(head_dim/r)); one sliding window for every
layer, or none. Chosen by `auto` for partial RoPE with NeoX's spectrum.
"""

from __future__ import annotations

from typing import Any

from pretrain.config import ModelConfig
from pretrain.hf.targets import llama
from pretrain.hf.targets.base import (
    HFConversionError,
    TensorMap,
    block_name,
    position_limits,
    rotary_factor,
)

# Our module names inside a block -> Phi3's (the fused projections keep our layout).
LAYER_NAMES = {
    **llama.LAYER_NAMES,
    "attn.qkv": "self_attn.qkv_proj",
    "mlp.w_in": "mlp.gate_up_proj",
}


class Phi3(llama.Llama):
    name = "phi3"
    class_name = "Phi3ForCausalLM"

    def auto(self, cfg: ModelConfig) -> bool:
        return 0 < cfg.rope_dims < cfg.head_dim and cfg.rope_spectrum == "neox"

    def unsupported(self, cfg: ModelConfig) -> list[str]:
        cls = self.class_name
        problems = self.layer_problems(cfg) + self.bias_and_window_problems(cfg)
        if cfg.rope_dims == 0 or cfg.rope_spectrum != "neox":
            problems.append(
                f"{cls} rotates with NeoX's spectrum over its rotary dims (model.rope_spectrum:"
                f" {cfg.rope_spectrum}, rotary_dims {cfg.rope_dims})"
            )
        if cfg.rope_scaling is not None and cfg.rope_scaling.factor != 1.0:
            problems.append(
                f"{cls} scales RoPE by longrope only (model.rope_scaling: {cfg.rope_scaling.type})"
            )
        return problems + position_limits(cfg, cls, sliding=True)

    def hf_config(self, cfg: ModelConfig, common: dict[str, Any]) -> Any:
        from transformers import Phi3Config

        return Phi3Config(
            **common,
            **self.layer_config(cfg),
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            original_max_position_embeddings=cfg.max_seq_len,
            rope_parameters={
                "rope_type": "default",
                "rope_theta": float(cfg.rope_theta),
                "partial_rotary_factor": rotary_factor(cfg.rope_dims, cfg.head_dim),
            },
            sliding_window=cfg.sliding_window,
            pad_token_id=None,  # its default (32000) is an embedding row: none here
        )

    def model_config(self, hf_cfg: Any) -> ModelConfig:
        rope = dict(getattr(hf_cfg, "rope_parameters", None) or {})
        if rope.get("rope_type", "default") != "default":
            raise HFConversionError(
                f"rope_type {rope['rope_type']!r} (Phi-3's longrope scaling) is not supported; "
                f"a Phi3 folder with the default rope_type converts exactly"
            )
        head_dim = self.head_dim(hf_cfg)
        fields = {**self.layer_fields(hf_cfg), "mlp_bias": False, "attn_bias": False}
        return ModelConfig(
            **fields,
            rotary_dims=int(head_dim * float(rope.get("partial_rotary_factor", 1.0))),
            sliding_window=hf_cfg.sliding_window,
        )

    def tensor_map(self, cfg: ModelConfig, name: str) -> TensorMap:
        i, module, leaf = block_name(name)
        if i is None or module not in ("attn.qkv", "mlp.w_in"):
            return llama.llama_tensor_map(cfg, name)
        return TensorMap((f"model.layers.{i}.{LAYER_NAMES[module]}.{leaf}",))
