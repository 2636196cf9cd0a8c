"""apply_rope's hand-written backward against the plain autograd expression, RMSNorm's dtype
under autocast, and the casts a bf16 autocast step makes (issue 16 item 2)."""

from __future__ import annotations

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
