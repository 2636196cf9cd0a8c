"""SmolLM3ForCausalLM: Llama's layers (sequential block, RMSNorm, SwiGLU, grouped-query
attention, RoPE on the whole head) with two per-layer settings Llama lacks: NoPE layers
(`no_rope_layers`, one flag per layer, 1 = RoPE; SmolLM3 itself drops RoPE in every 4th) and
sliding-window layers (`use_sliding_window`, `sliding_window`, `layer_types`), each window W
seeing the query and the W - 1 tokens before it, as ours (`kv > q - W`). So it holds our
`nope_every` / `nope_layers` and `sliding_window` with `sliding_window_pattern` /
`layer_types` (any mix, Cohere 2's NoPE global layers too) when every RoPE layer rotates the
whole head at one theta; transformers' DynamicCache keeps W - 1 keys of a sliding layer.

`choose_target` picks it only for a model whose layers differ (NoPE layers among RoPE ones,
or sliding windows): a uniform model stays what it was (Llama, or RopeLM for NoPE everywhere,
as every config in configs/); `--target smollm3` takes any model it holds.
Weights: exactly Llama's names and layouts (`llama.llama_tensor_map`).
"""

from __future__ import annotations

from typing import Any

from pretrain.config import ModelConfig
from pretrain.hf.targets import llama
from pretrain.hf.targets.base import (
    hf_rope_parameters,
    hf_windows,
    position_limits,
    windows_from_hf,
)
from pretrain.model.position import layer_positions


class SmolLM3(llama.Llama):
    """Llama's layers, names and weights; the per-layer positions are its own."""

    name = "smollm3"
    class_name = "SmolLM3ForCausalLM"

    def auto(self, cfg: ModelConfig) -> bool:
        positions = layer_positions(cfg)
        return len({p.rope for p in positions}) > 1 or any(p.window for p in positions)

    def unsupported(self, cfg: ModelConfig) -> list[str]:
        cls = self.class_name
        problems = self.layer_problems(cfg)
        if cfg.rope_dims not in (0, cfg.head_dim):
            problems.append(
                f"{cls} applies RoPE to the whole head of its RoPE layers; partial RoPE "
                f"(rotary_dims {cfg.rope_dims} of head_dim {cfg.head_dim}) is not representable"
            )
        return problems + position_limits(cfg, cls, nope_layers=True, sliding=True)

    def hf_config(self, cfg: ModelConfig, common: dict[str, Any]) -> Any:
        from transformers import SmolLM3Config

        positions = layer_positions(cfg)
        return SmolLM3Config(
            **common,
            **self.layer_config(cfg),
            # its default (128004) is an embedding row: none here, as Llama's
            pad_token_id=None,
            attention_bias=cfg.attn_bias,
            mlp_bias=cfg.mlp_bias,
            rope_parameters=hf_rope_parameters(cfg),
            no_rope_layers=[int(p.rope) for p in positions],
            no_rope_layer_interval=cfg.nope_every or 4,  # read only when no_rope_layers is None
            **hf_windows(cfg),
        )

    def model_config(self, hf_cfg: Any) -> ModelConfig:
        n = hf_cfg.num_hidden_layers
        head_dim = self.head_dim(hf_cfg)
        fields = self.layer_fields(hf_cfg)
        flags = list(hf_cfg.no_rope_layers)[:n]
        nope = [i for i, rope in enumerate(flags) if not rope]
        return ModelConfig(
            **fields,
            rotary_dims=0 if len(nope) == n else head_dim,
            nope_layers=nope if 0 < len(nope) < n else None,
            **windows_from_hf(hf_cfg),
        )
