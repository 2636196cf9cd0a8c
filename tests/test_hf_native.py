"""Native classes in and out (issue 44): Qwen3, Mistral, Phi3, Qwen2 and Llama 3.x's llama3
RoPE scaling imported from models transformers builds itself, with its logits; our models
exported as those classes (and partial RoPE / p-RoPE / NoPE as Llama's proportional RoPE),
transformers' logits, KV cache and 32 greedy tokens equal to ours, imported back exactly;
what the model cannot hold refused in one line naming it.

The same exports load in plain transformers at both ends of the supported range in
tests/test_hf_export.py (`make test-exports`).
"""

from __future__ import annotations

import re

import pytest
import torch
import transformers
from test_hf_parity import LLAMA, check_same, random_model

from pretrain.hf import HFConversionError, export_hf, from_hf
from pretrain.hf.check import check_parity
from pretrain.hf.convert import choose_target, config_from_hf
from pretrain.hf.folder import read_hf_folder
from pretrain.model.rope import scaled_frequencies

SMALL = dict(
    vocab_size=320,
    hidden_size=64,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=96,
    max_position_embeddings=128,
    pad_token_id=None,  # Phi-3's defaults (32000) are past this vocabulary
    bos_token_id=None,
    eos_token_id=None,
)


def built_by_transformers(cls_name: str, seed: int = 0, **fields):
    """A transformers model of the class, its weights transformers' own initialisation plus
    noise (norms and biases too, so nothing hides), in fp32."""
    config_name = {"Gemma3ForCausalLM": "Gemma3TextConfig"}.get(cls_name)
    config_cls = getattr(transformers, config_name or cls_name.replace("ForCausalLM", "Config"))
    torch.manual_seed(seed)
    hf = getattr(transformers, cls_name)(config_cls(**{**SMALL, **fields})).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return hf


IMPORTS = {
    "qwen3": ("Qwen3ForCausalLM", dict(head_dim=16), dict(qk_norm=True, rope_dims=16)),
    "qwen3_bias_windows": (
        "Qwen3ForCausalLM",
        dict(
            head_dim=16,
            attention_bias=True,
            use_sliding_window=True,
            sliding_window=8,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        ),
        dict(qk_norm=True, attn_bias=True, sliding_window=8),
    ),
    # Qwen3-0.6B's shape in small: heads wider than hidden_size / heads (32 x 4 on 64)
    "qwen3_wide_heads": (
        "Qwen3ForCausalLM",
        dict(head_dim=32),
        dict(qk_norm=True, head_dim=32, head_dim_decoupled=True, rope_dims=32),
    ),
    # and narrower (8 x 4 on 64; Mistral-Nemo's 32 x 128 on 5120 is wider)
    "mistral_narrow_heads": (
        "MistralForCausalLM",
        dict(head_dim=8, sliding_window=None),
        dict(head_dim=8, head_dim_decoupled=True, rope_dims=8),
    ),
    "mistral": ("MistralForCausalLM", dict(sliding_window=8), dict(sliding_window=8)),
    "mistral_no_window": ("MistralForCausalLM", dict(sliding_window=None), dict()),
    "phi3_partial": (
        "Phi3ForCausalLM",
        dict(
            rope_parameters={
                "rope_type": "default",
                "rope_theta": 500.0,
                "partial_rotary_factor": 0.5,
            }
        ),
        dict(rope_dims=8, rope_theta=500.0),
    ),
    "qwen2": ("Qwen2ForCausalLM", dict(), dict(attn_bias=True)),
    "llama3_scaling": (
        "LlamaForCausalLM",
        dict(
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            }
        ),
        dict(rope_theta=500000.0),
    ),
}


@pytest.mark.parametrize("name", sorted(IMPORTS))
def test_native_class_imports_with_transformers_logits(name):
    cls, fields, expect = IMPORTS[name]
    hf = built_by_transformers(cls, **fields)
    ours = from_hf(hf)
    for key, value in expect.items():
        assert getattr(ours.cfg, key) == value, (key, getattr(ours.cfg, key))
    check_same(ours, hf, 0)
    # past the original length too, where llama3's interpolated low frequencies act
    x = torch.randint(0, 320, (2, 120), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert (ours(x) - hf(x).logits).abs().max().item() < 1e-4


def test_qwen2s_missing_output_bias_is_imported_as_zeros():
    hf = built_by_transformers("Qwen2ForCausalLM")
    ours = from_hf(hf)
    for block in ours.blocks:
        assert not block.attn.proj.bias.any()
        assert block.attn.qkv.bias.abs().sum() > 0  # q, k, v biases: transformers' own


def test_llama3_frequencies_are_transformers_own():
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf = built_by_transformers("LlamaForCausalLM", **IMPORTS["llama3_scaling"][1])
    theirs, _ = ROPE_INIT_FUNCTIONS["llama3"](hf.config, "cpu")
    cfg = config_from_hf(hf.config)
    ours, factor = scaled_frequencies(cfg.rope_dims, cfg.rope_theta, cfg.rope_scaling, 128)
    assert factor == 1.0
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=0)
    # all three regimes present: kept, blended and interpolated frequencies
    base, _ = scaled_frequencies(cfg.rope_dims, cfg.rope_theta)
    ratio = (base / ours).tolist()
    assert min(ratio) == 1.0 and max(ratio) == pytest.approx(8.0)
    assert any(1.0 < r < 8.0 for r in ratio)


# Phi-3's long-context scaling: no RoPE of ours computes it.
LONGROPE = {
    "rope_type": "longrope",
    "rope_theta": 10000.0,
    "short_factor": [1.0] * 8,
    "long_factor": [2.0] * 8,
    "original_max_position_embeddings": 64,
}


@pytest.mark.parametrize(
    "cls, fields, words",
    [
        ("Phi3ForCausalLM", dict(rope_parameters=LONGROPE), "rope_type 'longrope'"),
        ("Gemma3ForCausalLM", dict(head_dim=16), "model_type 'gemma3_text' is not supported"),
        (
            "LlamaForCausalLM",
            dict(rope_parameters=LONGROPE),
            "rope_type 'longrope' (RoPE scaling) is not supported",
        ),
    ],
)
def test_what_the_model_cannot_hold_is_refused_in_one_line(cls, fields, words):
    hf = built_by_transformers(cls, **fields)
    with pytest.raises(HFConversionError) as e:
        from_hf(hf)
    assert words in str(e.value) and "\n" not in str(e.value), str(e.value)


# Our models and the native class each exports as (auto): (fields, class).
EXPORTS = {
    "partial_no_bias": (dict(rope_fraction=0.25, mlp_bias=False), "phi3"),
    "partial_windows": (dict(rope_fraction=0.5, mlp_bias=False, sliding_window=8), "phi3"),
    "partial_biased": (dict(rope_fraction=0.5), "llama"),  # the paper's Llama: MLP biases
    "p_rope": (dict(rope_fraction=0.25, rope_spectrum="p_rope"), "llama"),
    "nope": (dict(rope_fraction=0.0), "llama"),
    "windows": (dict(mlp_bias=False, sliding_window=8, n_kv_heads=2), "mistral"),
    "qk_norm": (dict(mlp_bias=False, qk_norm=True, n_kv_heads=2), "qwen3"),
    "qk_norm_partial": (dict(mlp_bias=False, qk_norm=True, rope_fraction=0.25), "qwen3"),
    "qk_norm_windows": (
        dict(mlp_bias=False, qk_norm=True, sliding_window=8, sliding_window_pattern=2),
        "qwen3",
    ),
    "qk_norm_wide_heads": (dict(mlp_bias=False, qk_norm=True, head_dim=32), "qwen3"),
    "partial_wide_heads": (dict(mlp_bias=False, rope_fraction=0.5, head_dim=24), "phi3"),
    "p_rope_narrow_heads": (dict(rope_fraction=0.5, rope_spectrum="p_rope", head_dim=8), "llama"),
    "parallel_wide_heads": (
        dict(block="parallel", norm="layernorm", mlp="gelu", n_kv_heads=None, head_dim=24),
        "rope_lm",
    ),
    "llama3_scaling": (
        dict(
            rope_theta=500000.0,
            rope_scaling={"type": "llama3", "factor": 8.0, "original_max_seq_len": 16},
        ),
        "llama",
    ),
}


@pytest.mark.parametrize("name", sorted(EXPORTS))
def test_export_as_native_class_equals_ours_and_imports_back_exactly(name, tmp_path):
    fields, target = EXPORTS[name]
    model = random_model(0, **{**LLAMA, **fields})
    assert choose_target(model.cfg) == target
    export = export_hf(model, tmp_path / name, card=False)
    assert export.target == target and export.remote_code == (target == "rope_lm")
    parity = check_parity(model, export.path, greedy_tokens=32, length=64)
    assert parity["ok"], parity["problems"]
    assert parity["greedy_tokens"] == 32
    assert parity["class"].lower().replace("_", "").startswith(target[:4].replace("_", ""))
    back, _, _ = read_hf_folder(export.path)
    assert back.cfg == model.cfg  # the toolkit's record restores the exact config
    ours, theirs = model.state_dict(), back.state_dict()
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[k], theirs[k]) for k in ours), name


@pytest.mark.parametrize("head_dim", [None, 24])
def test_qwen2_exports_when_asked_with_zero_qkv_biases(head_dim, tmp_path):
    model = random_model(1, **{**LLAMA, "mlp_bias": False, "head_dim": head_dim})
    assert choose_target(model.cfg) == "llama"  # never chosen by auto
    export = export_hf(model, tmp_path / "qwen2", target="qwen2", card=False)
    parity = check_parity(model, export.path, greedy_tokens=32, length=64)
    assert parity["ok"] and parity["class"] == "Qwen2ForCausalLM", parity
    back, _, _ = read_hf_folder(export.path)
    x = torch.randint(0, 300, (2, 40))
    with torch.no_grad():
        assert torch.equal(back(x), model(x))


@pytest.mark.parametrize(
    "fields, target, words",
    [
        (dict(rope_fraction=0.25), "phi3", "Phi3ForCausalLM has no biases (model.mlp_bias: true)"),
        (dict(mlp_bias=False), "qwen3", "always normalises q and k per head"),
        (dict(qk_norm=True), "qwen3", "MLP has no biases"),
        (
            dict(mlp_bias=False, sliding_window=8, sliding_window_pattern=2),
            "mistral",
            "windows every layer alike",
        ),
        (dict(attn_bias=True, mlp_bias=False), "qwen2", "no output-projection bias"),
        (
            dict(block="parallel", norm="layernorm", mlp="gelu", n_kv_heads=None, head_dim=24),
            "gpt_neox",
            "heads are hidden_size / heads wide (model.head_dim: 24 x 4 heads != d_model 64)",
        ),
        # 10% of 64 dims: NeoX's spectrum needs base 1e4^(64/6), past fp32
        (dict(rope_fraction=0.1, d_model=256), "llama", "past fp32's range"),
    ],
)
def test_a_forced_native_class_that_cannot_hold_the_model_says_why(fields, target, words):
    model = random_model(0, **{**LLAMA, **fields})
    with pytest.raises(HFConversionError, match=re.escape(words)):
        choose_target(model.cfg, target)


def test_the_papers_partial_rope_llamas_export_natively_where_fp32_allows():
    # Llama-1B's 64-dim heads with MLP biases: 25/50/75% and NoPE as Llama's proportional
    # RoPE; 10% and 4% (base 1e4^(64/6) and beyond) stay remote code.
    from pretrain.config import load_model_config

    for fraction, target in (
        (0.0, "llama"),
        (0.04, "rope_lm"),
        (0.1, "rope_lm"),
        (0.25, "llama"),
        (0.5, "llama"),
        (0.75, "llama"),
        (1.0, "llama"),
    ):
        cfg = load_model_config("configs/models/llama1b.yaml").replace(rope_fraction=fraction)
        assert choose_target(cfg) == target, fraction
