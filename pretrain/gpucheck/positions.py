"""What each position encoding costs on the GPU: forward + backward of a few blocks at
llama1b's width (GQA 32/8 heads of 64, d_ff 8192) in bf16, 4 x 2048 tokens, against plain
causal attention with 10% RoPE, paired rounds (issue 36 item 4).

Windows and ALiBi run through FlexAttention on CUDA (a BlockMask that skips the tiles outside
the window, ALiBi as a score modifier: pretrain/model/attention.py `choose_kernel`), causal
attention through SDPA's fused kernels (cuDNN on H100/H200). A variant that fell back to a
dense T x T mask or bias would cost a multiple of the causal step: the check flags any over
1.5x. The table also names the kernel `choose_kernel` gave each variant's training forward,
so a silent fallback shows as a name as well as a time.
"""

from __future__ import annotations

import statistics
from typing import Any

import torch

from pretrain.gpucheck.results import at_most
from pretrain.gpucheck.sizes import Context, blocks_model, timed_step
from pretrain.model.attention import choose_kernel
from pretrain.model.transformer import Transformer

SLOWDOWN_BOUND = 1.5  # a variant's step / the causal step


def variants(window: int, layers: int) -> dict[str, dict[str, Any]]:
    """Model fields of each variant; the first is the reference (the paper's llama1b_rope10)."""
    return {
        "causal, RoPE 10%": {"rope_fraction": 0.1},
        "RoPE 100%": {"rope_fraction": 1.0},
        "p-RoPE 25%": {"rope_fraction": 0.25, "rope_spectrum": "p_rope"},
        "NoPE every 2nd layer": {"rope_fraction": 0.1, "nope_every": 2},
        f"sliding window {window}, every layer": {"rope_fraction": 0.1, "sliding_window": window},
        f"sliding {window}, 1 full in {layers}": {
            "rope_fraction": 0.1,
            "sliding_window": window,
            "sliding_window_pattern": layers,
        },
        "ALiBi, NoPE": {"rope_fraction": 0.0, "alibi": True},
    }


def positions_stage(ctx: Context) -> dict[str, Any]:
    s = ctx.sizes.positions
    dtype = torch.bfloat16 if ctx.cuda else torch.float32
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, s["vocab"], (s["batch"], s["seq_len"]), generator=g).to(ctx.device)
    models: dict[str, Transformer] = {}
    kernels: dict[str, str] = {}
    for name, fields in variants(s["window"], s["layers"]).items():
        cfg = blocks_model(s, **fields)
        torch.manual_seed(0)
        with torch.device(ctx.device):
            models[name] = Transformer(cfg).to(dtype).train()
        kernels[name] = str(
            choose_kernel(
                ctx.device,
                head_dim=cfg.head_dim,
                documents=False,
                dropout=0.0,
                soft_cap=0.0,
                injected=False,
                window=bool(fields.get("sliding_window")),
                alibi=bool(fields.get("alibi")),
            )
        )
        for _ in range(s["warmup"]):  # FlexAttention compiles its kernel on the first call
            timed_step(models[name], x, ctx.device)
    times: dict[str, list[float]] = {name: [] for name in models}
    for _ in range(s["rounds"]):  # paired: every variant once per round, same conditions
        for name, model in models.items():
            model.zero_grad(set_to_none=True)
            times[name].append(timed_step(model, x, ctx.device)[0])
    reference = next(iter(models))
    base = statistics.median(times[reference])
    rows, checks = [], []
    for name in models:
        median = statistics.median(times[name])
        ratio = statistics.median(t / r for t, r in zip(times[name], times[reference], strict=True))
        rows.append(
            {
                "variant": name,
                "kernel": kernels[name],
                "median_ms": 1e3 * median,
                "ratio_to_causal": ratio,
                "tokens_per_s": x.numel() / median,
            }
        )
        if name != reference and ctx.cuda:  # CPU timings say nothing of the GPU kernels
            checks.append(at_most(f"{name} / causal step time (paired)", ratio, SLOWDOWN_BOUND))
    notes = [
        f"{s['layers']} blocks of d {s['d_model']}, {s['heads']}/{s['kv_heads']} heads, "
        f"{s['batch']} x {s['seq_len']} tokens, window {s['window']}, {dtype}; "
        f"causal step {1e3 * base:.1f} ms; {s['rounds']} paired rounds after {s['warmup']} warm-up"
    ]
    return {"tables": {"positions": rows}, "checks": checks, "notes": notes}
