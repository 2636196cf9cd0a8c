"""A study's plan: per run its parameters, tokens, steps, whether it fits and its peak memory
per GPU, GPU-hours and wall time on the study's Slurm layout, and the total.

Each run is traced by the planner (pretrain/planner/, docs/performance.md) as `tools/plan.py`
plans one config: the real model on fake tensors, DeepSpeed's buffers added, the GPU's
reserve kept free. Runs that differ only in their seed or run folder are traced once. Time is
the run's executed FLOPs (recompute included) at `mfu` of the GPU's peak, as the paper's Slurm
time limits are (pretrain/planner/paper.py).
"""

from __future__ import annotations

import json
import time
from typing import Any, TextIO

from pretrain.config import Config, from_dict
from pretrain.model.recompute import describe_recompute
from pretrain.planner.gpus import DEFAULT_MFU, GiB, parse_gpu
from pretrain.planner.search import Plan, plan_run
from pretrain.study.spec import Study, StudyRun


def _trace_key(run: StudyRun, ranks: int) -> str:
    """What the plan depends on: the config without what only names or seeds the run."""
    config = json.loads(json.dumps(run.config))
    config["train"].pop("seed", None)
    config["logging"].pop("run_dir", None)
    return json.dumps([config, ranks], sort_keys=True)


def _ranks(run: StudyRun) -> tuple[int, str]:
    if run.slurm is None:
        return 1, "1 x 1"
    return run.slurm.ranks, f"{run.slurm.nodes} x {run.slurm.tasks_per_node}"


def plan_rows(
    study: Study, gpu: str | None = None, mfu: float = DEFAULT_MFU, log: TextIO | None = None
) -> list[dict[str, Any]]:
    """One row per run of the study on `gpu` (h100, h200; default: the study's `gpu:`)."""
    device = parse_gpu(gpu or study.gpu)
    plans: dict[str, Plan] = {}
    rows = []
    for run in study.runs:
        ranks, layout = _ranks(run)
        key = _trace_key(run, ranks)
        if key not in plans:
            t0 = time.perf_counter()
            cfg = from_dict(Config, run.config)
            plans[key] = plan_run(cfg, device, ranks, name=run.name)
            if log is not None:
                print(
                    f"planned {run.name} in {time.perf_counter() - t0:.0f} s", file=log, flush=True
                )
        p = plans[key]
        wall_h = p.run_time(mfu) * p.recompute_ratio / 3600
        rows.append(
            {
                "name": run.name,
                "group": run.group,
                "seed": run.seed,
                "params": p.n_params,
                "tokens": p.tokens_per_step * p.steps,
                "steps": p.steps,
                "tokens_per_step": p.tokens_per_step,
                "layout": layout,
                "gpus": ranks,
                "micro_batch": p.micro_batch,
                "grad_accum": p.grad_accum,
                "recompute": describe_recompute(p.layers, p.n_layers),
                "peak_gib": round(p.peak / GiB, 2),
                "fits": p.fits,
                "gpu": device.name,
                "gpu_gib": round(device.gib, 2),
                "wall_hours": wall_h,
                "gpu_hours": wall_h * ranks,
                "slurm_time": run.slurm.time if run.slurm is not None else None,
            }
        )
    return rows


def _count(n: float) -> str:
    for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= size:
            return f"{n / size:.3g}{unit}"
    return f"{n:g}"


def _gpu_hours(h: float) -> str:
    return f"{h:,.0f}" if h >= 100 else f"{h:.1f}" if h >= 1 else f"{h:.2g}"


def _hours(h: float) -> str:
    return f"{h:.1f} h" if h >= 1 else f"{h * 60:.1f} min"


PLAN_COLUMNS = (
    "run",
    "params",
    "tokens",
    "steps",
    "nodes x GPUs",
    "micro x accum",
    "peak/GPU",
    "fits?",
    "GPU-hours",
    "wall time",
)


def format_plan_table(rows: list[dict[str, Any]]) -> str:
    """The plan as a text table with a total line (the runs one after another)."""
    table = [PLAN_COLUMNS]
    for r in rows:
        table.append(
            (
                r["name"],
                _count(r["params"]),
                _count(r["tokens"]),
                f"{r['steps']:,}",
                r["layout"],
                f"{r['micro_batch']} x {r['grad_accum']}",
                f"{r['peak_gib']:.1f} GiB",
                "yes" if r["fits"] else "NO",
                _gpu_hours(r["gpu_hours"]),
                _hours(r["wall_hours"]),
            )
        )
    misfits = sum(not r["fits"] for r in rows)
    table.append(
        (
            f"total: {len(rows)} runs",
            "",
            _count(sum(r["tokens"] for r in rows)),
            f"{sum(r['steps'] for r in rows):,}",
            "",
            "",
            f"max {max(r['peak_gib'] for r in rows):.1f} GiB" if rows else "",
            f"{misfits} do not" if misfits else "all",
            _gpu_hours(sum(r["gpu_hours"] for r in rows)),
            _hours(sum(r["wall_hours"] for r in rows)),
        )
    )
    widths = [max(len(row[i]) for row in table) for i in range(len(PLAN_COLUMNS))]

    def line(row: tuple[str, ...]) -> str:
        return "  ".join(
            v.ljust(w) if i == 0 else v.rjust(w)
            for i, (v, w) in enumerate(zip(row, widths, strict=True))
        ).rstrip()

    head = f"on {rows[0]['gpu']} ({rows[0]['gpu_gib']:.1f} GiB per GPU)" if rows else ""
    return "\n".join([head, line(table[0]), *map(line, table[1:-1]), line(table[-1])])


__all__ = ["PLAN_COLUMNS", "format_plan_table", "plan_rows"]
