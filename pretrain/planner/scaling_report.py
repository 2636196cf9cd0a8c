"""The scaling table and plot of `tools/plan.py --scaling` and `--paper-scaling`."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from pretrain.planner.scaling import EFFICIENCY_FLOOR, ScalePoint, first_below
from pretrain.tables import pipe_table


def _groups(results: dict[str, list[ScalePoint]]) -> dict[str, list[ScalePoint]]:
    """Runs whose steps are the same at every count (the paper's RoPE fractions change neither
    the FLOPs nor the parameters) as one row, named by what differs."""
    by_key: dict[tuple, list[str]] = {}
    for name, points in results.items():  # the same as the table shows them
        key = tuple(
            (p.gpus, f"{p.time.efficiency:.3f}", round(1e3 * p.time.exposed)) for p in points
        )
        by_key.setdefault(key, []).append(name)
    out = {}
    for names in by_key.values():
        out[_label(names)] = results[names[0]]
    return out


def _label(names: Sequence[str]) -> str:
    """`llama1b_rope{0,10,100}`: names that differ only after `_rope`, brought together."""
    by_stem: dict[str, list[str]] = {}
    for name in names:
        stem, sep, rest = name.rpartition("_rope")
        by_stem.setdefault(stem if sep else name, []).append(rest if sep else "")
    return ", ".join(
        f"{stem}_rope{{{','.join(rests)}}}"
        if len(rests) > 1
        else f"{stem}_rope{rests[0]}"
        if rests[0]
        else stem
        for stem, rests in by_stem.items()
    )


def scaling_table(results: dict[str, list[ScalePoint]], detail: bool = False) -> str:
    """One row per run (or group of identical runs): efficiency at each count and where it
    falls under 90%; `detail` (one run): a row per count with the step's parts."""
    if detail:
        (points,) = results.values()
        header = [
            "GPUs",
            "micro x accum",
            "compute",
            "communication",
            "exposed",
            "optimizer",
            "step",
            "efficiency",
            "run",
        ]
        body = [
            [
                str(p.gpus),
                f"{p.micro_batch} x {p.grad_accum}",
                f"{p.time.compute:.3f} s",
                f"{1e3 * p.time.communication:.1f} ms",
                f"{1e3 * p.time.exposed:.1f} ms",
                f"{1e3 * p.time.optimizer:.2f} ms",
                f"{p.time.total:.3f} s",
                f"{100 * p.time.efficiency:.1f}%",
                f"{p.run_hours:.1f} h",
            ]
            for p in points
        ]
        return pipe_table(header, body)
    groups = _groups(results)
    counts = sorted({p.gpus for points in groups.values() for p in points})
    header = [
        "run",
        "exposed comm. / step",
        *[str(n) for n in counts],
        f"under {100 * EFFICIENCY_FLOOR:.0f}% at",
    ]
    body = []
    for label, points in groups.items():
        at = {p.gpus: p for p in points}
        comm = sorted({round(1e3 * p.time.exposed) for p in points})
        body.append(
            [
                label,
                f"{comm[0]}-{comm[-1]} ms" if len(comm) > 1 else f"{comm[0]} ms",
                *[f"{100 * at[n].time.efficiency:.1f}%" if n in at else "-" for n in counts],
                str(first_below(points) or f"> {counts[-1]}"),
            ]
        )
    return pipe_table(header, body)


def scaling_plot(results: dict[str, list[ScalePoint]], path: Path, title: str) -> None:
    """Efficiency against GPUs (left) and the step's exposed communication (right)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = _groups(results)
    fig, (eff, comm) = plt.subplots(1, 2, figsize=(12, 4.8))
    for label, points in groups.items():
        gpus = [p.gpus for p in points]
        eff.plot(gpus, [100 * p.time.efficiency for p in points], marker="o", ms=3, label=label)
        comm.plot(gpus, [1e3 * p.time.exposed for p in points], marker="o", ms=3, label=label)
    eff.axhline(100 * EFFICIENCY_FLOOR, color="grey", ls="--", lw=1)
    for ax in (eff, comm):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("GPUs (data parallel, the config's global batch)")
        ax.grid(alpha=0.3)
    eff.set_ylabel("efficiency: compute / step (%)")
    comm.set_ylabel("exposed communication per step (ms)")
    eff.legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
