"""The study file's schema (docs/studies.md, "The study file"): pydantic checks its shape and
publishes it as schemas/study.schema.json; what each part means on its own (an axis's labelled
values, a grid's entries, an exclusion's labels, a rule's keys, a template) is parsed here, what
the parts mean together as the runs are expanded (spec.py), each run's config by the run loader
itself. Anything wrong is a `StudyError` in one line naming the file, the field and the fix."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, ValidationError

from pretrain.config import ConfigError, check_key
from pretrain.errors import UserError
from pretrain.schema import (
    Int,
    Section,
    config_error,
    did_you_mean,
    validate_section,
)
from pretrain.study.slurm import StudySlurm


class StudyError(UserError, ValueError):
    """A study file that cannot be expanded into runs."""

    label = "study error"


LABEL = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+-]*$")
_TEMPLATE_FIELD = re.compile(r"\{([A-Za-z_]\w*(?:\.text)?)\}")


@dataclass(frozen=True)
class Where:
    """Says which study file, and which field of it, an error is about."""

    path: Path

    def error(self, where: str, problem: str, fix: str) -> StudyError:
        return StudyError(f"{shown_path(self.path)}: {where}: {problem}; {fix}")


def shown_path(path: Path) -> str:
    """A path as the user would name it: from the current folder when inside it."""
    try:
        rel = os.path.relpath(path)
    except ValueError:  # another drive (Windows)
        return str(path)
    return str(path) if rel.startswith("..") else rel


def checked_key(w: Where, where: str, key: Any, fix: str) -> str:
    """`key` if it names a config key (pretrain/config.py check_key), else one line."""
    try:
        check_key(str(key))
    except ConfigError as e:
        raise w.error(where, str(e), fix) from None
    return str(key)


def label_of(value: Any) -> str | None:
    """A value's label (true, 500, 0.0003, text); None for a list or mapping, which needs one
    given."""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float):
        return f"{value:g}"
    return str(value) if isinstance(value, (int, str)) else None


def render_template(w: Where, where: str, template: str, values: dict[str, str]) -> str:
    def field_value(m: re.Match) -> str:
        name = m.group(1)
        if name not in values:
            raise w.error(
                where,
                f"{{{name}}} is not known here{did_you_mean(name, values)}",
                f"use {', '.join('{' + k + '}' for k in values)}",
            )
        return values[name]

    return _TEMPLATE_FIELD.sub(field_value, template)


Label = str | int | float | bool  # a label as YAML reads it: 500, 0.0003, true, lo
Labels = Label | list[Label]  # one label or several
# A grid's entry, one of the factors of its product: its rows, each a label of its axis or of
# each of the axes a zip moves together.
Entry = list[tuple[tuple[str, str], ...]]


class AxisSpec(Section):
    """An axis: one config key (key:, values:), keys moved together (keys:, each value a list
    of theirs), or settings per value (values: {LABEL: {config.key: value}})."""

    key_: str | None = Field(None, alias="key")
    """The config key its values set."""
    keys: list[str] | None = Field(None, min_length=1)
    """Config keys moved together; each value is a list, one item per key."""
    values: list[Any] | dict[Label, Any]
    """The values, or LABEL: value (without key: or keys:, LABEL: {config.key: value})."""
    labels: list[Label] | None = None
    """One label per value (default: a mapping's keys, else the values themselves)."""
    text: dict[Label, Label] = {}
    """LABEL: words, the value's {AXIS.text} (default: its label)."""


class GridSpec(Section):
    """A grid of runs: the product of its entries, named and described by its templates."""

    run_name: str | None = None
    """Template of a run's name without the seed: {AXIS}, {AXIS.text}, {study}."""
    run_description: str | None = None
    """Template of a run's description."""
    product: list[Any] | None = Field(None, min_length=1)
    """The product of its entries (an axis, {AXIS: [labels]}, {zip: [a, b]}); default: every axis."""
    exclude: list[dict[str, Labels]] | None = None
    """Combinations left out: each AXIS: label or AXIS: [labels]; one that matches no run is refused."""
    slurm: dict[str, Any] | None = None
    """Changes to the study's Slurm layout for this grid's runs, e.g. {signal_margin_s: 900}."""


class Layout(Section):
    """Templates of a run's files and names: {name} (the run), {stem} (without the seed),
    {seed}, {AXIS}, {AXIS.text}, {study}."""

    config: str = "studies/{study}/configs/{name}.yaml"
    """The config a run is written to; without {name} or {seed}, the seeds of a group share one file and get their seed and run folder with --set."""
    script: str = "studies/{study}/slurm/{name}.sh"
    """The job script."""
    run_dir: str = "runs/{study}/{name}"
    """The run folder."""
    job_name: str = "{name}"
    """The Slurm job name."""
    array_script: str = "studies/{study}/slurm/{study}.sh"
    """The job array's script."""


class StudyFile(GridSpec):
    """A study: a base config, the axes it varies, seeds, the Slurm layout, and how runs,
    folders and jobs are named (docs/studies.md, "The study file"); its grid fields are every
    grid's (exclude: and slurm: are the study's)."""

    name: str | None = None
    """The study's name (default: the file's)."""
    description: str = ""
    """What the study is."""
    config: str | dict[str, Any] | None = None
    """The base config: a mapping (a run config, `inherit:` paths from the repository root) or the path of a config file. Required."""
    axes: dict[str, AxisSpec] | None = None
    """AXIS: {key: K, values: [...]} (one config key), {keys: [a, b], values: ...} (keys moved together) or {values: {LABEL: {config.key: value}}} (settings per value); labels:, text: {LABEL: words}."""
    grids: list[GridSpec] | None = Field(None, min_length=1)
    """Several grids, each with its own product, run_name, run_description, exclude and slurm changes."""
    seeds: list[Int] | None = Field(None, min_length=1)
    """[1, 2, 3]: every combination once per seed, its `train.seed` (runs named STEM_sSEED)."""
    rules: dict[str, Any] | None = None
    """Fields derived from others, in order, after the axes: KEY: OTHER.KEY (a copy), KEY: {FROM_KEY: {value: result}} (a table) or KEY: VALUE."""
    layout: Layout = Field(default_factory=Layout)
    """Templates of the files and names."""
    slurm: StudySlurm | None = None
    """The Slurm layout of the runs' job scripts, plus array: true and max_running: N; without it, configs only."""
    gpu: Literal["h100", "h200"] = "h200"
    """The cluster's GPU: plan's default and the plan file's fit."""
    baseline: dict[str, Label] | None = None
    """The labels of the reports' baseline group, e.g. {theta: 10000}."""
    plan_file: str | None = None
    """A saved plan (pretrain-plan --paper --write): planned --time per run, refusal of a run that does not fit."""


def read_study_file(w: Where, data: dict[str, Any]) -> StudyFile:
    """Validate a study file's mapping; a StudyError names the field and the fix."""
    try:
        return validate_section(StudyFile, data)
    except ValidationError as e:
        error = config_error(e, StudyFile, top="the study file")
        raise StudyError(f"{shown_path(w.path)}: {error}; see docs/studies.md") from None


@dataclass(frozen=True)
class AxisValue:
    settings: dict[str, Any]  # dotted config key -> value
    text: str  # {AXIS.text} in descriptions; the label when not given


Axis = dict[str, AxisValue]  # label -> value, in the file's order


def parse_axis(w: Where, name: str, spec: AxisSpec) -> Axis:
    where = f"axis {name}"
    if not LABEL.match(name):
        raise w.error(where, "the axis name is not a word", "use letters, digits and _")
    if name in ("seed", "name", "stem", "study", "description"):
        raise w.error(where, "the name is taken by the run's own fields", "rename the axis")
    if spec.key_ is not None and spec.keys is not None:
        raise w.error(where, "both key and keys are given", "give one")
    keys = [spec.key_] if spec.key_ is not None else spec.keys
    for k in keys or ():
        checked_key(w, where, k, "fix the axis's key")
    values, labels = spec.values, spec.labels
    if not values:
        raise w.error(
            where, "has no values", "give `values:` as a list or a mapping label -> value"
        )
    if isinstance(values, dict):
        if labels is not None:
            raise w.error(where, "values is a mapping and labels are given", "drop labels:")
        labels = [label_of(k) if isinstance(k, bool) else k for k in values]
        values = list(values.values())
    elif labels is None:
        labels = [label_of(v) for v in values]
        if None in labels:
            raise w.error(where, "a value is a list or mapping", "give `labels:`, one per value")
    if len(labels) != len(values):
        n = f"{len(labels)} labels for {len(values)} values"
        raise w.error(where, n, "give one label per value")
    texts = {str(k): str(v) for k, v in spec.text.items()}
    out: dict[str, AxisValue] = {}
    for label, value in zip(map(str, labels), values, strict=True):
        if not LABEL.match(label):
            raise w.error(
                where,
                f"label {label!r} cannot be part of a run name",
                "use letters, digits, '.', '_', '+' and '-'",
            )
        if label in out:
            raise w.error(where, f"label {label!r} appears twice", "give every value its own label")
        settings = _settings(w, f"{where} value {label}", keys, value)
        out[label] = AxisValue(settings, texts.get(label, label))
    for label in texts:
        if label not in out:
            raise w.error(where, f"text for {label!r}, which is not a value", "use a value's label")
    return out


def _settings(w: Where, where: str, keys: list[str] | None, value: Any) -> dict:
    if keys is None:  # values are settings: {key: value, ...} ({} changes nothing)
        value = {} if value is None else value
        if not isinstance(value, dict):
            raise w.error(
                where,
                f"{value!r} is not a mapping of config keys",
                "give `key:` for plain values, or write {config.key: value}",
            )
        return {checked_key(w, where, k, "fix the key"): v for k, v in value.items()}
    if len(keys) == 1:
        return {keys[0]: value}
    if not isinstance(value, list) or len(value) != len(keys):
        raise w.error(
            where,
            f"{value!r} is not a list of {len(keys)} values for {', '.join(keys)}",
            "give one value per key, in the order of keys:",
        )
    return dict(zip(keys, value, strict=True))


def _axis_labels(
    w: Where, where: str, name: str, labels: Any, axes: dict[str, Axis], fix: str
) -> tuple[str, tuple[str, ...]]:
    """(axis, the labels named of it: one or a list, each one of its own; None: all)."""
    axis = axes.get(name)
    if axis is None:
        raise w.error(where, f"unknown axis {name!r}{did_you_mean(name, axes)}", fix)
    labels = None if labels is None else labels if isinstance(labels, list) else [labels]
    chosen = tuple(axis) if labels is None else tuple(label_of(x) or str(x) for x in labels)
    bad = next((lab for lab in chosen if lab not in axis), None if chosen else "[]")
    if bad is not None:  # [] too: an entry or exclusion of no value is a mistake
        raise w.error(
            f"{where} axis {name}",
            f"no value labelled {bad!r}{did_you_mean(bad, axis)}",
            f"use one of {', '.join(axis)}",
        )
    return name, chosen


def labels_by_axis(
    w: Where, where: str, spec: dict[str, Any], axes: dict[str, Axis]
) -> dict[str, tuple[str, ...]]:
    """`{AXIS: label or [labels], ...}` (an exclusion, the baseline) -> the labels by axis."""
    if not spec:
        raise w.error(where, "{} names no axis", "e.g. {corpus: text8, theta: 500}")
    fix = "name an axis of axes:"
    return dict(_axis_labels(w, where, a, lab, axes, fix) for a, lab in spec.items())


def parse_entries(
    w: Where, where: str, spec: list[Any], axes: dict[str, Axis], zipped: bool = False
) -> list[Entry]:
    """`product:`'s list -> entries; `{zip: [...]}` inside it moves its axes together."""
    entries: list[Entry] = []
    for item in spec:
        if isinstance(item, dict) and set(item) == {"zip"} and not zipped:
            here = f"{where} zip"
            if not isinstance(item["zip"], list) or not item["zip"]:
                raise w.error(here, f"{item['zip']!r} is not a list of axes", "e.g. [lr, seq]")
            inner = parse_entries(w, here, item["zip"], axes, True)
            if len({len(e) for e in inner}) != 1:
                raise w.error(
                    here,
                    "the zipped axes have different numbers of values "
                    + ", ".join(f"{e[0][0][0]}: {len(e)}" for e in inner),
                    "give every zipped axis the same number of values",
                )
            entries.append([sum(rows, ()) for rows in zip(*inner, strict=True)])
            continue
        if isinstance(item, str):
            name, labels = item, None
        elif isinstance(item, dict) and len(item) == 1:
            ((name, labels),) = item.items()
            labels = labels if isinstance(labels, list) else [labels]
        else:
            raise w.error(
                where,
                f"{item!r} is not an axis",
                "write an axis name, {AXIS: [labels]} or {zip: [axes]}",
            )
        axis, chosen = _axis_labels(w, where, name, labels, axes, "define it under axes:")
        if len(set(chosen)) != len(chosen):
            raise w.error(f"{where} axis {name}", "a label appears twice", "list each once")
        entries.append([((axis, lab),) for lab in chosen])
    names = [a for e in entries for a, _ in e[0]]
    for a in names:
        if names.count(a) > 1:
            raise w.error(where, f"axis {a} appears twice", "use each axis once per grid")
    return entries


def parse_rules(w: Where, spec: dict[str, Any] | None) -> dict[str, Any]:
    """Fields derived from others, each checked: `KEY: OTHER.KEY` (a copy), `KEY: {FROM:
    {value: result}}` (a table of FROM's value) or `KEY: VALUE`. No arithmetic: a derived size
    that depends on another is a table, which says every value it takes."""
    for key, how in (spec or {}).items():
        where = f"rule {key}"
        checked_key(w, where, key, "fix the rule's key")
        if isinstance(how, dict):
            if len(how) != 1 or not isinstance(next(iter(how.values())), dict):
                raise w.error(
                    where,
                    f"{how!r} is not a lookup table",
                    "write KEY: {FROM_KEY: {value: result, ...}}",
                )
            checked_key(w, where, next(iter(how)), "fix the key the table reads")
        elif isinstance(how, str):
            fix = "a rule copies another config key, or looks its value up in a table"
            checked_key(w, where, how, fix + " (KEY: {FROM_KEY: {value: result}})")
    return dict(spec or {})
