"""Qwen2ForCausalLM: Llama's layers with biases on q, k and v (always) and none on the output
projection or the MLP, and sliding-window layers by layer_types.

Import: our attention biases are all-or-none (model.attn_bias), so a Qwen2 folder imports
with attn_bias on and an output-projection bias of zeros, which is exact. Export (only with
`--target qwen2`, never chosen by `auto`: Llama holds the same models more simply): a model
without attention biases, its q, k and v biases written as zeros.
"""

from __future__ import annotations

from typing import Any

from pretrain.config import ModelConfig
from pretrain.hf.targets import llama
from pretrain.hf.targets.base import TensorMap, hf_windows, position_limits, windows_from_hf


class Qwen2(llama.Llama):
    name = "qwen2"
    class_name = "Qwen2ForCausalLM"

    def auto(self, cfg: ModelConfig) -> bool:
        return False

    def unsupported(self, cfg: ModelConfig) -> list[str]:
        cls = self.class_name
        problems = self.layer_problems(cfg)
        if cfg.attn_bias:
            problems.append(
                f"{cls} has no output-projection bias (model.attn_bias: true biases it too)"
            )
        if cfg.mlp_bias:
            problems.append(f"{cls}'s MLP has no biases (model.mlp_bias: true)")
        return problems + self.rotary_problems(cfg) + position_limits(cfg, cls, sliding=True)

    def hf_config(self, cfg: ModelConfig, common: dict[str, Any]) -> Any:
        from transformers import Qwen2Config

        return Qwen2Config(
            **common,
            **self.layer_config(cfg),
            rope_parameters=llama.rope_parameters(cfg),
            max_window_layers=0,  # layer_types decides (hf_windows)
            **hf_windows(cfg),
        )

    def model_config(self, hf_cfg: Any) -> ModelConfig:
        fields = {**self.layer_fields(hf_cfg), **llama.rotary_fields(hf_cfg), "attn_bias": True}
        return ModelConfig(**fields, **windows_from_hf(hf_cfg))

    def absent(self, cfg: ModelConfig) -> set[str]:
        return {f"model.layers.{i}.self_attn.o_proj.bias" for i in range(cfg.n_layers)}

    def zero_filled(self, cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
        q, kv = cfg.n_heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
        return {
            f"model.layers.{i}.self_attn.{x}_proj.bias": (size,)
            for i in range(cfg.n_layers)
            for x, size in (("q", q), ("k", kv), ("v", kv))
        }

    def tensor_map(self, cfg: ModelConfig, name: str) -> TensorMap:
        return llama.llama_tensor_map(cfg, name, order=llama.rotary_order(cfg))
