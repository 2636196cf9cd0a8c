"""Our model and its peers at one config with one set of weights, each behind the same
`loss(x, y)` call: what the race (peer_race.py) times, for `tools/benchmark.py peers` and
the GPU check's peers stages.

Two shapes, the paper's two 1B families (`SHAPES`; width and depth are the caller's):

- `llama1b`: sequential block, RMSNorm, SwiGLU (d_ff 4 x d_model), GQA (heads of 64, 4 query
  heads per kv head), full RoPE, no biases, untied (configs/models/llama1b.yaml less its MLP
  biases, which litgpt's LLaMAMLP cannot hold without attention biases too). Peers:
  transformers' LlamaForCausalLM and litgpt's GPT with a Llama config.
- `pythia1b`: parallel block, LayerNorm, GeLU MLP (d_ff 4 x d_model), MHA (heads of 256),
  NeoX RoPE on 25% of each head, every bias, untied (configs/models/pythia1b.yaml, Pythia-1B as
  EleutherAI trained it; the paper's pythia1b_rope10 has RMSNorm and SwiGLU, which
  GPTNeoXForCausalLM cannot hold). Peers: transformers' GPTNeoXForCausalLM and litgpt's GPT
  with a Pythia config.

Every peer gets our weights (transformers through pretrain/hf's exporter, litgpt by the name
map below), and computes its loss the way its own training code does: transformers through
`labels` (its ForCausalLMLoss; `shift_labels` hands it our already-shifted targets), litgpt
with `litgpt.utils.chunked_cross_entropy` on the logits (as litgpt's pretrain script).
`make(name, base, compile_backend)` builds any of them, eager or under torch.compile (the
module compiled, as DeepSpeed's engine.compile and litgpt's pretrain compile it).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
from torch import nn

from pretrain.config import ModelConfig
from pretrain.hf import to_hf
from pretrain.model.transformer import Transformer

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
IMPLEMENTATIONS = ("ours", "transformers", "litgpt")
PEERS = IMPLEMENTATIONS[1:]


@dataclasses.dataclass
class Contestant:
    """One model in the race: its name, its module (whose parameters the optimizer steps),
    its loss on a batch, whose code it is (`implementation`), whether torch.compile runs it,
    and whether it is the race's model (False: one of our RoPE/QK-Norm variants, another
    model whose loss differs)."""

    name: str
    module: nn.Module
    loss: LossFn
    implementation: str = "ours"
    compiled: bool = False
    same_model: bool = True


@dataclasses.dataclass(frozen=True)
class Shape:
    """One of the paper's model families at any width: per-head and per-width proportions."""

    name: str
    family: str  # "llama" or "pythia"
    head_dim: int
    q_per_kv: int  # query heads per kv head (1: MHA)
    ff_ratio: int  # d_ff / d_model
    rope_fraction: float
    variants: tuple[tuple[str, dict], ...]  # (name, ModelConfig changes) of our variants
    description: str


SHAPES = {
    "llama1b": Shape(
        "llama1b",
        "llama",
        head_dim=64,
        q_per_kv=4,
        ff_ratio=4,
        rope_fraction=1.0,
        variants=(
            ("ours, RoPE 25%", {"rope_fraction": 0.25}),
            ("ours, QK-Norm", {"qk_norm": True}),
        ),
        description="sequential, RMSNorm, SwiGLU, GQA, full RoPE, no biases",
    ),
    "pythia1b": Shape(
        "pythia1b",
        "pythia",
        head_dim=256,
        q_per_kv=1,
        ff_ratio=4,
        rope_fraction=0.25,
        variants=(("ours, RoPE 10%", {"rope_fraction": 0.1}), ("ours, QK-Norm", {"qk_norm": True})),
        description="parallel, LayerNorm, GeLU, MHA, RoPE 25%, biases",
    ),
}


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


def pythia_config(
    d_model: int,
    layers: int,
    heads: int,
    d_ff: int,
    vocab: int,
    seq_len: int,
    rope_fraction: float = 0.25,
) -> ModelConfig:
    """A Pythia-shaped model (parallel block, LayerNorm, GeLU MLP, every bias, MHA, untied,
    NeoX RoPE on a fraction of each head) that GPTNeoXForCausalLM and litgpt's GPT hold."""
    return ModelConfig(
        vocab_size=vocab,
        pad_vocab_to_multiple=1,
        n_layers=layers,
        d_model=d_model,
        n_heads=heads,
        n_kv_heads=None,
        d_ff=d_ff,
        max_seq_len=seq_len,
        block="parallel",
        norm="layernorm",
        norm_bias=True,
        mlp="gelu",
        mlp_bias=True,
        attn_bias=True,
        rope_fraction=rope_fraction,
        tie_embeddings=False,
        dropout=0.0,
    )


def shape_config(
    shape: str,
    d_model: int,
    layers: int,
    vocab: int,
    seq_len: int,
    heads: int | None = None,
    kv_heads: int | None = None,
    d_ff: int | None = None,
) -> ModelConfig:
    """The shape at this width and depth: heads of the shape's size (at least one), its
    query heads per kv head and d_ff ratio, unless given."""
    s = SHAPES[shape]
    heads = heads or max(1, d_model // s.head_dim)
    d_ff = d_ff or s.ff_ratio * d_model
    if s.family == "pythia":
        return pythia_config(d_model, layers, heads, d_ff, vocab, seq_len, s.rope_fraction)
    kv_heads = kv_heads or max(1, heads // s.q_per_kv)
    return llama_config(d_model, layers, heads, kv_heads, d_ff, vocab, seq_len)


def family(cfg: ModelConfig) -> str:
    """ "llama" or "pythia": which peers' configs hold this model (the two shapes' configs)."""
    return "pythia" if cfg.block == "parallel" and cfg.norm == "layernorm" else "llama"


def _compiled(module: nn.Module, backend: str | None) -> nn.Module:
    return module if backend is None else torch.compile(module, backend=backend)


def _name(implementation: str, backend: str | None) -> str:
    return implementation if backend is None else f"{implementation}, compiled"


def ours(name: str, model: nn.Module, compile_backend: str | None = None, **kw) -> Contestant:
    run = _compiled(model, compile_backend)
    return Contestant(
        name, model, lambda x, y: run(x, targets=y).loss, compiled=compile_backend is not None, **kw
    )


def variant(base: nn.Module, **changes) -> nn.Module:
    """Our model with other RoPE/QK-Norm settings and the base's weights (copied: each
    variant has its own optimizer state and steps). QK-Norm's new weights start at one."""

    cfg = base.cfg.replace(**changes)
    model = Transformer(cfg)
    missing, unexpected = model.load_state_dict(base.state_dict(), strict=False)
    if unexpected or any("_norm" not in k for k in missing):
        raise RuntimeError(f"variant weights unmatched: {missing} {unexpected}")
    return model.train()


def transformers_peer(model: nn.Module, compile_backend: str | None = None) -> Contestant:
    """LlamaForCausalLM or GPTNeoXForCausalLM (by the model's family) with our weights."""

    target = "gpt_neox" if family(model.cfg) == "pythia" else "llama"
    hf = to_hf(model, target).train()
    run = _compiled(hf, compile_backend)

    def loss(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return run(input_ids=x, labels=y, shift_labels=y).loss

    name = _name("transformers", compile_backend)
    return Contestant(name, hf, loss, "transformers", compile_backend is not None)


def litgpt_available() -> bool:
    """Installed? Found without importing it (litgpt imports lightning: seconds)."""
    import importlib.util

    return importlib.util.find_spec("litgpt") is not None


def litgpt_state_dict(state: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Our parameter names -> litgpt's. Both fuse q, k, v as [q heads | k heads | v heads]
    (weight and bias). Llama: our SwiGLU w_in is [gate | up], litgpt's fc_1 is the gate and
    fc_2 the up projection. Pythia: w_in is litgpt's fc, w_out its proj; norms have biases."""
    out = {
        "transformer.wte.weight": state["wte.weight"],
        "transformer.ln_f.weight": state["norm_f.weight"],
        "lm_head.weight": state["lm_head.weight"],
    }
    if "norm_f.bias" in state:
        out["transformer.ln_f.bias"] = state["norm_f.bias"]
    for i in range(cfg.n_layers):
        a, b = f"blocks.{i}.", f"transformer.h.{i}."
        names = {
            "norm1": "norm_1",
            "norm2": "norm_2",
            "attn.qkv": "attn.qkv",
            "attn.proj": "attn.proj",
            "mlp.w_out": "mlp.proj",
        }
        if cfg.mlp == "swiglu":
            gate, up = state[a + "mlp.w_in.weight"].chunk(2, dim=0)
            out |= {b + "mlp.fc_1.weight": gate, b + "mlp.fc_2.weight": up}
        else:
            names["mlp.w_in"] = "mlp.fc"
        for ours_name, theirs in names.items():
            for leaf in ("weight", "bias"):
                if f"{a}{ours_name}.{leaf}" in state:
                    out[f"{b}{theirs}.{leaf}"] = state[f"{a}{ours_name}.{leaf}"]
    return {k: v.detach().clone() for k, v in out.items()}


def litgpt_config(c: ModelConfig):
    """litgpt's Config for our model: its Llama recipe (RMSNorm, LLaMAMLP, no biases) or its
    Pythia recipe (parallel residual with two norms, LayerNorm, GptNeoxMLP, biases)."""
    from litgpt.config import Config

    pythia = family(c) == "pythia"
    return Config(
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
        rotary_percentage=c.rope_dims / c.head_dim,
        rope_base=int(c.rope_theta),
        parallel_residual=pythia,
        shared_attention_norm=False,
        bias=pythia,
        norm_class_name="LayerNorm" if pythia else "RMSNorm",
        norm_eps=c.norm_eps,
        mlp_class_name="GptNeoxMLP" if pythia else "LLaMAMLP",
        gelu_approximate="none",
    )


def litgpt_gpt(model: nn.Module, compile_backend: str | None = None) -> Contestant:
    from litgpt.model import GPT
    from litgpt.utils import chunked_cross_entropy

    c: ModelConfig = model.cfg
    gpt = GPT(litgpt_config(c))
    gpt.load_state_dict(litgpt_state_dict(model.state_dict(), c), strict=True)
    gpt.train()
    run = _compiled(gpt, compile_backend)

    def loss(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return chunked_cross_entropy(run(x), y)

    return Contestant(
        _name("litgpt", compile_backend), gpt, loss, "litgpt", compile_backend is not None
    )


def make(implementation: str, base: nn.Module, compile_backend: str | None = None) -> Contestant:
    """One implementation at the base model's weights (copied: each has its own parameters
    and optimizer state), eager or compiled with `compile_backend`."""
    if implementation == "ours":
        return ours(_name("ours", compile_backend), variant(base), compile_backend)
    if implementation == "transformers":
        return transformers_peer(base, compile_backend)
    if implementation == "litgpt":
        return litgpt_gpt(base, compile_backend)
    raise ValueError(f"unknown implementation {implementation!r}; one of {IMPLEMENTATIONS}")
