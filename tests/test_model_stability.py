"""The two spike-prevention options, off by default: z-loss (in the chunked loss) and the
attention-logit soft cap (in our attention and in the exported remote code)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pretrain.config import ModelConfig
from pretrain.hf import check_parity, export_hf, read_hf_folder, unsupported_features
from pretrain.model.loss import linear_cross_entropy
from pretrain.model.transformer import Transformer


def _reference_z_loss(hidden, weight, targets, z):
    """PaLM's auxiliary loss written out: CE + z * mean(logsumexp(logits)^2) over scored rows."""
    logits = hidden @ weight.T
    keep = targets != -100
    lse = torch.logsumexp(logits, dim=-1)
    ce = F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1), ignore_index=-100)
    return ce + z * (lse[keep] ** 2).mean(), z * (lse[keep] ** 2).mean()


@pytest.mark.parametrize("z", [0.0, 1e-4, 0.05])
def test_z_loss_matches_its_formula_with_gradients(z):
    g = torch.Generator().manual_seed(0)
    # fp32 in, as the model runs; the reference in fp64. The loss works in fp32: 1e-6.
    hidden = torch.randn(3, 50, 16, generator=g, requires_grad=True)
    weight = torch.randn(97, 16, generator=g, requires_grad=True)
    targets = torch.randint(0, 97, (3, 50), generator=g)
    targets[0, :7] = -100
    loss, z_term = linear_cross_entropy(hidden, weight, targets, chunk_tokens=32, z_loss=z)
    h64 = hidden.detach().double().requires_grad_()
    w64 = weight.detach().double().requires_grad_()
    ref, ref_z = _reference_z_loss(h64, w64, targets, z)
    assert loss.item() == pytest.approx(ref.item(), rel=1e-6)
    assert z_term.item() == pytest.approx(ref_z.item(), rel=1e-6, abs=1e-12)
    dh, dw = torch.autograd.grad(loss, (hidden, weight))
    rh, rw = torch.autograd.grad(ref, (h64, w64))
    for got, want in ((dh, rh), (dw, rw)):
        assert (got.double() - want).abs().max() <= 1e-6 * want.abs().max()
    if z:  # and the z term does change the gradient
        plain, _ = linear_cross_entropy(hidden, weight, targets, chunk_tokens=32)
        assert (torch.autograd.grad(plain, weight)[0] - dw).abs().max() > 1e-4 * dw.abs().max()


def _cfg(**kw) -> ModelConfig:
    base = dict(
        vocab_size=64,
        pad_vocab_to_multiple=1,
        n_layers=2,
        d_model=32,
        n_heads=4,
        n_kv_heads=2,
        d_ff=64,
        max_seq_len=32,
        rope_fraction=0.5,
        qk_norm=True,
    )
    return ModelConfig(**{**base, **kw})


def _model(cfg: ModelConfig) -> Transformer:
    torch.manual_seed(0)
    model = Transformer(cfg).eval()
    with torch.no_grad():  # large weights: logits far beyond the cap, so the cap matters
        for name, p in model.named_parameters():
            if "qkv" in name:
                p.mul_(40)
    return model


def test_soft_cap_is_the_capped_formula_and_off_at_infinity():
    ids = torch.randint(0, 64, (2, 24), generator=torch.Generator().manual_seed(1))
    plain = _model(_cfg())
    capped = _model(_cfg(attn_logit_softcap=5.0))
    huge = _model(_cfg(attn_logit_softcap=1e9))
    capped.load_state_dict(plain.state_dict())
    huge.load_state_dict(plain.state_dict())
    with torch.no_grad():
        out_plain, out_capped, out_huge = plain(ids), capped(ids), huge(ids)
        # The formula, for layer 0's attention, from q and k as the model makes them.
        attn = capped.blocks[0].attn
        x = capped.blocks[0].norm1(capped.wte(ids))
        cos, sin = capped.rope(0, ids.shape[1])
        q, k, v = attn.heads(x, cos, sin)
        k, v = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)
        s = q @ k.transpose(-2, -1) / 8**0.5
        s = 5.0 * torch.tanh(s / 5.0)
        s = s.masked_fill(~torch.ones(24, 24, dtype=torch.bool).tril(), float("-inf"))
        y = (s.softmax(-1) @ v).transpose(1, 2).reshape(2, 24, 32)
        assert torch.allclose(attn(x, cos, sin), attn.proj(y), atol=1e-5)
    assert torch.allclose(out_huge, out_plain, atol=1e-4)  # cap -> infinity: no cap
    assert (out_capped - out_plain).abs().max() > 1e-2  # and the cap does act here


def test_soft_cap_exports_as_remote_code_with_equal_logits(tmp_path):
    cfg = _cfg(attn_logit_softcap=5.0)
    model = _model(cfg)
    assert unsupported_features(cfg, "llama") and not unsupported_features(cfg, "rope_lm")
    export = export_hf(model, tmp_path / "hf", card=False)
    assert export.remote_code
    report = check_parity(model, export.path, length=24, sequences=2, greedy_tokens=4)
    assert report["ok"], report
    back, _, _ = read_hf_folder(export.path)
    assert back.cfg == model.cfg
