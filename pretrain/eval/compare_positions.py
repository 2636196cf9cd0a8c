"""positions.json across runs: the file's schema, the mean loss-by-position curve of a group of
seeds (drawn by pretrain/eval/position_plots.py).

`tools/evaluate.py --val --per-position --lengths 1x,2x,4x,8x` writes RUN/eval/<step>/positions.json:

    {"label": ..., "train_seq_len": 256, "rope_scaling": null | {"type": "yarn", ...},
     "results": [{"length": 512, "stride": 512, "windows": 8, "loss": 1.30, "tokens": 4096,
                  "buckets": [{"start": 0, "end": 1, "loss": 3.1, "tokens": 16}, ...]}, ...]}

`length` is the window in tokens, `stride` its step (== length: disjoint windows), `loss` the
mean over the length's `tokens`; a bucket holds the positions start <= p < end (0-based, of
the predicting token in its window). pretrain/eval/compare.py reads it for each run.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Any

from pretrain.eval.position_plots import position_x
from pretrain.eval.positions import POSITIONS_JSON, Bucket, LengthResult, merge_buckets


@dataclass(frozen=True)
class Positions:
    label: str
    train_seq_len: int
    rope_scaling: dict[str, Any] | None
    results: tuple[LengthResult, ...]

    def disjoint(self, length: int) -> LengthResult | None:
        """The result of `length` with disjoint windows (stride == length)."""
        return next((r for r in self.results if r.length == length == r.stride), None)

    def per_length(self) -> dict[int, LengthResult]:
        """One result per length: the disjoint windows' where a length has several strides."""
        return {r.length: r for r in sorted(self.results, key=lambda r: r.stride == r.length)}

    def disjoint_lengths(self) -> set[int]:
        return {r.length for r in self.results if r.stride == r.length}


def _field(obj: Any, key: str, kind: type, where: str) -> Any:
    if not isinstance(obj, dict) or key not in obj:
        raise ValueError(f"{where}: {key!r} is missing")
    value = obj[key]
    ok = (
        isinstance(value, (int, float)) and not isinstance(value, bool)
        if kind is float
        else isinstance(value, kind) and not isinstance(value, bool)
    )
    if not ok:
        raise ValueError(
            f"{where}.{key}: {value!r} is not {'a number' if kind is float else kind.__name__}"
        )
    return float(value) if kind is float else value


def parse_positions(data: Any) -> Positions:
    """The checked content of a positions.json; ValueError (one line, the field named) if the
    schema is not met."""
    if not isinstance(data, dict):
        raise ValueError("not a JSON object")
    train_len = _field(data, "train_seq_len", int, "top level")
    scaling = data.get("rope_scaling")
    if scaling is not None and not isinstance(scaling, dict):
        raise ValueError(f"rope_scaling: {scaling!r} is neither null nor a mapping")
    results = data.get("results")
    if not isinstance(results, list) or not results:
        raise ValueError("'results' is missing or empty")
    out = []
    for i, r in enumerate(results):
        where = f"results[{i}]"
        buckets = r.get("buckets") if isinstance(r, dict) else None
        if not isinstance(buckets, list):
            raise ValueError(f"{where}: 'buckets' is missing or not a list")
        parsed = tuple(
            Bucket(
                _field(b, "start", int, f"{where}.buckets[{j}]"),
                _field(b, "end", int, f"{where}.buckets[{j}]"),
                _field(b, "loss", float, f"{where}.buckets[{j}]"),
                _field(b, "tokens", int, f"{where}.buckets[{j}]"),
            )
            for j, b in enumerate(buckets)
        )
        if any(b.end <= b.start or b.start < 0 for b in parsed):
            raise ValueError(f"{where}: a bucket has end <= start or a negative start")
        out.append(
            LengthResult(
                _field(r, "length", int, where),
                _field(r, "stride", int, where),
                _field(r, "windows", int, where) if "windows" in r else 0,
                _field(r, "loss", float, where),
                _field(r, "tokens", int, where),
                parsed,
            )
        )
    return Positions(str(data.get("label", "")), train_len, scaling, tuple(out))


NO_POSITIONS = (
    f"no run has an eval/<step>/{POSITIONS_JSON} (of --eval-step where given); write them with: "
    "python tools/evaluate.py --run RUN --val --per-position --lengths 1x,2x,4x,8x"
)


def length_titles(files: list[Positions]) -> dict[int, str]:
    """{length: '512 (2x)'} of every length in `files`, shortest first ('512' alone when they
    differ in training length)."""
    train_lens = {f.train_seq_len for f in files}
    lengths = sorted({r.length for f in files for r in f.results})
    if len(train_lens) != 1:
        return {n: str(n) for n in lengths}
    (train_len,) = train_lens
    return {n: f"{n} ({n / train_len:g}x)" for n in lengths}


def scaling_text(scaling: dict[str, Any] | None) -> str:
    """'none', or 'yarn x4' (the type and factor of model.rope_scaling)."""
    if not scaling:
        return "none"
    factor = scaling.get("factor")
    return str(scaling.get("type", "?")) + ("" if factor is None else f" x{factor:g}")


@dataclass
class PositionCurve:
    """One group's loss by position at one window length: the mean over its seeds."""

    label: str
    length: int
    train_seq_len: int
    spans: list[tuple[int, int]]  # the buckets [start, end) of 0-based positions
    mean: list[float]
    std: list[float] | None  # sample std over seeds, None for one seed
    n: int  # seeds

    @property
    def x(self) -> list[float]:
        """Where the plot draws each bucket."""
        return [position_x(a, b) for a, b in self.spans]


def coarsen(buckets: tuple[Bucket, ...], per_octave: int) -> tuple[Bucket, ...]:
    """The buckets merged into about `per_octave` per octave of position (a bucket joins the
    group of floor(per_octave * log2(start + 1))), each merged loss the token-weighted mean: the
    exact loss over the merged positions. The first positions stay apart (0, 1, 2, 3, ...: under
    one token per group there), the long tail gets the sample size a smooth curve needs."""
    groups: dict[int, list[Bucket]] = {}
    for b in buckets:
        groups.setdefault(math.floor(per_octave * math.log2(b.start + 1) + 1e-9), []).append(b)
    return tuple(merge_buckets(members) for members in groups.values())


def mean_curve(label: str, files: list[Positions], per_octave: int | None = None) -> PositionCurve:
    """The mean (and std) over `files`, one per seed, of the loss in each bucket, at the longest
    disjoint-window length every seed has; with `per_octave`, of the buckets `coarsen`ed to that
    many per octave. ValueError when they share no length."""
    common = set.intersection(*(f.disjoint_lengths() for f in files))
    if not common:
        raise ValueError(
            f"the seeds of {label} share no length with disjoint windows (stride == length); "
            "evaluate them with the same --lengths"
        )
    length = max(common)
    per_seed = []
    for f in files:
        buckets = f.disjoint(length).buckets
        if per_octave:
            buckets = coarsen(buckets, per_octave)
        per_seed.append({(b.start, b.end): b.loss for b in buckets})
    spans = sorted(set.intersection(*(set(s) for s in per_seed)))
    values = [[s[span] for s in per_seed] for span in spans]
    train_lens = {f.train_seq_len for f in files}
    return PositionCurve(
        label=label,
        length=length,
        train_seq_len=max(train_lens),
        spans=spans,
        mean=[statistics.fmean(v) for v in values],
        std=[statistics.stdev(v) for v in values] if len(files) > 1 else None,
        n=len(files),
    )
