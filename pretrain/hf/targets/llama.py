"""LlamaForCausalLM: sequential block, RMSNorm, SwiGLU, grouped-query attention; no QK-Norm,
no learned positions, no dropout but the attention's.

Positions: RoPE on the whole head at rope_theta; partial RoPE, p-RoPE and NoPE as
transformers' `proportional` rope_type (transformers >= 5.5, made for Gemma 4's p-RoPE),
which rotates the whole head with the highest int(partial_rotary_factor x head_dim / 2)
frequencies of base^(-2j/head_dim) and frequency 0 (no rotation) for the other pairs. That is
our p-RoPE at base = rope_theta, and our NeoX-rescaled partial RoPE (theta^(-2j/r) over r
rotary dims) at base = theta^(head_dim/r), exactly in the arithmetic. Llama pairs dim j with
dim j + head_dim/2 where we pair j with j + r/2 over the first r dims, so the rows of q and k
(and QK-Norm's weights, in the classes that have it) are permuted per head on export and back
on import (`rotary_order`): a permutation of q and k alike leaves every q.k unchanged.

Weights: our attention's fused projection [q heads | k heads | v heads] is split into q_proj,
k_proj and v_proj; our SwiGLU w_in [gate; up] into gate_proj and up_proj; every other tensor
is copied under Llama's name (the tables below). Biases are written where our model has them
(attention_bias, mlp_bias).
"""

from __future__ import annotations

import math
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
from pretrain.model.position import layer_positions

# Our module names inside a block -> Llama's, where the tensor is only renamed.
LAYER_NAMES = {
    "norm1": "input_layernorm",
    "norm2": "post_attention_layernorm",
    "attn.proj": "self_attn.o_proj",
    "mlp.w_out": "mlp.down_proj",
}
# transformers computes the proportional RoPE's base^(2j/head_dim) in fp32.
FP32_MAX = float(torch.finfo(torch.float32).max)
# Our modules outside the blocks -> Llama's.
TOP_NAMES = {
    "wte": "model.embed_tokens",
    "norm_f": "model.norm",
    "lm_head": "lm_head",
}


def rotary_order(cfg: ModelConfig) -> list[int] | None:
    """Our head dims in the order a rotate-half class over the whole head sees them with the
    `proportional` rope_type: Llama's pair (j, j + head_dim/2) is our rotary pair (j, j + r/2)
    for j < r/2 and two of our unrotated dims (frequency 0) after. None when no reordering is
    needed (RoPE on the whole head, or on none of it)."""
    r, d = cfg.rope_dims, cfg.head_dim
    if r in (0, d):
        return None
    rest = (d - r) // 2
    first = [*range(r // 2), *range(r, r + rest)]
    second = [*range(r // 2, r), *range(r + rest, d)]
    return first + second


def _permute_heads(t: torch.Tensor, cfg: ModelConfig, order: list[int], inverse: bool):
    """Each head's rows of a q, k projection or bias (or a per-head norm weight) reordered."""
    index = torch.tensor(order)
    if inverse:
        index = torch.argsort(index)
    d = cfg.head_dim
    if t.shape[0] == d:  # a norm's weight over one head
        return t[index]
    return t.reshape(-1, d, *t.shape[1:])[:, index].reshape(t.shape)


def _permute_qkv(t: torch.Tensor, cfg: ModelConfig, order: list[int], inverse: bool):
    q, kv = cfg.n_heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
    tq, tk, tv = t.split((q, kv, kv))
    return torch.cat(
        [_permute_heads(tq, cfg, order, inverse), _permute_heads(tk, cfg, order, inverse), tv]
    )


def llama_tensor_map(
    cfg: ModelConfig,
    name: str,
    layer_names: dict[str, str] = LAYER_NAMES,
    top_names: dict[str, str] = TOP_NAMES,
    order: list[int] | None = None,
) -> TensorMap:
    """Where our tensor `name` goes in a Llama-named state dict. Classes that name their
    weights as Llama does and add some (RopeLM: QK-Norm, learned positions) pass wider tables;
    `order` (rotary_order) reorders q's and k's head dims, QK-Norm's weights too."""
    i, module, leaf = block_name(name)
    if i is None:
        return TensorMap((f"{top_names[module]}.{leaf}",))
    p = f"model.layers.{i}"
    if module == "attn.qkv":
        q, kv = cfg.n_heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
        names = tuple(f"{p}.self_attn.{x}_proj.{leaf}" for x in "qkv")
        if order is None:
            return TensorMap(names, (q, kv, kv))
        return TensorMap(
            names,
            (q, kv, kv),
            partial(_permute_qkv, cfg=cfg, order=order, inverse=False),
            partial(_permute_qkv, cfg=cfg, order=order, inverse=True),
        )
    if module in ("attn.q_norm", "attn.k_norm") and order is not None:
        return TensorMap(
            (f"{p}.{layer_names[module]}.{leaf}",),
            to_hf=partial(_permute_heads, cfg=cfg, order=order, inverse=False),
            from_hf=partial(_permute_heads, cfg=cfg, order=order, inverse=True),
        )
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
        problems = self.layer_problems(cfg) + self.rotary_problems(cfg)
        return problems + position_limits(cfg, cls)

    def rotary_problems(self, cfg: ModelConfig) -> list[str]:
        """Partial RoPE, p-RoPE and NoPE go as the proportional rope_type, which scales no
        other way than dividing every frequency (not one of ours on a partial RoPE), and
        computes base^(2j/head_dim) in fp32: NeoX's spectrum over few rotary dims needs a base
        (theta^(head_dim/r)) past fp32's range (1e4^(64/6) for 10% of 64 dims)."""
        s, r, d = cfg.rope_scaling, cfg.rope_dims, cfg.head_dim
        if r in (0, d):
            return []
        what = f"partial RoPE (rotary_dims {r} of head_dim {d}) as transformers' proportional RoPE"
        if s is not None and s.factor != 1.0:
            return [f"{self.class_name} holds {what}, which has no {s.type} scaling"]
        base = rope_parameters(cfg)["rope_theta"]
        if base >= FP32_MAX:
            return [
                f"{self.class_name} holds {what} at base theta^(head_dim/r) = {base:.3g}, past "
                f"fp32's range, where transformers computes it (model.rope_theta "
                f"{cfg.rope_theta:g}, {r} of {d} dims; p-RoPE, model.rope_spectrum: p_rope, "
                f"needs no such base)"
            ]
        return []

    def bias_and_window_problems(self, cfg: ModelConfig) -> list[str]:
        """What a class without biases and with one window for every layer (Mistral, Phi3)
        cannot hold."""
        cls = self.class_name
        problems = [
            f"{cls} has no biases (model.{field}: true)"
            for field in ("attn_bias", "mlp_bias")
            if getattr(cfg, field)
        ]
        if len({p.window for p in layer_positions(cfg)}) > 1:
            problems.append(
                f"{cls} windows every layer alike; full-attention layers among sliding ones "
                f"(model.sliding_window_pattern / layer_types) are not representable"
            )
        return problems

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
            **self.layer_config(cfg),
            attention_bias=cfg.attn_bias,
            mlp_bias=cfg.mlp_bias,
            rope_parameters=rope_parameters(cfg),
        )

    @staticmethod
    def layer_config(cfg: ModelConfig) -> dict[str, Any]:
        """The config fields of Llama's layers that its kin spell the same way (layer_fields'
        inverse, biases and positions aside)."""
        return dict(
            num_key_value_heads=cfg.kv_heads,
            # Every Llama-kin attention reads head_dim before hidden / heads (Qwen3's shape).
            head_dim=cfg.head_dim,
            hidden_act="silu",
            rms_norm_eps=cfg.norm_eps,
            attention_dropout=cfg.dropout,
        )

    def model_config(self, hf_cfg: Any) -> ModelConfig:
        return ModelConfig(**{**self.layer_fields(hf_cfg), **rotary_fields(hf_cfg)})

    @staticmethod
    def head_dim(hf_cfg: Any) -> int:
        """The class's own rule (transformers' attention: head_dim, else hidden / heads)."""
        return getattr(hf_cfg, "head_dim", None) or hf_cfg.hidden_size // hf_cfg.num_attention_heads

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
            # Classes without the field have no MLP (or attention) biases.
            mlp_bias=bool(getattr(hf_cfg, "mlp_bias", False)),
            attn_bias=bool(getattr(hf_cfg, "attention_bias", False)),
            dropout=float(hf_cfg.attention_dropout),
        )

    def tensor_map(self, cfg: ModelConfig, name: str) -> TensorMap:
        return llama_tensor_map(cfg, name, order=rotary_order(cfg))


def rope_parameters(cfg: ModelConfig) -> dict[str, Any]:
    """rope_parameters of a class that rotates the whole head (Llama and its kin): our RoPE
    and its scaling; partial RoPE, p-RoPE and NoPE as the proportional rope_type."""
    r, d = cfg.rope_dims, cfg.head_dim
    if r == d:
        return hf_rope_parameters(cfg)
    # The base whose highest r/2 frequencies of base^(-2j/d) are ours.
    if cfg.rope_spectrum == "p_rope" or r == 0:
        base = float(cfg.rope_theta)
    else:  # capped below float64's overflow; past fp32's range anyway (rotary_problems)
        base = math.exp(min(math.log(cfg.rope_theta) * d / r, 709.0))
    return {
        "rope_type": "proportional",
        "rope_theta": float(base),
        "partial_rotary_factor": rotary_factor(r, d) if r else 0.0,
    }


def rotary_fields(hf_cfg: Any) -> dict[str, Any]:
    """Our rotary dims, spectrum and theta of a class that rotates the whole head: the
    proportional rope_type is p-RoPE over its highest frequencies (rope_from_hf: the others)."""
    head_dim = Llama.head_dim(hf_cfg)
    rope = dict(getattr(hf_cfg, "rope_parameters", None) or {})
    if rope.get("rope_type") != "proportional":
        return {"rotary_dims": head_dim}
    if float(rope.get("factor", 1.0)) != 1.0:
        raise HFConversionError(
            f"rope_type 'proportional' with factor {rope['factor']}: a scaled p-RoPE is not "
            f"representable (model.rope_scaling of a p_rope spectrum)"
        )
    pairs = int(float(rope.get("partial_rotary_factor", 1.0)) * head_dim // 2)
    return {
        "rotary_dims": 2 * pairs,
        "rope_spectrum": "p_rope" if 0 < 2 * pairs < head_dim else "neox",
        "rope_theta": float(rope.get("rope_theta", 10000.0)),
        "rope_scaling": None,
    }
