"""Parity with Hugging Face transformers in memory: GPTNeoXForCausalLM, LlamaForCausalLM and
RopeLMForCausalLM (the remote-code model), both directions."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    GPTNeoXConfig,
    GPTNeoXForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
)

from pretrain.config import ModelConfig, load_model_config
from pretrain.hf import HFConversionError, export_hf, from_hf, hf_config, to_hf
from pretrain.model import Transformer
from pretrain.weights import save_weights

REPO = Path(__file__).resolve().parents[1]


def random_model(seed: int, **kw) -> Transformer:
    """A small model with every weight random (norms and biases too), so nothing hides."""
    torch.manual_seed(seed)
    base = dict(
        vocab_size=300,
        pad_vocab_to_multiple=64,
        n_layers=2,
        d_model=64,
        n_heads=4,
        d_ff=112,
        max_seq_len=64,
        rope_theta=[10000.0, 500.0, 50000.0][seed % 3],
    )
    base.update(kw)
    model = Transformer(ModelConfig(**base)).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model


def check_same(ours: Transformer, hf, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, ours.cfg.vocab_size, (3, 40), generator=g)
    with torch.no_grad():
        a = ours(x)
        b = hf(x).logits
        assert (a - b).abs().max().item() < 1e-4
        # Same loss: HF shifts labels inside; ours takes the shifted targets.
        hf_loss = hf(x, labels=x).loss
        our_loss = ours(x[:, :-1], targets=x[:, 1:]).loss
        assert abs(hf_loss.item() - our_loss.item()) < 1e-5


NEOX = dict(norm="layernorm", norm_bias=True, mlp="gelu", attn_bias=True, mlp_bias=True)
LLAMA = dict(block="sequential", norm="rmsnorm", mlp="swiglu", rope_fraction=1.0)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("fraction", [0.25, 1.0])
def test_export_gpt_neox_parallel_block(seed, fraction):
    ours = random_model(seed, block="parallel", rope_fraction=fraction, **NEOX)
    hf = to_hf(ours)
    assert isinstance(hf, GPTNeoXForCausalLM) and hf.config.use_parallel_residual
    check_same(ours, hf, seed)


def test_export_gpt_neox_sequential_tied_no_bias():
    ours = random_model(
        3,
        block="sequential",
        norm="layernorm",
        mlp="gelu",
        attn_bias=False,
        mlp_bias=False,
        rope_fraction=0.5,
        tie_embeddings=True,
    )
    check_same(ours, to_hf(ours), 3)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_export_llama_gqa(seed):
    ours = random_model(
        seed, n_heads=8, n_kv_heads=2, mlp_bias=seed == 1, attn_bias=seed == 2, **LLAMA
    )
    hf = to_hf(ours)
    assert isinstance(hf, LlamaForCausalLM) and hf.config.num_key_value_heads == 2
    check_same(ours, hf, seed)


@pytest.mark.parametrize("seed", [0, 1])
def test_import_gpt_neox_weights(seed):
    torch.manual_seed(seed)
    cfg = GPTNeoXConfig(
        vocab_size=320,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        max_position_embeddings=64,
        use_parallel_residual=True,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 10000.0,
            "partial_rotary_factor": 0.25,
        },
    )
    hf = GPTNeoXForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    ours = from_hf(hf)
    assert ours.cfg.rope_dims == 4 and ours.cfg.block == "parallel"
    check_same(ours, hf, seed)


def test_import_llama_weights():
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=320,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=2,
        intermediate_size=96,
        max_position_embeddings=64,
        rope_parameters={"rope_type": "default", "rope_theta": 5000.0},
    )
    hf = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    ours = from_hf(hf)
    assert ours.cfg.kv_heads == 2 and ours.cfg.rope_theta == 5000.0
    check_same(ours, hf, 0)


@pytest.mark.parametrize(
    "kw, target, words",
    [
        (dict(qk_norm=True, **LLAMA), "llama", ["QK-Norm"]),
        (
            dict(
                block="sequential",
                norm="rmsnorm",
                mlp="swiglu",
                rope_fraction=0.25,
                rope_scaling={"type": "yarn", "factor": 2.0},
            ),
            "llama",
            ["partial RoPE", "no yarn scaling"],
        ),
        (
            dict(block="parallel", norm="rmsnorm", mlp="gelu"),
            "gpt_neox",
            ["LayerNorm only", "rmsnorm"],
        ),
        (dict(block="parallel", norm="layernorm", mlp="swiglu"), "gpt_neox", ["GeLU"]),
        (dict(norm="layernorm", mlp="gelu", n_kv_heads=2), "gpt_neox", ["grouped-query"]),
        (
            dict(norm="layernorm", mlp="gelu", learned_pos_emb=True),
            "gpt_neox",
            ["learned absolute positions"],
        ),
        (
            dict(block="parallel", **{k: v for k, v in LLAMA.items() if k != "block"}),
            "llama",
            ["parallel block"],
        ),
    ],
)
def test_unrepresentable_features_are_refused(kw, target, words):
    ours = random_model(0, **kw)
    with pytest.raises(HFConversionError) as e:
        to_hf(ours, target)
    for w in words:
        assert w in str(e.value)


def test_pythia1b_preset_exports_the_published_pythia_config():
    cfg = hf_config(load_model_config(REPO / "configs/models/pythia1b.yaml"))
    # EleutherAI/pythia-1b config.json values.
    assert (cfg.model_type, cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads) == (
        "gpt_neox",
        2048,
        16,
        8,
    )
    assert (cfg.intermediate_size, cfg.vocab_size, cfg.use_parallel_residual) == (8192, 50304, True)
    assert cfg.rope_parameters["partial_rotary_factor"] == 0.25 and cfg.hidden_act == "gelu"


def test_partial_rotary_factor_survives_hf_rounding():
    # HF takes int(head_dim * factor): every even rotary_dims must come back exactly.
    for hd in (64, 128, 256):
        for r in range(2, hd + 1, 2):
            f = hf_config(
                ModelConfig(
                    d_model=hd,
                    n_heads=1,
                    norm="layernorm",
                    mlp="gelu",
                    rope_fraction=None,
                    rotary_dims=r,
                )
            ).rope_parameters["partial_rotary_factor"]
            assert int(hd * f) == r


def test_export_tool_writes_a_folder_from_pretrained_loads(tmp_path):
    ours = random_model(0, block="parallel", rope_fraction=0.25, **NEOX)
    save_weights(ours, tmp_path / "run" / "checkpoints" / "step_0000005")
    (tmp_path / "run" / "checkpoints" / "latest").write_text("step_0000005")
    out = tmp_path / "hf"
    r = subprocess.run(
        [
            sys.executable,
            str(REPO / "tools/export_hf.py"),
            "--run",
            str(tmp_path / "run"),
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    assert r.returncode == 0, r.stderr
    hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    check_same(ours, hf, 0)


def test_export_hf_then_load_back(tmp_path):
    ours = random_model(1, n_heads=8, n_kv_heads=4, **LLAMA)
    export_hf(ours, tmp_path)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    check_same(ours, hf, 1)
    check_same(from_hf(hf), hf, 2)


REMOTE_SHAPES = {
    "llama_gqa_full": dict(n_heads=8, n_kv_heads=2, **LLAMA),
    "llama_partial_qknorm_bias": dict(
        n_heads=8,
        n_kv_heads=4,
        rope_fraction=0.25,
        qk_norm=True,
        attn_bias=True,
        **{k: v for k, v in LLAMA.items() if k != "rope_fraction"},
    ),
    "parallel_rmsnorm_swiglu_nope": dict(
        block="parallel", norm="rmsnorm", mlp="swiglu", rope_fraction=0.0
    ),
    "neox_parallel_partial": dict(block="parallel", rope_fraction=0.25, **NEOX),
    "layernorm_qknorm_nobias": dict(norm="layernorm", mlp="gelu", qk_norm=True, rope_fraction=0.5),
    "char_gpt": dict(
        norm="layernorm",
        mlp="gelu",
        mlp_bias=False,
        learned_pos_emb=True,
        tie_embeddings=True,
        dropout=0.2,
    ),
}


@pytest.mark.parametrize("name", sorted(REMOTE_SHAPES))
def test_remote_code_model_matches_ours_both_ways(name):
    """RopeLM holds every shape, the native ones included: same logits, same loss, and its
    weights come back bit for bit."""
    ours = random_model(4, **REMOTE_SHAPES[name])
    hf = to_hf(ours, "rope_lm")
    assert type(hf).__name__ == "RopeLMForCausalLM"
    check_same(ours, hf, 4)
    back = from_hf(hf)
    assert back.cfg.rope_dims == ours.cfg.rope_dims and back.cfg.qk_norm == ours.cfg.qk_norm
    for k, v in ours.state_dict().items():
        assert torch.equal(back.state_dict()[k], v), k


def _left_padded_batch_like_ours(ours, hf, cache: str, seed: int) -> torch.Tensor:
    """Two prompts (12 and 7 tokens, the second left-padded) through transformers' generate()
    with `cache`: each gets the 16 greedy tokens our model gives it alone. Returns the first."""
    g = torch.Generator().manual_seed(seed)
    a, b = torch.randint(0, 300, (1, 12), generator=g), torch.randint(0, 300, (1, 7), generator=g)
    ids = torch.zeros(2, 12, dtype=torch.long)
    ids[0], ids[1, 5:] = a, b
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    out = hf.generate(
        ids,
        attention_mask=mask,
        max_new_tokens=16,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
        suppress_tokens=list(range(300, 320)),
        cache_implementation=cache,
    )
    assert torch.equal(out[0], ours.generate(a, 16, temperature=0)[0])
    assert torch.equal(out[1, 5:], ours.generate(b, 16, temperature=0)[0])
    return a


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_remote_code_generates_left_padded_batches_like_ours(cache):
    """A left-padded batch through generate() gives each prompt the tokens our model gives it
    alone (positions count real tokens, so learned positions are right too)."""
    ours = random_model(5, **REMOTE_SHAPES["char_gpt"])
    hf = to_hf(ours, "rope_lm")
    _left_padded_batch_like_ours(ours, hf, cache, 5)


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_remote_code_windows_and_alibi_generate_left_padded_batches_like_ours(cache):
    """Sliding windows (W = 6, shorter than prompt + generation) with ALiBi and 50% RoPE in
    RopeLM: a left-padded batch through generate() with transformers' dynamic cache (which
    keeps a sliding layer's last W - 1 keys) or static cache (a rolling buffer per sliding
    layer, masks built by generate) gives each prompt our tokens."""
    ours = random_model(
        6,
        n_layers=3,
        n_kv_heads=2,
        mlp_bias=False,
        rope_fraction=0.5,
        alibi=True,
        sliding_window=6,
        layer_types=["sliding", "full", "sliding"],
    )
    hf = to_hf(ours, "rope_lm")
    a = _left_padded_batch_like_ours(ours, hf, cache, 6)
    if cache == "dynamic":
        with torch.no_grad():
            step = hf(a, use_cache=True)
        kept = getattr(step, "cache", None) or step.past_key_values
        assert [layer.keys.shape[2] for layer in kept.layers] == [5, 12, 5]
