"""Memory-lean model paths: the chunked linear + cross-entropy, the blockwise max-logit probe,
and activation checkpointing by number of layers. Every figure is checked against the plain
computation (whole logits, whole score matrix, no recompute)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from pretrain.config import ConfigError, ModelConfig, TrainConfig, from_dict
from pretrain.model import Transformer
from pretrain.model.loss import default_chunk_tokens, linear_cross_entropy
from pretrain.model.probes import causal_max_abs_logit, max_attention_logits
from pretrain.model.recompute import describe_recompute, recompute_layers
from pretrain.model.rope import apply_rope


def tiny(**kw) -> ModelConfig:
    base = dict(
        vocab_size=97,
        pad_vocab_to_multiple=8,
        n_layers=3,
        d_model=64,
        n_heads=4,
        d_ff=96,
        max_seq_len=48,
    )
    base.update(kw)
    return ModelConfig(**base)


def _case(dtype, n=(3, 37), d=48, vocab=211, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(*n, d, generator=g).to(dtype)
    weight = (torch.randn(vocab, d, generator=g) * 0.2).to(dtype)
    targets = torch.randint(0, vocab, n, generator=g)
    targets[0, :5] = -100
    targets[2, -3:] = -100
    return hidden, weight, targets


def _grads(fn, hidden, weight, targets, scale=1.0):
    h = hidden.detach().clone().requires_grad_(True)
    w = weight.detach().clone().requires_grad_(True)
    loss = fn(h, w, targets)
    (loss * scale).backward()
    return loss.detach(), h.grad, w.grad


def _unfused(h, w, t):  # the model's loss before: whole logits, fp32 cross-entropy
    logits = F.linear(h, w)
    return F.cross_entropy(
        logits.float().view(-1, logits.size(-1)), t.reshape(-1), ignore_index=-100
    )


# ----------------------------------------------------------------------------- loss


@pytest.mark.parametrize("chunk", [1, 7, 64, 10_000])
def test_chunked_loss_and_gradients_equal_cross_entropy_fp32(chunk):
    hidden, weight, targets = _case(torch.float32)
    ref = _grads(_unfused, hidden, weight, targets, scale=0.37)
    new = _grads(
        lambda h, w, t: linear_cross_entropy(h, w, t, chunk_tokens=chunk)[0],
        hidden,
        weight,
        targets,
        scale=0.37,
    )
    assert new[0].dtype == torch.float32
    for a, b in zip(new, ref, strict=True):
        assert (a - b).abs().max().item() <= 1e-6


def test_chunked_loss_bf16_is_as_close_to_fp64_as_the_unfused_loss():
    hidden, weight, targets = _case(torch.bfloat16, n=(4, 160), d=64, vocab=1000, seed=1)
    exact = _grads(_unfused, hidden.double(), weight.double(), targets)
    ref = _grads(_unfused, hidden, weight, targets)
    new = _grads(
        lambda h, w, t: linear_cross_entropy(h, w, t, chunk_tokens=32)[0], hidden, weight, targets
    )
    assert new[1].dtype == new[2].dtype == torch.bfloat16

    def rel(a, b):
        return ((a.double() - b).norm() / b.norm()).item()

    # The loss: fp32 from the same bf16 logits -> equal to the unfused loss to fp32 rounding.
    assert abs(new[0].item() - ref[0].item()) <= 1e-6 * abs(ref[0].item())
    # d hidden: the same bf16 matmul per row as the unfused path.
    assert rel(new[1], exact[1]) <= 1.01 * rel(ref[1], exact[1])
    # d weight: fp32 sum of per-chunk bf16 products, rounded once more at the end: measured
    # 1.2-1.35x the unfused error (one rounding), both below bf16's epsilon 2^-8.
    assert rel(new[2], exact[2]) <= 1.5 * rel(ref[2], exact[2])
    assert rel(new[2], exact[2]) < 2**-8


class _MatmulDtypes(TorchDispatchMode):
    """The input dtypes of every matrix product that runs inside."""

    def __init__(self):
        super().__init__()
        self.seen: list[tuple[str, tuple[torch.dtype, ...]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.bmm):
            dtypes = tuple(a.dtype for a in args if isinstance(a, torch.Tensor))
            self.seen.append((func.overloadpacket.__name__, dtypes))
        return func(*args, **(kwargs or {}))


def test_chunked_loss_under_autocast_multiplies_in_bf16_like_f_linear():
    """fp32 weights under autocast (the peers benchmark, user code): every product of the
    loss, its gradients' too, runs in bf16 as autograd through F.linear would; an fp32
    gradient product ran 10x slower on an H200 (1.6x the whole step of a 700M model)."""
    hidden, weight, targets = _case(torch.float32, n=(4, 160), d=64, vocab=1000, seed=2)
    exact = _grads(_unfused, hidden.double(), weight.double(), targets)

    def autocast(fn):
        def run(h, w, t):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return fn(h, w, t)

        return run

    ref = _grads(autocast(_unfused), hidden, weight, targets)
    with _MatmulDtypes() as products:
        new = _grads(
            autocast(lambda h, w, t: linear_cross_entropy(h, w, t, chunk_tokens=128)[0]),
            hidden,
            weight,
            targets,
        )
    assert products.seen, "no matrix product seen"
    assert all(set(d) == {torch.bfloat16} for _, d in products.seen), products.seen
    assert new[1].dtype == new[2].dtype == torch.float32  # the leaves' dtype, as autograd's

    def rel(a, b):
        return ((a.double() - b).norm() / b.norm()).item()

    assert abs(new[0].item() - ref[0].item()) <= 1e-5 * abs(ref[0].item())
    # bf16 products: as far from the exact gradients as autocast's own (not fp32-exact)
    for k in (1, 2):
        assert rel(new[k], exact[k]) <= 1.5 * rel(ref[k], exact[k])
        assert rel(new[k], exact[k]) > 1e-4  # bf16 rounding is there: not fp32 products


def test_chunked_loss_without_gradients_and_all_ignored():
    hidden, weight, targets = _case(torch.float32)
    with torch.no_grad():
        assert torch.allclose(
            linear_cross_entropy(hidden, weight, targets, chunk_tokens=5)[0],
            _unfused(hidden, weight, targets),
            rtol=0,
            atol=1e-6,
        )
    none = torch.full_like(targets, -100)
    assert math.isnan(linear_cross_entropy(hidden, weight, none)[0].item())
    assert math.isnan(_unfused(hidden, weight, none).item())


def test_default_chunk_bounds_the_fp32_logits():
    assert default_chunk_tokens(50304, 131072) == 1024  # 206 MB of fp32 logits per chunk
    assert default_chunk_tokens(65, 4096) == 4096  # a character vocabulary: one chunk
    assert default_chunk_tokens(50304, 100) == 100


def test_model_loss_equals_whole_logits_cross_entropy():
    torch.manual_seed(0)
    model = Transformer(tiny())
    x = torch.randint(0, 97, (2, 16))
    y = torch.randint(0, 97, (2, 16))
    y[1, :4] = -100
    loss = model(x, y).loss
    loss.backward()
    g_new = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    ref = _unfused(model.hidden_states(x), model.lm_head.weight, y)
    ref.backward()
    assert abs(loss.item() - ref.item()) <= 1e-6
    for a, p in zip(g_new, model.parameters(), strict=True):
        assert (a - p.grad).abs().max().item() <= 1e-6


# ----------------------------------------------------------------------------- probe


def _explicit_max_logits(model, x):
    """Per layer: the whole causal score matrix, as the model's old recording did."""
    out = []
    cos, sin = model.rope(0, x.shape[1])
    z = model.wte(x)
    for blk in model.blocks:
        a = blk.attn
        B, T, _ = z.shape
        H, KV, D = a.n_heads, a.n_kv_heads, a.head_dim
        q, k, _ = a.qkv(blk.norm1(z)).split([H * D, KV * D, KV * D], -1)
        q = q.view(B, T, H, D).transpose(1, 2)
        k = k.view(B, T, KV, D).transpose(1, 2)
        if a.q_norm is not None:
            q, k = a.q_norm(q), a.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        k = k.repeat_interleave(H // KV, 1)
        s = (q.float() @ k.float().transpose(-1, -2)).abs() / math.sqrt(D)
        out.append(s.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), 0).amax().item())
        z = blk(z, cos, sin)
    return out


@pytest.mark.parametrize("kw", [dict(n_kv_heads=2), dict(qk_norm=True), dict(block="parallel")])
def test_blockwise_max_logits_equal_the_whole_score_matrix(kw):
    torch.manual_seed(1)
    model = Transformer(tiny(**kw))
    model.train()
    x = torch.randint(0, 97, (2, 45))
    with torch.no_grad():
        ref = _explicit_max_logits(model, x)
    for block in (4, 16, 512):
        got = max_attention_logits(model, x, block=block)
        assert got == pytest.approx(ref, rel=1e-6)
    assert model.training  # mode restored
    for blk in model.blocks:  # no hooks left behind
        assert not blk.attn._forward_pre_hooks


def test_blockwise_max_logit_with_cached_keys():
    torch.manual_seed(2)
    q = torch.randn(1, 4, 6, 8)  # 6 queries at positions 10..15
    k = torch.randn(1, 2, 16, 8)
    full = (q @ k.repeat_interleave(2, 1).transpose(-1, -2)).abs() / math.sqrt(8)
    keep = torch.ones(6, 16, dtype=torch.bool).tril(10)
    ref = full.masked_fill(~keep, 0).amax()
    for block in (1, 3, 64):
        assert causal_max_abs_logit(q, k, start=10, block=block).item() == pytest.approx(
            ref.item(), rel=1e-6
        )


# ----------------------------------------------------------------------------- checkpointing


def test_checkpoint_layers_values_and_errors():
    assert [recompute_layers(v, 16) for v in (False, True, "none", "full", 0, 6, 16)] == [
        0,
        16,
        0,
        16,
        0,
        6,
        16,
    ]
    assert recompute_layers("auto", 16) is None
    for bad, words in (
        (17, ["=17", "model.n_layers=16", "0..16"]),
        (-1, ["=-1"]),
        ("ful", ["'ful'", "'full'", "'auto'"]),
        (2.5, ["2.5"]),
    ):
        with pytest.raises(ConfigError) as e:
            recompute_layers(bad, 16)
        assert "train.activation_checkpointing" in str(e.value)
        for w in words:
            assert w in str(e.value)
    assert describe_recompute(0, 16) == "none" and describe_recompute(16, 16).startswith("full")
    assert describe_recompute(6, 16) == "6 of 16 layers"


def test_config_accepts_checkpointing_choices():
    for v in (True, False, 4, "auto", "full", "none"):
        assert (
            from_dict(
                TrainConfig, {"activation_checkpointing": v}, "train"
            ).activation_checkpointing
            == v
        )
    with pytest.raises(ConfigError, match=r"train\.activation_checkpointing='ful'"):
        from_dict(TrainConfig, {"activation_checkpointing": "ful"}, "train")


def test_partial_checkpointing_gives_the_same_gradients():
    torch.manual_seed(0)
    model = Transformer(tiny(n_layers=4))
    x = torch.randint(0, 97, (2, 16))
    grads = {}
    for n in (0, 1, 3, True):
        model.zero_grad()
        model.gradient_checkpointing = n
        model(x, x).loss.backward()
        grads[n] = [p.grad.clone() for p in model.parameters()]
    for n in (1, 3, True):
        for a, b in zip(grads[n], grads[0], strict=True):
            assert torch.equal(a, b)


def test_loss_backend_choice():
    hidden, weight, targets = _case(torch.float32)
    ref, z_term = linear_cross_entropy(hidden, weight, targets)
    assert z_term.item() == 0.0  # always (loss, z term); no z-loss asked
    # CPU tensors: liger falls back to the chunked path.
    assert torch.equal(linear_cross_entropy(hidden, weight, targets, backend="liger")[0], ref)
    with pytest.raises(ValueError, match=r"train\.loss_backend='fused'.*'chunked' or 'liger'"):
        linear_cross_entropy(hidden, weight, targets, backend="fused")
    # The config refuses it before a run builds, naming the key and the choices.
    with pytest.raises(ConfigError, match=r"train\.loss_backend.*chunked.*liger"):
        from_dict(TrainConfig, {"loss_backend": "fused"}, "train")
    model = Transformer(tiny())
    model.loss_fn = lambda h, w, t, ignore_index, z_loss: (h.sum() * 0 + 7.0, h.new_zeros(()))
    x = torch.randint(0, 97, (1, 8))
    assert model(x, x).loss.item() == 7.0  # the injection point is what forward uses


@pytest.mark.gpu
def test_liger_backend_matches_the_chunked_loss_on_gpu():
    pytest.importorskip("liger_kernel")
    hidden, weight, targets = _case(torch.float32, n=(4, 256), d=64, vocab=1000)
    args = (hidden.cuda(), weight.cuda(), targets.cuda())
    chunked = _grads(lambda h, w, t: linear_cross_entropy(h, w, t, backend="chunked")[0], *args)
    liger = _grads(lambda h, w, t: linear_cross_entropy(h, w, t, backend="liger")[0], *args)
    for a, b in zip(liger, chunked, strict=True):
        assert (a - b).abs().max().item() <= 1e-5
