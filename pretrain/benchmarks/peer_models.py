"""Our model and its peers (transformers' Llama, litgpt's GPT) at one config with one set of
weights, each behind the same `loss(x, y)` call: what `tools/benchmark.py peers` times.

Every peer gets our weights (transformers through pretrain/hf's exporter, litgpt by the name
map below), and computes its loss the way its own training code does: transformers through
`labels` (its ForCausalLMLoss; `shift_labels` hands it our already-shifted targets), litgpt
with `litgpt.utils.chunked_cross_entropy` on the logits (as litgpt's pretrain script).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
from torch import nn

from pretrain.config import ModelConfig
from pretrain.model.transformer import Transformer

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclasses.dataclass
class Contestant:
    """One model in the race: its name, its module (whose parameters the optimizer steps)
    and its loss on a batch."""

    name: str
    module: nn.Module
    loss: LossFn


def llama_config(
    d_model: int, layers: int, heads: int, kv_heads: int, d_ff: int, vocab: int, seq_len: int
) -> ModelConfig:
    """A Llama-shaped model (sequential block, RMSNorm, SwiGLU, no biases, untied, full RoPE)
    that transformers' LlamaForCausalLM and litgpt's GPT both hold exactly."""
    return ModelConfig(
        vocab_size=vocab,
        pad_vocab_to_multiple=1,
        n_layers=layers,
        d_model=d_model,
        n_heads=heads,
        n_kv_heads=kv_heads,
        d_ff=d_ff,
        max_seq_len=seq_len,
        block="sequential",
        norm="rmsnorm",
        mlp="swiglu",
        mlp_bias=False,
        attn_bias=False,
        rope_fraction=1.0,
        tie_embeddings=False,
        dropout=0.0,
    )


def ours(name: str, model: nn.Module) -> Contestant:
    return Contestant(name, model, lambda x, y: model(x, targets=y).loss)


def variant(base: nn.Module, **changes) -> nn.Module:
    """Our model with other RoPE/QK-Norm settings and the base's weights (copied: each
    variant has its own optimizer state and steps). QK-Norm's new weights start at one."""

    cfg = dataclasses.replace(base.cfg, **changes)
    model = Transformer(cfg)
    missing, unexpected = model.load_state_dict(base.state_dict(), strict=False)
    if unexpected or any("_norm" not in k for k in missing):
        raise RuntimeError(f"variant weights unmatched: {missing} {unexpected}")
    return model.train()


def transformers_llama(model: nn.Module) -> Contestant:
    from pretrain.hf import to_hf

    hf = to_hf(model, "llama").train()

    def loss(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return hf(input_ids=x, labels=y, shift_labels=y).loss

    return Contestant("transformers", hf, loss)


def litgpt_available() -> bool:
    """Installed? Found without importing it (litgpt imports lightning: seconds)."""
    import importlib.util

    return importlib.util.find_spec("litgpt") is not None


def litgpt_state_dict(state: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Our parameter names -> litgpt's. Both fuse q, k, v as [q heads | k heads | v heads];
    our SwiGLU w_in is [gate | up], litgpt's fc_1 is the gate and fc_2 the up projection."""
    out = {
        "transformer.wte.weight": state["wte.weight"],
        "transformer.ln_f.weight": state["norm_f.weight"],
        "lm_head.weight": state["lm_head.weight"],
    }
    for i in range(cfg.n_layers):
        a, b = f"blocks.{i}.", f"transformer.h.{i}."
        gate, up = state[a + "mlp.w_in.weight"].chunk(2, dim=0)
        out |= {
            b + "norm_1.weight": state[a + "norm1.weight"],
            b + "norm_2.weight": state[a + "norm2.weight"],
            b + "attn.qkv.weight": state[a + "attn.qkv.weight"],
            b + "attn.proj.weight": state[a + "attn.proj.weight"],
            b + "mlp.fc_1.weight": gate,
            b + "mlp.fc_2.weight": up,
            b + "mlp.proj.weight": state[a + "mlp.w_out.weight"],
        }
    return {k: v.detach().clone() for k, v in out.items()}


def litgpt_gpt(model: nn.Module) -> Contestant:
    from litgpt.config import Config
    from litgpt.model import GPT
    from litgpt.utils import chunked_cross_entropy

    c: ModelConfig = model.cfg
    config = Config(
        name="pretrain-peer",
        block_size=c.max_seq_len,
        vocab_size=c.padded_vocab_size,
        padded_vocab_size=c.padded_vocab_size,
        n_layer=c.n_layers,
        n_head=c.n_heads,
        n_query_groups=c.kv_heads,
        n_embd=c.d_model,
        head_size=c.head_dim,
        intermediate_size=c.d_ff,
        rotary_percentage=1.0,
        rope_base=int(c.rope_theta),
        parallel_residual=False,
        bias=False,
        norm_class_name="RMSNorm",
        norm_eps=c.norm_eps,
        mlp_class_name="LLaMAMLP",
    )
    gpt = GPT(config)
    gpt.load_state_dict(litgpt_state_dict(model.state_dict(), c), strict=True)
    gpt.train()

    def loss(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return chunked_cross_entropy(gpt(x), y)

    return Contestant("litgpt", gpt, loss)
