"""The peers `tools/benchmark.py peers` races hold our weights at both paper shapes (llama1b:
transformers' Llama and litgpt's Llama; pythia1b: GPTNeoXForCausalLM and litgpt's Pythia):
same losses and gradients as our model in fp32, the same loss to a measured tolerance in
bf16 weights; and the race (the GPU stage's code) gives every shape's rows, eager and
compiled, with the checks of both modes."""

from __future__ import annotations

import argparse

import pytest
import torch
from conftest import missing

from pretrain.benchmarks import peers
from pretrain.gpucheck.stages import peers_result
from pretrain.hf.targets.neox import neox_qkv
from pretrain.measure import peer_race
from pretrain.measure.peer_models import (
    IMPLEMENTATIONS,
    PEERS,
    SHAPES,
    litgpt_available,
    make,
    ours,
    shape_config,
)
from pretrain.model import Transformer

# bf16 weights: our loss against each peer's, relative (peer_race.LOSS_TOLERANCE, the race's
# check, is 5e-3 for both). Measured on CPU at these sizes and at seq 2048: transformers
# 1.4e-5 to 1.2e-4 (the same fp32 loss over bf16 logits as ours), litgpt 8e-4 to 2.7e-3
# (its loss is a bf16 number: rounding alone is up to 2^-8 = 3.9e-3).
BF16_TOLERANCE = {"transformers": 1e-3, "litgpt": peer_race.LOSS_TOLERANCE["bf16"]}


def _need(implementation: str) -> None:
    if implementation == "litgpt" and not litgpt_available():
        missing("litgpt not installed (make venv installs requirements/bench.txt)")


def _model(shape: str) -> Transformer:
    # llama1b: 4 heads of 16, GQA 4/2; pythia1b: 4 heads of 16, MHA, 4 rotary dims (25%)
    cfg = shape_config(shape, d_model=64, layers=2, vocab=128, seq_len=32, heads=4, kv_heads=2)
    torch.manual_seed(0)
    model = Transformer(cfg).train()
    with torch.no_grad():  # norms away from one and biases away from zero, so a swap shows
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model


def _qkv_grad(peer: torch.nn.Module, cfg) -> torch.Tensor:
    """Layer 1's q/k/v weight gradient of a peer, in our layout [q heads | k heads | v heads]."""
    grads = {n: p.grad for n, p in peer.named_parameters()}
    if "transformer.h.1.attn.qkv.weight" in grads:  # litgpt fuses them as we do
        return grads["transformer.h.1.attn.qkv.weight"]
    if "gpt_neox.layers.1.attention.query_key_value.weight" in grads:  # per head [q, k, v]
        g = grads["gpt_neox.layers.1.attention.query_key_value.weight"]
        return neox_qkv(g, cfg, to_hf=False)
    p = "model.layers.1.self_attn."
    return torch.cat([grads[f"{p}{x}_proj.weight"] for x in "qkv"])


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("implementation", PEERS)
def test_peer_has_our_loss_and_gradients(shape, implementation):
    _need(implementation)
    model = _model(shape)
    cfg = model.cfg
    assert (cfg.kv_heads < cfg.n_heads) == (shape == "llama1b")
    mine, peer = ours("ours", model), make(implementation, model)
    expected = {"llama1b": "Llama", "pythia1b": ("GPTNeoX", "GPT")}[shape]
    assert type(peer.module).__name__.startswith(expected) or implementation == "litgpt"
    g = torch.Generator().manual_seed(1)
    x, y = torch.randint(0, 128, (2, 2, 32), generator=g)
    want, got = mine.loss(x, y), peer.loss(x, y)
    assert abs(got.item() - want.item()) <= 1e-5 * want.item()
    want.backward()
    got.backward()
    # The same gradients in the same places: every weight sat where ours did.
    ours_qkv = model.blocks[1].attn.qkv.weight.grad
    assert torch.allclose(ours_qkv, _qkv_grad(peer.module, cfg), rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("implementation", PEERS)
def test_peer_in_bf16_weights_has_our_loss(shape, implementation):
    """Every model cast to bf16 (`.to(torch.bfloat16)`, as DeepSpeed's BF16 engine holds it,
    no autocast): the same loss as ours to BF16_TOLERANCE, and not the fp32 loss exactly (the
    cast happened)."""
    _need(implementation)
    model = _model(shape)
    mine, peer = ours("ours", model), make(implementation, model)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randint(0, 128, (2, 2, 32), generator=g)
    with torch.no_grad():
        fp32 = mine.loss(x, y).item()
        model.to(torch.bfloat16)
        peer.module.to(torch.bfloat16)
        assert all(p.dtype == torch.bfloat16 for p in peer.module.parameters())
        want, got = mine.loss(x, y).item(), peer.loss(x, y).item()
    assert want != fp32
    assert abs(got - want) <= BF16_TOLERANCE[implementation] * want


def _race_args(**changes) -> argparse.Namespace:
    """peer_race.race's command-line arguments at tiny sizes, every model compiled (dynamo's
    "eager" backend on CPU, as the smoke's)."""
    args = dict(
        d_model=64,
        layers=1,
        heads=4,
        kv_heads=None,
        d_ff=None,
        vocab=128,
        batch=1,
        seq_len=16,
        bf16_seq_len=16,
        rounds=2,
        bf16_rounds=2,
        warmup=1,
        threads=1,
        clock="wall",
        no_variants=True,
        compile=True,
        compile_backend="eager",
        seed=0,
        device="cpu",
    )
    return argparse.Namespace(**{**args, **changes})


def test_race_has_both_shapes_eager_and_compiled_with_their_checks():
    """The GPU stage's code path (peer_race.race, then the stage's table and checks) at tiny
    sizes in bf16 weights, every model also compiled (dynamo's "eager" backend on CPU, as the
    smoke's): for each shape, six rows, ratios to ours in the same mode, every loss within the
    race's tolerance, the compiled ones equal to their eager twin's, and the checks for eager
    and compiled measured."""
    _need("litgpt")
    args = _race_args()
    tables, checks = [], []
    for shape in SHAPES:
        result = peer_race.race(args, "bf16", shape)
        assert result["not_compiled"] == {}
        assert "ours / fastest peer, compiled" in peers.format_result(result, "wall")
        out = peers_result(result, peak_flops=1e12)
        tables += out["tables"]["peers"]
        checks += out["checks"]
    for shape in SHAPES:
        rows = {r["model"]: r for r in tables if r["shape"] == shape}
        assert set(rows) == {f"{i}{c}" for i in IMPLEMENTATIONS for c in ("", ", compiled")}
        assert {r["precision"] for r in rows.values()} == {"bf16 weights"}
        for name, r in rows.items():
            assert r["compiled"] == name.endswith(", compiled")
            assert r["loss_rel_error"] <= peer_race.LOSS_TOLERANCE["bf16"], name
            assert r["ratio_to_ours"] > 0 and r["ratio_to_eager"] > 0
            if r["compiled"]:  # dynamo's eager backend runs the same operators
                eager = rows[name.removesuffix(", compiled")]
                assert r["first_loss"] == pytest.approx(eager["first_loss"], rel=1e-6)
            else:
                assert r["ratio_to_eager"] == 1
        assert rows["ours"]["ratio_to_ours"] == rows["ours, compiled"]["ratio_to_ours"] == 1
        names = {c["name"]: c for c in checks if c["name"].startswith(f"{shape}:")}
        assert set(names) == {
            f"{shape}: ours / fastest peer step time, eager (paired)",
            f"{shape}: ours / fastest peer step time, compiled (paired)",
            f"{shape}: ours compiled / ours eager step time (paired)",
        }
        assert all(c["measured"] > 0 and c["bound"] == "at most" for c in names.values())
    # The pythia1b models are Pythia's: MHA, a quarter of each head rotated.
    assert SHAPES["pythia1b"].rope_fraction == 0.25 and SHAPES["pythia1b"].q_per_kv == 1


def test_a_model_that_does_not_compile_is_left_out_with_its_reason():
    """A compiler that fails (here a backend that raises) costs the race its compiled rows,
    not the stage: they are left out and named, and the compiled check has nothing to
    measure (not flagged); the eager race stands."""
    _need("litgpt")

    def broken(gm, example_inputs):
        raise RuntimeError("this backend compiles nothing")

    args = _race_args(
        d_model=32,
        heads=2,
        vocab=64,
        seq_len=8,
        bf16_seq_len=8,
        rounds=1,
        bf16_rounds=1,
        compile_backend=broken,
    )
    result = peer_race.race(args, "fp32", "llama1b")
    assert set(result["not_compiled"]) == {f"{i}, compiled" for i in IMPLEMENTATIONS}
    assert all("compiles nothing" in why for why in result["not_compiled"].values())
    assert [r["model"] for r in result["rows"]] == list(IMPLEMENTATIONS)
    out = peers_result(result, peak_flops=1e12)
    (compiled,) = [c for c in out["checks"] if "compiled" in c["name"]]
    assert compiled["measured"] is None and not compiled["flagged"]
    assert sum("did not compile" in n for n in out["notes"]) == 3
