"""The paper's plan: every run of the grid on H200 and H100, Slurm hours, the table of
docs/performance.md (`pretrain-plan --paper`).
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pretrain.config import load_config
from pretrain.planner.downstream import DownstreamCost, downstream_cost
from pretrain.planner.gpus import DEFAULT_MFU, GPUS, GiB
from pretrain.planner.search import Plan, choose, plan_run
from pretrain.run_layout import atomic_write
from pretrain.slurm_limits import time_limit_hours
from pretrain.tables import pipe_table

PAPER_PLAN = Path(__file__).parent.parent / "sweep_plan.json"  # written by `plan --paper --write`


def slurm_hours(plan: Plan, mfu: float = DEFAULT_MFU) -> int:
    """`time_limit_hours` of a plan, the run at `mfu` of the peak."""
    return time_limit_hours(plan.run_time(mfu) * plan.recompute_ratio / 3600)


def _downstream(cfg: Any, plan: Plan, mfu: float) -> DownstreamCost | None:
    train_flops = plan.executed_flops * plan.tokens_per_step * plan.steps
    return downstream_cost(cfg, train_flops, plan.run_time(mfu))


def plan_paper_run(
    config: str | Path,
    world_size: int = 32,
    mfu: float = DEFAULT_MFU,
    overrides: Sequence[str] = (),
    tokens_per_step: int | None = None,
) -> dict[str, Any]:
    """One row of the paper's plan: the config as it is on an H200 and an H100, and what
    `auto` picks on an H200 (micro batch and recomputed blocks, global batch kept).
    `tokens_per_step`: set the global batch to this many tokens / seq_len."""
    cfg = load_config(config, list(overrides))
    if tokens_per_step:
        cfg.train.global_batch_size = tokens_per_step // cfg.seq_len
    name = Path(config).stem
    h200, h100 = GPUS["h200"], GPUS["h100"]
    as_is = plan_run(cfg, h200, world_size, name=name)
    on_h100 = plan_run(cfg, h100, world_size, name=name)
    auto = choose(cfg, h200, world_size, name=name)
    row: dict[str, Any] = {
        "name": name,
        "seq_len": cfg.seq_len,
        "global_batch": cfg.train.global_batch_size,
        "micro_batch": as_is.micro_batch,
        "grad_accum": as_is.grad_accum,
        "checkpointing": as_is.layers,
        "n_layers": as_is.n_layers,
        "train_peak_gib": round(as_is.train_peak / GiB, 2),
        "eval_peak_gib": round(as_is.eval_peak / GiB, 2),
        "fits_h200": as_is.fits,
        "fits_h100": on_h100.fits,
        "model_flops": as_is.model_flops,
        "executed_flops": as_is.executed_flops,
        "run_hours": round(as_is.run_time(mfu) / 3600, 2),
        "gpu_hours": round(as_is.gpu_hours(mfu)),
    }
    cost = _downstream(cfg, as_is, mfu)
    if cost is not None:  # in-loop downstream evaluation: its time is the run's too
        row["run_hours"] = round((as_is.run_time(mfu) + cost.seconds) / 3600, 2)
        row["gpu_hours"] = round(row["run_hours"] * world_size)
        row["downstream_hours"] = round(cost.seconds / 3600, 3)
        row["downstream_share"] = round(cost.share, 5)
        if cost.unplanned:
            row["downstream_unplanned"] = list(cost.unplanned)
    if auto is not None:
        row["auto_h200"] = {
            "micro_batch": auto.micro_batch,
            "grad_accum": auto.grad_accum,
            "checkpointing": auto.layers,
            "train_peak_gib": round(auto.train_peak / GiB, 2),
            "eval_peak_gib": round(auto.eval_peak / GiB, 2),
            "executed_flops": auto.executed_flops,
            "recompute_ratio": round(auto.recompute_ratio, 4),
            "slurm_hours": slurm_hours(auto, mfu),
        }
    return row


def paper_plan(
    configs: Sequence[str | Path],
    world_size: int = 32,
    mfu: float = DEFAULT_MFU,
    overrides: Sequence[str] = (),
    out: Path | None = None,
    log: Any = None,
    tokens_per_step: int | None = None,
) -> list[dict[str, Any]]:
    """Rows of `plan_paper_run` for every config; with `out`, written after each row and
    rows already there (same name) are kept, so an interrupted run continues."""
    done: dict[str, dict[str, Any]] = {}
    if out is not None and out.is_file():
        done = {r["name"]: r for r in json.loads(out.read_text())["runs"]}
    rows = []
    for config in configs:
        name = Path(config).stem
        if name not in done:
            t0 = time.perf_counter()
            done[name] = plan_paper_run(config, world_size, mfu, overrides, tokens_per_step)
            if log is not None:
                print(f"planned {name} in {time.perf_counter() - t0:.0f} s", file=log, flush=True)
        rows.append(done[name])
        if out is not None:
            meta = {
                "world_size": world_size,
                "mfu": mfu,
                "overrides": list(overrides),
                "tokens_per_step": tokens_per_step,
                "gpus": {k: {"name": g.name, "gib": round(g.gib, 2)} for k, g in GPUS.items()},
                "reserve": "2 GiB + 5% of the GPU",
            }
            atomic_write(
                out, json.dumps({"meta": meta, "runs": rows}, indent=1) + "\n", fsync=False
            )
    return rows


def _hours(h: float) -> str:
    return f"{h:.1f} h"


def paper_table(rows: Sequence[dict[str, Any]]) -> str:
    """The markdown table of docs/performance.md."""
    header = [
        "run",
        "seq",
        "global batch",
        "micro x accum",
        "recompute",
        "train peak",
        "eval peak",
        "H200",
        "H100",
        "exec. FLOPs/token",
        "run time at 40% MFU",
        "auto on H200: micro x accum, recompute, exec./model, train peak, Slurm --time",
    ]
    body = []
    for r in rows:
        a = r.get("auto_h200")
        auto = (
            f"{a['micro_batch']} x {a['grad_accum']}, {a['checkpointing']}/{r['n_layers']}, "
            f"{a['recompute_ratio']:.3f}x, {a['train_peak_gib']:.1f} GiB, {a['slurm_hours']} h"
            if a
            else "nothing fits"
        )
        body.append(
            [
                str(r["name"]),
                str(r["seq_len"]),
                str(r["global_batch"]),
                f"{r['micro_batch']} x {r['grad_accum']}",
                f"{r['checkpointing']}/{r['n_layers']}",
                f"{r['train_peak_gib']:.1f} GiB",
                f"{r['eval_peak_gib']:.1f} GiB",
                "fits" if r["fits_h200"] else "no",
                "fits" if r["fits_h100"] else "no",
                f"{r['executed_flops']:.3g}",
                _hours(r["run_hours"]),
                auto,
            ]
        )
    return pipe_table(header, body)
