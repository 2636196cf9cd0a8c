"""apply_rope's hand-written backward against the plain autograd expression, RMSNorm's dtype
under autocast, and the casts a bf16 autocast step makes (issue 16 item 2)."""

from __future__ import annotations

import math

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from pretrain.config import ModelConfig
from pretrain.model import Transformer
from pretrain.model.norm import RMSNorm
from pretrain.model.rope import apply_rope, apply_rope_reference, rope_cache


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rotary_dims", [64, 16, 2])
def test_apply_rope_is_bit_identical_to_the_plain_expression(dtype, rotary_dims):
    # q as attention sees it: a (B, H, T, D) view of a (B, T, H, D) projection.
    g = torch.Generator().manual_seed(rotary_dims)
    base = torch.randn(2, 40, 3, 64, generator=g).to(dtype).transpose(1, 2)
    grad_out = torch.randn(2, 3, 40, 64, generator=g).to(dtype)
    cos, sin = rope_cache(40, rotary_dims, 500.0)
    results = []
    for fn in (apply_rope_reference, apply_rope):
        x = base.detach().clone().requires_grad_()
        y = fn(x, cos, sin)
        y.backward(grad_out)
        results.append((y.detach(), x.grad, y.stride(), x.grad.stride()))
    (ref, ref_grad, ref_strides, ref_grad_strides), (out, grad, strides, grad_strides) = results
    assert out.dtype == dtype and grad.dtype == dtype
    assert torch.equal(out, ref) and torch.equal(grad, ref_grad)
    # Same memory layouts too: a later reduction over them sums in the same order.
    assert strides == ref_strides and grad_strides == ref_grad_strides


def test_rmsnorm_keeps_bf16_activations_bf16_under_autocast():
    norm = RMSNorm(64)
    with torch.no_grad():
        norm.weight.copy_(torch.linspace(0.5, 1.5, 64))
    x = torch.randn(3, 5, 64, generator=torch.Generator().manual_seed(0))
    # fp32: bit-identical to the formula before (weight * normalized x).
    xf = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.eps)
    assert torch.equal(norm(x), norm.weight * xf)
    # bf16 activations with fp32 weights (autocast, QK-Norm's q and k): the output stays bf16
    # (before, it was promoted to fp32) and differs from the old fp32 output only by bf16
    # rounding of the weight and of the product: at most 2^-7 relative.
    xb = x.bfloat16()
    old = (
        norm.weight
        * (xb.float() * torch.rsqrt(xb.float().pow(2).mean(-1, keepdim=True) + norm.eps)).bfloat16()
    )
    with torch.autocast("cpu", dtype=torch.bfloat16):
        new = norm(xb)
    assert new.dtype == torch.bfloat16
    assert ((new.float() - old).abs() <= 2**-7 * old.abs()).all()


def test_bf16_autocast_step_casts_q_and_k_only_in_qk_norm():
    """A bf16 autocast step of a QK-Norm, partial-RoPE model: full-size (B, H, T, D) casts are
    only QK-Norm's fp32 up- and down-cast of q and of k, forward and backward (8 per layer).
    Before: 18 per layer (RoPE's copies, and q/k promoted to fp32 by the norm's weight and
    cast down again for attention)."""
    cfg = ModelConfig(
        vocab_size=64,
        pad_vocab_to_multiple=1,
        n_layers=2,
        d_model=64,
        n_heads=2,
        d_ff=64,
        max_seq_len=16,
        rope_fraction=0.25,
        qk_norm=True,
    )
    torch.manual_seed(0)
    model = Transformer(cfg)
    x = torch.randint(0, 64, (2, 16))
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(x, targets=x).loss
        loss.backward()
    heads_shape = [2, cfg.n_heads, 16, cfg.head_dim]
    casts = [e for e in prof.events() if e.name == "aten::_to_copy"]
    full = [e for e in casts if e.input_shapes and e.input_shapes[0] == heads_shape]
    assert len(full) == 8 * cfg.n_layers


# ----------------------------------------------------------------------------- scaling


def _hf_frequencies(kind: str, head_dim: int, rotary: int, params: dict, seq_len=None):
    """transformers' own RoPE init function: Llama for full RoPE, GPT-NeoX for partial."""
    from transformers import GPTNeoXConfig, LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope = {"rope_type": kind, "rope_theta": 500.0, **params}
    common = dict(hidden_size=4 * head_dim, num_attention_heads=4, max_position_embeddings=64)
    if rotary == head_dim:
        cfg = LlamaConfig(**common, rope_parameters=rope)
    else:
        cfg = GPTNeoXConfig(
            **common, rope_parameters={**rope, "partial_rotary_factor": rotary / head_dim}
        )
    kw = {} if seq_len is None else {"seq_len": seq_len}
    return ROPE_INIT_FUNCTIONS[kind](cfg, "cpu", **kw)


@pytest.mark.parametrize("rotary", [64, 16])  # full RoPE on Llama, 25% on GPT-NeoX
def test_scaled_frequencies_equal_transformers(rotary):
    from pretrain.config import RopeScalingConfig
    from pretrain.model.rope import scaled_frequencies

    def ours(kind, factor, seq_len=None, **kw):
        return scaled_frequencies(rotary, 500.0, RopeScalingConfig(kind, factor, **kw), 64, seq_len)

    cases = [
        (ours("linear", 4.0), _hf_frequencies("linear", 64, rotary, {"factor": 4.0})),
        (
            ours("yarn", 4.0),
            _hf_frequencies(
                "yarn", 64, rotary, {"factor": 4.0, "original_max_position_embeddings": 64}
            ),
        ),
        (
            ours("yarn", 8.0, beta_fast=16, beta_slow=2, truncate=False),
            _hf_frequencies(
                "yarn",
                64,
                rotary,
                {
                    "factor": 8.0,
                    "original_max_position_embeddings": 64,
                    "beta_fast": 16,
                    "beta_slow": 2,
                    "truncate": False,
                },
            ),
        ),
        (
            ours("dynamic_ntk", 2.0, seq_len=200),
            _hf_frequencies("dynamic", 64, rotary, {"factor": 2.0}, 200),
        ),
        (
            ours("dynamic_ntk", 2.0, seq_len=50),
            _hf_frequencies("dynamic", 64, rotary, {"factor": 2.0}, 50),
        ),
        # Static NTK is transformers' dynamic at the length where its multiplier equals the
        # factor: f L / L0 - (f - 1) = f  <=>  L = L0 (2f - 1) / f = 96 for f = 2, L0 = 64.
        (ours("ntk", 2.0), _hf_frequencies("dynamic", 64, rotary, {"factor": 2.0}, 96)),
    ]
    for (inv, factor), (hf_inv, hf_factor) in cases:
        assert inv.shape == hf_inv.shape == (rotary // 2,)
        # transformers computes in fp32, we in fp64 rounded once: a few ulps apart.
        torch.testing.assert_close(inv, hf_inv.float(), rtol=4e-7, atol=0)
        assert factor == pytest.approx(hf_factor, rel=1e-12)
    assert cases[1][0][1] == pytest.approx(0.1 * math.log(4.0) + 1)  # YaRN's attention factor


def test_a_factor_of_one_leaves_the_cache_bit_identical():
    from pretrain.config import RopeScalingConfig

    plain = rope_cache(96, 16, 500.0)
    for kind in ("linear", "ntk", "yarn", "dynamic_ntk"):
        scaled = rope_cache(
            96, 16, 500.0, scaling=RopeScalingConfig(kind, 1.0), original_len=32, seq_len=96
        )
        assert torch.equal(scaled[0], plain[0]) and torch.equal(scaled[1], plain[1]), kind
    # and a factor above 1 does change it (the test above would pass for a no-op otherwise)
    yarn = rope_cache(96, 16, 500.0, scaling=RopeScalingConfig("yarn", 2.0), original_len=32)
    assert not torch.equal(yarn[0], plain[0])


def test_dynamic_ntk_changes_only_past_the_original_length():
    from pretrain.config import ModelConfig, RopeScalingConfig
    from pretrain.model import Transformer

    cfg = ModelConfig(
        vocab_size=50,
        pad_vocab_to_multiple=1,
        n_layers=1,
        d_model=32,
        n_heads=2,
        d_ff=32,
        max_seq_len=16,
        rope_scaling=RopeScalingConfig("dynamic_ntk", 2.0),
    )
    rope = Transformer(cfg).rope
    plain = rope_cache(64, 16, 10000.0)
    cos, _ = rope(0, 16)
    assert torch.equal(cos, plain[0][:16])  # within the trained length: unscaled
    cos, _ = rope(0, 64)
    assert not torch.equal(cos, plain[0])
    # the frequencies of a 64-token sequence, whatever window of it is asked for
    tail, _ = rope(48, 16)
    assert torch.equal(tail, cos[48:])
