"""What a person reads about positions by layer: the export's model card and the training
console's start-up line describe each run of layers when layers differ, and keep their old
one-phrase text for a uniform model."""

from __future__ import annotations

from pretrain.config import ModelConfig
from pretrain.hf.card import positions_text
from pretrain.model.position import layer_positions
from pretrain.train.sinks import describe_positions

BASE = dict(vocab_size=100, n_layers=4, d_model=64, n_heads=4, d_ff=96, max_seq_len=64)


def test_uniform_models_keep_their_one_phrase():
    cfg = ModelConfig(**BASE, rope_fraction=0.25)
    assert positions_text(layer_positions(cfg)) == (
        "4 of 16 dims per head (25%), theta 10000",
        "causal",
    )
    assert describe_positions(cfg) == "rotary dims 4/16"
    nope = ModelConfig(**BASE, rope_fraction=0.0)
    assert positions_text(layer_positions(nope))[0] == "none (NoPE)"


def test_layers_that_differ_are_described_per_run():
    cfg = ModelConfig(**BASE, nope_every=4, sliding_window=8, sliding_window_pattern=2)
    rope, attention = positions_text(layer_positions(cfg))
    assert rope == "layers 0-2: 16 of 16 dims per head (100%), theta 10000; layer 3: none (NoPE)"
    assert attention == (
        "layer 0: sliding window of 8 tokens; layer 1: causal; "
        "layer 2: sliding window of 8 tokens; layer 3: causal"
    )
    assert describe_positions(cfg).startswith("positions by layer: 0 RoPE 16/16")
    assert "3 NoPE, full" in describe_positions(cfg)


def test_p_rope_alibi_and_a_global_theta_are_named():
    p_rope = ModelConfig(**BASE, rope_fraction=0.25, rope_spectrum="p_rope", alibi=True)
    rope, attention = positions_text(layer_positions(p_rope))
    assert "p-RoPE" in rope and attention == "causal, ALiBi"
    assert (
        describe_positions(p_rope)
        == "positions by layer: 0-3 RoPE 4/16 (p_rope, theta 10000), full, ALiBi"
    )
    gemma = ModelConfig(**BASE, sliding_window=8, sliding_window_pattern=2, global_rope_theta=1e6)
    assert (
        "layer 1: 16 of 16 dims per head (100%), theta 1e+06"
        in positions_text(layer_positions(gemma))[0]
    )
