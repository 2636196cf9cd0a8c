"""Qwen3ForCausalLM: Llama's layers with QK-Norm (an RMSNorm over each head's dims of q and
of k, weights shared by the heads, before RoPE) as ours (model.qk_norm with rmsnorm), biases
on q, k, v and o together or none (attention_bias), no MLP biases, a head_dim of its own,
and sliding-window layers by layer_types. So it holds our QK-Norm models: RoPE on the whole
head, or partial RoPE / p-RoPE / NoPE as the proportional rope_type (llama.py says how).

Weights: Llama's names and layouts plus self_attn.q_norm / k_norm (reordered with q and k
for partial RoPE: llama.rotary_order).
"""

from __future__ import annotations

from typing import Any

from pretrain.config import ModelConfig
from pretrain.hf.targets import llama
from pretrain.hf.targets.base import TensorMap, hf_windows, position_limits, windows_from_hf

LAYER_NAMES = {
    **llama.LAYER_NAMES,
    "attn.q_norm": "self_attn.q_norm",
    "attn.k_norm": "self_attn.k_norm",
}


class Qwen3(llama.Llama):
    name = "qwen3"
    class_name = "Qwen3ForCausalLM"

    def auto(self, cfg: ModelConfig) -> bool:
        return cfg.qk_norm

    def unsupported(self, cfg: ModelConfig) -> list[str]:
        cls = self.class_name
        problems = [p for p in self.layer_problems(cfg) if not p.startswith("QK-Norm")]
        if not cfg.qk_norm:
            problems.append(f"{cls} always normalises q and k per head (model.qk_norm: false)")
        if cfg.mlp_bias:
            problems.append(f"{cls}'s MLP has no biases (model.mlp_bias: true)")
        return problems + self.rotary_problems(cfg) + position_limits(cfg, cls, sliding=True)

    def hf_config(self, cfg: ModelConfig, common: dict[str, Any]) -> Any:
        from transformers import Qwen3Config

        return Qwen3Config(
            **common,
            **self.layer_config(cfg),
            attention_bias=cfg.attn_bias,
            rope_parameters=llama.rope_parameters(cfg),
            max_window_layers=0,  # layer_types decides (hf_windows)
            **hf_windows(cfg),
        )

    def model_config(self, hf_cfg: Any) -> ModelConfig:
        fields = {**self.layer_fields(hf_cfg), **llama.rotary_fields(hf_cfg)}
        return ModelConfig(**fields, qk_norm=True, **windows_from_hf(hf_cfg))

    def tensor_map(self, cfg: ModelConfig, name: str) -> TensorMap:
        return llama.llama_tensor_map(cfg, name, LAYER_NAMES, order=llama.rotary_order(cfg))
