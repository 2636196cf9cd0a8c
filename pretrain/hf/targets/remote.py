"""RopeLMForCausalLM: our own model's code, shipped in the export folder (pretrain/hf/remote_code/,
loaded with trust_remote_code=True). It holds everything `ModelConfig` can express, so it is
the target when no native class holds a model exactly.

Weights: Llama's names (`llama.llama_tensor_map`), plus the tensors Llama has no place for:
learned positions (model.embed_positions), QK-Norm (self_attn.q_norm / k_norm), and a GeLU
MLP's single input matrix (mlp.up_proj). Positions by layer (NoPE layers, spectrum, sliding
windows, global theta, ALiBi, a pair selection) are RopeLMConfig fields of the same meaning
as ours.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pretrain.config import ModelConfig, RopeScalingConfig, from_dict, to_dict
from pretrain.hf.targets import llama
from pretrain.hf.targets.base import LAYER_TYPES, Target, TensorMap, common_model_fields

REMOTE_CODE_DIR = Path(__file__).parents[1] / "remote_code"
REMOTE_FILES = ("configuration_rope_lm.py", "modeling_rope_lm.py")
AUTO_MAP = {
    "AutoConfig": "configuration_rope_lm.RopeLMConfig",
    "AutoModel": "modeling_rope_lm.RopeLMModel",
    "AutoModelForCausalLM": "modeling_rope_lm.RopeLMForCausalLM",
}
LAYER_NAMES = {
    **llama.LAYER_NAMES,
    "attn.q_norm": "self_attn.q_norm",
    "attn.k_norm": "self_attn.k_norm",
}
TOP_NAMES = {**llama.TOP_NAMES, "wpe": "model.embed_positions"}


class RopeLM(Target):
    name = "rope_lm"
    # The class auto_map has transformers instantiate (config.json's architectures name it too).
    class_name = AUTO_MAP["AutoModelForCausalLM"].rsplit(".", 1)[1]
    native = False
    remote_files = REMOTE_FILES
    auto_map = AUTO_MAP

    def unsupported(self, cfg: ModelConfig) -> list[str]:
        return []

    def hf_config(self, cfg: ModelConfig, common: dict[str, Any]) -> Any:
        from pretrain.hf.remote_code.configuration_rope_lm import RopeLMConfig

        return RopeLMConfig(
            **common,
            num_key_value_heads=cfg.kv_heads,
            head_dim=cfg.head_dim,
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
            # positions by layer, as pretrain/model/position.py reads them from our config
            rope_spectrum=cfg.rope_spectrum,
            nope_layers=sorted(cfg.nope_layer_set) if cfg.rope_dims else None,
            rope_pairs=cfg.rope_pairs.selected if cfg.rope_pairs is not None else None,
            sliding_window=cfg.sliding_window,
            layer_types=[LAYER_TYPES[t] for t in cfg.attention_types]
            if cfg.sliding_window is not None
            else None,
            global_rope_theta=cfg.global_rope_theta,
            alibi=cfg.alibi,
        )

    def model_config(self, hf_cfg: Any) -> ModelConfig:
        raw = getattr(hf_cfg, "rotary_scaling", None)
        scaling = from_dict(RopeScalingConfig, raw, "rotary_scaling") if raw else None
        types = list(getattr(hf_cfg, "layer_types", None) or ())
        window = getattr(hf_cfg, "sliding_window", None) if "sliding_attention" in types else None
        pairs = getattr(hf_cfg, "rope_pairs", None)
        return ModelConfig(
            **common_model_fields(hf_cfg, float(hf_cfg.rope_theta), scaling),
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
            # folders exported before per-layer positions have none of these fields
            rope_spectrum=getattr(hf_cfg, "rope_spectrum", "neox"),
            nope_layers=list(getattr(hf_cfg, "nope_layers", None) or ()) or None,
            rope_pairs=None if pairs is None else {"selected": pairs},
            sliding_window=window,
            layer_types=None if window is None else [t.split("_")[0] for t in types],
            global_rope_theta=getattr(hf_cfg, "global_rope_theta", None) if window else None,
            alibi=bool(getattr(hf_cfg, "alibi", False)),
        )

    def tensor_map(self, cfg: ModelConfig, name: str) -> TensorMap:
        return llama.llama_tensor_map(cfg, name, LAYER_NAMES, TOP_NAMES)

    def config_class(self) -> Any:
        # our own copy of the class: reading a folder runs none of the code inside it
        from pretrain.hf.remote_code.configuration_rope_lm import RopeLMConfig

        return RopeLMConfig

    def empty_model(self, config: Any) -> Any:
        from pretrain.hf.remote_code.modeling_rope_lm import RopeLMForCausalLM

        return RopeLMForCausalLM(config).float()
