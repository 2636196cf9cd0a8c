"""MistralForCausalLM: Llama's layers without biases, a head_dim of its own, and one sliding
window for every layer (or none). So it holds our models whose every layer has the same
window (model.sliding_window without a pattern or layer_types), or none: chosen by `auto` for
the windowed ones, the class vLLM and llama.cpp know best for them. RoPE on the whole head, or
partial RoPE / p-RoPE / NoPE as the proportional rope_type (llama.py says how).
"""

from __future__ import annotations

from typing import Any

from pretrain.config import ModelConfig
from pretrain.hf.targets import llama
from pretrain.hf.targets.base import position_limits
from pretrain.model.position import layer_positions


class Mistral(llama.Llama):
    name = "mistral"
    class_name = "MistralForCausalLM"

    def auto(self, cfg: ModelConfig) -> bool:
        return any(p.window is not None for p in layer_positions(cfg))

    def unsupported(self, cfg: ModelConfig) -> list[str]:
        cls = self.class_name
        problems = self.layer_problems(cfg) + self.bias_and_window_problems(cfg)
        return problems + self.rotary_problems(cfg) + position_limits(cfg, cls, sliding=True)

    def hf_config(self, cfg: ModelConfig, common: dict[str, Any]) -> Any:
        from transformers import MistralConfig

        return MistralConfig(
            **common,
            **self.layer_config(cfg),
            rope_parameters=llama.rope_parameters(cfg),
            sliding_window=cfg.sliding_window,  # its default is 4096: none must be said
        )

    def model_config(self, hf_cfg: Any) -> ModelConfig:
        fields = {**self.layer_fields(hf_cfg), **llama.rotary_fields(hf_cfg)}
        return ModelConfig(**fields, sliding_window=hf_cfg.sliding_window)
