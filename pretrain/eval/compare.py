"""Several runs -> one table: benchmark results, validation loss and loss at each evaluated
length, grouped over seeds.

Per run it reads (all optional, a missing piece shows as –):
    the run config                          the resolved config (seed and grouping)
    the run's metrics                       "valid/loss" (final = last logged, best = lowest)
                                            and "valid/bits_per_byte"
    RUN/eval/<step>/lm_eval_results.json    the newest evaluation (tools/evaluate.py)
    RUN/eval/<step>/positions.json          the newest loss by position and window length
                                            (tools/evaluate.py --val --per-position --lengths)

Runs whose configs are equal except for the seed (and their own folder names) form one
group; a group of several seeds shows mean ± std (sample std, n - 1).
"""

from __future__ import annotations

import csv
import io
import json
import math
import re
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import yaml

from pretrain.config import yaml_error_message
from pretrain.errors import UserError
from pretrain.eval.compare_positions import (
    NO_POSITIONS,
    PositionCurve,
    Positions,
    length_titles,
    mean_curve,
    parse_positions,
    scaling_text,
)
from pretrain.eval.plots import save_png
from pretrain.eval.positions import POSITIONS_JSON
from pretrain.eval.tables import MISSING, PAPER_COLUMNS, PPL_COLUMNS, markdown_table, metric
from pretrain.run_layout import CONFIG_FILE, EVAL_DIR, RunLayout, read_metrics, step_tag

RESULTS_JSON = "lm_eval_results.json"
# Keys that differ between the seeds of one experiment without changing the experiment.
_RUN_SPECIFIC = (("train", "seed"), ("logging", "run_dir"), ("checkpoint", "dir"))
_SEED_SUFFIX = re.compile(r"[-_.]?(seed|s)[-_]?\d+$")


class CompareError(UserError, ValueError):
    """A run folder cannot be read; the message names it."""


# (column title, key in RunSummary.values)
COLUMNS: list[tuple[str, str]] = (
    [
        ("valid loss (final)", "valid_loss_final"),
        ("valid loss (best)", "valid_loss_best"),
        ("valid bits/byte", "valid_bits_per_byte"),
    ]
    + [(title, f"{task}/{name}") for title, task, name in PAPER_COLUMNS]
    + [(title, f"{task}/{name}") for title, task, name in PPL_COLUMNS]
)


@dataclass
class RunSummary:
    path: Path
    name: str
    seed: int | None
    group_key: str
    values: dict[str, float] = field(default_factory=dict)  # loss at a length: length_key()
    eval_file: Path | None = None
    positions_file: Path | None = None
    positions: Positions | None = None


def _read_config(run: Path) -> dict[str, Any] | None:
    layout = RunLayout(run)
    candidates = [layout.config]
    tag = layout.latest_tag()
    if tag is not None:
        candidates.append(layout.checkpoints / tag / CONFIG_FILE)
    for path in candidates:
        if path.is_file():
            try:
                return yaml.safe_load(path.read_text()) or {}
            except yaml.YAMLError as e:
                raise CompareError(yaml_error_message(e, path)) from None
    return None


def _valid_losses(run: Path) -> dict[str, float]:
    losses: list[tuple[int, float]] = []
    bpb: list[tuple[int, float]] = []
    for row in read_metrics(run):
        if "valid/loss" in row:
            losses.append((row.get("step", 0), float(row["valid/loss"])))
        if "valid/bits_per_byte" in row:
            bpb.append((row.get("step", 0), float(row["valid/bits_per_byte"])))
    out = {}
    if losses:
        losses.sort()
        out["valid_loss_final"] = losses[-1][1]
        out["valid_loss_best"] = min(v for _, v in losses)
        out["valid_step_final"] = losses[-1][0]
    if bpb:
        out["valid_bits_per_byte"] = sorted(bpb)[-1][1]
    return out


def _newest_eval(
    run: Path, step: int | None, name: str = RESULTS_JSON, scaling: str = ""
) -> Path | None:
    """RUN/eval/<step tag>[_<scaling tag>]/name of `step`, or of the newest step."""
    suffix = f"_{scaling}" if scaling else ""
    root = run / EVAL_DIR
    if step is not None:
        path = root / (step_tag(step) + suffix) / name
        return path if path.is_file() else None
    folder = re.compile(r"step_\d+" + re.escape(suffix))
    found = sorted(p for p in root.glob(f"step_*/{name}") if folder.fullmatch(p.parent.name))
    return found[-1] if found else None


def length_key(length: int) -> str:
    """The RunSummary.values key of the mean loss over windows of `length` tokens."""
    return f"loss@{length}"


def _read_positions(path: Path) -> Positions:
    try:
        return parse_positions(json.loads(path.read_text()))
    except json.JSONDecodeError as e:
        raise CompareError(f"{path}: not valid JSON ({e})") from None
    except ValueError as e:  # the schema, the field named
        raise CompareError(f"{path}: not a positions.json of tools/evaluate.py ({e})") from None


def summarize_run(run: str | Path, eval_step: int | None = None, scaling: str = "") -> RunSummary:
    """One run's figures; `scaling` (a lengths.scaling_tag) reads the evaluations made with
    that RoPE scaling instead of the model's own."""
    run = Path(run)
    if not run.is_dir():
        raise CompareError(f"run folder not found: {run}")
    config = _read_config(run)
    seed = None
    if config is not None:
        seed = (config.get("train") or {}).get("seed")
        stripped = json.loads(json.dumps(config, default=str))
        for section, key in _RUN_SPECIFIC:
            (stripped.get(section) or {}).pop(key, None)
        group_key = json.dumps(stripped, sort_keys=True)
    else:
        group_key = "name:" + _SEED_SUFFIX.sub("", run.name)
    summary = RunSummary(path=run, name=run.name, seed=seed, group_key=group_key)
    summary.values.update(_valid_losses(run))
    summary.eval_file = _newest_eval(run, eval_step, RESULTS_JSON, scaling)
    if summary.eval_file is not None:
        try:
            results = json.loads(summary.eval_file.read_text())
        except json.JSONDecodeError as e:
            raise CompareError(f"{summary.eval_file}: not valid JSON ({e})") from None
        for _, task, name in PAPER_COLUMNS + PPL_COLUMNS:
            m = metric(results, task, name)
            if m is not None:
                summary.values[f"{task}/{name}"] = m[0]
    summary.positions_file = _newest_eval(run, eval_step, POSITIONS_JSON, scaling)
    if summary.positions_file is not None:
        summary.positions = _read_positions(summary.positions_file)
        for length, r in summary.positions.per_length().items():
            summary.values[length_key(length)] = r.loss
    return summary


@dataclass
class Group:
    label: str
    runs: list[RunSummary]

    def stats(self, key: str) -> tuple[float, float, int] | None:
        """(mean, sample std or nan, n) of the runs that have `key`."""
        xs = [r.values[key] for r in self.runs if key in r.values and not math.isnan(r.values[key])]
        if not xs:
            return None
        return statistics.fmean(xs), statistics.stdev(xs) if len(xs) > 1 else float("nan"), len(xs)


def group_runs(runs: list[RunSummary]) -> list[Group]:
    """Runs with equal configs but for the seed, in the order of their first run."""
    by_key: dict[str, list[RunSummary]] = {}
    for r in runs:
        by_key.setdefault(r.group_key, []).append(r)
    groups = []
    for members in by_key.values():
        names = {_SEED_SUFFIX.sub("", r.name) for r in members}
        label = names.pop() if len(names) == 1 else f"{members[0].name} (+{len(members) - 1})"
        groups.append(Group(label, members))
    return groups


def _fmt(x: float | None, digits: int = 4) -> str:
    return MISSING if x is None or math.isnan(x) else f"{x:.{digits}f}"


def runs_table(runs: list[RunSummary], columns: Sequence[tuple[str, str]] = COLUMNS) -> str:
    """A row per run; `columns`: the metrics shown, (title, key) of COLUMNS."""
    header = ["run", "seed"] + [t for t, _ in columns]
    rows = [
        [r.name, "" if r.seed is None else str(r.seed)]
        + [_fmt(r.values.get(k)) for _, k in columns]
        for r in runs
    ]
    return markdown_table(header, rows)


def _cell(s: tuple[float, float, int] | None) -> str:
    """mean ± std, the value alone for one seed."""
    if s is None:
        return MISSING
    return _fmt(s[0]) if s[2] == 1 else f"{_fmt(s[0])} ± {_fmt(s[1])}"


def groups_table(groups: list[Group], columns: Sequence[tuple[str, str]] = COLUMNS) -> str:
    """A row per group, mean ± std over its seeds; `columns` as runs_table's."""
    header = ["config", "seeds"] + [t for t, _ in columns]
    rows = [[g.label, str(len(g.runs))] + [_cell(g.stats(k)) for _, k in columns] for g in groups]
    return markdown_table(header, rows)


def _length_titles(groups: list[Group]) -> dict[int, str]:
    return length_titles([r.positions for g in groups for r in g.runs if r.positions is not None])


def require_positions(runs: list[RunSummary]) -> None:
    """CompareError naming the fix when no run has a positions.json."""
    if not any(r.positions is not None for r in runs):
        raise CompareError(NO_POSITIONS)


def lengths_table(groups: list[Group]) -> str:
    """'Loss at each length': a row per group, a column per window length, mean ± std over the
    seeds that have it ('(n=k)' where fewer than the group's seeds with a positions.json),
    then the runs without a positions.json."""
    titles = _length_titles(groups)
    header = ["config", "seeds", "rope scaling"] + list(titles.values())
    rows = []
    for g in groups:
        have = [r.positions for r in g.runs if r.positions is not None]
        scaling = ", ".join(sorted({scaling_text(f.rope_scaling) for f in have})) or MISSING
        cells = []
        for length in titles:
            s = g.stats(length_key(length))
            cells.append(_cell(s) + (f" (n={s[2]})" if s is not None and s[2] < len(have) else ""))
        rows.append([g.label, str(len(have)), scaling] + cells)
    text = markdown_table(header, rows)
    missing = [r.name for g in groups for r in g.runs if r.positions is None]
    if missing:
        text += f"\nmissing (no {POSITIONS_JSON}): {', '.join(missing)}\n"
    return text


def length_welch_tests(groups: list[Group], baseline: str) -> list[WelchResult]:
    """welch_tests on the loss at each length; the metric is named '512 (2x)'."""
    titles = _length_titles(groups)
    results = welch_tests(groups, baseline, tuple(length_key(n) for n in titles))
    by_key = {length_key(n): f"loss at {t}" for n, t in titles.items()}
    return [replace(r, key=by_key[r.key]) for r in results]


def position_curves(groups: list[Group], per_octave: int | None = None) -> list[PositionCurve]:
    """Each group's mean loss by position over its seeds with a positions.json, at the longest
    disjoint-window length they all have (the plot's data); `per_octave`: see `coarsen`."""
    curves = []
    for g in groups:
        files = [r.positions for r in g.runs if r.positions is not None]
        if files:
            try:
                curves.append(mean_curve(g.label, files, per_octave))
            except ValueError as e:
                raise CompareError(str(e)) from None
    if not curves:
        require_positions([r for g in groups for r in g.runs])
    return curves


# ----------------------------------------------------------------------------- downstream

DOWNSTREAM_PREFIX = "downstream/"


def downstream_series(run: str | Path) -> dict[str, dict[int, float]]:
    """{task/metric: {tokens trained: value}} of a run's in-loop downstream evaluation
    (downstream.* in its config). A step evaluated twice (a rollback revisited it) keeps
    its last value, the one of the weights the run went on with."""
    run = Path(run)
    cfg = _read_config(run) or {}
    train, model = cfg.get("train") or {}, cfg.get("model") or {}
    per_step = int(train.get("global_batch_size") or 1) * int(
        train.get("seq_len") or model.get("max_seq_len") or 1
    )
    out: dict[str, dict[int, float]] = {}
    for row in read_metrics(run):
        for key, value in row.items():
            if key.startswith(DOWNSTREAM_PREFIX) and key != "downstream/seconds":
                name = key[len(DOWNSTREAM_PREFIX) :]
                out.setdefault(name, {})[int(row["step"]) * per_step] = float(value)
    return out


def downstream_bands(
    groups: list[Group],
) -> dict[str, list[tuple[str, list[int], list[float], list[float]]]]:
    """{task/metric: [(group label, tokens, mean, sample std or 0 for one seed)]}: each
    group's seeds at the token counts they all evaluated."""
    out: dict[str, list[tuple[str, list[int], list[float], list[float]]]] = {}
    for g in groups:
        series = [downstream_series(r.path) for r in g.runs]
        for name in sorted(set().union(*series)):
            have = [s[name] for s in series if name in s]
            xs = sorted(set.intersection(*(set(h) for h in have)))
            if not xs:
                continue
            means = [statistics.fmean(h[x] for h in have) for x in xs]
            stds = [statistics.stdev(h[x] for h in have) if len(have) > 1 else 0.0 for x in xs]
            out.setdefault(name, []).append((g.label, xs, means, stds))
    return out


def plot_downstream(groups: list[Group], out: str | Path) -> Path:
    """One panel per task/metric against tokens trained: each group's mean over its seeds,
    with a band of ± one standard deviation."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bands = downstream_bands(groups)
    if not bands:
        raise CompareError(
            "no run has downstream/* values: train with downstream.tasks set "
            "(docs/evaluation.md, 'In-loop downstream evaluation')"
        )
    cols = min(4, len(bands))
    rows = math.ceil(len(bands) / cols)
    fig, axes = plt.subplots(
        rows, cols, figsize=(4 * cols, 3 * rows), squeeze=False, layout="constrained"
    )
    for ax, (name, lines) in zip(axes.flat, bands.items(), strict=False):
        for label, xs, means, stds in lines:
            (line,) = ax.plot(xs, means, marker=".", label=label)
            lo = [m - s for m, s in zip(means, stds, strict=True)]
            hi = [m + s for m, s in zip(means, stds, strict=True)]
            ax.fill_between(xs, lo, hi, color=line.get_color(), alpha=0.2)
        if name.endswith("perplexity"):
            ax.set_yscale("log")
        ax.set_title(name, fontsize=9)
        ax.set_xlabel("tokens")
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(bands) :]:
        ax.axis("off")
    # One legend for every panel, below them: in a panel it would cover that panel's lines.
    handles = {}
    for ax in axes.flat:
        for handle, label in zip(*ax.get_legend_handles_labels(), strict=True):
            handles.setdefault(label, handle)
    fig.legend(
        list(handles.values()), list(handles), loc="outside lower center", ncols=cols, fontsize=7
    )
    return save_png(fig, out)


def to_csv(runs: list[RunSummary], groups: list[Group]) -> str:
    """One row per run and one per group (kind = run | group); groups have *_std columns.
    Where runs have a positions.json, also one row per group and length (kind = length) with
    the columns length, length_loss, length_loss_std (n: the seeds that have the length)."""
    keys = [k for _, k in COLUMNS]
    lengths = list(_length_titles(groups))
    pad = ["", "", ""] if lengths else []
    buf = io.StringIO()
    w = csv.writer(buf)
    w.writerow(
        ["kind", "name", "group", "seed", "n"]
        + [x for k in keys for x in (k, f"{k}_std")]
        + (["length", "length_loss", "length_loss_std"] if lengths else [])
    )
    label = {id(r): g.label for g in groups for r in g.runs}
    for r in runs:
        vals = [x for k in keys for x in (r.values.get(k, ""), "")]
        w.writerow(["run", r.name, label[id(r)], "" if r.seed is None else r.seed, 1] + vals + pad)
    for g in groups:
        vals = []
        for k in keys:
            s = g.stats(k)
            vals += ["", ""] if s is None else [s[0], "" if math.isnan(s[1]) else s[1]]
        w.writerow(["group", g.label, g.label, "", len(g.runs)] + vals + pad)
    for g in groups:
        for length in lengths:
            s = g.stats(length_key(length))
            if s is not None:
                std = "" if math.isnan(s[1]) else s[1]
                w.writerow(
                    ["length", g.label, g.label, "", s[2]]
                    + [""] * 2 * len(keys)
                    + [length, s[0], std]
                )
    return buf.getvalue()


def compare(
    run_dirs: list[str | Path], eval_step: int | None = None, scaling: str = ""
) -> tuple[list[RunSummary], list[Group]]:
    if not run_dirs:
        raise CompareError("give at least one run folder")
    runs = [summarize_run(r, eval_step, scaling) for r in run_dirs]
    return runs, group_runs(runs)


@dataclass
class WelchResult:
    group: str
    key: str
    mean: float
    baseline_mean: float
    rel_diff: float  # (mean - baseline) / baseline
    t: float
    df: float
    p: float  # two-sided


def welch_tests(
    groups: list[Group],
    baseline: str,
    keys: tuple[str, ...] = ("valid_loss_best", "valid_loss_final"),
) -> list[WelchResult]:
    """Welch's unequal-variance t-test of each group against the `baseline` group, per key.

    Needs at least two seeds on both sides (a variance on each); groups with fewer are left
    out. `baseline` is a group label or the name of one of its runs.
    """
    from scipy import stats

    base = next(
        (g for g in groups if g.label == baseline or any(r.name == baseline for r in g.runs)), None
    )
    if base is None:
        raise CompareError(
            f"--baseline {baseline!r} is none of the groups: {', '.join(g.label for g in groups)}"
        )
    out = []
    for g in groups:
        if g is base:
            continue
        for key in keys:
            xs = [r.values[key] for r in g.runs if key in r.values]
            ys = [r.values[key] for r in base.runs if key in r.values]
            if len(xs) < 2 or len(ys) < 2:
                continue
            res = stats.ttest_ind(xs, ys, equal_var=False)
            mx, my = statistics.fmean(xs), statistics.fmean(ys)
            out.append(
                WelchResult(
                    g.label,
                    key,
                    mx,
                    my,
                    (mx - my) / my,
                    float(res.statistic),
                    float(res.df),
                    float(res.pvalue),
                )
            )
    return out


def welch_table(results: list[WelchResult], baseline: str) -> str:
    header = [
        "config",
        "metric",
        "mean",
        f"mean of {baseline}",
        "difference",
        "t",
        "df",
        "p (two-sided)",
    ]
    rows = [
        [
            r.group,
            r.key,
            _fmt(r.mean),
            _fmt(r.baseline_mean),
            f"{100 * r.rel_diff:+.2f}%",
            f"{r.t:.3f}",
            f"{r.df:.1f}",
            f"{r.p:.4f}",
        ]
        for r in results
    ]
    return markdown_table(header, rows)


def markdown_report(
    runs: list[RunSummary],
    groups: list[Group],
    baseline: str | None = None,
    positions: bool | None = None,
) -> str:
    """The tables as markdown. `positions`: the loss at each length (True: required; None: when
    some run has a positions.json)."""
    parts = ["## Runs", "", runs_table(runs)]
    if any(len(g.runs) > 1 for g in groups):
        parts += ["", "## Configs (mean ± std over seeds)", "", groups_table(groups)]
    none = "(no group with at least two seeds on both sides)"
    if baseline is not None:
        results = welch_tests(groups, baseline)
        parts += ["", f"## Welch t-tests against {baseline}", ""]
        parts += [welch_table(results, baseline) if results else none]
    if positions is None:
        positions = any(r.positions is not None for r in runs)
    if positions:
        require_positions(runs)
        parts += ["", "## Loss at each length (nats per token, mean ± std over seeds)", ""]
        parts += [lengths_table(groups)]
        if baseline is not None:
            results = length_welch_tests(groups, baseline)
            parts += ["", f"## Welch t-tests against {baseline}, loss at each length", ""]
            parts += [welch_table(results, baseline) if results else none]
    return "\n".join(parts)
