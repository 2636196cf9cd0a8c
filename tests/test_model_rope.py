"""apply_rope's and RMSNorm's hand-written backwards against the plain autograd expressions,
RMSNorm's dtype under autocast and torch's fused F.rms_norm (the CUDA path) against ours, and
the casts a bf16 autocast step makes (issue 16 item 2, issue 25 item 4)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

from pretrain.config import ModelConfig
from pretrain.model import Transformer
from pretrain.model.norm import RMSNorm, rms_norm, rms_norm_reference
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


def _norm_inputs(dtype: torch.dtype, layout: str, seed: int = 0):
    """x, weight (random, fp32) and an incoming gradient; x as the residual stream (B, T, d)
    or as QK-Norm sees q: a (B, T, H, D) view of the fused qkv projection (rows strided)."""
    g = torch.Generator().manual_seed(seed)
    if layout == "stream":
        x = torch.randn(2, 40, 96, generator=g)
    else:
        x = torch.randn(2, 40, 3 * 3 * 32, generator=g)[..., : 3 * 32].view(2, 40, 3, 32)
    weight = 1 + 0.2 * torch.randn(x.shape[-1], generator=g)
    grad = torch.randn(x.shape, generator=g).to(dtype)
    return x.to(dtype) if dtype != torch.float32 else x, weight, grad


def _run(fn, x, weight, grad):
    x, weight = x.detach().requires_grad_(), weight.detach().clone().requires_grad_()
    y = fn(x, weight, 1e-5)
    y.backward(grad)
    return y.detach(), x.grad, weight.grad


@pytest.mark.parametrize("layout", ["stream", "qkv view"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rmsnorm_closed_form_backward_equals_autograd(dtype, layout):
    """The training path (closed-form backward) against the plain expression under autograd:
    the same forward bit for bit (memory layout too); in fp32 the same gradients within 1e-6
    of the largest (measured ~1e-7: another summation order); in bf16 gradients nearer to
    fp64 than autograd's chain (one rounding where it rounded at every step)."""
    x, weight, grad = _norm_inputs(dtype, layout)
    ref_y, ref_dx, ref_dw = _run(rms_norm_reference, x, weight, grad)
    y, dx, dw = _run(rms_norm, x, weight, grad)
    assert torch.equal(y, ref_y) and y.stride() == ref_y.stride() and y.dtype == dtype
    assert dx.dtype == dtype and dw.dtype == torch.float32
    if dtype == torch.float32:
        for new, ref in ((dx, ref_dx), (dw, ref_dw)):
            assert (new - ref).abs().max() <= 1e-6 * ref.abs().max()
        return
    # bf16: the truth is the same math in fp64 on the same (bf16-exact) inputs.
    _, true_dx, true_dw = _run(rms_norm_reference, x.double(), weight.double(), grad.double())

    def err(a, t):
        return float((a.double() - t).abs().max() / t.abs().max())

    assert err(dx, true_dx) <= err(ref_dx, true_dx) and err(dx, true_dx) < 2**-7
    assert err(dw, true_dw) <= err(ref_dw, true_dw) and err(dw, true_dw) < 1e-6


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_torch_rms_norm_is_exact_enough_for_the_cuda_path(dtype):
    """On CUDA the norm is torch's fused F.rms_norm (weight in x's dtype). Its math, run here
    by torch's CPU decomposition: in fp32 bit-identical to ours, forward and gradients; in
    bf16 it multiplies the weight before rounding (one rounding where ours rounds twice):
    within one bf16 rounding (2^-7 relative) of ours on every element, and nearer to fp64.
    tests/test_model_gpu.py checks the CUDA kernel itself against these paths."""

    def torch_rms_norm(x, weight, eps):
        return F.rms_norm(x, (x.shape[-1],), weight.to(x.dtype), eps)

    x, weight, grad = _norm_inputs(dtype, "stream", seed=1)
    ours, theirs = _run(rms_norm_reference, x, weight, grad), _run(torch_rms_norm, x, weight, grad)
    if dtype == torch.float32:
        assert all(torch.equal(a, b) for a, b in zip(ours, theirs, strict=True))
        return
    (ref, *_), (y, *_) = ours, theirs
    assert ((y.float() - ref.float()).abs() <= 2**-7 * ref.float().abs()).all()
    truth = rms_norm_reference(x.double(), weight.double(), 1e-5)
    assert (y.double() - truth).abs().mean() < (ref.double() - truth).abs().mean()


def test_bf16_autocast_step_casts_q_and_k_only_in_qk_norm():
    """A bf16 autocast step of a QK-Norm, partial-RoPE model: full-size q/k casts are only
    QK-Norm's, 5 per tensor (10 per layer): its input up to fp32 and its output down, and in
    its closed-form backward the input up again (recomputed, not kept: what a GPU's fused
    kernel keeps), the gradient up and the input gradient down. Before the closed form, 8
    per layer (autograd kept the fp32 input); before issue 16, 18 (RoPE's copies, and q/k
    promoted to fp32 by the norm's weight and cast down again for attention)."""
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
    # q/k as the norm sees them (B, T, H, D), or as RoPE and attention do (B, H, T, D)
    shapes = ([2, 16, cfg.n_heads, cfg.head_dim], [2, cfg.n_heads, 16, cfg.head_dim])
    casts = [e for e in prof.events() if e.name == "aten::_to_copy"]
    full = [e for e in casts if e.input_shapes and e.input_shapes[0] in shapes]
    assert len(full) == 10 * cfg.n_layers


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
        return scaled_frequencies(
            rotary, 500.0, RopeScalingConfig(type=kind, factor=factor, **kw), 64, seq_len
        )

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
            96,
            16,
            500.0,
            scaling=RopeScalingConfig(type=kind, factor=1.0),
            original_len=32,
            seq_len=96,
        )
        assert torch.equal(scaled[0], plain[0]) and torch.equal(scaled[1], plain[1]), kind
    # and a factor above 1 does change it (the test above would pass for a no-op otherwise)
    yarn = rope_cache(
        96, 16, 500.0, scaling=RopeScalingConfig(type="yarn", factor=2.0), original_len=32
    )
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
        rope_scaling=RopeScalingConfig(type="dynamic_ntk", factor=2.0),
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
