"""The science stage (--science, if time is left): the character-level RoPE-theta study.

configs/char/shakespeare_theta{5000,10000}.yaml (6 layers, 6 heads, d 384, block 256,
dropout 0.2, 5,000 steps of 64 x 256, learned positions plus RoPE) on Tiny Shakespeare, three
seeds each, through the real trainer with its own callbacks. The seed paper reports best
validation losses of 1.4662 +- 0.0014 (theta 5000) and 1.474 +- 0.0030 (theta 10000), and
that the non-default theta ran inference 1.8x slower. Theta only changes the numbers in the
RoPE cache, so ours must generate at the same speed within noise: paired rounds of
`Transformer.generate` of the two thetas at the same weights (pretrain/measure/
rope_variants.py, the variants `tools/benchmark.py model` times), their median ratio.

Chunked: one (theta, seed) run at a time, each result kept in results.json. A run still going
at the call's deadline is stopped through the trainer's own pre-emption path (a `Deadline`
callback sets the stop signal: a checkpoint is written) and the next call on the same
machine resumes it from that checkpoint; a fresh machine starts that run again.
"""

from __future__ import annotations

import random
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from pretrain.config import load_config
from pretrain.data.recipes import prepare_tinyshakespeare
from pretrain.exit_codes import EXIT_OK
from pretrain.gpucheck.results import check
from pretrain.gpucheck.sizes import CHAR_CONFIG, REPO, Context
from pretrain.measure.rope_variants import build_variants
from pretrain.run_layout import read_metrics
from pretrain.train.callbacks import build_callbacks
from pretrain.train.callbacks.base import Callback
from pretrain.train.trainer import Trainer

THETAS = (5000.0, 10000.0)
PAPER_BEST_LOSS = {5000.0: (1.4662, 0.0014), 10000.0: (1.474, 0.0030)}  # mean, std over seeds
PAPER_SLOWDOWN = 1.8  # the paper's inference time of the non-default theta / the default's
RUN_ESTIMATE_S = 300  # one 5,000-step run on an H100 (nanoGPT's recipe: ~3 min on an A100)
TEXT_CANDIDATES = ("data/tinyshakespeare.txt", "input.txt", "../shared/data/tinyshakespeare.txt")


class Deadline(Callback):
    """Asks the trainer to stop (checkpoint, exit 99) once the call's time is up."""

    def __init__(self, deadline: float) -> None:
        self.deadline = deadline

    def on_step_end(self, trainer, out) -> None:
        if time.monotonic() > self.deadline and trainer.stop_signal is None:
            trainer.stop_signal = 15  # as SIGTERM would


def find_text(given: Path | None) -> Path:
    for p in [given] if given else [REPO / c for c in TEXT_CANDIDATES]:
        if p is not None and p.is_file():
            return p
    raise FileNotFoundError(
        f"--science needs Tiny Shakespeare: pass --shakespeare PATH (looked for "
        f"{', '.join(TEXT_CANDIDATES)} in {REPO}); on a device machine copy it into the "
        f"checkout's data/ first"
    )


def best_valid_loss(run_dir: Path) -> tuple[float | None, int]:
    rows = read_metrics(run_dir)
    losses = [r["valid/loss"] for r in rows if "valid/loss" in r]
    steps = max((r["step"] for r in rows), default=0)
    return (min(losses) if losses else None), steps


def train_one(ctx: Context, data: Path, theta: float, seed: int) -> dict[str, Any]:
    run_dir = ctx.folder / "science" / f"theta{theta:g}_s{seed}"
    overrides = [
        f"train.seed={seed}",
        f"logging.run_dir={run_dir}",
        f"data.train=[{data}]",
        f"data.valid=[{data}]",
        *ctx.sizes.science["overrides"],
    ]
    cfg = load_config(REPO / CHAR_CONFIG.format(theta=theta), overrides)
    callbacks = [Deadline(ctx.deadline), *build_callbacks(cfg)]
    code = Trainer(cfg, callbacks=callbacks).fit()
    loss, steps = best_valid_loss(run_dir)
    return {
        "theta": theta,
        "seed": seed,
        "steps": steps,
        "best_valid_loss": loss,
        "status": "done" if code == EXIT_OK else "stopped (resumes from its checkpoint)",
    }


def generation_speed(ctx: Context) -> list[dict[str, Any]]:
    """Paired rounds of generation at theta 5000 and 10000, the same weights."""
    cfg = load_config(REPO / CHAR_CONFIG.format(theta=10000), list(ctx.sizes.science["overrides"]))
    dtype = torch.bfloat16 if ctx.cuda else torch.float32
    variants = build_variants(cfg.model, list(THETAS), [1.0], ctx.device, dtype, seed=0)
    prompt = torch.zeros(1, 1, dtype=torch.long, device=ctx.device)
    n = ctx.sizes.science["gen_tokens"]
    times: dict[float, list[float]] = {v.theta: [] for v in variants}
    rng = random.Random(0)
    for i in range(ctx.sizes.science["gen_rounds"] + 1):  # round 0 warms up
        rng.shuffle(variants)
        for v in variants:
            if ctx.cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            v.model.generate(prompt, n, temperature=0)
            if ctx.cuda:
                torch.cuda.synchronize()
            if i:
                times[v.theta].append((time.perf_counter() - t0) / n)
    ratios = [a / b for a, b in zip(times[5000.0], times[10000.0], strict=True)]
    return [
        {
            "theta": theta,
            "ms_per_token": 1e3 * statistics.median(times[theta]),
            "ratio_to_default": statistics.median(ratios) if theta != 10000.0 else 1.0,
        }
        for theta in THETAS
    ]


def science_stage(ctx: Context) -> dict[str, Any]:
    text = find_text(ctx.shakespeare)
    data = ctx.folder / "shakespeare_char"
    if not (data / "train").exists() and not list(data.glob("*train*")):
        prepare_tinyshakespeare(data, text, progress=False)
    previous = ctx.previous.get("tables", {})
    done = {
        (r["theta"], r["seed"]): r for r in previous.get("science", []) if r["status"] == "done"
    }
    rows = list(done.values())
    ran = 0
    for theta in THETAS:
        for seed in ctx.sizes.science["seeds"]:
            if (theta, seed) in done:
                continue
            if ran and ctx.seconds_left() < RUN_ESTIMATE_S:
                return {"status": "partial", "tables": {"science": rows}, "checks": [], "notes": []}
            ctx.log(f"  theta {theta:g}, seed {seed}")
            row = train_one(ctx, data, theta, seed)
            ran += 1
            if row["status"] != "done":
                rows.append(row)
                return {"status": "partial", "tables": {"science": rows}, "checks": [], "notes": []}
            rows.append(row)
    checks, notes = [], []
    for theta, (mean, std) in PAPER_BEST_LOSS.items():
        ours = [r["best_valid_loss"] for r in rows if r["theta"] == theta]
        ours = [x for x in ours if x is not None]
        m = statistics.mean(ours) if ours else None
        s = statistics.stdev(ours) if len(ours) > 1 else 0.0
        checks.append(check(f"best valid loss, theta {theta:g} (paper {mean} +- {std})", m, mean))
        notes.append(
            f"theta {theta:g}: ours {m if m is None else round(m, 4)} +- {s:.4f} over "
            f"{len(ours)} seeds; paper {mean} +- {std}"
        )
    speed = generation_speed(ctx)
    ratio = speed[0]["ratio_to_default"]
    checks.append(check("generation time, theta 5000 / theta 10000 (paper: 1.8)", ratio, 1.0))
    return {"tables": {"science": rows, "science_speed": speed}, "checks": checks, "notes": notes}
