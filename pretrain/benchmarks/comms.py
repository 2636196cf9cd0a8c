"""The planner's time model of communication against measured time on CPU ranks (gloo).

    python tools/benchmark.py comms                 # 2 ranks, a 3.4M-parameter model
    python tools/benchmark.py comms --ranks 4 --json out.json

1. gloo's own latency and bandwidth on this machine: all-reduces and all-gathers of 4 B to
   16 MB between the ranks, each after a barrier (so no rank waits for another), the median of
   the repeats; alpha (seconds per ring step) and the bandwidth fitted to both by least squares
   on the ring's t = steps x alpha + factor x S / B (pretrain/planner/network.py).
2. The engine's collectives in real steps (pretrain/measure/deepspeed_comms.py: the engine as
   training builds it, DeepSpeed's logger on) at ZeRO 0, 1 and 2.
3. Per collective, the planner's time on a `Fabric` of the fitted alpha and bandwidth against
   the median of the logged calls (a call's time on CPU ranks includes waiting for the other
   rank to arrive: the median leaves out the waits of a few), and the step's total: predicted
   sum vs the sum of the medians x calls. docs/scaling.md states the measured ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from pretrain.config import Config, from_dict
from pretrain.errors import UserError
from pretrain.measure.deepspeed_comms import free_port, measure
from pretrain.planner.comms import step_collectives
from pretrain.planner.network import Fabric
from pretrain.tables import text_table

SIZES = (4, 4096, 65536, 2**20, 2**22, 2**24)  # bytes


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ranks", type=int, default=2, help="CPU ranks (gloo; default 2)")
    p.add_argument("--d-model", type=int, default=256, help="model width (default 256)")
    p.add_argument("--layers", type=int, default=4, help="blocks (default 4)")
    p.add_argument("--steps", type=int, default=6, help="optimizer steps per setting (default 6)")
    p.add_argument("--repeats", type=int, default=15, help="timed calls per size (default 15)")
    p.add_argument("--json", type=Path, help="write the figures as JSON here")


def _fit_worker(rank: int, n: int, port: int, repeats: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=n)
    times: dict[str, dict[int, float]] = {"all_reduce": {}, "all_gather_into_tensor": {}}
    for size in SIZES:
        elements = max(1, size // 4)
        x = torch.ones(elements)
        gathered = torch.empty(elements * n)
        shard = torch.ones(max(1, elements // n))
        for op in times:
            samples = []
            for _ in range(repeats + 2):
                dist.barrier()
                t0 = time.perf_counter()
                if op == "all_reduce":
                    dist.all_reduce(x)
                else:  # the whole gathered buffer: `size` bytes
                    dist.all_gather_into_tensor(gathered[: shard.numel() * n], shard)
                samples.append(time.perf_counter() - t0)
            times[op][size] = statistics.median(samples[2:])
    if rank == 0:
        Path(out).write_text(json.dumps(times))
    dist.destroy_process_group()


def fit_gloo(n: int, repeats: int) -> tuple[Fabric, dict[str, dict[int, float]]]:
    """gloo's alpha and bandwidth on this machine for n ranks, and the timings they fit."""
    with tempfile.TemporaryDirectory() as d:
        out = str(Path(d, "fit.json"))
        mp.spawn(_fit_worker, (n, free_port(), repeats, out), nprocs=n)
        times = {
            op: {int(s): t for s, t in v.items()}
            for op, v in json.loads(Path(out).read_text()).items()
        }
    return fit_ring(times, n), times


def fit_ring(times: dict[str, dict[int, float]], n: int) -> Fabric:
    """The alpha (seconds per ring step) and bandwidth that fit `times` (op -> bytes ->
    seconds) best, by least squares on the ring's t = steps x alpha + factor x S / B."""
    ring = {
        "all_reduce": (2 * (n - 1), 2 * (n - 1) / n),
        "all_gather_into_tensor": (n - 1, (n - 1) / n),
    }
    rows = [
        (ring[op][0], ring[op][1] * size, t) for op, v in times.items() for size, t in v.items()
    ]
    a = np.array([(steps, moved) for steps, moved, _ in rows], dtype=float)
    (alpha, per_byte), *_ = np.linalg.lstsq(a, np.array([t for *_, t in rows]), rcond=None)
    bandwidth = 1 / max(float(per_byte), 1e-15)
    return Fabric(
        name=f"gloo, {n} CPU ranks on this machine",
        gpus_per_node=n,
        nvlink_bandwidth=bandwidth,
        nic_bandwidth=bandwidth,
        nvlink_alpha=max(float(alpha), 0.0),
        nic_alpha=max(float(alpha), 0.0),
    )


def settings(args: argparse.Namespace) -> dict[str, Config]:
    n = args.ranks
    model = {
        "vocab_size": 4096,
        "pad_vocab_to_multiple": 1,
        "n_layers": args.layers,
        "d_model": args.d_model,
        "n_heads": max(1, args.d_model // 64),
        "d_ff": 4 * args.d_model,
        "max_seq_len": 64,
    }
    base = {
        "model": model,
        "data": {"train": [], "valid": []},
        "train": {
            "train_iters": args.steps,
            "global_batch_size": 2 * n,
            "micro_batch_size": 2,
            "seq_len": 64,
            "precision": "fp32",
            "eval_interval": 0,
        },
    }
    out = {}
    for stage in (0, 1, 2):
        data = json.loads(json.dumps(base))
        data["train"]["zero_stage"] = stage
        out[f"zero{stage}"] = from_dict(Config, data)
    return out


def predicted_vs_logged(
    configs: dict[str, Config], logged: dict[str, Any], fabric: Fabric, n: int, steps: int
) -> list[dict[str, Any]]:
    """Per setting and collective: calls, bytes, the median logged call and the prediction."""
    rows = []
    for name, cfg in configs.items():
        planned = {(c.op, c.size): c for c in step_collectives(cfg, n)}
        ranks = logged[name]
        for op, sizes in ranks[0].items():
            for size, v in sorted(sizes.items()):
                c = planned.get((op, size))
                # A call's own time is the last rank's to arrive: it waits for no one. So
                # per call the least over ranks, then the median over calls.
                own = [
                    min(calls)
                    for calls in zip(*(r[op][size]["latencies"] for r in ranks), strict=True)
                ]
                rows.append(
                    {
                        "setting": name,
                        "op": op,
                        "bytes": size,
                        "calls": v["calls"],
                        "planned_calls": (c.calls * steps) if c else 0,
                        "measured_s": statistics.median(own),
                        "predicted_s": fabric.time(op, c.buffer(n) if c else size, n),
                    }
                )
    return rows


def run(args: argparse.Namespace) -> None:
    n = args.ranks
    for flag, value, least in (
        ("--ranks", n, 2),
        ("--steps", args.steps, 1),
        ("--repeats", args.repeats, 1),
    ):
        if value < least:
            raise UserError(f"{flag} {value}: give at least {least}")
    fabric, times = fit_gloo(n, args.repeats)
    print(
        f"gloo on {n} ranks: alpha {fabric.nvlink_alpha * 1e6:.1f} us per ring step, "
        f"bandwidth {fabric.nvlink_bandwidth / 1e9:.2f} GB/s (fitted to all the timings)"
    )
    fit_rows = [
        [
            op,
            f"{s:,}",
            f"{t * 1e6:.0f}",
            f"{fabric.time(op, s, n) * 1e6:.0f}",
            f"{fabric.time(op, s, n) / t:.2f}",
        ]
        for op, v in times.items()
        for s, t in v.items()
    ]
    print(text_table(["op", "bytes", "measured us", "model us", "model/measured"], fit_rows))
    configs = settings(args)
    logged = measure(configs, n, steps=args.steps)
    rows = predicted_vs_logged(configs, logged, fabric, n, args.steps)
    print(
        text_table(
            ["setting", "op", "bytes", "calls", "median us", "model us", "model/measured"],
            [
                [
                    r["setting"],
                    r["op"],
                    f"{r['bytes']:,}",
                    str(r["calls"]),
                    f"{r['measured_s'] * 1e6:.0f}",
                    f"{r['predicted_s'] * 1e6:.0f}",
                    f"{r['predicted_s'] / r['measured_s']:.2f}",
                ]
                for r in rows
            ],
        )
    )
    totals = {}
    for r in rows:
        t = totals.setdefault(r["setting"], [0.0, 0.0])
        t[0] += r["measured_s"] * r["calls"]
        t[1] += r["predicted_s"] * r["calls"]
    for name, (measured, predicted) in totals.items():
        print(
            f"{name}: communication of {args.steps} steps measured {measured * 1e3:.1f} ms "
            f"(medians x calls), predicted {predicted * 1e3:.1f} ms, ratio {predicted / measured:.2f}"
        )
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "ranks": n,
                    "alpha_s": fabric.nvlink_alpha,
                    "bandwidth": fabric.nvlink_bandwidth,
                    "fit": times,
                    "rows": rows,
                    "totals": {
                        k: {"measured_s": a, "predicted_s": b} for k, (a, b) in totals.items()
                    },
                },
                indent=1,
            )
        )
