"""The planner on issue 36's encodings at the paper's shape (seq 2048, llama1b's width and
heads, 2 of its layers to keep the traces short): on CUDA, sliding windows and ALiBi run in
FlexAttention (a BlockMask, a score modifier), so their step holds no T x T tensor and plans
like plain causal attention; the CPU path builds the dense mask or bias, and the plan shows it
at its size. Executed FLOPs count the pairs a window attends."""

from __future__ import annotations

import pytest

from pretrain.config import load_config
from pretrain.planner import GPUS, plan_run

SEQ, MB, LAYERS = 2048, 4, 2
BASE = ["train.compile=false", f"model.n_layers={LAYERS}", "train.activation_checkpointing=0"]
VARIANTS = {
    "causal": [],
    "window": ["model.sliding_window=512"],
    "alibi": ["model.alibi=true", "model.rope_fraction=0"],
}


def plan(variant: str, target: str):
    cfg = load_config("configs/paper/llama1b_rope10.yaml", BASE + VARIANTS[variant])
    return cfg, plan_run(cfg, GPUS["h100"], 32, MB, 0, target)


@pytest.mark.parametrize("variant", ["window", "alibi"])
def test_on_cuda_windows_and_alibi_plan_like_causal_attention(variant):
    _, causal = plan("causal", "cuda")
    cfg, p = plan(variant, "cuda")
    heads = cfg.model.n_heads
    dense_bias = MB * heads * SEQ * SEQ * 4  # one fp32 T x T bias per head: 2 GiB here
    # within a sixteenth of one dense bias (ALiBi's model also drops RoPE's rotated q/k)
    assert abs(p.trace.train - causal.trace.train) < dense_bias / 16


def test_on_cpu_alibi_holds_its_dense_bias():
    cfg, cpu = plan("alibi", "cpu")
    _, cuda = plan("alibi", "cuda")
    one_bias = MB * cfg.model.n_heads * SEQ * SEQ * 4
    assert cpu.trace.train - cuda.trace.train >= one_bias


def test_a_window_counts_the_pairs_it_attends():
    cfg, window = plan("window", "cuda")
    _, causal = plan("causal", "cuda")
    m, w = cfg.model, 512
    pairs = sum(min(i + 1, w) for i in range(SEQ))  # brute force, per sequence
    causal_pairs = SEQ * (SEQ + 1) // 2
    # PaLM's count, the MFU convention: 12 x heads x head_dim x seq per token and layer for
    # causal attention (QK^T and AV, forward and backward); a window scales it by the share
    # of the causal pairs it attends.
    full = 12 * m.n_heads * m.head_dim * SEQ
    saved = LAYERS * full * (1 - pairs / causal_pairs)
    assert causal.model_flops - window.model_flops == pytest.approx(saved, rel=1e-9)
    assert window.executed_flops == window.model_flops  # no recompute
