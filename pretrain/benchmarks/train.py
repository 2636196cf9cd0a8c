"""Training throughput through the real DeepSpeed engine: tokens/s, MFU, step time, memory.

    python tools/benchmark.py train                                   # quickstart model, CPU or GPU
    python tools/benchmark.py train --model configs/models/llama1b.yaml --micro-batch 8 --seq-len 2048
    torchrun --nproc_per_node 8 tools/benchmark.py train --model configs/models/llama1b.yaml

Batches are random tokens (throughput does not depend on the text), so no data needs
preparing; no checkpoint is written. The first --warmup steps (allocation, kernel
selection) are left out of the figures, which are medians over the remaining steps.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path
from typing import Any

import torch

from pretrain.config import (
    Config,
    add_set_option,
    load_config,
    load_model_config,
    to_dict,
)
from pretrain.data.dataset import make_loader
from pretrain.data.pipeline import DataSource
from pretrain.measure.measured_run import RandomTokens, measurement_config
from pretrain.run_layout import read_metrics
from pretrain.train.trainer import train

REPO = Path(__file__).resolve().parents[2]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config",
        default=str(REPO / "configs" / "quickstart.yaml"),
        help="run config whose model/train/optim sections are used (default: quickstart)",
    )
    parser.add_argument(
        "--model",
        default=None,
        help="model preset replacing the config's model, e.g. configs/models/llama1b.yaml",
    )
    parser.add_argument(
        "--micro-batch",
        type=int,
        default=None,
        help="sequences per rank per step (no accumulation); default: the config's micro batch",
    )
    parser.add_argument(
        "--seq-len", type=int, default=None, help="tokens per sequence (default: the config's)"
    )
    parser.add_argument(
        "--precision",
        choices=["bf16", "fp32"],
        default=None,
        help="default: bf16 on a GPU, the config's on CPU",
    )
    parser.add_argument("--steps", type=int, default=10, help="timed optimizer steps")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    add_set_option(parser, "train.micro_batch_size=8")
    parser.add_argument("--json", default=None, help="also write the figures to this JSON file")


def build_config(args: argparse.Namespace, run_dir: str, world_size: int) -> Config:
    data = to_dict(load_config(args.config, args.overrides))
    if args.model:
        data["model"] = to_dict(load_model_config(args.model))
    train: dict[str, Any] = {}
    if args.seq_len:
        train["seq_len"] = args.seq_len
        data["model"]["max_seq_len"] = max(data["model"]["max_seq_len"], args.seq_len)
    if args.precision:
        train["precision"] = args.precision
    elif torch.cuda.is_available():
        train["precision"] = "bf16"
    micro = args.micro_batch or data["train"]["micro_batch_size"]
    return measurement_config(
        data, run_dir, args.warmup + args.steps, micro, micro * world_size, **train
    )


def run(args: argparse.Namespace) -> None:
    import os

    world = int(os.environ.get("WORLD_SIZE", "1"))
    with tempfile.TemporaryDirectory() as tmp:
        cfg = build_config(args, tmp, world)
        n = cfg.train.train_iters * cfg.train.global_batch_size
        ds = RandomTokens(n, cfg.seq_len, cfg.model.vocab_size)

        train(cfg, DataSource(ds, None, make_loader), save_checkpoints=False)
        if os.environ.get("RANK", "0") != "0":
            return
        rows = read_metrics(tmp)
    timed = [r for r in rows if r["step"] > args.warmup and "perf/tokens_per_s" in r]
    med = {
        k: statistics.median(r[k] for r in timed)
        for k in ("perf/tokens_per_s", "perf/mfu", "perf/step_time_s")
    }
    device = (
        torch.cuda.get_device_name()
        if torch.cuda.is_available()
        else f"CPU ({os.cpu_count()} cores)"
    )
    result = {
        "device": device,
        "world_size": world,
        "precision": cfg.train.precision,
        "micro_batch": cfg.train.micro_batch_size,
        "seq_len": cfg.seq_len,
        "tokens_per_s": med["perf/tokens_per_s"],
        "mfu": med["perf/mfu"],
        "step_time_s": med["perf/step_time_s"],
        "peak_memory_gib": max(r["perf/peak_memory_gib"] for r in timed),
        "peak_tflops_per_device": cfg.logging.peak_tflops,
        "timed_steps": len(timed),
    }
    print(
        f"\ntrain benchmark on {device} x{world}, {cfg.train.precision}, micro batch "
        f"{cfg.train.micro_batch_size} x {cfg.seq_len} tokens, {len(timed)} timed steps:"
    )
    print(f"  tokens/s  {result['tokens_per_s']:,.0f}")
    print(
        f"  MFU       {100 * result['mfu']:.2f}%  (peak {cfg.logging.peak_tflops:g} TFLOP/s per device)"
    )
    print(
        f"  step time {result['step_time_s']:.3f} s;  peak memory {result['peak_memory_gib']:.2f} GiB"
    )
    if not torch.cuda.is_available():
        print("  (MFU is against logging.peak_tflops, a GPU's peak: not meaningful on CPU)")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
