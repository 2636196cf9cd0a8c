"""The optimizer step through the real DeepSpeed engine, per optim.impl: time and share of a step.

    python tools/benchmark.py optim                              # ~46M parameters, CPU, fp32
    python tools/benchmark.py optim --d-model 768 --layers 12    # GPT-2-small-sized (~120M)
    python tools/benchmark.py optim --impls deepspeed fused --precision bf16 --json out.json

One engine per implementation ("deepspeed" = the optimizer DeepSpeed builds from its config,
the old path: torch's single-tensor AdamW on CPU, FusedAdam on CUDA; "foreach" / "fused" =
torch's AdamW with that implementation as DeepSpeed's client optimizer), all built first and
then run in interleaved rounds (one training step of each per round: forward+backward, then
`engine.step()`, timed apart), so that load on a shared machine falls on all of them alike.
Figures are medians over the rounds after --warmup; the optimizer's share is its step time
over the whole step's. Random tokens: the data does not change the timings.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch

from pretrain.config import Config, from_dict
from pretrain.train import distributed as dist_utils
from pretrain.train.engine import build_engine, optimizer_impl

IMPLS = ("deepspeed", "foreach", "fused")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--impls",
        nargs="+",
        default=list(IMPLS),
        choices=IMPLS,
        help="optim.impl values to compare",
    )
    p.add_argument("--d-model", type=int, default=512)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--vocab", type=int, default=50304)
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    p.add_argument("--zero-stage", type=int, default=1)
    p.add_argument(
        "--rounds", type=int, default=8, help="timed rounds (one step of every impl each)"
    )
    p.add_argument("--warmup", type=int, default=2, help="untimed rounds first")
    p.add_argument("--json", metavar="PATH", help="also write the figures as JSON")


def model_section(args: argparse.Namespace) -> dict:
    """The config's model section of the optimizer and checkpoint benchmarks: a Llama-shaped
    model of --layers blocks of width --d-model (heads of 64), its vocabulary and length."""
    d = args.d_model
    return {
        "vocab_size": args.vocab,
        "pad_vocab_to_multiple": 64,
        "n_layers": args.layers,
        "d_model": d,
        "n_heads": max(1, d // 64),
        "d_ff": 4 * d,
        "max_seq_len": args.seq_len,
        "rope_fraction": 0.25,
    }


def _config(args: argparse.Namespace, impl: str):
    return from_dict(
        Config,
        {
            "model": model_section(args),
            "optim": {"impl": impl},
            "schedule": {"warmup_steps": 1},
            "train": {
                "train_iters": args.warmup + args.rounds,
                "global_batch_size": args.micro_batch,
                "micro_batch_size": args.micro_batch,
                "seq_len": args.seq_len,
                "precision": args.precision,
                "zero_stage": args.zero_stage,
            },
        },
    )


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def run(args: argparse.Namespace) -> None:
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    if not torch.distributed.is_initialized():
        dist_utils.setup_env()
        dist_utils.init_process_group(device)
    engines, names = {}, {}
    for impl in args.impls:
        cfg = _config(args, impl)
        engines[impl] = build_engine(cfg, 1, device, recompute=0)
        opt = engines[impl].basic_optimizer
        g = opt.param_groups[0]
        names[impl] = f"{type(opt).__module__.split('.')[0]}.{type(opt).__name__}" + (
            " fused" if g.get("fused") else " foreach" if g.get("foreach") else ""
        )
        resolved = optimizer_impl(cfg, device)
        if resolved != impl:
            names[impl] += f" ({resolved})"
    n_params = sum(p.numel() for p in next(iter(engines.values())).module.parameters())
    gen = torch.Generator().manual_seed(0)
    shape = (args.micro_batch, args.seq_len)
    x = torch.randint(0, args.vocab, shape, generator=gen).to(device)
    y = torch.randint(0, args.vocab, shape, generator=gen).to(device)
    times: dict[str, dict[str, list[float]]] = {i: {"fwd_bwd": [], "opt": []} for i in args.impls}
    for r in range(args.warmup + args.rounds):
        order = args.impls if r % 2 == 0 else args.impls[::-1]  # alternate who goes first
        for impl in order:
            e = engines[impl]
            _sync(device)
            t0 = time.perf_counter()
            loss = e(x, targets=y).loss
            e.backward(loss)
            _sync(device)
            t1 = time.perf_counter()
            e.step()
            _sync(device)
            t2 = time.perf_counter()
            if r >= args.warmup:
                times[impl]["fwd_bwd"].append(t1 - t0)
                times[impl]["opt"].append(t2 - t1)
    where = (
        torch.cuda.get_device_name() if device.type == "cuda" else f"CPU ({os.cpu_count()} cores)"
    )
    print(
        f"\noptimizer benchmark on {where}: {n_params / 1e6:.1f}M parameters, {args.precision}, "
        f"ZeRO-{args.zero_stage}, micro batch {args.micro_batch} x {args.seq_len}; medians of "
        f"{args.rounds} interleaved rounds; load average {os.getloadavg()[0]:.1f}"
    )
    print(
        f"{'optim.impl':>10} {'optimizer':<28} {'opt ms':>8} {'step ms':>8} {'opt share':>9} {'vs first':>8}"
    )
    results, base = [], None
    for impl in args.impls:
        opt = statistics.median(times[impl]["opt"]) * 1e3
        step = (
            statistics.median(
                [a + b for a, b in zip(times[impl]["fwd_bwd"], times[impl]["opt"], strict=True)]
            )
            * 1e3
        )
        base = base or opt
        results.append(
            {
                "impl": impl,
                "optimizer": names[impl],
                "opt_ms": round(opt, 2),
                "step_ms": round(step, 2),
                "opt_share": round(opt / step, 3),
                "speedup_vs_first": round(base / opt, 2),
            }
        )
        print(
            f"{impl:>10} {names[impl]:<28} {opt:8.1f} {step:8.1f} {100 * opt / step:8.1f}% {base / opt:7.2f}x"
        )
    if args.json:
        Path(args.json).write_text(
            json.dumps({"device": where, "parameters": n_params, "results": results}, indent=1)
            + "\n"
        )
