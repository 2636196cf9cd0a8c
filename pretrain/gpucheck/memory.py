"""The memory and speed stages: the planner's prediction against real training steps.

For each paper config (llama1b, pythia1b at seq 2048) on one GPU, ZeRO-1, bf16: the micro
batch the planner picks for this GPU with no block recomputed and with every block
recomputed (the largest of the micro batches `choose` considers that fits: divisors of the
global batch, at most the config's, at least 16,384 tokens), then a real run at it
(training.measure_run). Each run gives a memory row per phase (training step, evaluation
forward: planned peak vs torch.cuda.max_memory_allocated and max_memory_reserved), a speed
row (step time, tokens/s, MFU on the model's and on the executed FLOPs, the step time the
plan gives at 40% MFU) and the profiler's split of one step. The compile stage runs the
no-recompute plan eagerly and compiled, back to back (a paired ratio).
"""

from __future__ import annotations

from typing import Any

from pretrain.config import Config, load_config
from pretrain.gpucheck.results import at_most, check, relative_error
from pretrain.gpucheck.sizes import REPO, Context, smoke_model_overrides
from pretrain.gpucheck.training import GiB, measure_run, run_config
from pretrain.model.recompute import describe_recompute
from pretrain.planner.gpus import DEFAULT_MFU
from pretrain.planner.network import HOPPER_IB
from pretrain.planner.scaling import scaling
from pretrain.planner.search import Plan, micro_batch_candidates, plan_run

SMOKE_SEQ = 32


def paper_config(ctx: Context, name: str) -> Config:
    path = REPO / "configs" / "paper" / f"{name}.yaml"
    cfg = load_config(path)
    if ctx.sizes.tiny_model is not None:
        cfg = load_config(path, smoke_model_overrides(cfg.model, ctx.sizes.tiny_model, SMOKE_SEQ))
    return cfg


def picked_micro_batch(ctx: Context, cfg: Config, layers: int) -> int | None:
    """The largest micro batch the planner lets fit on this GPU with `layers` recomputed."""
    largest = ctx.sizes.micro_batch_cap or cfg.train.micro_batch_size
    for mb in micro_batch_candidates(cfg, 1, largest):
        if plan_run(cfg, ctx.gpu, 1, mb, layers, ctx.target).fits:
            return mb
    return None


def _gib(n: int | None) -> float | None:
    return None if n is None else n / GiB


def run_rows(
    ctx: Context, label: str, plan: Plan, measured: dict[str, Any], compiled: bool
) -> tuple[dict[str, list[dict[str, Any]]], list[dict[str, Any]]]:
    """The memory, speed and split rows of one measured run, and its checks."""
    common = {"run": label, "micro_batch": plan.micro_batch, "recompute": plan.layers}
    memory = []
    checks = []
    phases = [
        ("train step", plan.train_peak, measured["train_allocated"], measured["train_reserved"]),
        ("eval forward", plan.eval_peak, measured["eval_allocated"], measured["eval_reserved"]),
    ]
    for phase, predicted, allocated, reserved in phases[:1] if compiled else phases:
        memory.append(
            {
                **common,
                "phase": phase,
                "compile": compiled,
                "predicted_gib": predicted / GiB,
                "allocated_gib": _gib(allocated),
                "reserved_gib": _gib(reserved),
                "error_allocated": relative_error(predicted, allocated),
                "error_reserved": relative_error(predicted, reserved),
            }
        )
        gib = memory[-1]  # the checks in GiB, as the table
        # A compiled plan is the eager trace plus the measured allowance (planner/compiled.py)
        name = f"{label}, {phase}: allocated peak (GiB) vs planned"
        checks.append(check(name, gib["allocated_gib"], gib["predicted_gib"]))
        # The plan's reserve allows 5% of the GPU for the caching allocator's rounding.
        room = (predicted + 0.05 * plan.gpu.memory) / GiB
        name = f"{label}, {phase}: reserved (GiB) vs planned + 5% of the GPU"
        checks.append(at_most(name, gib["reserved_gib"], room))
    tokens = plan.micro_batch * plan.grad_accum * plan.seq_len
    step = measured["step_time_s"]
    planned = plan.model_flops * tokens / (plan.gpu.peak_flops * DEFAULT_MFU)
    speed = {
        **common,
        "compile": compiled,
        "step_time_s": step,
        "tokens_per_s": measured["tokens_per_s"],
        "mfu_model": plan.model_flops * tokens / step / plan.gpu.peak_flops,
        "mfu_executed": plan.executed_flops * tokens / step / plan.gpu.peak_flops,
        "planned_step_time_s": planned * plan.recompute_ratio,
        "first_step_s": measured.get("first_step_s"),
    }
    if ctx.cuda:  # the planner's 40% of peak on executed FLOPs is a GPU's figure
        checks.append(
            at_most(f"{label}: step time vs planned at 40% MFU", step, speed["planned_step_time_s"])
        )
    split = measured["split_ms"] or {}
    profiled = measured["profiled_step_s"]
    split_row = {
        "run": label,
        "step_ms": None if profiled is None else 1e3 * profiled,
        **{f"{k}_ms": split.get(k) for k in ("forward", "backward", "optimizer", "communication")},
    }
    parts = [split_row[f"{k}_ms"] for k in ("forward", "backward", "optimizer")]
    split_row["other_ms"] = (
        split_row["step_ms"] - sum(parts)
        if split_row["step_ms"] is not None and None not in parts
        else None
    )
    return {"memory": memory, "speed": [speed], "split": [split_row]}, checks


def _merge(into: dict[str, list], more: dict[str, list]) -> None:
    for k, rows in more.items():
        into.setdefault(k, []).extend(rows)


def measure_plan(
    ctx: Context,
    cfg: Config,
    name: str,
    layers: int,
    mb: int,
    compiled: bool,
    regions: str = "model",
) -> tuple[Plan, dict[str, Any]]:
    tag = f"{name}_mb{mb}_r{layers}{'_compiled' if compiled else ''}"
    tag += "_blocks" if compiled and regions == "blocks" else ""
    run = run_config(
        cfg, mb, layers, 1, str(ctx.folder / "runs" / tag), compiled, compile_regions=regions
    )
    plan = plan_run(run, ctx.gpu, 1, target=ctx.target, name=tag)
    ctx.log(
        f"  {tag}: planned train peak {plan.train_peak / GiB:.2f} GiB, eval "
        f"{plan.eval_peak / GiB:.2f} GiB; training {ctx.sizes.warmup + ctx.sizes.timed + 1} steps"
    )
    sizes = ctx.sizes
    return plan, measure_run(
        run, ctx.device, sizes.warmup, sizes.timed, True, sizes.compile_backend
    )


def memory_stage(ctx: Context, name: str) -> dict[str, Any]:
    """Planned vs measured memory, and the speed and split, with and without recompute."""
    cfg = paper_config(ctx, name)
    tables: dict[str, list] = {}
    checks: list[dict[str, Any]] = []
    notes = []
    L = cfg.model.n_layers
    for layers in (0, L):
        mb = picked_micro_batch(ctx, cfg, layers)
        what = describe_recompute(layers, L)
        if mb is None:
            notes.append(f"{name}, {what}: no micro batch fits {ctx.gpu.name} by the plan")
            continue
        plan, measured = measure_plan(ctx, cfg, name, layers, mb, compiled=False)
        label = f"{name}, micro batch {mb}, recompute {what}"
        rows, more = run_rows(ctx, label, plan, measured, compiled=False)
        _merge(tables, rows)
        checks += more
    return {"tables": tables, "checks": checks, "notes": notes}


SCALING_COUNTS = (32, 256, 1024)


def scaling_rows(ctx: Context, name: str, label: str, mfu: float) -> list[dict[str, Any]]:
    """The paper config's step on N GPUs (pretrain/planner/scaling.py) with its compute part
    at the MFU this GPU just measured: the plan's scaling resting on a measured step."""
    points = scaling(paper_config(ctx, name), ctx.gpu, HOPPER_IB, mfu, SCALING_COUNTS)
    return [
        {
            "run": label,
            "gpus": p.gpus,
            "mfu_model": mfu,
            "compute_s": p.time.compute,
            "exposed_comm_ms": 1e3 * p.time.exposed,
            "step_s": p.time.total,
            "efficiency": p.time.efficiency,
            "run_hours": p.run_hours,
        }
        for p in points
    ]


def compile_stage(ctx: Context, name: str) -> dict[str, Any]:
    """train.compile off, on (the whole model) and on (each block: compile_regions='blocks')
    at the planner's no-recompute micro batch, back to back: step time, the first step's time
    (set-up and compile), and the compiled runs' memory against the compiled plan."""
    cfg = paper_config(ctx, name)
    layers = 0
    mb = picked_micro_batch(ctx, cfg, layers)
    if mb is None:  # then the fullest recompute's
        layers = cfg.model.n_layers
        mb = picked_micro_batch(ctx, cfg, layers)
    if mb is None:
        raise RuntimeError(f"{name}: no micro batch fits {ctx.gpu.name} by the plan")
    tables: dict[str, list] = {}
    checks: list[dict[str, Any]] = []
    steps, first = {}, {}
    for compiled, regions in ((False, "model"), (True, "model"), (True, "blocks")):
        plan, measured = measure_plan(ctx, cfg, name, layers, mb, compiled, regions)
        label = (
            f"{name}, micro batch {mb}, recompute {describe_recompute(layers, cfg.model.n_layers)}"
        )
        label += (
            (", compiled" + (" (blocks)" if regions == "blocks" else "")) if compiled else ", eager"
        )
        rows, more = run_rows(ctx, label, plan, measured, compiled)
        _merge(tables, rows)
        # the eager run's memory is the memory stage's; the compiled runs' is checked here
        checks += more if compiled else [c for c in more if "step time" in c["name"]]
        steps[compiled, regions] = measured["step_time_s"]
        first[compiled, regions] = measured["first_step_s"]
        if regions == "model":  # the plan's scaling from the MFU this run measured
            mfu = rows["speed"][0]["mfu_model"]
            _merge(tables, {"scaling": scaling_rows(ctx, name, label, mfu)})
    eager = steps[False, "model"]
    checks.append(at_most(f"{name}: compiled / eager step time", steps[True, "model"] / eager, 1.0))
    checks.append(
        at_most(f"{name}: compiled (blocks) / eager step time", steps[True, "blocks"] / eager, 1.0)
    )
    notes = []
    if all(v is not None for v in first.values()):
        notes.append(
            f"first step (set-up and compile): eager {first[False, 'model']:.1f} s, compiled "
            f"{first[True, 'model']:.1f} s, compiled by blocks {first[True, 'blocks']:.1f} s; "
            f"blocks / model step time {steps[True, 'blocks'] / steps[True, 'model']:.3f}"
        )
    return {"tables": tables, "checks": checks, "notes": notes}
