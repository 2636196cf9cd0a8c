"""A study's per-run tables: `study list` (each run's sequence length, batch layout and
tokens, read from the resolved configs: nothing traced) and `study plan` (per run its
parameters, tokens, steps, whether it fits and its peak memory per GPU, GPU-hours and wall
time on the study's Slurm layout, and the total).

Each run is traced by the planner as `tools/plan.py` plans one config (pretrain/planner/,
docs/performance.md); time is the run's executed FLOPs at `mfu` of the GPU's peak, as the
paper's Slurm time limits are. Runs that differ only in their seed, run folder or data share a
trace, and a trace's figures are kept in studies/NAME/plan_cache/ under the sha256 of all it
depends on (docs/studies.md, "plan and write"): planning again traces only what changed.
"""

from __future__ import annotations

import ast
import concurrent.futures
import dataclasses
import functools
import hashlib
import io
import json
import multiprocessing
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from pydantic import BaseModel, ConfigDict

import pretrain
from pretrain.config import Config, from_dict
from pretrain.model.recompute import describe_recompute
from pretrain.run_layout import atomic_write
from pretrain.study.file import shown_path
from pretrain.study.runs import Study, StudyRun
from pretrain.tables import pipe_table, text_table

if TYPE_CHECKING:
    from pretrain.planner.gpus import GPU
    from pretrain.planner.search import Plan

# The planner (and torch) load inside the functions that trace, so that `study write`,
# `status` and `submit` never do (tests/contracts.py).

# Bump when what a trace gives changes in a way the planner's sources do not show (or
# PlanFigures changes): every cache entry written before is then a miss.
PLAN_CACHE_VERSION = 2
PLAN_CACHE_DIR = "plan_cache"  # under studies/NAME/
TRACE_ENTRY = "pretrain.planner.search"  # its plan_run traces a run
# Traces at once, one process each, up to the machine's cores: a trace is single-threaded
# Python dispatching fake tensors. Below PARALLEL_FROM traces, starting the processes (an
# import of torch each) costs more than it saves.
PARALLEL_FROM = 3


class PlanFigures(BaseModel):
    """What plan_rows reads of a Plan (pretrain/planner/search.py), small enough to cache."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    n_params: int
    tokens_per_step: int
    steps: int
    micro_batch: int
    grad_accum: int
    layers: int  # recomputed blocks
    n_layers: int
    peak: int  # bytes per GPU
    fits: bool
    recompute_ratio: float  # executed / model FLOPs
    full_mfu_seconds: float  # Plan.run_time(1.0): the run's model FLOPs at the GPUs' peak

    @classmethod
    def of(cls, plan: Plan) -> PlanFigures:
        names = [n for n in cls.model_fields if n != "full_mfu_seconds"]
        return cls(**{n: getattr(plan, n) for n in names}, full_mfu_seconds=plan.run_time(1.0))


def trace_sources(entry: str = TRACE_ENTRY) -> list[Path]:
    """The source files of our modules a trace can run: `entry` and every module of ours it
    imports, directly or through others, at load time or inside a function, read with `ast`
    (a package's `_LAZY` table counts as its imports). tests/test_study_plan_cache.py checks
    that a real trace loads nothing outside them."""
    root = Path(pretrain.__file__).resolve().parent

    def path_of(module: str) -> Path | None:
        rel = Path(*module.split(".")[1:])
        for candidate in (root / rel / "__init__.py", (root / rel).with_suffix(".py")):
            if module.startswith("pretrain") and candidate.is_file():
                return candidate
        return None

    seen: dict[str, Path] = {}
    todo = [entry]
    while todo:
        module = todo.pop()
        path = path_of(module)
        if module in seen or path is None:
            continue
        seen[module] = path
        parts = module.split(".")
        todo += [".".join(parts[:i]) for i in range(1, len(parts))]  # its packages
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                todo += [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                todo += [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
            elif isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "_LAZY" for t in node.targets
            ):
                todo += [v.value for v in ast.walk(node.value) if isinstance(v, ast.Constant)]
    return sorted(seen.values())


@functools.cache
def _planner_stamp() -> dict[str, Any]:
    """The planner's version: the constant, torch's, and the sha256 of `trace_sources` (read
    once per process: the code imported is the code that traces)."""
    import torch

    root = Path(pretrain.__file__).resolve().parent
    digest = hashlib.sha256()
    for file in trace_sources():
        digest.update(file.relative_to(root).as_posix().encode() + b"\0")
        digest.update(file.read_bytes() + b"\0")
    return {"version": PLAN_CACHE_VERSION, "torch": torch.__version__, "source": digest.hexdigest()}


def _cache_key(run: StudyRun, ranks: int, device: GPU) -> str:
    """The sha256 of all a trace depends on: the config without what only names, seeds or
    feeds the run, the GPUs, the GPU, the planner's version and, with a document mask, the
    attention share measured on the data here (what the data changes)."""
    from pretrain.planner.search import document_fraction

    config = json.loads(json.dumps(run.config))
    config["train"].pop("seed", None)
    config["logging"].pop("run_dir", None)
    for split in ("train", "valid"):
        config.get("data", {}).pop(split, None)
    cfg = from_dict(Config, run.config)
    material = {
        "trace": json.dumps([config, ranks], sort_keys=True),
        "gpu": dataclasses.asdict(device),
        "planner": _planner_stamp(),
        "documents": document_fraction(cfg)[0] if cfg.data.document_mask else None,
    }
    return hashlib.sha256(json.dumps(material, sort_keys=True).encode()).hexdigest()


def _read_cached(path: Path) -> PlanFigures | None:
    """A cache entry's figures; None (a miss: traced again, rewritten) when it is missing,
    unreadable or corrupt (strict: "2 GiB" is no int)."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))["figures"]
        return PlanFigures.model_validate(data, strict=True)
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _write_cached(path: Path, figures: PlanFigures, run: StudyRun, device: GPU) -> None:
    entry = {
        "run": run.name,  # the first run traced with this key: for a reader, not a check
        "gpu": device.name,
        "planner": _planner_stamp(),
        "figures": figures.model_dump(),
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    # No fsync: an entry a crash loses or leaves empty is only a miss.
    atomic_write(path, json.dumps(entry, indent=1) + "\n", fsync=False)


def _timed_trace(config: dict[str, Any], device: GPU, ranks: int, name: str):
    from pretrain.planner.search import plan_run

    t0 = time.perf_counter()
    plan = plan_run(from_dict(Config, config), device, ranks, name=name)
    return PlanFigures.of(plan), time.perf_counter() - t0


def _trace_all(todo: dict[str, tuple[StudyRun, int]], device: GPU):
    """(key, figures, seconds) of every trace in `todo` as each ends: in processes of their
    own from PARALLEL_FROM traces on, with more than one core; else here."""
    workers = min(len(todo), os.cpu_count() or 1)
    if len(todo) < PARALLEL_FROM or workers < 2:
        for key, (run, ranks) in todo.items():
            yield key, *_timed_trace(run.config, device, ranks, run.name)
        return
    context = multiprocessing.get_context("spawn")  # a fork would copy this process's threads
    with concurrent.futures.ProcessPoolExecutor(workers, mp_context=context) as pool:
        futures = {
            pool.submit(_timed_trace, run.config, device, ranks, run.name): key
            for key, (run, ranks) in todo.items()
        }
        for future in concurrent.futures.as_completed(futures):
            yield futures[future], *future.result()


def plan_rows(
    study: Study,
    gpu: str | None = None,
    mfu: float | None = None,
    log: TextIO | None = None,
    cache: bool = True,
    fresh: bool = False,
) -> list[dict[str, Any]]:
    """One row per run of the study on `gpu` (h100, h200; default: the study's `gpu:`).
    `cache`: reuse the traces in studies/NAME/plan_cache/ and keep the new ones there;
    `fresh`: trace every run again (still replacing their entries); `mfu`: the planner's
    DEFAULT_MFU unless given."""
    from pretrain.planner.gpus import DEFAULT_MFU, GiB, parse_gpu

    say = functools.partial(print, file=log or io.StringIO(), flush=True)
    mfu = DEFAULT_MFU if mfu is None else mfu
    device = parse_gpu(gpu or study.gpu)
    cache_dir = study.out_dir / PLAN_CACHE_DIR
    plans: dict[str, PlanFigures] = {}  # key -> figures, from the cache or traced
    todo: dict[str, tuple[StudyRun, int]] = {}  # key -> the first run with it, its GPUs
    keys = []
    for run in study.runs:
        ranks = run.slurm.ranks if run.slurm is not None else 1
        key = _cache_key(run, ranks, device)
        keys.append(key)
        if key not in plans and key not in todo:
            figures = _read_cached(cache_dir / f"{key}.json") if cache and not fresh else None
            if figures is None:
                todo[key] = (run, ranks)
            else:
                plans[key] = figures
    cached_runs = sum(key in plans for key in keys)
    unwritable: OSError | None = None
    for key, figures, seconds in _trace_all(todo, device):
        run = todo[key][0]
        plans[key] = figures
        say(f"planned {run.name} in {seconds:.0f} s")
        if cache:
            try:
                _write_cached(cache_dir / f"{key}.json", figures, run, device)
            except OSError as e:  # a read-only checkout still plans
                unwritable = e
    rows = []
    for run, key in zip(study.runs, keys, strict=True):
        p, slurm = plans[key], run.slurm
        ranks = slurm.ranks if slurm is not None else 1
        wall_h = p.full_mfu_seconds / mfu * p.recompute_ratio / 3600  # executed FLOPs
        rows.append(
            {
                "name": run.name,
                "group": run.group,
                "seed": run.seed,
                "params": p.n_params,
                "tokens": p.tokens_per_step * p.steps,
                "steps": p.steps,
                "tokens_per_step": p.tokens_per_step,
                "layout": "1 x 1" if slurm is None else f"{slurm.nodes} x {slurm.tasks_per_node}",
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
                "slurm_time": slurm.time if slurm is not None else None,
            }
        )
    if cached_runs:
        say(
            f"{cached_runs} of {len(rows)} runs from the plan cache ({shown_path(cache_dir)}; "
            "--fresh traces them again)"
        )
    if unwritable is not None:
        say(f"the plan cache is not kept: {unwritable}")
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


# The plan's columns: title -> a row's cell.
_PLAN_CELLS: dict[str, Callable[[dict[str, Any]], str]] = {
    "run": lambda r: r["name"],
    "params": lambda r: _count(r["params"]),
    "tokens": lambda r: _count(r["tokens"]),
    "steps": lambda r: f"{r['steps']:,}",
    "nodes x GPUs": lambda r: r["layout"],
    "micro x accum": lambda r: f"{r['micro_batch']} x {r['grad_accum']}",
    "peak/GPU": lambda r: f"{r['peak_gib']:.1f} GiB",
    "fits?": lambda r: "yes" if r["fits"] else "NO",
    "GPU-hours": lambda r: _gpu_hours(r["gpu_hours"]),
    "wall time": lambda r: _hours(r["wall_hours"]),
}


def format_plan_table(rows: list[dict[str, Any]]) -> str:
    """The plan as a text table with a total line (the runs one after another)."""
    misfits = sum(not r["fits"] for r in rows)
    total = {
        "run": f"total: {len(rows)} runs",
        "tokens": _count(sum(r["tokens"] for r in rows)),
        "steps": f"{sum(r['steps'] for r in rows):,}",
        "peak/GPU": f"max {max(r['peak_gib'] for r in rows):.1f} GiB" if rows else "",
        "fits?": f"{misfits} do not" if misfits else "all",
        "GPU-hours": _gpu_hours(sum(r["gpu_hours"] for r in rows)),
        "wall time": _hours(sum(r["wall_hours"] for r in rows)),
    }
    table = [[cell(r) for cell in _PLAN_CELLS.values()] for r in rows]
    table.append([total.get(title, "") for title in _PLAN_CELLS])
    head = f"on {rows[0]['gpu']} ({rows[0]['gpu_gib']:.1f} GiB per GPU)" if rows else ""
    return head + "\n" + text_table(list(_PLAN_CELLS), table)


def _tokens(n: int) -> str:
    """100.7B, 12.3M, 409,600 (the paper's budget table's form)."""
    if n >= 1e9:
        return f"{n / 1e9:.1f}B"
    return f"{n / 1e6:.1f}M" if n >= 1e6 else f"{n:,}"


def format_run_table(study: Study, markdown: bool = False) -> str:
    """`study list`: the runs as an aligned table, or a markdown one: how many tokens each
    trains and how its batch is laid out (a run without Slurm is one process)."""
    rows = []
    for r in study.runs:
        t = r.config["train"]
        seq = t["seq_len"] or r.config["model"]["max_seq_len"]
        nodes, per_node = (r.slurm.nodes, r.slurm.tasks_per_node) if r.slurm else (1, 1)
        batch, micro = t["global_batch_size"], t["micro_batch_size"]
        rows.append(
            {
                "run": r.name,
                "seq len": str(seq),
                "global batch": f"{batch:,}",
                "micro batch": str(micro),
                "accum": str(batch // (micro * nodes * per_node)),
                "tokens/step": f"{batch * seq:,}",
                "total tokens": _tokens(batch * seq * t["train_iters"]),
                "nodes x GPUs": f"{nodes} x {per_node}",
            }
        )
    header, cells = list(rows[0]), [list(r.values()) for r in rows]
    if markdown:
        return pipe_table(header, cells, align=["left"] + ["right"] * (len(header) - 1))
    return text_table(header, cells)
