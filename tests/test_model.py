"""The model: rotary dims, RoPE properties, QK-Norm, KV cache, init, counts, bad configs."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from pretrain.config import ConfigError, ModelConfig, from_dict, load_model_config
from pretrain.model import KVCache, Transformer
from pretrain.model.rope import apply_rope, inverse_frequencies, rope_cache
from pretrain.weights import load_weights, save_weights

PRESETS = Path(__file__).resolve().parents[1] / "configs" / "models"


def tiny(**kw) -> ModelConfig:
    base = dict(
        vocab_size=97,
        pad_vocab_to_multiple=8,
        n_layers=2,
        d_model=64,
        n_heads=4,
        d_ff=96,
        max_seq_len=48,
    )
    base.update(kw)
    return ModelConfig(**base)


# ----------------------------------------------------------------------------- rotary dims

# The paper's Appendix A (head_dim -> {percent: rotary dims}).
APPENDIX_A = {
    256: {1: 2, 10: 26, 25: 64, 50: 128, 75: 192, 100: 256},
    64: {4: 2, 10: 6, 25: 16, 50: 32, 75: 48, 100: 64},
    128: {10: 12, 25: 32, 50: 64, 75: 96, 100: 128},
}


@pytest.mark.parametrize("head_dim", sorted(APPENDIX_A))
def test_rotary_dims_match_paper_appendix_a(head_dim):
    d_model = head_dim * 4
    for pct, dims in APPENDIX_A[head_dim].items():
        cfg = ModelConfig(d_model=d_model, n_heads=4, rope_fraction=pct / 100)
        assert cfg.rope_dims == dims, (head_dim, pct)


def test_nope_and_direct_rotary_dims():
    assert tiny(rope_fraction=0.0).rope_dims == 0
    assert tiny(rope_fraction=None, rotary_dims=6).rope_dims == 6


@pytest.mark.parametrize(
    "kw, words",
    [
        (dict(rope_fraction=None, rotary_dims=5), ["model.rotary_dims=5", "odd", "4 or 6"]),
        (dict(rope_fraction=0.01), ["model.rope_fraction=0.01", "0 rotary dims", "0.0625"]),
        (dict(rope_fraction=1.5), ["model.rope_fraction=1.5", "[0, 1]"]),
        (dict(rope_fraction=-0.1), ["model.rope_fraction=-0.1", "[0, 1]"]),
        (dict(n_kv_heads=3), ["model.n_heads=4", "model.n_kv_heads=3", "divisor"]),
        (dict(d_model=66), ["model.d_model=66", "model.n_heads=4"]),
        (dict(rope_fraction=0.5, rotary_dims=8), ["rotary_dims", "rope_fraction", "only one"]),
    ],
)
def test_bad_model_configs_name_field_and_fix(kw, words):
    with pytest.raises(ConfigError) as e:
        tiny(**kw)
    for w in words:
        assert w in str(e.value)


def test_unknown_names_and_keys_are_refused_with_the_key():
    with pytest.raises(ConfigError, match=r"model\.norm='batchnorm'.*'rmsnorm', 'layernorm'"):
        from_dict(ModelConfig, {"norm": "batchnorm"}, "model")
    with pytest.raises(ConfigError, match=r"model\.rope_thetaa.*did you mean model\.rope_theta\?"):
        from_dict(ModelConfig, {"rope_thetaa": 500}, "model")
    with pytest.raises(ConfigError, match=r"model\.n_layers='two' must be an integer"):
        from_dict(ModelConfig, {"n_layers": "two"}, "model")


def test_vocab_padding():
    assert ModelConfig(vocab_size=50277, pad_vocab_to_multiple=128).padded_vocab_size == 50304


# ----------------------------------------------------------------------------- RoPE


def _rotate_pair_reference(x: torch.Tensor, pos: int, r: int, theta: float) -> torch.Tensor:
    """RoPE written from the formula, dim by dim: pair (i, i + r/2) rotated by pos * theta^(-2i/r)."""
    out = x.clone().double()
    half = r // 2
    for i in range(half):
        ang = pos * theta ** (-2 * i / r)
        a, b = x[..., i].double(), x[..., i + half].double()
        out[..., i] = a * math.cos(ang) - b * math.sin(ang)
        out[..., i + half] = b * math.cos(ang) + a * math.sin(ang)
    return out


def test_apply_rope_matches_formula_and_leaves_the_rest_untouched():
    torch.manual_seed(0)
    hd, r, theta, T = 16, 6, 500.0, 9
    x = torch.randn(2, 3, T, hd)
    cos, sin = rope_cache(T, r, theta)
    y = apply_rope(x, cos, sin)
    for pos in range(T):
        ref = _rotate_pair_reference(x[:, :, pos], pos, r, theta)
        torch.testing.assert_close(y[:, :, pos].double(), ref, atol=1e-5, rtol=1e-5)
    assert torch.equal(y[..., r:], x[..., r:])  # dims past rotary_dims untouched
    cos0, sin0 = rope_cache(T, 0, theta)
    assert torch.equal(apply_rope(x, cos0, sin0), x)  # NoPE


def test_rope_dot_product_depends_only_on_relative_position():
    torch.manual_seed(1)
    hd, r = 32, 8
    q, k = torch.randn(hd), torch.randn(hd)
    cos, sin = rope_cache(64, r, 10000.0)

    def score(m, n):
        qm = apply_rope(q.expand(64, hd).clone(), cos, sin)[m]
        kn = apply_rope(k.expand(64, hd).clone(), cos, sin)[n]
        return float(qm @ kn)

    for delta in (0, 3, 17):
        scores = [score(m + delta, m) for m in (0, 5, 20, 40)]
        assert max(scores) - min(scores) < 1e-4, (delta, scores)
    assert abs(score(10, 0) - score(0, 0)) > 1e-3  # and it does depend on the offset


def test_theta_changes_the_result_but_not_the_cache_shape():
    x = torch.randn(1, 1, 16, 8)
    outs = []
    for theta in (500.0, 10000.0):
        cos, sin = rope_cache(16, 8, theta)
        assert cos.shape == (16, 8) and cos.dtype == torch.float32
        outs.append(apply_rope(x, cos, sin))
    assert (outs[0] - outs[1]).abs().max() > 1e-2
    inv = inverse_frequencies(8, 500.0)
    torch.testing.assert_close(inv, torch.tensor([500.0 ** (-2 * i / 8) for i in range(4)]))


def test_rope_cache_is_fp32_and_exact_in_a_bf16_model():
    cfg = tiny(rope_fraction=0.5, rope_theta=20000.0)
    model = Transformer(cfg).to(torch.bfloat16)
    cos, sin = rope_cache(cfg.max_seq_len, cfg.rope_dims, cfg.rope_theta)
    assert model.rope.cos.dtype == torch.float32 and model.rope.sin.dtype == torch.float32
    assert torch.equal(model.rope.cos, cos) and torch.equal(model.rope.sin, sin)
    assert model.blocks[0].attn.qkv.weight.dtype == torch.bfloat16
    logits = model(torch.randint(0, 97, (1, 10)))
    assert logits.dtype == torch.bfloat16 and torch.isfinite(logits.float()).all()


def test_one_rope_cache_per_model():
    model = Transformer(tiny(n_layers=3))
    rope_buffers = [n for n, _ in model.named_buffers() if "cos" in n or "sin" in n]
    assert rope_buffers == ["rope.cos", "rope.sin"]
    assert "rope.cos" not in model.state_dict()  # derived, never checkpointed


# ----------------------------------------------------------------------------- QK-Norm


@pytest.mark.parametrize("norm", ["rmsnorm", "layernorm"])
def test_qk_norm_with_gqa_normalizes_each_head_over_head_dim(norm):
    torch.manual_seed(0)
    cfg = tiny(n_heads=8, n_kv_heads=2, qk_norm=True, norm=norm)  # head_dim 8
    model = Transformer(cfg)
    attn = model.blocks[0].attn
    assert attn.q_norm.weight.shape == (cfg.head_dim,) and attn.k_norm.weight.shape == (
        cfg.head_dim,
    )
    seen = {}
    attn.q_norm.register_forward_hook(lambda m, i, o: seen.__setitem__("q", (i[0], o)))
    attn.k_norm.register_forward_hook(lambda m, i, o: seen.__setitem__("k", (i[0], o)))
    model(torch.randint(0, 97, (2, 12)))
    for name, heads in (("q", 8), ("k", 2)):
        inp, out = seen[name]  # (B, T, heads, head_dim): normed before the transpose
        assert inp.shape[2] == heads and inp.shape[-1] == cfg.head_dim
        x = inp.double()
        if norm == "layernorm":
            x = x - x.mean(-1, keepdim=True)
            ref = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + cfg.norm_eps)
        else:
            ref = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + cfg.norm_eps)
        torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
        # Normalizing over heads and head_dim together (GPT-NeoX's default) gives another result.
        joint = inp.double().flatten(2)
        joint = joint / torch.sqrt(joint.pow(2).mean(-1, keepdim=True) + cfg.norm_eps)
        assert (joint.view_as(inp) - ref).abs().max() > 1e-3


def test_qk_norm_changes_the_output():
    torch.manual_seed(0)
    a = Transformer(tiny(qk_norm=False))
    torch.manual_seed(0)
    b = Transformer(tiny(qk_norm=True))
    b.load_state_dict(a.state_dict(), strict=False)
    x = torch.randint(0, 97, (1, 8))
    assert (a(x) - b(x)).abs().max() > 1e-4


# ----------------------------------------------------------------------------- KV cache


@pytest.mark.parametrize("block", ["sequential", "parallel"])
@pytest.mark.parametrize("fraction", [0.0, 0.25, 1.0])
def test_kv_cache_decoding_equals_full_forward(block, fraction):
    torch.manual_seed(0)
    cfg = tiny(
        block=block,
        rope_fraction=fraction,
        n_kv_heads=2,
        qk_norm=fraction == 0.25,
        learned_pos_emb=fraction == 0.0,
        rope_theta=777.0,
    )
    model = Transformer(cfg).eval()
    x = torch.randint(0, 97, (2, 20))
    full = model(x)
    cache = KVCache(cfg, batch_size=2)
    chunks = [model(x[:, :7], kv_cache=cache)]  # prefill, then chunks of 1 and 5
    for s, e in [(7, 8), (8, 13), (13, 14), (14, 20)]:
        chunks.append(model(x[:, s:e], kv_cache=cache))
    assert cache.pos == 20
    torch.testing.assert_close(torch.cat(chunks, dim=1), full, atol=1e-5, rtol=1e-5)


def test_greedy_generate_equals_repeated_full_forward():
    """Greedy decoding with the KV cache gives the tokens of repeated full forwards, and the
    output layer never sees more than one position per sequence (at the prefill, the
    prompt's last one: (B, d) rows, not (B, T, d))."""
    torch.manual_seed(0)
    cfg = tiny(rope_fraction=0.25, n_kv_heads=2)
    model = Transformer(cfg).eval()
    prompt = torch.randint(0, 97, (2, 5))
    rows = []
    hook = model.lm_head.register_forward_hook(lambda m, i, o: rows.append(i[0].shape[:-1]))
    out = model.generate(prompt, max_new_tokens=8, temperature=0)
    hook.remove()
    assert rows[0] == (2,) and all(r.numel() == 2 for r in rows) and len(rows) == 8
    ref = prompt
    for _ in range(8):
        logits = model(ref)[:, -1, : cfg.vocab_size]
        ref = torch.cat([ref, logits.argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(out, ref)


def test_sampling_respects_top_k_and_never_samples_padding():
    torch.manual_seed(0)
    cfg = tiny()
    model = Transformer(cfg).eval()
    g = torch.Generator().manual_seed(0)
    out = model.generate(
        torch.zeros(4, 1, dtype=torch.long), 30, temperature=5.0, top_k=3, generator=g
    )
    assert out.max() < cfg.vocab_size
    # with top_k=1 sampling is greedy
    a = model.generate(torch.zeros(1, 2, dtype=torch.long), 6, temperature=1.0, top_k=1)
    b = model.generate(torch.zeros(1, 2, dtype=torch.long), 6, temperature=0)
    assert torch.equal(a, b)


def test_learned_positions_refuse_past_their_table_and_rope_runs_on():
    learned = Transformer(tiny(max_seq_len=16, learned_pos_emb=True))
    with pytest.raises(
        ValueError, match=r"learned position table \(model.learned_pos_emb, 16 rows"
    ):
        learned(torch.zeros(1, 17, dtype=torch.long))
    with pytest.raises(ValueError, match="learned position table"):
        learned.generate(torch.zeros(1, 10, dtype=torch.long), 7)
    torch.manual_seed(0)
    model = Transformer(tiny(max_seq_len=16)).eval()
    x = torch.randint(0, 97, (1, 40))
    with torch.no_grad():
        short, long = model(x[:, :16]), model(x)
    assert model.rope.cos.shape[0] >= 40  # grown on demand
    # Causal attention and a cache whose first rows did not change: the first 16 positions
    # give the same logits whatever follows them (to rounding: the matmuls differ in shape).
    torch.testing.assert_close(long[:, :16], short, rtol=0, atol=1e-5)


# ----------------------------------------------------------------------------- training bits


def test_loss_equals_cross_entropy_and_ignores_minus_100():
    torch.manual_seed(0)
    model = Transformer(tiny())
    x = torch.randint(0, 97, (2, 10))
    y = torch.randint(0, 97, (2, 10))
    y[0, :3] = -100
    logp = torch.log_softmax(model(x).double(), -1)
    keep = y != -100
    ref = -logp[keep].gather(-1, y[keep][:, None]).mean()
    assert abs(model(x, y).loss.item() - ref.item()) < 1e-5


def test_gradient_checkpointing_gives_the_same_gradients():
    torch.manual_seed(0)
    model = Transformer(tiny(dropout=0.0))
    x = torch.randint(0, 97, (2, 12))
    model(x, x).loss.backward()
    g1 = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    model.gradient_checkpointing = True
    model(x, x).loss.backward()
    for a, p in zip(g1, model.parameters(), strict=True):
        torch.testing.assert_close(a, p.grad)


@pytest.mark.parametrize("init", ["normal", "scaled_normal", "small_init"])
def test_initialisation_stds(init):
    torch.manual_seed(0)
    L, d = 4, 256
    model = Transformer(
        ModelConfig(
            vocab_size=512,
            n_layers=L,
            d_model=d,
            n_heads=4,
            d_ff=1024,
            max_seq_len=16,
            init=init,
            attn_bias=True,
        )
    )
    expected = {
        "normal": (0.02, 0.02),
        "scaled_normal": (0.02, 0.02 / math.sqrt(2 * L)),
        "small_init": (math.sqrt(2 / (5 * d)), 2 / (L * math.sqrt(d))),
    }[init]
    w_in = torch.cat([b.mlp.w_in.weight.flatten() for b in model.blocks])
    w_out = torch.cat(
        [
            torch.cat([b.mlp.w_out.weight.flatten(), b.attn.proj.weight.flatten()])
            for b in model.blocks
        ]
    )
    assert abs(w_in.std().item() / expected[0] - 1) < 0.02
    assert abs(w_out.std().item() / expected[1] - 1) < 0.02
    assert abs(model.wte.weight.std().item() / expected[0] - 1) < 0.02
    assert torch.all(model.blocks[0].attn.qkv.bias == 0)
    assert torch.all(model.blocks[0].norm1.weight == 1)


def test_max_attention_logit_matches_explicit_scores():
    torch.manual_seed(0)
    cfg = tiny(n_layers=1, n_kv_heads=2)
    model = Transformer(cfg)
    seen = {}
    attn = model.blocks[0].attn
    orig = attn.forward

    def spy(x, cos, sin, kv_cache=None, layer=0, documents=None):
        H, KV, D = attn.n_heads, attn.n_kv_heads, attn.head_dim
        q, k, _ = attn.qkv(x).split([H * D, KV * D, KV * D], -1)
        q = apply_rope(q.view(*x.shape[:2], H, D).transpose(1, 2), cos, sin)
        k = apply_rope(k.view(*x.shape[:2], KV, D).transpose(1, 2), cos, sin)
        k = k.repeat_interleave(H // KV, 1)
        s = (q @ k.transpose(-1, -2)) / math.sqrt(D)
        T = s.shape[-1]
        seen["ref"] = (
            s.detach().masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), 0).abs().max()
        )
        return orig(x, cos, sin, kv_cache, layer)

    attn.forward = spy
    x = torch.randint(0, 97, (2, 16))
    model(x)
    from pretrain.model.probes import max_attention_logits

    assert abs(max_attention_logits(model, x)[0] - seen["ref"].item()) < 1e-5


# ----------------------------------------------------------------------------- counts


def _count_by_hand(c: ModelConfig) -> tuple[int, int]:
    """(total, non-embedding) parameters from the shape, written out."""
    d, L, hd = c.d_model, c.n_layers, c.d_model // c.n_heads
    kv = c.n_kv_heads or c.n_heads
    V = math.ceil(c.vocab_size / c.pad_vocab_to_multiple) * c.pad_vocab_to_multiple
    attn = d * (c.n_heads * hd) + 2 * d * (kv * hd) + (c.n_heads * hd) * d
    if c.attn_bias:
        attn += c.n_heads * hd + 2 * kv * hd + d
    if c.mlp == "swiglu":
        mlp = 3 * d * c.d_ff + ((2 * c.d_ff + d) if c.mlp_bias else 0)
    else:
        mlp = 2 * d * c.d_ff + ((c.d_ff + d) if c.mlp_bias else 0)
    norm = d * (2 if c.norm == "layernorm" and c.norm_bias else 1)
    qk = 2 * hd * (2 if c.norm == "layernorm" and c.norm_bias else 1) if c.qk_norm else 0
    per_layer = attn + mlp + 2 * norm + qk
    non_emb = L * per_layer + norm
    emb = (
        V * d + (c.max_seq_len * d if c.learned_pos_emb else 0) + (0 if c.tie_embeddings else V * d)
    )
    return non_emb + emb, non_emb


@pytest.mark.parametrize(
    "preset", ["llama1b", "llama8b", "pythia1b_paper", "pythia1b", "gpt_char", "nanogpt_rope"]
)
def test_preset_parameter_counts(preset):
    cfg = load_model_config(PRESETS / f"{preset}.yaml")
    with torch.device("meta"):
        model = Transformer(cfg)
    total, non_emb = _count_by_hand(cfg)
    assert abs(model.num_params() / total - 1) < 0.005
    assert abs(model.num_params(exclude_embeddings=True) / non_emb - 1) < 0.005


def test_pythia1b_matches_the_published_size():
    # EleutherAI's Pythia-1B: 1,011,781,632 parameters (805,736,448 without embeddings).
    with torch.device("meta"):
        model = Transformer(load_model_config(PRESETS / "pythia1b.yaml"))
    assert (
        model.num_params()
        == 16 * (4 * 2048**2 + 3 * 2048 + 2048 + 2 * 2048 * 8192 + 8192 + 2048 + 4 * 2048)
        + 2 * 2048
        + 2 * 50304 * 2048
    )
    assert model.cfg.rope_dims == 64


@pytest.mark.parametrize("head_dim", [None, 24])  # 24: heads wider than d_model / n_heads
def test_flops_per_token_formula(head_dim):
    cfg = tiny(n_kv_heads=2, mlp="swiglu", head_dim=head_dim)
    model = Transformer(cfg)
    d, L, hd, T = cfg.d_model, cfg.n_layers, cfg.head_dim, 32
    V, H = cfg.padded_vocab_size, cfg.n_heads
    assert hd == (head_dim or d // H)
    attention = d * (H + 2 * cfg.kv_heads) * hd + H * hd * d  # qkv, output projection
    linear = L * (attention + 3 * d * cfg.d_ff) + d * V
    assert model.flops_per_token(T) == 6 * linear + 12 * L * H * hd * T


# ----------------------------------------------------------------------------- weights


def test_weights_roundtrip_tied_and_bf16(tmp_path):
    torch.manual_seed(0)
    cfg = tiny(tie_embeddings=True, rope_fraction=0.25, qk_norm=True)
    model = Transformer(cfg).eval()
    save_weights(model, tmp_path / "w", {"train": {"seed": 1}})
    loaded, full = load_weights(tmp_path / "w")
    assert full["train"] == {"seed": 1} and full["model"]["rope_fraction"] == 0.25
    assert loaded.lm_head.weight.data_ptr() == loaded.wte.weight.data_ptr()
    x = torch.randint(0, 97, (2, 9))
    assert torch.equal(loaded(x), model(x))
    bf, _ = load_weights(tmp_path / "w", dtype=torch.bfloat16)
    assert bf.rope.cos.dtype == torch.float32


def test_attention_injection_point_is_what_every_block_calls():
    """The planner's FlashAttention stand-in goes in through Transformer.set_attention_fn; no
    global is rebound, so another model (and torch's F) is untouched."""
    import torch.nn.functional as F

    model, other = Transformer(tiny()), Transformer(tiny())
    x = torch.randint(0, 97, (2, 9))
    calls = []

    def recording(q, k, v, **kw):
        calls.append(tuple(q.shape))
        return F.scaled_dot_product_attention(q, k, v, **kw)

    want = model(x)
    model.set_attention_fn(recording)
    assert torch.equal(model(x), want)  # the same kernel behind it: the same logits
    assert len(calls) == model.cfg.n_layers and calls[0][2] == 9
    other(x)
    assert len(calls) == model.cfg.n_layers  # the other model does not use it
    model.set_attention_fn(None)
    model(x)
    assert len(calls) == model.cfg.n_layers
