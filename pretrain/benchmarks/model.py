"""Model step time across rope_theta and rope fraction; on a GPU also tokens/s and MFU.

    python tools/benchmark.py model                      # CPU: ratios, a preset-shaped small model
    python tools/benchmark.py model --rounds 60 --threads 2

What it shows: theta only changes the numbers in the RoPE cache, never the work, so every
theta must run at the same speed (a published theta study saw 1.8x slowdowns away from
the default); and partial RoPE rotates fewer dims, so it must never be slower than full.

How it measures: every configuration shares the same weights (built once; each variant
is the same Transformer class at another theta/fraction, its parameters assigned from
the first: pretrain/measure/rope_variants.py, which the GPU check's science stage uses
too). After warmup, rounds visit all configurations in a fresh random order, one timed
forward+backward each, so machine noise lands on all of them alike. Each time is
divided by the median time of its round (a steady yardstick made of all configurations,
which cancels slow drifts in machine load); a configuration's figure is the median of
those over rounds, reported relative to the baseline's (theta 10000, fraction 1.0).

On CPU the clock is by default this process's CPU time (`time.process_time`): with one
thread that is the step's own compute, and time spent descheduled while other jobs use
the cores does not count. `--clock wall` times wall-clock instead (what a GPU run uses).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import torch

from pretrain.analysis.presets import load_preset
from pretrain.config import ConfigError, ModelConfig, rotary_dims_from_fraction
from pretrain.measure.rope_variants import Variant, build_variants
from pretrain.model.rope import apply_rope, rope_cache
from pretrain.run_layout import atomic_write
from pretrain.tables import text_table

THETAS = (500.0, 1000.0, 5000.0, 10000.0, 20000.0, 50000.0)
FRACTIONS = (0.0, 0.1, 0.25, 1.0)
BASELINE = (10000.0, 1.0)
THETA_TOLERANCE = 0.03  # every theta within 3% of theta 10000


def _floats(text: str) -> list[float]:
    try:
        return [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a comma-separated list of numbers"
        ) from None


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--preset",
        default="pythia1b_paper",
        help="preset whose shape the CPU model keeps (block, norm, MLP, head_dim); "
        "default pythia1b_paper (head_dim 256, where partial RoPE differs most)",
    )
    p.add_argument("--layers", type=int, default=2, help="CPU model: layers (default 2)")
    p.add_argument(
        "--heads",
        type=int,
        default=1,
        help="CPU model: heads; d_model = heads x the preset's head_dim (default 1)",
    )
    p.add_argument("--vocab", type=int, default=512, help="CPU model: vocabulary (default 512)")
    p.add_argument(
        "--seq-len", type=int, default=256, help="CPU: tokens per sequence (default 256)"
    )
    p.add_argument("--batch", type=int, default=1, help="CPU: sequences per step (default 1)")
    p.add_argument(
        "--rope-seq-len",
        type=int,
        default=2048,
        help="CPU: also time apply_rope alone on q/k of the full preset at this many positions "
        "(default 2048; 0 = skip)",
    )
    p.add_argument(
        "--thetas",
        type=_floats,
        default=list(THETAS),
        help="comma-separated rope_theta values (default 500,...,50000; must hold 10000)",
    )
    p.add_argument(
        "--fractions",
        type=_floats,
        default=list(FRACTIONS),
        help="comma-separated rope fractions (default 0,0.1,0.25,1; must hold 1)",
    )
    p.add_argument(
        "--rounds",
        type=int,
        default=60,
        help="timed rounds; each runs every configuration once, in random order (default 60)",
    )
    p.add_argument(
        "--warmup", type=int, default=3, help="untimed steps per configuration first (default 3)"
    )
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch.set_num_threads for the CPU run (default 1: steadier on a shared machine)",
    )
    p.add_argument(
        "--clock",
        choices=("cpu", "wall"),
        default="cpu",
        help="CPU run: time steps by process CPU time (default; ignores time the OS "
        "gives to other jobs) or wall clock. GPU runs always use wall clock",
    )
    p.add_argument("--seed", type=int, default=0, help="seed for weights, data and round order")
    p.add_argument(
        "--device",
        choices=("auto", "cpu", "cuda"),
        default="auto",
        help="auto: the GPU figures when CUDA is available, else the CPU ratios",
    )
    p.add_argument(
        "--gpu-presets",
        default="llama1b,pythia1b_paper",
        help="GPU: full-size presets to time (default llama1b,pythia1b_paper)",
    )
    p.add_argument(
        "--gpu-seq-len", type=int, default=2048, help="GPU: tokens per sequence (default 2048)"
    )
    p.add_argument("--gpu-batch", type=int, default=8, help="GPU: sequences per step (default 8)")
    p.add_argument("--gpu-rounds", type=int, default=10, help="GPU: timed rounds (default 10)")
    p.add_argument(
        "--peak-tflops",
        type=float,
        default=989.0,
        help="GPU: peak dense BF16 TFLOP/s for MFU (default 989, H200 SXM)",
    )
    p.add_argument("--json", metavar="PATH", default=None, help="also write the results as JSON")


# ----------------------------------------------------------------------------- building


def small_config(
    preset: ModelConfig, layers: int, heads: int, vocab: int, seq_len: int
) -> ModelConfig:
    """The preset's kind of block at a CPU-friendly size, with its head_dim (so its rotary dims)."""
    d_model = heads * preset.head_dim
    kv = None if preset.n_kv_heads is None else max(1, heads * preset.kv_heads // preset.n_heads)
    return preset.replace(
        n_layers=layers,
        n_heads=heads,
        n_kv_heads=kv,
        d_model=d_model,
        d_ff=max(64, preset.d_ff * d_model // preset.d_model),
        vocab_size=vocab,
        pad_vocab_to_multiple=1,
        max_seq_len=max(seq_len, 1),
        dropout=0.0,
    )


# ----------------------------------------------------------------------------- timing


def _step(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, sync) -> tuple[float, float]:
    """(wall seconds, process CPU seconds) of one forward+backward."""
    sync()
    w0, c0 = time.perf_counter(), time.process_time()
    loss = model(x, y).loss
    loss.backward()
    sync()
    c1, w1 = time.process_time(), time.perf_counter()
    model.zero_grad(set_to_none=True)
    return w1 - w0, c1 - c0


def time_variants(
    variants: list[Variant],
    x: torch.Tensor,
    y: torch.Tensor,
    rounds: int,
    warmup: int,
    seed: int,
    sync,
    desc: str,
    clock: str = "wall",
) -> Variant:
    """Warm up, then `rounds` shuffled round-robin passes; fills samples and ratios."""
    from tqdm import tqdm

    for v in variants:
        for _ in range(warmup):
            _step(v.model, x, y, sync)
    rng = random.Random(seed)
    order = list(variants)
    for _ in tqdm(range(rounds), desc=desc, unit="round", leave=False):
        rng.shuffle(order)
        for v in order:
            wall, cpu = _step(v.model, x, y, sync)
            v.wall.append(wall)
            v.samples.append(cpu if clock == "cpu" else wall)
        yardstick = statistics.median(v.samples[-1] for v in variants)
        for v in variants:
            v.ratios.append(v.samples[-1] / yardstick)
    return next(v for v in variants if (v.theta, v.fraction) == BASELINE)


def _median_ratio(v: Variant, base: Variant) -> float:
    """Step time relative to the baseline: medians over rounds of time / round median."""
    return statistics.median(v.ratios) / statistics.median(base.ratios)


def ratio_table(variants: list[Variant], thetas: list[float], fractions: list[float]) -> str:
    """Rows theta, columns fraction: step time relative to the baseline."""
    by = {(v.theta, v.fraction): v for v in variants}
    base = by[BASELINE]
    head = ["theta \\ fraction"] + [
        f"{f:g} ({by[(thetas[0], f)].rotary_dims} dims)" for f in fractions
    ]
    rows = [
        [f"{t:g}"] + [f"{_median_ratio(by[(t, f)], base):.3f}" for f in fractions] for t in thetas
    ]
    rows.append(
        ["median ms/step"]
        + [
            f"{1e3 * statistics.median(s for t in thetas for s in by[(t, f)].samples):.1f}"
            for f in fractions
        ]
    )
    return text_table(head, rows, align=["right"] * len(head))


def verdict(variants: list[Variant], thetas: list[float], fractions: list[float]) -> list[str]:
    by = {(v.theta, v.fraction): v for v in variants}
    base = by[BASELINE]
    lines = []
    worst = 0.0
    for f in fractions:
        ref = _median_ratio(by[(BASELINE[0], f)], base)
        for t in thetas:
            worst = max(worst, abs(_median_ratio(by[(t, f)], base) / ref - 1))
    ok = worst <= THETA_TOLERANCE
    lines.append(
        f"theta: largest difference from theta 10000 at the same fraction "
        f"{100 * worst:.1f}% ({'within' if ok else 'OVER'} {100 * THETA_TOLERANCE:.0f}%)"
    )
    slower = []
    for f in fractions:
        if f == 1.0:
            continue
        r = statistics.median(
            _median_ratio(by[(t, f)], base) / _median_ratio(by[(t, 1.0)], base) for t in thetas
        )
        slower.append((f, r))
    parts = ", ".join(f"{f:g}: {r:.3f}" for f, r in slower)
    ok = all(r <= 1.0 + THETA_TOLERANCE for _, r in slower)
    lines.append(
        f"partial vs full RoPE (step time / full, median over thetas): {parts} "
        f"({'never slower' if ok else 'SLOWER than full'}, noise band {100 * THETA_TOLERANCE:.0f}%)"
    )
    return lines


def _iqr_pct(values: list[float]) -> float:
    s = sorted(values)
    return 100 * (s[(3 * len(s)) // 4] - s[len(s) // 4]) / statistics.median(s)


def noise_line(base: Variant, clock: str) -> str:
    return (
        f"baseline over {len(base.samples)} rounds: median {1e3 * statistics.median(base.samples):.1f} ms "
        f"({clock} clock); interquartile range of its time {_iqr_pct(base.samples):.1f}%, "
        f"of its round-normalised time {_iqr_pct(base.ratios):.1f}%; "
        f"wall clock median {1e3 * statistics.median(base.wall):.1f} ms, IQR {_iqr_pct(base.wall):.1f}%"
    )


# ----------------------------------------------------------------------------- runs


def _check_args(args: argparse.Namespace) -> None:
    if BASELINE[0] not in args.thetas or BASELINE[1] not in args.fractions:
        raise SystemExit(
            "error: --thetas must include 10000 and --fractions must include 1 "
            "(the baseline every ratio is taken against)"
        )
    for name in (
        "layers",
        "heads",
        "vocab",
        "seq_len",
        "batch",
        "rounds",
        "threads",
        "gpu_seq_len",
        "gpu_batch",
        "gpu_rounds",
    ):
        if getattr(args, name) < 1:
            raise SystemExit(
                f"error: --{name.replace('_', '-')}={getattr(args, name)} must be >= 1"
            )
    if args.rope_seq_len < 0:
        raise SystemExit(f"error: --rope-seq-len={args.rope_seq_len} must be >= 0")
    if args.warmup < 0:
        raise SystemExit(f"error: --warmup={args.warmup} must be >= 0")


def time_rope_alone(
    preset: ModelConfig, fractions: list[float], seq_len: int, rounds: int, seed: int, clock: str
) -> dict[float, tuple[int, float]]:
    """apply_rope forward+backward on q- and k-shaped tensors of the full preset (one
    sequence): {fraction: (rotary dims, median seconds)}. Shows what RoPE itself costs at
    real sizes, where the small model's step hides it under per-op overhead."""

    H, KV, D, T = preset.n_heads, preset.kv_heads, preset.head_dim, seq_len
    g = torch.Generator().manual_seed(seed)
    # As attention sees them: (B, heads, T, D) views of a (B, T, heads * D) projection.
    q = torch.randn(1, T, H, D, generator=g).transpose(1, 2).requires_grad_()
    k = torch.randn(1, T, KV, D, generator=g).transpose(1, 2).requires_grad_()
    caches = {}
    for f in fractions:
        dims = rotary_dims_from_fraction(f, D)
        caches[f] = (dims, *rope_cache(T, dims, BASELINE[0]))
    samples: dict[float, list[float]] = {f: [] for f in fractions}
    clock_fn = time.process_time if clock == "cpu" else time.perf_counter
    rng = random.Random(seed)
    order = list(fractions)
    for i in range(rounds + 1):  # round 0 is warmup
        rng.shuffle(order)
        for f in order:
            _, cos, sin = caches[f]
            t0 = clock_fn()
            out = apply_rope(q, cos, sin).sum() + apply_rope(k, cos, sin).sum()
            out.backward()
            dt = clock_fn() - t0
            q.grad = k.grad = None
            if i:
                samples[f].append(dt)
    return {f: (caches[f][0], statistics.median(samples[f])) for f in fractions}


def run_cpu(args: argparse.Namespace) -> dict:

    torch.set_num_threads(args.threads)
    preset = load_preset(args.preset)
    cfg = small_config(preset, args.layers, args.heads, args.vocab, args.seq_len)
    variants = build_variants(
        cfg, args.thetas, args.fractions, torch.device("cpu"), torch.float32, args.seed
    )
    g = torch.Generator().manual_seed(args.seed)
    x = torch.randint(0, cfg.vocab_size, (args.batch, args.seq_len), generator=g)
    y = torch.randint(0, cfg.vocab_size, (args.batch, args.seq_len), generator=g)
    print(
        f"CPU, {args.threads} thread(s), fp32: {args.preset}-shaped model, {cfg.n_layers} layers, "
        f"d_model {cfg.d_model}, {cfg.n_heads} heads x head_dim {cfg.head_dim}, {cfg.block} block, "
        f"{cfg.mlp}, vocab {cfg.vocab_size}; batch {args.batch} x {args.seq_len} tokens; "
        f"{len(variants)} configurations x {args.rounds} rounds"
    )
    base = time_variants(
        variants, x, y, args.rounds, args.warmup, args.seed, lambda: None, "cpu", args.clock
    )
    print(
        f"\nforward+backward step time ({args.clock} clock) relative to theta 10000, fraction 1.0:"
    )
    print(ratio_table(variants, args.thetas, args.fractions))
    print()
    for line in [noise_line(base, args.clock), *verdict(variants, args.thetas, args.fractions)]:
        print(line)

    alone = {}
    if args.rope_seq_len:
        alone = time_rope_alone(
            preset,
            args.fractions,
            args.rope_seq_len,
            max(5, args.rounds // 4),
            args.seed,
            args.clock,
        )
        full_s = alone[1.0][1]
        print(
            f"\nRoPE alone, full {args.preset} shape: apply_rope forward+backward on q "
            f"(1 x {preset.n_heads} x {args.rope_seq_len} x {preset.head_dim}) and k "
            f"({preset.kv_heads} heads), {args.clock} clock, relative to full RoPE:"
        )
        print(
            "  "
            + "  ".join(
                f"{f:g} ({d} dims): {1e3 * t:.1f} ms = {t / full_s:.2f}"
                for f, (d, t) in alone.items()
            )
        )
    return {
        "rope_alone": {str(f): {"rotary_dims": d, "median_s": t} for f, (d, t) in alone.items()},
        "device": "cpu",
        "threads": args.threads,
        "clock": args.clock,
        "preset": args.preset,
        "model": cfg.model_dump(),
        "batch": args.batch,
        "seq_len": args.seq_len,
        "results": [
            {
                "theta": v.theta,
                "fraction": v.fraction,
                "rotary_dims": v.rotary_dims,
                "median_s": statistics.median(v.samples),
                "ratio": _median_ratio(v, base),
            }
            for v in variants
        ],
    }


def run_gpu(args: argparse.Namespace, device: torch.device | None = None) -> dict:

    device = device or torch.device("cuda")
    out = {"device": torch.cuda.get_device_name(), "peak_tflops": args.peak_tflops, "presets": {}}
    B, T = args.gpu_batch, args.gpu_seq_len
    for name in [n.strip() for n in args.gpu_presets.split(",") if n.strip()]:
        cfg = load_preset(name).replace(
            max_seq_len=max(T, load_preset(name).max_seq_len), dropout=0.0
        )
        variants = build_variants(
            cfg, args.thetas, args.fractions, device, torch.bfloat16, args.seed
        )
        g = torch.Generator(device=device).manual_seed(args.seed)
        x = torch.randint(0, cfg.vocab_size, (B, T), generator=g, device=device)
        y = torch.randint(0, cfg.vocab_size, (B, T), generator=g, device=device)
        base = time_variants(
            variants, x, y, args.gpu_rounds, args.warmup, args.seed, torch.cuda.synchronize, name
        )
        flops = variants[0].model.flops_per_token(T)
        print(
            f"\n{name} on {out['device']}, bf16, batch {B} x {T} tokens, "
            f"{flops:.3g} training FLOPs/token, peak {args.peak_tflops:g} TFLOP/s"
        )
        print(
            f"{'fraction':>8} {'dims':>5} {'theta':>7} {'ms/step':>9} {'tokens/s':>10} "
            f"{'MFU':>6} {'vs base':>8}"
        )
        rows = []
        for v in variants:
            s = statistics.median(v.samples)
            tps = B * T / s
            mfu = flops * tps / (args.peak_tflops * 1e12)
            rows.append(
                {
                    "theta": v.theta,
                    "fraction": v.fraction,
                    "rotary_dims": v.rotary_dims,
                    "median_s": s,
                    "tokens_per_s": tps,
                    "mfu": mfu,
                    "ratio": _median_ratio(v, base),
                }
            )
            print(
                f"{v.fraction:>8g} {v.rotary_dims:>5} {v.theta:>7g} {1e3 * s:>9.1f} {tps:>10.0f} "
                f"{100 * mfu:>5.1f}% {_median_ratio(v, base):>8.3f}"
            )
        for line in [noise_line(base, "wall"), *verdict(variants, args.thetas, args.fractions)]:
            print(line)
        out["presets"][name] = {"batch": B, "seq_len": T, "flops_per_token": flops, "results": rows}
        del variants
        torch.cuda.empty_cache()
    return out


def run(args: argparse.Namespace) -> None:
    _check_args(args)
    use_gpu = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    if use_gpu and not torch.cuda.is_available():
        raise SystemExit("error: --device cuda but CUDA is not available; use --device cpu")
    try:
        result = run_gpu(args) if use_gpu else run_cpu(args)
    except ConfigError as e:
        raise SystemExit(f"error: {e}") from None
    if args.json:
        from pathlib import Path

        path = Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, json.dumps(result, indent=2), fsync=False)
        print(f"wrote {path}")
