"""The race of our training step against its peers' (peer_models.py) in paired rounds: what
`tools/benchmark.py peers` (pretrain/benchmarks/peers.py: its options, the printed table)
and the GPU check's peers stages (pretrain/gpucheck/stages.py) both run.

`race(args, precision, shape)` times one training step (forward, backward, torch's fused
AdamW step over the model's own parameters) of every contestant, all built from one set of
weights: ours, the peers, our partial-RoPE and QK-Norm variants (eager, against our model)
unless `args.no_variants`, and with `args.compile` every implementation under torch.compile
(own copy of the weights and own optimizer; a model whose compilation fails is left out with
its reason). `args` holds the benchmark's options (pretrain/benchmarks/peers.py's
`add_arguments`). Before anything is timed every contestant's loss on the first batch must
agree with our eager model's (LOSS_TOLERANCE).

How: each round runs every contestant's step once, in a fresh random order, and times
F.linear at the model's MLP shape (the matmul peak, in the same precision, in the same
conditions); ratios are per-round (paired) ratios, their median over rounds: to our step in
the same mode (eager rows to ours, compiled rows to ours compiled), and to the same model's
eager step. On CPU the clock is process CPU time by default (descheduled time on a shared
machine does not count); on a GPU (`args.device` cuda) wall time between device
synchronisations.
MFU = model FLOPs per step / (CPU seconds / threads) over the same rate of the matmul peak, so
the clock's scale cancels. On a CPU without bf16 matrix units (AVX2 only) bf16 matmuls run in
a fallback kernel far below fp32, so bf16 and autocast run `args.bf16_seq_len` tokens (the
benchmark's default is a quarter of fp32's).
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import statistics
import time

import torch
import torch.nn.functional as F

from pretrain.measure.peer_models import (
    IMPLEMENTATIONS,
    PEERS,
    SHAPES,
    Contestant,
    make,
    ours,
    shape_config,
    variant,
)
from pretrain.model.transformer import Transformer

PRECISIONS = ("fp32", "bf16", "autocast")
# Relative to our eager loss on the same batch. fp32: the models agree to ~1e-7. bf16 and
# autocast: 5e-3. litgpt's bf16 loss is a bf16 number (its cross-entropy runs on bf16 logits
# and returns their dtype), whose rounding alone is up to 2^-8 = 3.9e-3 relative; measured
# on CPU (tests/test_benchmark_peers.py, both shapes, seq 32 and 2048): transformers
# 1.4e-5-1.2e-4, litgpt 8e-4-2.7e-3 of ours.
LOSS_TOLERANCE = {"fp32": 1e-5, "bf16": 5e-3, "autocast": 5e-3}
LABEL = {"fp32": "fp32", "bf16": "bf16 weights", "autocast": "bf16 autocast"}


@dataclasses.dataclass
class Entry:
    contestant: Contestant
    optimizer: torch.optim.Optimizer
    seconds: list[float] = dataclasses.field(default_factory=list)
    first_loss: float = float("nan")


def _contestants(args: argparse.Namespace, shape: str, seq_len: int) -> list[Contestant]:
    """Ours, the peers, our variants (unless --no-variants) and, with --compile, every
    implementation compiled: all from one set of weights."""
    cfg = shape_config(
        shape,
        args.d_model,
        args.layers,
        args.vocab,
        seq_len,
        getattr(args, "heads", None),
        getattr(args, "kv_heads", None),
        getattr(args, "d_ff", None),
    )
    torch.manual_seed(args.seed)
    base = Transformer(cfg).train()
    out = [ours("ours", base)] + [make(p, base) for p in PEERS]
    if not args.no_variants:
        for name, changes in SHAPES[shape].variants:
            out.append(ours(name, variant(base, **changes), same_model=False))
    if args.compile:
        backend = getattr(args, "compile_backend", "inductor")
        out += [make(i, base, backend) for i in IMPLEMENTATIONS]
    return out


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _step(entry: Entry, x: torch.Tensor, y: torch.Tensor, autocast: bool, clock) -> float:
    _sync(x.device)
    t0 = clock()
    with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=autocast):
        loss = entry.contestant.loss(x, y)
    loss.backward()
    entry.optimizer.step()
    entry.optimizer.zero_grad(set_to_none=True)
    _sync(x.device)
    dt = clock() - t0
    if entry.first_loss != entry.first_loss:  # nan: the first step, before any update
        entry.first_loss = loss.item()
    return dt


def _matmul_seconds(a: torch.Tensor, w: torch.Tensor, clock, repeat: int = 3) -> float:
    F.linear(a, w)
    _sync(a.device)
    t0 = clock()
    for _ in range(repeat):
        F.linear(a, w)
    _sync(a.device)
    return (clock() - t0) / repeat


def _paired(mine: list[float], reference: list[float]) -> float:
    """The median over rounds of one contestant's step time over another's."""
    return statistics.median(s / r for s, r in zip(mine, reference, strict=True))


def _reason(e: BaseException) -> str:
    """An exception in one line: its type and first two lines (dynamo's say which backend
    raised on the first, what it raised on the second)."""
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    return f"{type(e).__name__}: {' '.join(lines[:2])[:300]}"


def race(args: argparse.Namespace, precision: str, shape: str = "llama1b") -> dict:
    """One shape in one precision: every contestant's step in paired rounds; the figures."""
    low = precision in ("bf16", "autocast")
    seq = args.bf16_seq_len if low else args.seq_len
    rounds = args.bf16_rounds if low else args.rounds
    device = torch.device(getattr(args, "device", "cpu"))
    # A GPU's work runs beside the process: its time is the wall clock's.
    cpu_clock = args.clock == "cpu" and device.type == "cpu"
    clock = time.process_time if cpu_clock else time.perf_counter
    contestants = _contestants(args, shape, seq)
    model = contestants[0].module
    cfg, flops_per_token, parameters = model.cfg, model.flops_per_token(seq), model.num_params()
    for c in contestants:  # in place: each loss closure holds the same module
        if precision == "bf16":  # bf16 weights, as DeepSpeed's BF16 engine holds the model
            c.module.to(device, torch.bfloat16)
        else:
            c.module.to(device)
    entries = [
        Entry(c, torch.optim.AdamW(c.module.parameters(), lr=1e-4, fused=True)) for c in contestants
    ]
    g = torch.Generator().manual_seed(args.seed)
    x = torch.randint(0, args.vocab, (args.batch, seq), generator=g).to(device)
    y = torch.randint(0, args.vocab, (args.batch, seq), generator=g).to(device)
    dtype = torch.float32 if precision == "fp32" else torch.bfloat16
    a = torch.randn(args.batch * seq, cfg.d_model, generator=g).to(device, dtype)
    w = torch.randn(2 * cfg.d_ff, cfg.d_model, generator=g).to(device, dtype)
    peak_flops = 2 * a.shape[0] * a.shape[1] * w.shape[0]
    flops = flops_per_token * args.batch * seq
    autocast = precision == "autocast"

    not_compiled: dict[str, str] = {}
    for e in list(entries):  # warmup; the first step records each loss at the shared weights
        try:
            for _ in range(args.warmup):
                _step(e, x, y, autocast, clock)
        except Exception as err:  # noqa: BLE001 - a model that does not compile is left out
            if not e.contestant.compiled:
                raise
            not_compiled[e.contestant.name] = _reason(err)
            entries.remove(e)
            e.optimizer.zero_grad(set_to_none=True)
    ref = entries[0].first_loss
    tolerance = LOSS_TOLERANCE[precision]
    for e in entries[1:]:
        rel = abs(e.first_loss - ref) / abs(ref)
        if e.contestant.same_model and rel > tolerance:
            raise SystemExit(
                f"error: {shape} {precision}: {e.contestant.name}'s loss {e.first_loss:.7f} "
                f"differs from ours {ref:.7f} by {rel:.2e} (relative; allowed {tolerance:g})"
            )
    peak_s: list[float] = []
    rng = random.Random(args.seed)
    order = list(entries)
    from tqdm import tqdm

    for _ in tqdm(range(rounds), desc=f"{shape} {precision}", unit="round", leave=False):
        rng.shuffle(order)
        for e in order:
            e.seconds.append(_step(e, x, y, autocast, clock))
        peak_s.append(_matmul_seconds(a, w, clock))
    # Rates per second of one thread's clock x threads: the CPU clock sums the threads.
    scale = args.threads if cpu_clock else 1
    peak = peak_flops / (statistics.median(peak_s) / scale)
    by = {  # the race's model (not our variants) by implementation and mode
        (e.contestant.implementation, e.contestant.compiled): e
        for e in entries
        if e.contestant.same_model
    }
    rows = []
    for e in entries:
        c = e.contestant
        med = statistics.median(e.seconds)
        # Eager rows (and our variants) against our eager step; compiled ones against ours
        # compiled; and each against its own eager step.
        same_mode = by.get(("ours", c.compiled)) if c.same_model else entries[0]
        eager = by.get((c.implementation, False)) if c.same_model else None
        rows.append(
            {
                "model": c.name,
                "implementation": c.implementation,
                "compiled": c.compiled,
                "median_s": med,
                "ratio_to_ours": _paired(e.seconds, same_mode.seconds) if same_mode else None,
                "ratio_to_eager": _paired(e.seconds, eager.seconds) if eager else None,
                "mfu": flops / (med / scale) / peak,
                "first_loss": e.first_loss,
                "loss_rel_error": abs(e.first_loss - ref) / abs(ref),
            }
        )
    versus = {}
    for compiled in (False, True):
        mine = by.get(("ours", compiled))
        theirs = [by[(p, compiled)] for p in PEERS if (p, compiled) in by]
        if mine is None or not theirs:
            continue
        # ours over each peer, paired; the fastest peer is the one ours is slowest against
        ratio, peer = max((_paired(mine.seconds, p.seconds), p.contestant.name) for p in theirs)
        versus["compiled" if compiled else "eager"] = {"ratio": ratio, "fastest_peer": peer}
    del entries, contestants, order, by, model
    if args.compile:  # compiled code and its guards hold the modules: let them go
        torch._dynamo.reset()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {
        "shape": shape,
        "description": SHAPES[shape].description,
        "precision": precision,
        "device": str(device),
        "batch": args.batch,
        "seq_len": seq,
        "rounds": rounds,
        "parameters": parameters,
        "d_model": cfg.d_model,
        "layers": cfg.n_layers,
        "heads": cfg.n_heads,
        "kv_heads": cfg.kv_heads,
        "d_ff": cfg.d_ff,
        "rotary_dims": cfg.rope_dims,
        "flops_per_step": flops,
        "peak_gflops": peak / 1e9,
        "peak_shape": [a.shape[0], a.shape[1], w.shape[0]],
        "rows": rows,
        "ours_vs_fastest_peer": versus,
        "not_compiled": not_compiled,
    }
