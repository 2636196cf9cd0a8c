"""A study's report from the runs that have finished, in studies/NAME/report/ (docs/studies.md,
"report", lists its files).

The numbers are compare_runs' (pretrain/eval/compare.py: `summarize_run` per run, groups pooled
over seeds by `Group.stats`, `welch_tests`). What this module adds is the study's own grouping
(the runs whose labels are equal but for the seed, named by their labels) and baseline:
`baseline: {rope: "1.0"}` tests each group against the group with the same labels but rope
1.0 (with several axes, each model against its own full-RoPE group).
"""

from __future__ import annotations

import csv
import io
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from pretrain.eval.compare import (
    COLUMNS,
    Group,
    WelchResult,
    groups_table,
    length_welch_tests,
    lengths_table,
    position_curves,
    runs_table,
    summarize_run,
    to_csv,
    welch_table,
    welch_tests,
)
from pretrain.eval.plots import plot_group_losses
from pretrain.eval.position_plots import plot_position_curves
from pretrain.run_layout import atomic_write
from pretrain.study.records import StudyUsageError
from pretrain.study.status import read_progress, run_folder

if TYPE_CHECKING:
    from pretrain.study.runs import Study, StudyRun

REPORT_DIR = "report"
_NO_PAIR = "(no pair with at least two seeds on both sides)\n"


@dataclass
class StudyReport:
    folder: Path
    markdown: str
    files: list[Path] = field(default_factory=list)
    finished: int = 0
    total: int = 0

    @property
    def partial(self) -> bool:
        return self.finished < self.total


@dataclass
class _StudyGroup(Group):
    """A group of compare's (its finished runs' summaries) with the study's labels."""

    labels: Mapping[str, str] = field(default_factory=dict)


def _groups(study: Study, finished: Sequence[StudyRun], repo: Path) -> list[_StudyGroup]:
    out: dict[str, _StudyGroup] = {}
    for run in study.runs:  # in the study's order
        out.setdefault(run.group, _StudyGroup(run.group, [], dict(run.labels)))
    for run in finished:
        summary = summarize_run(run_folder(run, repo))
        summary.name = run.name  # the study's name for it, not its folder's
        out[run.group].runs.append(summary)
    return [g for g in out.values() if g.runs]


def parse_baseline(text: str | None) -> dict[str, str] | None:
    """`rope=1.0` or `model=llama1b,rope=1.0` -> {axis: label}."""
    if not text:
        return None
    pairs = {}
    for part in text.split(","):
        axis, sep, label = part.partition("=")
        if not sep:
            raise StudyUsageError(f"--baseline {text!r}: give AXIS=LABEL, e.g. rope=1.0")
        pairs[axis.strip()] = label.strip()
    return pairs


def baseline_pairs(
    groups: Sequence[_StudyGroup], baseline: Mapping[str, str]
) -> list[tuple[_StudyGroup, _StudyGroup]]:
    """(group, its baseline group): the group with the same labels but `baseline`'s."""
    by_labels = {tuple(sorted(g.labels.items())): g for g in groups}
    pairs = []
    for g in groups:
        base = by_labels.get(tuple(sorted({**g.labels, **baseline}.items())))
        if base is not None and base is not g:
            pairs.append((g, base))
    return pairs


def _welch(pairs: list[tuple[_StudyGroup, _StudyGroup]], keys: tuple[str, ...] | None):
    """Each group against its baseline group: on `keys`, or (None) the loss at each length."""
    results: list[WelchResult] = []
    for g, base in pairs:
        both = [g, base]
        if keys is None:
            results += length_welch_tests(both, base.label)
        else:
            results += welch_tests(both, base.label, keys)
    return results


def _welch_csv(results: Sequence[WelchResult], pairs) -> str:
    base_of = {g.label: b.label for g, b in pairs}
    buf = io.StringIO()
    w = csv.writer(buf)
    w.writerow(["group", "baseline", "metric", "mean", "baseline_mean", "rel_diff", "t", "df", "p"])
    for r in results:
        row = [r.group, base_of.get(r.group, ""), r.key, r.mean, r.baseline_mean, r.rel_diff]
        w.writerow(row + [r.t, r.df, r.p])
    return buf.getvalue()


def write_study_report(
    study: Study,
    repo: Path,
    out: Path | None = None,
    baseline: Mapping[str, str] | None = None,
    plots: bool = True,
    per_octave: int | None = 8,
) -> StudyReport:
    """Write the report of `study`'s finished runs into `out` (studies/NAME/report/).
    `per_octave`: the loss-by-position plot's points per octave of position (compare's
    `coarsen`: token-weighted, so each point is the exact loss over its positions); None
    plots every bucket as evaluated, which a few hundred samples leave noisy."""
    repo = Path(repo)
    out = Path(out) if out is not None else Path(study.out_dir) / REPORT_DIR
    baseline = baseline if baseline is not None else study.baseline
    progress = {r.name: read_progress(r, repo) for r in study.runs}
    finished = [r for r in study.runs if progress[r.name].done]
    report = StudyReport(out, "", [], len(finished), len(study.runs))
    out.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    lines = [f"# Study {study.name}", ""]
    if report.partial:
        missing = ", ".join(
            f"{r.name} (step {progress[r.name].step}/{progress[r.name].total})"
            for r in study.runs
            if not progress[r.name].done
        )
        lines += [
            f"**Partial report** (written {stamp}): {len(finished)} of {len(study.runs)} runs "
            f"have finished. Not in it: {missing}.",
            "",
        ]
    else:
        lines += [f"Written {stamp}: all {len(study.runs)} runs have finished.", ""]
    diverged = [r.name for r in finished if progress[r.name].diverged]
    if diverged:
        lines += [f"Diverged (their figures are not finite): {', '.join(diverged)}.", ""]
    if not finished:
        report.markdown = "\n".join([*lines, "No run has finished yet: nothing to report."]) + "\n"
        report.files.append(atomic_write(out / "report.md", report.markdown, fsync=False))
        return report

    groups = _groups(study, finished, repo)
    summaries = [s for g in groups for s in g.runs]
    # A study evaluates a few of compare's many metrics, often none: those some run has.
    has = {k for s in summaries for k, v in s.values.items() if not math.isnan(v)}
    shown = [(t, k) for t, k in COLUMNS if k in has]
    lines += ["## Runs", "", runs_table(summaries, shown)]
    lines += ["## Groups (mean ± std over seeds)", "", groups_table(groups, shown)]
    welch: list[WelchResult] = []
    pairs = baseline_pairs(groups, baseline) if baseline else []
    if baseline:
        text = ", ".join(f"{k}={v}" for k, v in baseline.items())
        welch = _welch(pairs, tuple(k for _, k in COLUMNS if any(k in s.values for s in summaries)))
        lines += [
            f"## Against the baseline ({text})",
            "",
            f"Each group against the group with the same labels but {text}: Welch's t-test "
            f"(two-sided), on every metric that both have for at least two seeds.",
            "",
            welch_table(welch, "baseline") if welch else _NO_PAIR,
        ]
    positions = any(s.positions is not None for s in summaries)
    if positions:
        lines += [
            "## Loss at each length (nats per token, mean ± std over seeds)",
            "",
            lengths_table(groups),
        ]
        if pairs:
            at_lengths = _welch(pairs, None)
            welch += at_lengths
            lines += [
                "### Against the baseline, loss at each length",
                "",
                welch_table(at_lengths, "baseline") if at_lengths else _NO_PAIR,
            ]
    report.files.append(atomic_write(out / "report.csv", to_csv(summaries, groups), fsync=False))
    if welch:
        report.files.append(atomic_write(out / "welch.csv", _welch_csv(welch, pairs), fsync=False))
    if plots:
        lines += ["## Plots", "", "![loss curves](loss_curves.png)", ""]
        seeds = [(g.label, [r.path for r in g.runs]) for g in groups]
        report.files.append(plot_group_losses(seeds, out / "loss_curves.png"))
        if positions:
            curves = position_curves(groups, per_octave)
            report.files.append(plot_position_curves(curves, out / "positions.png"))
            lines += ["![loss by position](positions.png)", ""]
    report.markdown = "\n".join(lines).rstrip() + "\n"
    report.files.insert(0, atomic_write(out / "report.md", report.markdown, fsync=False))
    return report
