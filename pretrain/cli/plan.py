"""Memory and FLOP plan of a training run: will it fit, with what, and how long will it take.

    python tools/plan.py configs/paper/llama1b_rope10.yaml --gpu h200 --gpus 32
    python tools/plan.py CONFIG --gpu h100 --checkpointing auto     # least recompute that fits
    python tools/plan.py --validate                                  # predicted vs CPU allocator
    python tools/plan.py CONFIG --scaling --plot scaling.png         # 8 to 1,024 GPUs
    python tools/plan.py --paper-scaling                             # every paper run's scaling

How it works: pretrain/planner/ (docs/performance.md).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from pathlib import Path

from pretrain.cli.errors import ArgumentParser, user_errors
from pretrain.config import ConfigError, add_set_option, load_config
from pretrain.model.recompute import describe_recompute, recompute_layers
from pretrain.planner.comms import LOG_STEP, collective_rows
from pretrain.planner.gpus import DEFAULT_MFU, GPU, GiB, parse_gpu
from pretrain.planner.network import HOPPER_IB, Fabric, fabric
from pretrain.planner.paper import PAPER_PLAN, paper_plan, paper_table
from pretrain.planner.scaling import first_below, paper_scaling, point, scaling
from pretrain.planner.scaling_report import scaling_plot, scaling_table
from pretrain.planner.search import (
    Plan,
    choose,
    largest_micro_batch,
    micro_batch_on,
    plan_run,
    with_micro_batch,
)
from pretrain.planner.validation import VALIDATION_TOLERANCE, cpu_kernel_path, validate
from pretrain.study.spec import load_study


def _h(seconds: float) -> str:
    h = seconds / 3600
    return f"{h:.1f} h" if h >= 1 else f"{seconds / 60:.1f} min"


def format_plan(p: Plan, mfu: float, largest_mb: int | None = None) -> str:
    g = GiB
    lines = [
        f"{p.name or 'run'}: {p.n_params / 1e9:.3g}B parameters, {p.world_size} x {p.gpu.name} "
        f"({p.gpu.gib:.1f} GiB), {p.optimizer}",
        f"  micro batch {p.micro_batch} x {p.grad_accum} accumulation x {p.world_size} GPUs, "
        f"seq {p.seq_len}; activation checkpointing: {describe_recompute(p.layers, p.n_layers)}",
        "  memory per GPU (allocated by torch):",
    ]
    for k, v in p.static.items():
        lines.append(f"    {k:<38} {v / g:8.2f} GiB")
    lines += [
        f"    {'= state between steps':<38} {p.static_bytes / g:8.2f} GiB",
        f"    {'+ gradients (.grad) during a step':<38} {p.ds.grads / g:8.2f} GiB",
        f"    {'+ forward/backward of a micro batch':<38} {(p.trace.train + p.ds.backward) / g:8.2f} GiB"
        f"  (forward alone {p.trace.train_forward / g:.2f})",
        *(
            [f"    {'+ compiled step (torch.compile)':<38} {p.compile_extra / g:8.2f} GiB"]
            if p.compiled
            else []
        ),
        f"    {'+ after backward / optimizer step':<38} {max(p.ds.after_backward, p.ds.step) / g:8.2f} GiB",
        f"  train peak {p.train_peak / g:.2f} GiB, eval peak {p.eval_peak / g:.2f} GiB, "
        f"max-logit probe {p.probe_peak / g:.2f} GiB",
        f"  {'FITS' if p.fits else 'DOES NOT FIT'}: peak {p.peak / g:.2f} GiB + reserve "
        f"{p.reserve / g:.1f} GiB vs {p.gpu.gib:.1f} GiB",
    ]
    if largest_mb is not None:
        lines.append(f"  largest micro batch that fits with this checkpointing: {largest_mb}")
    lines += [
        f"  FLOPs per token: model {p.model_flops:.3e}, executed {p.executed_flops:.3e} "
        f"({p.recompute_ratio:.3f}x with recompute)",
        f"  step ({p.tokens_per_step:,} tokens): {p.step_time(1.0):.2f} s at 100% MFU, "
        f"{p.step_time(mfu):.2f} s at {100 * mfu:.0f}% MFU",
        f"  run ({p.steps:,} steps): {_h(p.run_time(1.0))} at 100% MFU, {_h(p.run_time(mfu))} at "
        f"{100 * mfu:.0f}% MFU = {p.gpu_hours(mfu):,.0f} GPU-hours",
    ]
    if p.fp8_flops:
        lines.append(
            f"  fp8: {100 * p.fp8_share:.0f}% of the model FLOPs in fp8 matmuls; at twice bf16's "
            f"rate and free casts (a bound) the step would take {p.fp8_ideal_step_time(mfu):.2f} s "
            f"at {100 * mfu:.0f}% MFU"
        )
    lines += [f"  note: {n}" for n in p.notes]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """`python tools/plan.py`: a user error -> one line, exit 2 (pretrain/cli/errors.py)."""
    return user_errors(_main)(None if argv is None else list(argv))


def _main(argv: list[str] | None = None) -> int:
    ap = ArgumentParser(
        prog="plan", description="Memory and time plan of a run, traced on fake tensors."
    )
    ap.add_argument("config", nargs="?", help="run config (YAML)")
    add_set_option(ap, "train.micro_batch_size=32")
    ap.add_argument("--gpu", default="h200", help="h100, h200 or memory in GiB (default h200)")
    ap.add_argument("--gpus", type=int, default=32, help="number of GPUs (data parallel)")
    ap.add_argument("--mfu", type=float, default=DEFAULT_MFU, help="model FLOPs utilization")
    ap.add_argument("--peak-tflops", type=float, help="peak dense BF16 TFLOP/s per GPU (989)")
    ap.add_argument("--reserve-gib", type=float, help="memory kept free (2 GiB + 5%% of the GPU)")
    ap.add_argument("--checkpointing", help="none, full, N layers or auto (default: the config's)")
    ap.add_argument("--micro-batch", type=int, help="micro batch (default: the config's)")
    ap.add_argument("--json", action="store_true", help="print the plan as JSON")
    ap.add_argument(
        "--validate",
        action="store_true",
        help="check the planner against the CPU allocator on small models",
    )
    ap.add_argument(
        "--paper",
        action="store_true",
        help="plan every run of studies/partial_rope.yaml (the paper) and print "
        "docs/performance.md's table",
    )
    ap.add_argument(
        "--tokens-per-step",
        type=int,
        help="with --paper: global batch = this / seq_len (the paper: 8388608)",
    )
    ap.add_argument(
        "--write",
        action="store_true",
        help=f"with --paper: write the plans to {PAPER_PLAN.name} (the study's plan_file: each "
        "job's --time)",
    )
    net = ap.add_argument_group(
        "communication",
        "the network the step's collectives cross (defaults: H100/H200 nodes of 8 GPUs on "
        "NVLink 4, 400 Gb/s InfiniBand per GPU across; docs/scaling.md cites each figure)",
    )
    net.add_argument("--gpus-per-node", type=int, help="GPUs on one node's NVLink (8)")
    net.add_argument(
        "--nvlink-gbs", type=float, help="GB/s a ring reaches over NVLink, per GPU (370)"
    )
    net.add_argument(
        "--nic-gbs", type=float, help="GB/s a ring reaches over one GPU's NIC across nodes (47)"
    )
    net.add_argument(
        "--scaling",
        action="store_true",
        help="the step on 8 to 1,024 GPUs: compute, exposed communication, efficiency",
    )
    net.add_argument(
        "--paper-scaling",
        action="store_true",
        help="--scaling for every run of studies/partial_rope.yaml (docs/scaling.md's table)",
    )
    net.add_argument("--plot", type=Path, help="with --scaling/--paper-scaling: a PNG here")
    args = ap.parse_args(argv)
    if args.validate:
        return _main_validate()
    if args.paper:
        return _main_paper(args)
    if args.paper_scaling:
        return _main_paper_scaling(args)
    if not args.config:
        ap.error("give a CONFIG (or --validate)")
    if args.scaling:
        return _main_scaling(args)
    return _main_plan(args)


def _fabric(args) -> Fabric:
    return fabric(args.gpus_per_node, args.nvlink_gbs, args.nic_gbs, HOPPER_IB)


def _check_mfu(args) -> None:
    if not 0 < args.mfu <= 1:
        raise ConfigError(f"--mfu {args.mfu} must be in (0, 1], e.g. 0.4")


def _main_scaling(args) -> int:
    _check_mfu(args)
    cfg = load_config(args.config, list(args.overrides))
    gpu, net = parse_gpu(args.gpu, args.peak_tflops), _fabric(args)
    points = scaling(cfg, gpu, net, args.mfu)
    name = Path(args.config).stem
    print(f"{name} on {gpu.name} at {100 * args.mfu:.0f}% MFU; {net.name}")
    print(scaling_table({name: points}, detail=True))
    for p in points:
        if p.note:
            print(p.note)
    below = first_below(points)
    print(
        f"efficiency falls under 90% at {below} GPUs"
        if below
        else "efficiency stays at or above 90% up to the largest count"
    )
    if args.plot:
        scaling_plot({name: points}, args.plot, f"{name}: {gpu.name}, {net.name}")
        print(f"wrote {args.plot}")
    return 0


def _main_paper_scaling(args) -> int:
    _check_mfu(args)
    repo = Path(__file__).resolve().parents[2]
    runs = load_study(repo / "studies" / "partial_rope.yaml").runs
    gpu, net = parse_gpu(args.gpu, args.peak_tflops), _fabric(args)
    results = paper_scaling([repo / run.config_path for run in runs], gpu, net, args.mfu)
    print(f"the paper's runs on {gpu.name} at {100 * args.mfu:.0f}% MFU; {net.name}")
    print(scaling_table(results))
    if args.plot:
        scaling_plot(
            results, args.plot, f"the paper's runs: {gpu.name} at {100 * args.mfu:.0f}% MFU"
        )
        print(f"wrote {args.plot}")
    return 0


def _main_plan(args) -> int:
    overrides = list(args.overrides)
    if args.checkpointing is not None:
        overrides.append(f"train.activation_checkpointing={args.checkpointing}")
    if args.micro_batch is not None:
        if args.micro_batch <= 0:
            raise ConfigError(f"--micro-batch {args.micro_batch} must be a positive integer")
        overrides.append(f"train.micro_batch_size={args.micro_batch}")
    cfg = load_config(args.config, overrides)
    if args.gpus <= 0:
        raise ConfigError(f"--gpus {args.gpus} must be a positive integer")
    _check_mfu(args)
    gpu = parse_gpu(args.gpu, args.peak_tflops)
    reserve = None if args.reserve_gib is None else int(args.reserve_gib * GiB)
    name = Path(args.config).stem
    auto = recompute_layers(cfg.train.activation_checkpointing, cfg.model.n_layers) is None
    shrunk = None
    if args.micro_batch is None:  # the config's micro batch: shrunk as --scaling does
        micro, shrunk = micro_batch_on(cfg, args.gpus)
        cfg = with_micro_batch(cfg, micro)
        if shrunk and not args.json:
            print(shrunk)  # first: what the whole plan is of (JSON: in its notes)
    if auto:
        plan = choose(
            cfg,
            gpu,
            args.gpus,
            change_micro_batch=args.micro_batch is None,
            reserve=reserve,
            name=name,
        )
        if plan is None:
            print(
                f"{name}: nothing fits {gpu.name} ({gpu.gib:.1f} GiB) on {args.gpus} GPUs, "
                f"even with full recompute at the smallest micro batch"
            )
            return 1
        plan.notes.append(
            f"auto picked micro batch {plan.micro_batch} x {plan.grad_accum} "
            f"accumulation, recompute: {describe_recompute(plan.layers, plan.n_layers)}"
        )
    else:
        plan = plan_run(cfg, gpu, args.gpus, reserve=reserve, name=name)
    if shrunk and args.json:
        plan.notes.insert(0, shrunk)
    largest = largest_micro_batch(cfg, gpu, args.gpus, plan.layers, reserve=reserve)
    comms = _comms_point(cfg, plan, gpu, _fabric(args), args.mfu)
    if args.json:
        extra = {"largest_micro_batch": largest}
        if comms is not None:
            extra["communication"] = comms_summary(comms)
        print(json.dumps({**plan.summary(args.mfu), **extra}, indent=2))
    else:
        print(format_plan(plan, args.mfu, largest))
        if comms is not None:
            print(format_comms(comms, _fabric(args), args.mfu))
    return 0 if plan.fits else 1


def _comms_point(cfg, plan: Plan, gpu: GPU, net: Fabric, mfu: float):
    if plan.world_size < 2:
        return None
    t = cfg.train.model_copy(update={"micro_batch_size": plan.micro_batch})
    return point(cfg.model_copy(update={"train": t}), gpu, plan.world_size, net, mfu)


def comms_summary(p) -> dict:
    t = p.time
    return {
        "collectives": collective_rows(list(p.collectives)),
        "trainer_collectives": collective_rows(list(p.trainer)),
        "log_interval": p.log_interval,
        "communication_s": t.communication,
        "exposed_s": t.exposed,
        "compute_s": t.compute,
        "optimizer_s": t.optimizer,
        "step_s": t.total,
        "efficiency": t.efficiency,
        "run_hours": p.run_hours,
    }


def _collective_line(c, net: Fabric, n: int) -> str:
    seconds = net.time(c.op, c.buffer(n), n) * c.calls
    return (
        f"    {c.op:<23} {c.size:>15,} B x {c.calls:<3} {c.phase:<15} {c.what:<22} "
        f"{1e3 * seconds:9.2f} ms"
    )


def format_comms(p, net: Fabric, mfu: float) -> str:
    t = p.time
    lines = [f"  communication per step on {p.gpus} GPUs ({net.name}):"]
    per_step = [c for c in p.trainer if c.phase != LOG_STEP]
    logging = [c for c in p.trainer if c.phase == LOG_STEP]
    lines += [_collective_line(c, net, p.gpus) for c in [*p.collectives, *per_step]]
    if logging:
        lines.append(
            f"  and at a logging step (every {p.log_interval} steps; the metrics of the steps "
            f"since the last flush):"
        )
        lines += [_collective_line(c, net, p.gpus) for c in logging]
    hidden = t.communication - t.exposed
    lines += [
        f"    {'= all collectives':<23} {1e3 * t.communication:.2f} ms a step (the trainer's "
        f"own, a logging step's spread over its interval), {1e3 * hidden:.2f} ms hidden "
        f"behind the backward (overlap_comm)",
        f"  step: compute {t.compute:.3f} s at {100 * mfu:.0f}% MFU + exposed communication "
        f"{t.exposed:.3f} s + optimizer {t.optimizer:.4f} s = {t.total:.3f} s: efficiency "
        f"{100 * t.efficiency:.1f}%, run {_h(p.run_hours * 3600)}",
    ]
    return "\n".join(lines)


def _main_paper(args) -> int:
    repo = Path(__file__).resolve().parents[2]
    runs = load_study(repo / "studies" / "partial_rope.yaml").runs
    configs = [repo / run.config_path for run in runs]
    out = PAPER_PLAN if args.write else None
    rows = paper_plan(
        configs, args.gpus, args.mfu, args.overrides, out, sys.stderr, args.tokens_per_step
    )
    print(paper_table(rows))
    return 0


def _main_validate() -> int:
    print(
        "planner vs CPU allocator (real DeepSpeed steps on CPU: bf16, ZeRO-1, fp32 gradient "
        "accumulation, 2 of 4 blocks recomputed, micro batch 4 x 256):"
    )
    print(f"  CPU kernels: {cpu_kernel_path()}")
    worst, bad = 0.0, []
    for v in validate():
        worst = max(worst, abs(v.error))
        if abs(v.error) > VALIDATION_TOLERANCE:
            bad.append(v)
        print(
            f"  {v.name:<32} {v.n_params / 1e6:4.2f}M params: planned "
            f"{v.predicted / 2**20:7.2f} MiB, allocator {v.measured / 2**20:7.2f} MiB, "
            f"error {100 * v.error:+.2f}%"
        )
    for v in bad:
        print(f"  {v.name}: the allocator's largest live allocations before the evaluation:")
        print("\n".join(f"    {line}" for line in v.live_at_eval))
    ok = worst <= VALIDATION_TOLERANCE
    print(
        f"{'OK' if ok else 'FAILED'}: largest error {100 * worst:.2f}% "
        f"(target {100 * VALIDATION_TOLERANCE:g}%)"
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
