"""results.json as markdown (results.md, and the tables of
docs/gpu_check.md between its markers) and as the console summary: every stage's state
and time against its budget, every check, the flagged ones marked.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from pretrain.gpucheck.results import TABLES, Stage
from pretrain.run_layout import atomic_write
from pretrain.tables import pipe_table

BEGIN = "<!-- gpu-check:begin (written by tools/gpu_check.py --update-docs; do not edit) -->"
END = "<!-- gpu-check:end -->"
TABLE_TITLES = {
    "tests": "GPU-marked tests",
    "memory": "Memory: planned peak vs torch.cuda.max_memory_allocated / max_memory_reserved",
    "speed": "Speed: step time, tokens/s, MFU (model and executed FLOPs)",
    "scaling": (
        "The plan's step on N GPUs from this GPU's measured MFU: compute, exposed "
        "communication (H100/H200 nodes, 400 Gb/s InfiniBand), efficiency"
    ),
    "split": "Step split from torch.profiler (ms; communication is inside the phases)",
    "peers": (
        "Peers: training step at both paper shapes, same weights, eager and compiled, paired "
        "rounds (ratio to ours: to our step in the same mode)"
    ),
    "kernels": "Attention kernel per shape: predicted from documented constraints vs measured",
    "numerics": "Numerics: the device against fp32 on CPU",
    "science": "Science: best validation loss, character-level RoPE-theta study",
    "science_speed": "Science: generation speed by theta (paper: 1.8x slower off the default)",
    "positions": "Position encodings: forward + backward vs causal attention, paired rounds",
    "fp8": "FP8 training (torchao): compiled forward + backward vs bf16, paired rounds",
}
PERCENT = ("error_", "mfu_", "_rel_error", "efficiency")


def cell(field: str, v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, list):
        return ", ".join(cell(field, x) for x in v[:4]) + (" ..." if len(v) > 4 else "")
    if isinstance(v, float):
        if not math.isfinite(v):
            return str(v)
        if any(p in field for p in PERCENT):
            return f"{100 * v:+.2f}%" if field.startswith("error") else f"{100 * v:.3g}%"
        if field.endswith("_gib"):
            return f"{v:.2f}" if abs(v) >= 0.1 else f"{v:.2g}"
        if field.endswith("_ms"):
            return f"{v:.1f}"
        if field == "tokens_per_s":
            return f"{v:,.0f}"
        return f"{v:.4g}"
    return str(v).replace("|", "/")


def _rows(data: dict[str, Any], table: str) -> list[dict[str, Any]]:
    return [
        row
        for result in data.get("stages", {}).values()
        for row in result.get("tables", {}).get(table, [])
    ]


def markdown(data: dict[str, Any], stages: list[Stage]) -> str:
    meta = data.get("meta", {})
    commits = sorted(
        {r.get("commit", meta.get("commit", "?")) for r in data.get("stages", {}).values()}
    )
    lines = [
        f"Measured by `make gpu-check` on {meta.get('device', '?')} ({meta.get('mode', '?')} "
        f"mode), torch {meta.get('torch', '?')}, {meta.get('date', '?')}, "
        f"commit{'s' if len(commits) > 1 else ''} {', '.join(commits) or '?'} "
        "(each stage's below).",
        "",
    ]
    for table, fields in TABLES.items():
        rows = _rows(data, table)
        if not rows:
            continue
        lines += [f"**{TABLE_TITLES[table]}**", ""]
        header = [f.replace("_", " ") for f in fields]
        lines += [pipe_table(header, [[cell(f, row.get(f)) for f in fields] for row in rows]), ""]
    summary = []
    for stage in stages:
        r = data.get("stages", {}).get(stage.name, {})
        flagged = [c["name"] for c in r.get("checks", []) if c.get("flagged")]
        summary.append(
            [
                stage.name,
                str(r.get("status", "not run")),
                str(r.get("commit", "")),
                cell("s", r.get("seconds")),
                str(stage.budget_s),
                "; ".join(flagged) or "none",
            ]
        )
    header = ["stage", "status", "commit", "seconds", "budget", "flagged"]
    lines += ["**Stages and checks**", "", pipe_table(header, summary)]
    return "\n".join(lines) + "\n"


def check_line(c: dict[str, Any]) -> str:
    off = c.get("off")
    where = f" ({100 * off:+.1f}%)" if isinstance(off, float) else ""
    bound = f"{c.get('bound', 'expected')} "
    mark = "OFF " if c.get("flagged") else "ok  "
    return (
        f"  {mark}{c['name']}: {cell('v', c['measured'])}, {bound}{cell('v', c['expected'])}{where}"
    )


def summary(data: dict[str, Any], stages: list[Stage]) -> list[str]:
    """The console's summary: stages with time vs budget, then every check."""
    out = ["", "GPU check summary (OFF = more than its tolerance, 5% unless stated, off):"]
    if data.get("meta", {}).get("mode") == "cpu-smoke":
        out.append("(cpu-smoke: tiny models on CPU; the figures and flags are not a GPU's)")
    flagged = 0
    for stage in stages:
        r = data.get("stages", {}).get(stage.name)
        if r is None:
            out.append(f"- {stage.name}: not run yet (budget {stage.budget_s} s)")
            continue
        seconds = r.get("seconds")
        over = (
            " OVER BUDGET"
            if isinstance(seconds, float) and seconds > stage.budget_s and r["status"] != "partial"
            else ""
        )
        out.append(
            f"- {stage.name}: {r['status']}, {cell('s', seconds)} s of {stage.budget_s} s{over}"
        )
        if r.get("error"):
            out.append(f"    error: {r['error'].splitlines()[-1]}")
        for note in r.get("notes", []):
            out.append(f"    {note}")
        for c in r.get("checks", []):
            out.append(check_line(c))
            flagged += bool(c.get("flagged"))
    out.append(f"{flagged} figure(s) flagged.")
    return out


def update_docs(doc: Path, md: str) -> None:
    """Replace what lies between the markers of `doc` with `md`."""
    text = doc.read_text()
    if BEGIN not in text or END not in text:
        raise ValueError(f"{doc} has no gpu-check markers ({BEGIN} ... {END})")
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    atomic_write(doc, f"{head}{BEGIN}\n{md}{END}{tail}", fsync=False)
