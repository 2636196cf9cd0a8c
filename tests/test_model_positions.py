"""Per-layer positions (pretrain/model/position.py) against references nobody here wrote:
NoPE layers and sliding windows against transformers' own SmolLM3ForCausalLM (SmolLM3's
no_rope_layer_interval and layer_types) and MistralForCausalLM built from the same weights;
p-RoPE frequencies against the paper's formula; ALiBi slopes against Press et al.'s formula
and transformers' Bloom `build_alibi_tensor`, and attention against a brute-force reference;
sliding-window FLOPs against a brute-force count of attended pairs; decoding through the KV
cache against full recomputation for every variant."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from pretrain.config import ConfigError, ModelConfig
from pretrain.model.attention import attend, choose_kernel
from pretrain.model.document_attention import DocumentMask, document_attention_backend
from pretrain.model.position import alibi_slopes, attended_pairs, layer_positions
from pretrain.model.transformer import Transformer

V, T = 101, 24


def tiny(**kw) -> ModelConfig:
    """Llama-shaped (RMSNorm, SwiGLU, no biases), GQA, fp32; 4 layers so every 4th is one."""
    base = dict(
        vocab_size=V,
        pad_vocab_to_multiple=1,
        n_layers=4,
        d_model=64,
        n_heads=4,
        n_kv_heads=2,
        d_ff=96,
        max_seq_len=64,
        mlp_bias=False,
        norm_eps=1e-6,
        rope_theta=1000.0,
    )
    return ModelConfig(**{**base, **kw})


def model_of(cfg: ModelConfig, seed: int = 0) -> Transformer:
    torch.manual_seed(seed)
    model = Transformer(cfg).eval()
    with torch.no_grad():  # norms away from 1, so a swapped norm would show
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    return model


def llama_state(model: Transformer) -> dict[str, torch.Tensor]:
    """Our weights under transformers' Llama-family names (SmolLM3, Mistral, Qwen2)."""
    c = model.cfg
    H, KV, D = c.n_heads, c.kv_heads, c.head_dim
    out = {
        "model.embed_tokens.weight": model.wte.weight,
        "model.norm.weight": model.norm_f.weight,
        "lm_head.weight": model.lm_head.weight,
    }
    for i, b in enumerate(model.blocks):
        pre = f"model.layers.{i}."
        q, k, v = b.attn.qkv.weight.split([H * D, KV * D, KV * D])
        gate, up = b.mlp.w_in.weight.chunk(2)
        out |= {
            pre + "input_layernorm.weight": b.norm1.weight,
            pre + "post_attention_layernorm.weight": b.norm2.weight,
            pre + "self_attn.q_proj.weight": q,
            pre + "self_attn.k_proj.weight": k,
            pre + "self_attn.v_proj.weight": v,
            pre + "self_attn.o_proj.weight": b.attn.proj.weight,
            pre + "mlp.gate_proj.weight": gate,
            pre + "mlp.up_proj.weight": up,
            pre + "mlp.down_proj.weight": b.mlp.w_out.weight,
        }
    return {k: v.detach().clone() for k, v in out.items()}


def hf_common(cfg: ModelConfig) -> dict:
    return dict(
        vocab_size=cfg.padded_vocab_size,
        hidden_size=cfg.d_model,
        intermediate_size=cfg.d_ff,
        num_hidden_layers=cfg.n_layers,
        num_attention_heads=cfg.n_heads,
        num_key_value_heads=cfg.kv_heads,
        max_position_embeddings=cfg.max_seq_len,
        rms_norm_eps=cfg.norm_eps,
        tie_word_embeddings=False,
        attention_dropout=0.0,
        pad_token_id=0,
        bos_token_id=0,
        eos_token_id=0,
    )


def hf_model(cls, config):
    config._attn_implementation = "eager"
    m = cls(config).eval()
    return m


def compare(ours: Transformer, theirs, tol: float = 1e-5) -> float:
    missing, unexpected = theirs.load_state_dict(llama_state(ours), strict=False)
    assert not unexpected and not [k for k in missing if "rotary" not in k], (missing, unexpected)
    ids = torch.randint(0, V, (2, T), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = theirs(ids).logits
        got = ours(ids)
    diff = (got - want).abs().max().item()
    assert diff < tol, diff
    return diff


# ----------------------------------------------------------------------------- NoPE layers


def smollm3(cfg: ModelConfig, **kw):
    from transformers import SmolLM3Config, SmolLM3ForCausalLM

    config = SmolLM3Config(
        **hf_common(cfg),
        rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta},
        **kw,
    )
    return hf_model(SmolLM3ForCausalLM, config)


def test_nope_every_is_smollm3s_no_rope_layer_interval():
    """model.nope_every=4 against SmolLM3 with its own no_rope_layer_interval=4 (layer 3 of
    4 NoPE): logits to 1e-5 in fp32; the same model with RoPE everywhere is far away."""
    cfg = tiny(nope_every=4)
    assert [p.rope for p in layer_positions(cfg)] == [True, True, True, False]
    theirs = smollm3(cfg, no_rope_layer_interval=4)
    assert theirs.config.no_rope_layers == [1, 1, 1, 0]
    compare(model_of(cfg), theirs)
    everywhere = model_of(tiny())
    with pytest.raises(AssertionError):
        compare(everywhere, theirs, tol=1e-3)


def test_nope_layers_list_against_smollm3s_flags():
    cfg = tiny(nope_layers=[0, 2])
    theirs = smollm3(cfg, no_rope_layers=[0, 1, 0, 1])
    compare(model_of(cfg), theirs)


def test_sliding_windows_and_nope_layers_against_smollm3_layer_types():
    """Sliding windows (W = 5 < T) on layers 0 and 2, NoPE on layer 3: SmolLM3 with
    use_sliding_window and layer_types, attention eager (transformers' own masks)."""
    cfg = tiny(sliding_window=5, layer_types=["sliding", "full", "sliding", "full"], nope_every=4)
    theirs = smollm3(
        cfg,
        no_rope_layer_interval=4,
        use_sliding_window=True,
        sliding_window=5,
        layer_types=["sliding_attention", "full_attention"] * 2,
    )
    compare(model_of(cfg), theirs)


def test_every_layer_sliding_against_mistral():
    from transformers import MistralConfig, MistralForCausalLM

    cfg = tiny(sliding_window=7)
    config = MistralConfig(
        **hf_common(cfg),
        sliding_window=7,
        head_dim=cfg.head_dim,
        rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta},
    )
    compare(model_of(cfg), hf_model(MistralForCausalLM, config))
    # a window as long as the sequence is full attention: the plain model's logits
    ids = torch.randint(0, V, (1, T))
    with torch.no_grad():
        assert torch.allclose(
            model_of(tiny(sliding_window=T))(ids), model_of(tiny())(ids), atol=1e-6
        )


def test_global_theta_layers_match_gemma3s_rotary_tables():
    """Gemma 3's pattern (every 6th layer full) and its two thetas: the full layers read
    the cos/sin of global_rope_theta, the sliding ones of rope_theta, as transformers'
    Gemma3 rotary embedding computes them per layer type; one cache per theta."""
    from transformers import Gemma3TextConfig
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RotaryEmbedding

    cfg = tiny(
        n_layers=6,
        sliding_window=4,
        sliding_window_pattern=6,
        rope_theta=10000.0,
        global_rope_theta=1e6,
    )
    assert cfg.attention_types == ["sliding"] * 5 + ["full"]
    config = Gemma3TextConfig(
        **{**hf_common(cfg), "num_hidden_layers": 6},
        head_dim=cfg.head_dim,
        sliding_window=4,
        rope_parameters={
            "full_attention": {"rope_type": "default", "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        },
    )
    assert config.layer_types == ["sliding_attention"] * 5 + ["full_attention"]
    rotary = Gemma3RotaryEmbedding(config)
    x = torch.zeros(1, T, cfg.d_model)
    pos = torch.arange(T)[None]
    model = model_of(cfg)
    assert len(model.rope.caches) == 2
    for i, (cos, sin) in enumerate(model.rope.per_layer(0, T)):
        kind = config.layer_types[i]
        want_cos, want_sin = rotary(x, pos, layer_type=kind)
        torch.testing.assert_close(cos, want_cos[0], rtol=0, atol=1e-6)
        torch.testing.assert_close(sin, want_sin[0], rtol=0, atol=1e-6)


# ----------------------------------------------------------------------------- p-RoPE


def test_p_rope_keeps_the_highest_frequencies_of_full_rope():
    """Barbero et al. (2025): full RoPE's frequencies theta^(-2j/head_dim), j < head_dim/2;
    p-RoPE with r rotary dims keeps the r/2 highest (j < r/2) and drops the lowest. NeoX's
    partial RoPE instead rescales theta^(-2j/r) over the r dims."""
    head_dim, r, theta = 16, 4, 1000.0
    cfg = tiny(rope_fraction=r / head_dim, rope_spectrum="p_rope", rope_theta=theta)
    full = [theta ** (-2 * j / head_dim) for j in range(head_dim // 2)]
    keep = sorted(full, reverse=True)[: r // 2]
    (p,) = {q.cache_key: q for q in layer_positions(cfg)}.values()
    torch.testing.assert_close(p.inverse_frequencies(), torch.tensor(keep), rtol=1e-7, atol=0)
    neox = [theta ** (-2 * j / r) for j in range(r // 2)]
    assert not math.isclose(neox[1], keep[1])
    model = model_of(cfg)
    cos, sin = model.rope(0, T)
    angles = torch.arange(T, dtype=torch.float64)[:, None] * torch.tensor(keep, dtype=torch.float64)
    torch.testing.assert_close(cos, torch.cat([angles.cos()] * 2, -1).float(), rtol=0, atol=1e-6)
    torch.testing.assert_close(sin, torch.cat([angles.sin()] * 2, -1).float(), rtol=0, atol=1e-6)
    # p-RoPE at theta is NeoX at theta^(r/head_dim) on the same dims
    same = model_of(tiny(rope_fraction=r / head_dim, rope_theta=theta ** (r / head_dim)))
    ids = torch.randint(0, V, (1, T))
    with torch.no_grad():
        torch.testing.assert_close(model(ids), same(ids), rtol=0, atol=1e-5)
    # and at full rotation both spectra are full RoPE, bit for bit
    with torch.no_grad():
        assert torch.equal(model_of(tiny(rope_spectrum="p_rope"))(ids), model_of(tiny())(ids))


# ----------------------------------------------------------------------------- ALiBi


def test_alibi_slopes_are_press_et_al_and_blooms():
    from transformers.models.bloom.modeling_bloom import build_alibi_tensor

    for n in (1, 2, 4, 8, 16, 32):  # the paper: 2^(-8i/n), i = 1..n
        want = torch.tensor([2 ** (-8 * i / n) for i in range(1, n + 1)])
        torch.testing.assert_close(alibi_slopes(n), want, rtol=0, atol=0)
    for n in (3, 5, 6, 12, 20, 24, 40):  # the paper's repository, through Bloom
        bias = build_alibi_tensor(torch.ones(1, 3), n, torch.float32)  # (n, 1, 3): slope x j
        torch.testing.assert_close(alibi_slopes(n), bias[:, 0, 1], rtol=1e-6, atol=0)
    # 12 heads: the 8 of 2^(-8i/8), then every other one of the 16-head sequence
    assert alibi_slopes(12)[8:].tolist() == pytest.approx(
        [2 ** (-8 * i / 16) for i in (1, 3, 5, 7)]
    )


B, H, KV, D = 2, 4, 2, 16
IDS = torch.tensor([[0] * 5 + [1] * 11 + [2] * 8, [0] * 12 + [1] * 12])


def brute_force(q, k, v, cached=0, window=None, slopes=None, ids=None, cap=0.0):
    """Attention from the definitions, fp64, loop-free but with nothing shared with attend."""
    q, k, v = q.double(), k.double(), v.double()
    k, v = k.repeat_interleave(H // KV, 1), v.repeat_interleave(H // KV, 1)
    n = q.shape[2]
    scores = q @ k.transpose(-2, -1) / D**0.5
    if cap:
        scores = torch.tanh(scores / cap) * cap
    i = torch.arange(n)[:, None] + cached
    j = torch.arange(cached + n)[None]
    ok = j <= i
    if window is not None:
        ok &= i - j < window
    if slopes is not None:
        scores = scores - slopes.double()[:, None, None] * (i - j)
    ok = ok.expand(B, 1, n, cached + n)
    if ids is not None:
        ok = ok & (ids[:, None, :, None] == ids[:, None, None, :])
    return torch.softmax(scores.masked_fill(~ok, float("-inf")), -1) @ v


@torch.no_grad()
@pytest.mark.parametrize("kernel", ["sdpa", "flex", "injected", "unfused"])
@pytest.mark.parametrize("documents", [False, True])
@pytest.mark.parametrize("window, alibi", [(5, False), (None, True), (6, True)])
def test_windows_and_alibi_on_every_kernel_are_the_brute_force(kernel, documents, window, alibi):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, n, T, D, generator=g) for n in (H, KV, KV))
    slopes = alibi_slopes(H) if alibi else None
    docs = DocumentMask.build(IDS, "sdpa_mask", compile=False) if documents else None
    cap = 3.0 if kernel == "unfused" else 0.0
    fn = F.scaled_dot_product_attention if kernel == "injected" else None
    got = attend(
        q, k, v, kernel=kernel, documents=docs, window=window, slopes=slopes, fn=fn, soft_cap=cap
    )
    want = brute_force(
        q, k, v, window=window, slopes=slopes, ids=IDS if documents else None, cap=cap
    )
    plain = brute_force(q, k, v, ids=IDS if documents else None, cap=cap)
    assert (want - plain).abs().max() > 0.05  # the window / bias changes the result
    torch.testing.assert_close(got.double(), want, rtol=0, atol=1e-5)


@torch.no_grad()
def test_decoding_after_cached_keys_with_window_and_alibi():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, H, 3, D, generator=g)
    k, v = torch.randn(B, KV, 10, D, generator=g), torch.randn(B, KV, 10, D, generator=g)
    got = attend(q, k, v, kernel="sdpa", cached=7, window=4, slopes=alibi_slopes(H))
    want = brute_force(q, k, v, cached=7, window=4, slopes=alibi_slopes(H))
    torch.testing.assert_close(got.double(), want, rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match="^attend: kernel='flex'"):
        attend(q, k, v, kernel="flex", cached=7, window=4)


def test_choose_kernel_runs_windows_and_alibi_through_flex_on_cuda_only():
    """FlexAttention (block masks, a score modifier) for windows and ALiBi where it runs:
    CUDA, no dropout, no cached keys (decoding takes the small dense mask), no injected
    kernel or cap; SDPA with the dense mask everywhere else."""
    import itertools

    for device, window, alibi, cached, dropout, injected in itertools.product(
        ["cpu", "cuda"], [False, True], [False, True], [False, True], [0.0, 0.1], [False, True]
    ):
        facts = dict(head_dim=64, documents=False, dropout=dropout, soft_cap=0.0)
        got = choose_kernel(
            device, **facts, injected=injected, window=window, alibi=alibi, cached=cached
        )
        flex = document_attention_backend(device, 64, dropout, 0.0) == "flex"
        want = (
            "injected"
            if injected
            else "flex"
            if (window or alibi) and not cached and flex
            else "sdpa"
        )
        assert got == want, (device, window, alibi, cached, dropout, injected)
    assert choose_kernel("cuda", **dict(facts, dropout=0.0), injected=False) == "sdpa"


@torch.no_grad()
def test_alibi_model_against_a_brute_force_kernel():
    """A whole ALiBi model (RoPE on 2 layers, NoPE on the others, a window on one): its
    logits equal the same model whose every attention is the brute force above, injected
    in place of the kernel (it ignores the mask it is handed and builds its own)."""
    cfg = tiny(
        alibi=True, nope_layers=[1, 3], sliding_window=6, layer_types=["sliding"] + ["full"] * 3
    )
    model = model_of(cfg)
    ids = torch.randint(0, V, (B, T))
    got = model(ids)
    windows = iter([6, None, None, None])

    def reference(q, k, v, **kw):
        return brute_force(q, k, v, window=next(windows), slopes=alibi_slopes(H)).float()

    model.set_attention_fn(reference)
    torch.testing.assert_close(got, model(ids), rtol=0, atol=1e-5)
    model.set_attention_fn(None)
    # ALiBi with document masking: each packed document scores as it would alone
    alone = model(ids[:1, 5:16])
    packed = model(
        ids[:1],
        document_ids=IDS[:1],
        position_ids=torch.cat([torch.arange(5), torch.arange(11), torch.arange(8)])[None],
    )
    torch.testing.assert_close(packed[:, 5:16], alone, rtol=0, atol=1e-5)


# ----------------------------------------------------------------------------- FLOPs


def test_sliding_window_flops_count_attended_pairs():
    def brute(seq, w):
        return sum(1 for i in range(seq) for j in range(seq) if j <= i and (w is None or i - j < w))

    for seq in (1, 7, 64, 100):
        for w in (None, 1, 5, 64, 200):
            assert attended_pairs(seq, w) == brute(seq, w), (seq, w)
    full, slid = tiny(), tiny(sliding_window=16, sliding_window_pattern=4)
    a, b = Transformer(full), Transformer(slid)
    c = full
    per_layer = 12 * c.n_heads * c.head_dim * 64  # a full layer's attention FLOPs per token
    saved = 3 * per_layer * (1 - brute(64, 16) / brute(64, None))  # 3 sliding layers
    assert a.flops_per_token(64) - b.flops_per_token(64) == pytest.approx(saved)
    assert b.attention_shares(64) == [brute(64, 16) / brute(64, None)] * 3 + [1.0]


# ----------------------------------------------------------------------------- decoding


VARIANTS = {
    "nope_every": dict(nope_every=2),
    "p_rope": dict(rope_fraction=0.5, rope_spectrum="p_rope"),
    "sliding": dict(sliding_window=5, sliding_window_pattern=2, global_rope_theta=50000.0),
    "sliding_all": dict(sliding_window=1),
    "alibi": dict(alibi=True, rope_fraction=0.0),
    "alibi_rope_sliding": dict(alibi=True, sliding_window=4, nope_layers=[0]),
}


@torch.no_grad()
@pytest.mark.parametrize("name", list(VARIANTS))
def test_kv_cache_decoding_equals_full_recomputation(name):
    """A prompt of 9, then 15 tokens one at a time through the cache (a sliding layer keeps
    W - 1 keys): the logits of every step equal one forward over the whole sequence, and
    generate's greedy tokens equal argmax of full recomputation."""
    from pretrain.model.attention import KVCache

    model = model_of(tiny(**VARIANTS[name]))
    ids = torch.randint(0, V, (2, T), generator=torch.Generator().manual_seed(3))
    want = model(ids)
    cache = KVCache(model.cfg, 2, T)
    steps = [model(ids[:, :9], kv_cache=cache)]
    steps += [model(ids[:, t : t + 1], kv_cache=cache) for t in range(9, T)]
    torch.testing.assert_close(torch.cat(steps, 1), want, rtol=0, atol=2e-5)
    w = model.cfg.sliding_window
    for layer, p in enumerate(model.layer_positions()):
        if p.window is not None:
            assert cache.k[layer].shape[2] == min(w - 1, T)
    out = model.generate(ids[:, :6], 10, temperature=0)
    seq = ids[:, :6]
    for _ in range(10):
        seq = torch.cat([seq, model(seq)[:, -1].argmax(-1, keepdim=True)], 1)
    assert torch.equal(out, seq)


# ----------------------------------------------------------------------------- config


@pytest.mark.parametrize(
    "kw, words",
    [
        (dict(nope_layers=[1], nope_every=2), "model.nope_layers and model.nope_every"),
        (dict(nope_layers=[4]), "model.nope_layers=[4]"),
        (dict(nope_layers=[1, 1]), "repeats"),
        (dict(nope_layers=[0, 1, 2, 3]), "rope_fraction: 0"),
        (dict(nope_every=1), "model.nope_every=1 must be >= 2"),
        (dict(nope_every=2, rope_fraction=0.0), "model.nope_every with 0 rotary dims"),
        (dict(rope_spectrum="pope"), "model.rope_spectrum='pope'"),
        (dict(sliding_window=0), "model.sliding_window=0"),
        (dict(sliding_window_pattern=2), "model.sliding_window_pattern needs model.sliding_window"),
        (dict(layer_types=["full"] * 4), "model.layer_types needs model.sliding_window"),
        (dict(sliding_window=4, layer_types=["full"]), "model.layer_types has 1 entries"),
        (dict(sliding_window=4, layer_types=["full", "local"] * 2), "use one of 'full', 'sliding'"),
        (dict(sliding_window=4, sliding_window_pattern=1), "model.sliding_window_pattern=1"),
        (dict(sliding_window=4, global_rope_theta=1e6), "no layer is full attention"),
        (dict(alibi=True, attn_logit_softcap=30.0), "model.alibi with model.attn_logit_softcap"),
    ],
)
def test_bad_position_settings_are_one_line_naming_the_field(kw, words):
    with pytest.raises(ConfigError) as err:
        tiny(**kw)
    assert words in str(err.value) and "\n" not in str(err.value)


def test_yaml_keys_load_and_check_types():
    from pretrain.config import from_dict

    cfg = from_dict(
        ModelConfig,
        {"n_layers": 4, "sliding_window": 8, "layer_types": ["sliding", "full"] * 2},
        "model",
    )
    assert cfg.attention_types == ["sliding", "full"] * 2
    with pytest.raises(ConfigError, match=r"model\.layer_types\[1\]='global' is not allowed"):
        from_dict(ModelConfig, {"sliding_window": 8, "layer_types": ["full", "global"]}, "model")


def test_uniform_models_hold_one_cache_and_mixed_ones_one_per_setting():
    assert len(Transformer(tiny()).rope.caches) == 1
    assert len(Transformer(tiny(nope_every=2)).rope.caches) == 1  # NoPE layers hold none
    m = Transformer(tiny(sliding_window=4, sliding_window_pattern=2, global_rope_theta=1e5))
    assert len(m.rope.caches) == 2
    assert [p.theta for p in m.layer_positions()] == [1000.0, 1e5, 1000.0, 1e5]
    assert m.rope.cache_bytes() == 2 * 2 * 64 * 16 * 4


def test_planner_counts_the_pairs_sliding_layers_attend():
    from pretrain.planner.search import flops_per_token

    cfg = tiny(sliding_window=16)
    model, executed = flops_per_token(cfg, 64, 0)
    assert model == executed == Transformer(cfg).flops_per_token(64)
    _, recomputed = flops_per_token(cfg, 64, 2)
    share = attended_pairs(64, 16) / attended_pairs(64, None)
    block = sum(
        p.numel() for n, p in Transformer(cfg).blocks[0].named_parameters() if "norm" not in n
    )
    want = 2 * (2 * block + 4 * cfg.n_heads * cfg.head_dim * 64 * share)
    assert recomputed - executed == pytest.approx(want)


def test_an_alibi_model_round_trips_through_its_weights_folder(tmp_path):
    """load_weights builds the model on the meta device (export, evaluation, passkey do too):
    the slopes are derived, not loaded, and must not land on meta (the worked example's
    evaluation of its ALiBi runs failed there: "Cannot copy out of meta tensor")."""
    from pretrain.config import to_dict
    from pretrain.weights import load_weights, save_weights

    cfg = ModelConfig(
        vocab_size=64,
        pad_vocab_to_multiple=1,
        n_layers=2,
        d_model=32,
        n_heads=4,
        d_ff=64,
        max_seq_len=32,
        rope_fraction=0.0,
        alibi=True,
        nope_every=None,
    )
    torch.manual_seed(0)
    model = Transformer(cfg).eval()
    save_weights(model, tmp_path / "w", config={"model": to_dict(cfg)})
    loaded, _ = load_weights(tmp_path / "w")
    x = torch.randint(0, 64, (2, 32))
    with torch.no_grad():
        assert torch.equal(loaded(x), model(x))


def _same(t):
    return t


def _keep(into: list):
    """A pack hook that counts the tensors saved for the backward into `into`."""

    def pack(t):
        into.append(t)
        return t

    return pack


def test_recompute_gives_the_same_gradients_for_every_position_variant():
    """Activation checkpointing re-runs a block's forward in the backward: with per-layer
    positions, windows and ALiBi it must rebuild the same masks, biases and rotations."""
    fields = dict(vocab_size=64, pad_vocab_to_multiple=1, n_layers=4, d_model=32, n_heads=4)
    variants = {
        "nope_every_2": dict(nope_every=2),
        "windows": dict(sliding_window=5, sliding_window_pattern=2, global_rope_theta=5e5),
        "p_rope": dict(rope_fraction=0.5, rope_spectrum="p_rope"),
        "alibi_nope_windows": dict(rope_fraction=0.0, alibi=True, sliding_window=6),
    }
    x = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(3))
    for name, extra in variants.items():
        cfg = ModelConfig(**fields, d_ff=64, max_seq_len=16, **extra)
        torch.manual_seed(0)
        model = Transformer(cfg)
        grads, saved = [], []
        for layers in (0, cfg.n_layers):
            model.zero_grad(set_to_none=True)
            model.gradient_checkpointing = layers
            packed: list[torch.Tensor] = []
            with torch.autograd.graph.saved_tensors_hooks(_keep(packed), _same):
                loss = model(x, targets=x).loss
            loss.backward()
            saved.append(len(packed))
            grads.append([p.grad.clone() for p in model.parameters()])
        assert saved[1] < saved[0] / 2, (name, saved)  # the recomputed blocks kept their input
        for a, b in zip(*grads, strict=True):
            assert torch.equal(a, b), name
