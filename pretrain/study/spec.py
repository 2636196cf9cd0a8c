"""A study file (studies/NAME.yaml, docs/studies.md "The study file") -> its runs, every field
checked before anything is written: whatever would make a run the trainer refuses, two runs
sharing a name, config or run folder, or no run at all is a `StudyError` in one line."""

from __future__ import annotations

import copy
import itertools
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pretrain.config import (
    Config,
    ConfigError,
    apply_overrides,
    check_world_size,
    from_dict,
    get_key,
    read_yaml,
    resolve_inherit,
    set_key,
    to_dict,
)
from pretrain.slurm_limits import time_limit_hours
from pretrain.study.file import (
    LABEL,
    Entry,
    GridSpec,
    StudyError,
    StudyFile,
    Where,
    labels_by_axis,
    parse_axis,
    parse_entries,
    parse_rules,
    read_study_file,
    render_template,
    shown_path,
)
from pretrain.study.runs import Study, StudyRun, as_array
from pretrain.study.slurm import Slurm

SEED_KEY = "train.seed"  # what a study's seeds set


@dataclass(frozen=True)
class Grid:
    run_name: str
    run_description: str
    entries: tuple[Entry, ...]  # the grid is their product
    slurm: dict[str, Any]  # changes to the study's layout
    exclude: dict[str, Labels]  # by where each is in the file
    where: str


Labels = dict[str, tuple[str, ...]]  # axis -> labels: an exclusion, the baseline


def load_study(path: str | Path) -> Study:
    """Read, expand and check a study file; raises StudyError (one line) for anything wrong."""
    shown = Path(shown_path(Path(path)))
    if not shown.is_file():
        raise StudyError(f"{shown}: no such study file; check the path (studies/NAME.yaml)")
    try:
        data = read_yaml(shown)
    except ConfigError as e:  # not YAML, or not a mapping
        raise StudyError(str(e)) from None
    w = Where(Path(path))
    return _Loader(w, shown.resolve(), read_study_file(w, data)).study()


class _Loader:
    """One study file's parts, parsed in order; `study()` expands and checks the runs."""

    def __init__(self, w: Where, path: Path, file: StudyFile):
        self.w, self.path, self.file = w, path, file
        self.repo = path.parent.parent
        self.name = file.name or path.stem
        if not LABEL.match(self.name):
            raise w.error(
                "name", f"{self.name!r} is not a file name", "use letters, digits, _ and -"
            )
        self.axes = {k: parse_axis(w, k, v) for k, v in (file.axes or {}).items()}
        self.base = self._base_config()
        self.rules = parse_rules(w, file.rules)
        self.seeds = self._seeds()
        self.layout = file.layout.model_dump()
        for k, v in self.layout.items():
            if not v:
                raise w.error(f"layout {k}", f"{v!r} is not a template", "e.g. runs/{name}")
        # The header's fields as given (a grid's `slurm:` changes them); the header alone holds.
        self.slurm_spec, self.header = None, None
        self.array, self.max_running = False, None
        if (slurm := file.slurm) is not None:
            self.slurm_spec = slurm.model_dump(exclude={"array", "max_running"}, exclude_unset=True)
            self.header = parse_slurm(w, self.slurm_spec, "slurm")
            self.array, self.max_running = slurm.array, slurm.max_running
        self.plan = self._plan_file()
        self.exclude = self._exclude("exclude", file.exclude)
        self.grids = self._grids()
        self.names: dict[str, str] = {}  # run name -> its group, as runs are made

    # -- fields

    def _base_config(self) -> dict[str, Any]:
        spec = self.file.config
        if spec is None:
            raise self.w.error("config", "missing", "give the base config: a path or a mapping")
        if isinstance(spec, str):
            if not (self.repo / spec).is_file():
                raise self.w.error(
                    "config",
                    f"{spec} does not exist",
                    "give a path relative to the repository root",
                )
            return {"inherit": spec}
        base = copy.deepcopy(spec)
        self._merged(base, "config")  # its inherited files exist and read, as the runs' will
        return base

    def _seeds(self) -> tuple[int, ...]:
        seeds = self.file.seeds or []
        if len(set(seeds)) != len(seeds):
            raise self.w.error("seeds", f"{seeds} repeats a seed", "list each seed once")
        return tuple(seeds)

    def _plan_file(self) -> dict[str, dict[str, Any]]:
        spec = self.file.plan_file
        if spec is None:
            return {}
        if not (self.repo / spec).is_file():
            raise self.w.error(
                "plan_file",
                f"{spec} does not exist",
                "write it with `pretrain-plan --paper --write`, or drop plan_file",
            )
        return {r["name"]: r for r in json.loads((self.repo / spec).read_text())["runs"]}

    def _grids(self) -> tuple[Grid, ...]:
        if self.file.grids is None:
            return (self._grid("grid", GridSpec()),)
        if "product" in self.file.model_fields_set:
            raise self.w.error("product", "given beside grids:", "put it inside one of the grids")
        return tuple(self._grid(f"grids[{i}]", g) for i, g in enumerate(self.file.grids))

    def _grid(self, where: str, own: GridSpec) -> Grid:
        # Grid fields given at the top are every grid's (exclude: and slurm: are the study's).
        shared = ("run_name", "run_description", "product")
        g = {k: getattr(x, k) for x in (self.file, own) for k in shared if k in x.model_fields_set}
        if g.get("product") is not None:
            entries = parse_entries(self.w, f"{where} product", g["product"], self.axes)
        else:
            entries = [[((a, lab),) for lab in axis] for a, axis in self.axes.items()]
        default_name = "_".join(f"{a}{{{a}}}" for e in entries for a, _ in e[0]) or self.name
        if own.slurm and self.slurm_spec is None:
            raise self.w.error(
                f"{where} slurm", "the study has no slurm: layout", "add slurm: at the top"
            )
        return Grid(
            run_name=g.get("run_name") or default_name,
            run_description=g.get("run_description") or self.file.description or "{name}",
            entries=tuple(entries),
            slurm=own.slurm or {},
            exclude=self._exclude(f"{where} exclude", own.exclude),
            where=where,
        )

    # -- expansion

    def study(self) -> Study:
        runs: list[StudyRun] = []
        unused = dict(self.exclude)  # exclusions that matched no run yet, in the file's order
        for grid in self.grids:
            excludes = {**self.exclude, **grid.exclude}
            unused |= grid.exclude
            for combo in itertools.product(*grid.entries):
                picked = dict(pair for row in combo for pair in row)
                hit = [k for k, ex in excludes.items() if _matches(ex, picked)]
                for k in hit:
                    unused.pop(k, None)
                if not hit:
                    runs += [self._run(grid, picked, seed) for seed in self.seeds or (None,)]
        if unused:
            raise self.w.error(next(iter(unused)), "matches no run", "fix its labels or remove it")
        if not runs:
            raise self.w.error(
                "grid", "no runs: every combination is excluded", "loosen exclude: or add values"
            )
        self._check_unique(runs)
        slurm = self.header
        study = Study(
            name=self.name,
            path=self.path,
            runs=tuple(runs),
            baseline=self._baseline(runs),
            out_dir=self.repo / "studies" / self.name,
            slurm=slurm,
            description=self.file.description,
            repo=self.repo,
            gpu=self.file.gpu,
            array=self.array,
            max_running=self.max_running,
            array_script=None
            if slurm is None
            else self._render("array_script", {"study": self.name}),
            seeds=self.seeds,
        )
        return as_array(study) if self.array else study

    def _render(self, layout: str, fields: dict[str, str]) -> str:
        return render_template(self.w, f"layout {layout}", self.layout[layout], fields)

    def _run(self, grid: Grid, picked: dict[str, str], seed: int | None) -> StudyRun:
        w = self.w
        labels = {a: picked[a] for a in self.axes if a in picked}  # in the axes' order
        values = {"study": self.name}
        for a, lab in labels.items():
            values[a] = lab
            values[f"{a}.text"] = self.axes[a][lab].text
        stem = render_template(w, f"{grid.where} run_name", grid.run_name, values)
        if not LABEL.match(stem):
            raise w.error(
                f"{grid.where} run_name",
                f"{stem!r} is not a file name",
                "use letters, digits, _, - and .",
            )
        name = stem if seed is None else f"{stem}_s{seed}"
        where = f"run {name}"
        group = ",".join(f"{a}={lab}" for a, lab in labels.items())
        if name in self.names:  # found before any config is built: the naming is wrong
            raise w.error(
                f"{grid.where} run_name",
                f"the runs {self.names[name]} and {group or '(no axes)'} are both named {name}",
                "put every axis that varies in run_name",
            )
        self.names[name] = group or "(no axes)"
        names = {**values, "name": name, "stem": stem, "seed": "" if seed is None else str(seed)}
        stem_names = {**names, "name": stem, "seed": ""}
        description = render_template(
            w, f"{grid.where} run_description", grid.run_description, names
        )
        config_path = self._render("config", names)
        # A config path without {name} or {seed}: the group's seeds share one file.
        shared = seed is not None and config_path == self._render("config", stem_names)
        run_dir = self._render("run_dir", names)
        job_name = self._render("job_name", names)

        compact = copy.deepcopy(self.base)
        source: dict[str, str] = {}  # config key -> what set it, for the refusals
        for a, lab in labels.items():
            for key, value in self.axes[a][lab].settings.items():
                if key in source:
                    raise w.error(
                        where,
                        f"axes {source[key].split()[1]} and {a} both set {key}",
                        "let one axis set it",
                    )
                set_key(compact, key, copy.deepcopy(value))
                source[key] = f"axis {a} ({lab})"
        if seed is not None and not shared:  # a rule may read the run's own seed
            set_key(compact, SEED_KEY, seed)
        self._apply_rules(compact, source, where)
        overrides: tuple[str, ...] = ()
        if shared:  # the file holds the group's run folder; each run its own seed and folder
            set_key(compact, "logging.run_dir", self._render("run_dir", stem_names))
            overrides = (f"{SEED_KEY}={seed}", f"logging.run_dir={run_dir}")
        else:
            set_key(compact, "logging.run_dir", run_dir)
            if seed is not None:
                set_key(compact, SEED_KEY, seed)
        source.setdefault("logging.run_dir", "layout run_dir")

        slurm = None
        if self.slurm_spec is not None:
            slurm = parse_slurm(w, {**self.slurm_spec, **grid.slurm}, f"{grid.where} slurm")
            slurm = planned_slurm(w, slurm, self.plan.get(stem), self.file.gpu, where)
        return StudyRun(
            name=name,
            labels=labels,
            seed=seed,
            group=group,
            config=self._resolve(compact, list(overrides), slurm, where, source),
            config_path=config_path,
            script_path=self._render("script", names)
            if slurm is not None and not self.array
            else None,
            run_dir=run_dir,
            job_name=job_name,
            description=description,
            overrides=overrides,
            slurm=slurm,
            config_file=written_config(compact, config_path),
            stem=stem,
        )

    def _apply_rules(self, compact: dict, source: dict[str, str], where: str) -> None:
        if not self.rules:
            return
        merged = self._merged(compact, where)
        defaults = to_dict(Config())
        for key, how in self.rules.items():
            if key in source:  # what a run's axis value names beats what a rule derives
                continue
            here = f"{where} rule {key}"

            def lookup(name: str, here: str = here) -> Any:
                found, value = get_key(merged, name)
                if not found:
                    found, value = get_key(defaults, name)
                if not found:
                    raise self.w.error(here, f"{name} is not set", "set it in config: or an axis")
                return value

            if isinstance(how, dict):  # a table of another key's value
                ((from_key, table),) = how.items()
                have = lookup(from_key)
                if have not in table:
                    raise self.w.error(
                        here,
                        f"{from_key}={have!r} is not in its table ({', '.join(map(str, table))})",
                        "add it to the table",
                    )
                value = table[have]
            else:
                value = lookup(how) if isinstance(how, str) else copy.deepcopy(how)
            set_key(compact, key, value)
            set_key(merged, key, value)
            source[key] = f"rule {key}"

    def _merged(self, compact: dict[str, Any], where: str) -> dict[str, Any]:
        """The config with its `inherit:` read (paths from the repository), by the run loader's
        own rule."""
        try:
            return resolve_inherit(compact, self.repo)
        except ConfigError as e:
            raise self.w.error(
                f"{where} inherit", str(e), "give paths relative to the repository root"
            ) from None

    def _resolve(
        self,
        compact: dict[str, Any],
        overrides: list[str],
        slurm: Slurm | None,
        where: str,
        source: dict[str, str],
    ) -> dict[str, Any]:
        merged = apply_overrides(self._merged(compact, where), overrides)
        ranks = slurm.ranks if slurm is not None else 1
        try:
            cfg = from_dict(Config, merged, "")
            check_world_size(cfg, ranks)
        except ConfigError as e:
            text = str(e)
            # The keys the refusal names, by what set them (an axis value, a rule, the layout).
            named = sorted((text.find(k), s) for k, s in source.items() if k in text)
            culprits = list(dict.fromkeys(s for _, s in named)) or ["config"]
            what = " or ".join(c.split(" (")[0] for c in culprits)
            layout = ""
            if "world size" in text:
                layout = f" on {ranks} rank{'s' * (ranks != 1)} of the Slurm layout"
                what += " or the Slurm layout (nodes x GPUs)"
            raise self.w.error(
                f"{where} ({', '.join(culprits)}){layout}", text, f"fix the {what}"
            ) from None
        return to_dict(cfg)

    def _check_unique(self, runs: list[StudyRun]) -> None:
        """No two runs share a folder, job or script (names are checked as runs are made),
        nor two groups a config."""
        for attr, what in (
            ("run_dir", "run folder"),
            ("job_name", "job name"),
            ("script_path", "job script"),
        ):
            seen: dict[Any, str] = {}
            for r in runs:
                v = getattr(r, attr)
                if v is not None and seen.setdefault(v, r.name) != r.name:
                    raise self.w.error(
                        f"run {r.name}",
                        f"has the same {what} {v} as run {seen[v]}",
                        f"put {{name}} in layout {attr.removesuffix('_path')}",
                    )
        owner: dict[str, str] = {}
        for r in runs:
            if owner.setdefault(r.config_path, r.group) != r.group:
                raise self.w.error(
                    f"run {r.name}",
                    f"writes the config {r.config_path} of another group",
                    "put {name} or {stem} in layout config",
                )

    def _exclude(self, where: str, spec: list[dict[str, Any]] | None) -> dict[str, Labels]:
        """Each exclusion by where it is (exclude[0], grids[1] exclude[0])."""
        out = {f"{where}[{i}]": x for i, x in enumerate(spec or ())}
        return {k: labels_by_axis(self.w, k, x, self.axes) for k, x in out.items()}

    def _baseline(self, runs: list[StudyRun]) -> dict[str, str] | None:
        if self.file.baseline is None:
            return None
        labels = labels_by_axis(self.w, "baseline", self.file.baseline, self.axes)
        out = {a: lab for a, (lab,) in labels.items()}
        if not any(_matches(labels, r.labels) for r in runs):
            raise self.w.error("baseline", f"no run has {out}", "choose labels some run has")
        return out


def written_config(compact: dict[str, Any], config_path: str) -> dict[str, Any]:
    """The config file's content: the study's repository paths in `inherit:` become paths
    from the config's own folder, as the config loader reads them."""
    here = os.path.dirname(config_path) or "."

    def rel(p: Any) -> Any:  # a path, a list of them, or {section: path}
        if isinstance(p, list):
            return [rel(x) for x in p]
        if isinstance(p, dict):
            return {k: rel(x) for k, x in p.items()}
        return Path(os.path.relpath(str(p), here)).as_posix()

    out = copy.deepcopy(compact)
    if out.get("inherit") is not None:
        out["inherit"] = rel(out["inherit"])
    return out


def _matches(rule: Labels, picked: dict[str, str]) -> bool:
    return all(picked.get(a) in labels for a, labels in rule.items())


def parse_slurm(w: Where, spec: dict[str, Any], where: str) -> Slurm:
    """A Slurm header from a study's fields (a grid's changes merged in)."""
    try:
        return from_dict(Slurm, spec, "slurm")
    except ConfigError as e:
        raise w.error(where, str(e), "fix the Slurm layout (docs/slurm.md)") from None


def planned_slurm(
    w: Where, slurm: Slurm, row: dict[str, Any] | None, gpu: str, where: str
) -> Slurm:
    """A run's header with its planned time limit (a plan file's row); a run the plan says
    does not fit the study's GPU is refused."""
    if row is None:  # not planned yet: the layout's own time limit
        return slurm
    if not row.get(f"fits_{gpu}", True):
        raise w.error(
            where,
            f"the plan file says it does not fit an {gpu.upper()} ({row['train_peak_gib']} GiB per GPU)",
            "change its micro batch or recompute, then re-plan: pretrain-plan --paper --write",
        )
    hours = time_limit_hours(row["run_hours"] * row["executed_flops"] / row["model_flops"])
    return slurm.replace(time=f"{hours}:00:00")
