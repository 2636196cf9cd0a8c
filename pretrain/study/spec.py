"""A study file (studies/NAME.yaml) -> its runs, every field checked before anything is written.

The format is docs/studies.md's "The study file". In short: a base `config:`, `axes:` (one
config key, several keys moved together, or a mapping of settings per value; short labels),
the grid (`product:`, `zip:`, or several `grids:`), `seeds:`, `exclude:`, `rules:` that derive
fields from others, the Slurm layout and the run-folder, config, script and job naming
(`layout:`). `load_study` expands it into `StudyRun`s and refuses, in one line naming the
study file, the field or axis and the fix (a `StudyError`), whatever would make a run that the
trainer refuses, two runs that share a name, config or run folder, or no run at all.
"""

from __future__ import annotations

import copy
import itertools
import json
from pathlib import Path
from typing import Any

import yaml

from pretrain.config import (
    Config,
    ConfigError,
    apply_overrides,
    check_world_size,
    from_dict,
    get_key,
    resolve_inherit,
    set_key,
    to_dict,
    yaml_error_message,
)
from pretrain.schema import did_you_mean
from pretrain.study.fields import (
    CONFIG_HEADER,
    GRID_FIELDS,
    LABEL,
    SCRIPT_HEADER,
    SEED_NAME,
    STUDY_GENERATED,
    Axis,
    Grid,
    Rule,
    StudyError,
    Where,
    checked_key,
    label_of,
    parse_axis,
    parse_exclude,
    parse_grid_entries,
    parse_rules,
    refuse_unknown_fields,
    render_template,
    shown_path,
)
from pretrain.study.file import Seeds, StudyFile, read_study_file
from pretrain.study.runs import Headers, Study, StudyRun, as_array, relative_path, written_config
from pretrain.study.slurm import Slurm, parse_slurm, planned_slurm, slurm_options

# ----------------------------------------------------------------------------- loading


def _read(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise StudyError(
            f"{shown_path(path)}: no such study file; check the path (studies/NAME.yaml)"
        )
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise StudyError(yaml_error_message(e, shown_path(path))) from None
    if not isinstance(data, dict):
        raise StudyError(
            f"{shown_path(path)}: the top level must be a mapping of fields; see docs/studies.md"
        )
    return data


def load_study(path: str | Path) -> Study:
    """Read, expand and check a study file; raises StudyError (one line) for anything wrong."""
    path = Path(path)
    data = _read(path)
    w = Where(path)
    try:
        file = read_study_file(data)
    except ValueError as e:
        raise StudyError(f"{shown_path(path)}: {e}") from None
    return _Loader(w, path.resolve(), data, file).study()


class _Loader:
    """One study file's parts, parsed in order; `study()` expands and checks the runs."""

    def __init__(self, w: Where, path: Path, data: dict[str, Any], file: StudyFile):
        self.w, self.path, self.data, self.file = w, path, data, file
        self.repo = path.parent.parent
        self.name = str(data.get("name") or path.stem)
        if not LABEL.match(self.name):
            raise w.error(
                "name", f"{self.name!r} is not a file name", "use letters, digits, _ and -"
            )
        self.description = str(data.get("description") or "")
        self.axes = self._axes()
        self.base = self._base_config()
        self.rules = parse_rules(w, data.get("rules"))
        self.seeds, self.seed_key = self._seeds()
        self.layout = self._layout()
        self.gpu = file.gpu
        self.slurm_spec, self.array, self.max_running = slurm_options(w, data.get("slurm"))
        self.plan = self._plan_file()
        self.exclude = parse_exclude(w, "exclude", data.get("exclude"), self.axes)
        self.grids = self._grids()
        self.headers = self._headers()
        self.names: dict[str, str] = {}

    # -- fields

    def _axes(self) -> dict[str, Axis]:
        spec = self.data.get("axes") or {}
        if not isinstance(spec, dict):
            raise self.w.error(
                "axes", f"{spec!r} is not a mapping", "write AXIS: {key: ..., values: [...]}"
            )
        axes = {str(k): parse_axis(self.w, str(k), v) for k, v in spec.items()}
        for reserved in ("seed", "name", "stem", "study", "description"):
            if reserved in axes:
                raise self.w.error(
                    f"axis {reserved}",
                    "the name is taken by the run's own fields",
                    "rename the axis",
                )
        return axes

    def _base_config(self) -> dict[str, Any]:
        spec = self.data.get("config")
        if spec is None:
            raise self.w.error("config", "missing", "give the base config: a path or a mapping")
        if isinstance(spec, str):
            base = self.repo / spec
            if not base.is_file():
                raise self.w.error(
                    "config",
                    f"{spec} does not exist",
                    "give a path relative to the repository root",
                )
            return {"inherit": spec}
        if not isinstance(spec, dict):
            raise self.w.error(
                "config", f"{spec!r} is neither a path nor a mapping", "see docs/studies.md"
            )
        base = copy.deepcopy(spec)
        self._merged(base, "config")  # its inherited files exist and read, as the runs' will
        return base

    def _seeds(self) -> tuple[tuple[int, ...], str]:
        spec = self.file.seeds
        if isinstance(spec, Seeds):
            return self._seed_values(spec.values), checked_key(
                self.w, "seeds key", spec.key_, "fix the key"
            )
        return self._seed_values(spec), "train.seed"

    def _seed_values(self, seeds: list[int] | None) -> tuple[int, ...]:
        if seeds is None:
            return ()
        if not seeds:
            raise self.w.error("seeds", "[] is not a list of integers", "e.g. seeds: [1, 2, 3]")
        if len(set(seeds)) != len(seeds):
            raise self.w.error("seeds", f"{seeds} repeats a seed", "list each seed once")
        return tuple(seeds)

    def _layout(self) -> dict[str, str]:
        out = {
            "config": f"studies/{self.name}/configs/{{name}}.yaml",
            "script": f"studies/{self.name}/slurm/{{name}}.sh",
            "run_dir": f"runs/{self.name}/{{name}}",
            "job_name": "{name}",
            "array_script": f"studies/{self.name}/slurm/{self.name}.sh",
        }
        for k, v in self.file.layout.model_dump(exclude_none=True).items():
            if not v:
                raise self.w.error(f"layout {k}", f"{v!r} is not a template", "e.g. runs/{name}")
            out[k] = v
        return out

    def _plan_file(self) -> dict[str, dict[str, Any]]:
        spec = self.data.get("plan_file")
        if spec is None:
            return {}
        p = self.repo / str(spec)
        if not p.is_file():
            raise self.w.error(
                "plan_file",
                f"{spec} does not exist",
                "write it with `pretrain-plan --paper --write`, or drop plan_file",
            )
        return {r["name"]: r for r in json.loads(p.read_text())["runs"]}

    def _grids(self) -> tuple[Grid, ...]:
        data = self.data
        top = {k: data[k] for k in GRID_FIELDS if k in data and k not in ("exclude", "slurm")}
        spec = data.get("grids")
        if spec is None:
            return (self._grid("grid", top),)
        if not isinstance(spec, list) or not spec:
            raise self.w.error(
                "grids", f"{spec!r} is not a list of grids", "give a list, or product: at the top"
            )
        if "product" in data or "zip" in data:
            raise self.w.error("product", "given beside grids:", "put it inside one of the grids")
        out = []
        for i, g in enumerate(spec):
            if not isinstance(g, dict):
                raise self.w.error(f"grids[{i}]", f"{g!r} is not a mapping", "see docs/studies.md")
            refuse_unknown_fields(self.w, f"grids[{i}]", g, GRID_FIELDS)
            out.append(self._grid(f"grids[{i}]", {**top, **g}))
        return tuple(out)

    def _grid(self, where: str, g: dict[str, Any]) -> Grid:
        if "product" in g and "zip" in g:
            raise self.w.error(where, "both product and zip", "write product: [..., {zip: [...]}]")
        if "zip" in g:
            entries = parse_grid_entries(self.w, where, [{"zip": g["zip"]}], self.axes)
        elif "product" in g:
            entries = parse_grid_entries(self.w, f"{where} product", g["product"], self.axes)
        else:
            entries = [((a.name, tuple(v.label for v in a.values)),) for a in self.axes.values()]
        default_name = "_".join(f"{a}{{{a}}}" for e in entries for a, _ in e) or self.name
        slurm = g.get("slurm") or {}
        if slurm and self.slurm_spec is None:
            raise self.w.error(
                f"{where} slurm", "the study has no slurm: layout", "add slurm: at the top"
            )
        if not isinstance(slurm, dict):
            raise self.w.error(
                f"{where} slurm", f"{slurm!r} is not a mapping", "e.g. {signal_margin_s: 900}"
            )
        return Grid(
            run_name=str(g.get("run_name", default_name)),
            run_description=str(g.get("run_description", self.description or "{name}")),
            entries=tuple(entries),
            slurm=slurm,
            exclude=parse_exclude(self.w, f"{where} exclude", g.get("exclude"), self.axes),
            where=where,
        )

    def _headers(self) -> Headers:
        spec = self.file.headers
        study_file = relative_path(self.path, self.repo)
        return Headers(
            config=spec.config or CONFIG_HEADER,
            script=spec.script or SCRIPT_HEADER,
            generated=spec.generated or STUDY_GENERATED.replace("{study_file}", study_file),
        )

    # -- expansion

    def study(self) -> Study:
        runs: list[StudyRun] = []
        used: set[str] = set()
        for grid in self.grids:
            excludes = [(f"exclude[{i}]", ex) for i, ex in enumerate(self.exclude)]
            excludes += [(f"{grid.where} exclude[{i}]", ex) for i, ex in enumerate(grid.exclude)]
            for combo in itertools.product(*[_entry_rows(e) for e in grid.entries]):
                picked = dict(pair for row in combo for pair in row)
                hit = {label for label, ex in excludes if _matches(ex, picked)}
                if hit:
                    used |= hit
                    continue
                for seed in self.seeds or (None,):
                    runs.append(self._run(grid, picked, seed))
        every = [f"exclude[{i}]" for i in range(len(self.exclude))]
        every += [f"{g.where} exclude[{i}]" for g in self.grids for i in range(len(g.exclude))]
        for label in every:
            if label not in used:
                raise self.w.error(label, "matches no run", "fix its labels or remove it")
        if not runs:
            raise self.w.error(
                "grid", "no runs: every combination is excluded", "loosen exclude: or add values"
            )
        self._check_unique(runs)
        baseline = self._baseline(runs)
        spec = self.slurm_spec
        slurm = parse_slurm(self.w, dict(spec), "slurm") if spec is not None else None
        array_script = None
        if slurm is not None:
            array_script = render_template(
                self.w, "layout array_script", self.layout["array_script"], {"study": self.name}
            )
        study = Study(
            name=self.name,
            path=self.path,
            runs=tuple(runs),
            baseline=baseline,
            out_dir=self.repo / "studies" / self.name,
            slurm=slurm,
            description=self.description,
            repo=self.repo,
            gpu=self.gpu,
            array=self.array,
            max_running=self.max_running,
            array_script=array_script,
            headers=self.headers,
            axes={a.name: tuple(v.label for v in a.values) for a in self.axes.values()},
            seeds=self.seeds,
        )
        if self.array:
            study = as_array(study)
        return study

    def _run(self, grid: Grid, picked: dict[str, str], seed: int | None) -> StudyRun:
        w = self.w
        labels = {a: picked[a] for a in self.axes if a in picked}  # in the axes' order
        values = {"study": self.name}
        for a, lab in labels.items():
            values[a] = lab
            values[f"{a}.text"] = self.axes[a].value(lab).text  # type: ignore[union-attr]
        stem = render_template(w, f"{grid.where} run_name", grid.run_name, values)
        if not LABEL.match(stem):
            raise w.error(
                f"{grid.where} run_name",
                f"{stem!r} is not a file name",
                "use letters, digits, _, - and .",
            )
        name = (
            stem
            if seed is None
            else render_template(w, "seeds", SEED_NAME, {"stem": stem, "seed": str(seed)})
        )
        where = f"run {name}"
        group = ",".join(f"{a}={lab}" for a, lab in labels.items()) or "(no axes)"
        if name in self.names:  # found before any config is built: the naming is wrong
            raise w.error(
                f"{grid.where} run_name",
                f"the runs {self.names[name]} and {group} are both named {name}",
                "put every axis that varies in run_name",
            )
        self.names[name] = group
        names = {**values, "name": name, "stem": stem, "seed": "" if seed is None else str(seed)}
        description = render_template(
            w, f"{grid.where} run_description", grid.run_description, names
        )
        config_path = render_template(w, "layout config", self.layout["config"], names)
        shared = seed is not None and config_path == render_template(
            w, "layout config", self.layout["config"], {**names, "name": stem, "seed": ""}
        )
        run_dir = render_template(w, "layout run_dir", self.layout["run_dir"], names)
        job_name = render_template(w, "layout job_name", self.layout["job_name"], names)

        compact = copy.deepcopy(self.base)
        source: dict[str, str] = {}
        for a, lab in labels.items():
            for key, value in self.axes[a].value(lab).settings.items():  # type: ignore[union-attr]
                if key in source:
                    raise w.error(
                        where,
                        f"axes {source[key].split()[1]} and {a} both set {key}",
                        "let one axis set it",
                    )
                set_key(compact, key, copy.deepcopy(value))
                source[key] = f"axis {a} ({lab})"
        if seed is not None and not shared:  # a rule may read the run's own seed
            set_key(compact, self.seed_key, seed)
        self._apply_rules(compact, source, where)
        overrides: tuple[str, ...] = ()
        if shared:  # the file is the group's: its run folder without the seed, its own seed
            set_key(
                compact,
                "logging.run_dir",
                render_template(
                    w, "layout run_dir", self.layout["run_dir"], {**names, "name": stem, "seed": ""}
                ),
            )
            overrides = (f"{self.seed_key}={seed}", f"logging.run_dir={run_dir}")
        else:
            set_key(compact, "logging.run_dir", run_dir)
            if seed is not None:
                set_key(compact, self.seed_key, seed)
        source.setdefault("logging.run_dir", "layout run_dir")

        slurm = None
        if self.slurm_spec is not None:
            slurm = parse_slurm(w, {**self.slurm_spec, **grid.slurm}, f"{grid.where} slurm")
            slurm = planned_slurm(w, slurm, self.plan.get(stem), self.gpu, where)
        resolved = self._resolve(compact, list(overrides), slurm, where, source)
        script_path = None
        if slurm is not None and not self.array:
            script_path = render_template(w, "layout script", self.layout["script"], names)
        return StudyRun(
            name=name,
            labels=labels,
            seed=seed,
            group=",".join(f"{a}={lab}" for a, lab in labels.items()),
            config=resolved,
            config_path=config_path,
            script_path=script_path,
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
        for rule in self.rules:
            # What a run's axis value names beats what a rule derives.
            if rule.key in source:
                continue

            def lookup(key: str, rule: Rule = rule) -> Any:
                found, value = get_key(merged, key)
                if not found:
                    found, value = get_key(defaults, key)
                if not found:
                    raise self.w.error(
                        f"{where} rule {rule.key}",
                        f"{key} is not set",
                        "set it in config: or an axis",
                    )
                return value

            if rule.copy_key is not None:
                value = lookup(rule.copy_key)
            elif rule.lookup_key is not None:
                have = lookup(rule.lookup_key)
                table = rule.table or {}
                if have not in table:
                    raise self.w.error(
                        f"{where} rule {rule.key}",
                        f"{rule.lookup_key}={have!r} is not in its table ({', '.join(map(str, table))})",
                        "add it to the table",
                    )
                value = table[have]
            else:
                value = copy.deepcopy(rule.value)
            set_key(compact, rule.key, value)
            set_key(merged, rule.key, value)
            source[rule.key] = f"rule {rule.key}"

    def _merged(self, compact: dict[str, Any], where: str) -> dict[str, Any]:
        """The config file's content with its `inherit:` read (paths from the repository),
        by the run loader's own rule (pretrain/config.py resolve_inherit)."""
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
            layout = ""
            if "world size" in text:
                layout = f" on {ranks} rank{'s' * (ranks != 1)} of the Slurm layout"
            what = " or ".join(c.split(" (")[0] for c in culprits)
            if layout:
                what += " or the Slurm layout (nodes x GPUs)"
            raise self.w.error(
                f"{where} ({', '.join(culprits)}){layout}", text, f"fix the {what}"
            ) from None
        return to_dict(cfg)

    def _check_unique(self, runs: list[StudyRun]) -> None:
        for attr, what, fix in (
            ("name", "name", "put every axis that varies in run_name"),
            ("run_dir", "run folder", "put {name} in layout run_dir"),
            ("job_name", "job name", "put {name} in layout job_name"),
            ("script_path", "job script", "put {name} in layout script"),
        ):
            seen: dict[Any, str] = {}
            for r in runs:
                v = getattr(r, attr)
                if v is None:
                    continue
                if v in seen:
                    raise self.w.error(
                        f"run {r.name}",
                        f"has the same {what} {v} as run {seen[v]}",
                        fix,
                    )
                seen[v] = r.name
        owner: dict[str, str] = {}
        for r in runs:  # a shared config is one group's, never two groups'
            if owner.setdefault(r.config_path, r.group) != r.group:
                raise self.w.error(
                    f"run {r.name}",
                    f"writes the config {r.config_path} of another group",
                    "put {name} or {stem} in layout config",
                )

    def _baseline(self, runs: list[StudyRun]) -> dict[str, str] | None:
        spec = self.data.get("baseline")
        if spec is None:
            return None
        if not isinstance(spec, dict) or not spec:
            raise self.w.error(
                "baseline", f"{spec!r} is not a mapping of labels", "e.g. baseline: {theta: 10000}"
            )
        out = {}
        for a, lab in spec.items():
            axis = self.axes.get(str(a))
            lab = label_of(lab) or str(lab)
            if axis is None or axis.value(lab) is None:
                known = self.axes if axis is None else [v.label for v in axis.values]
                raise self.w.error(
                    f"baseline {a}",
                    f"{a}={lab} is not a value of the study"
                    + did_you_mean(lab if axis else str(a), known),
                    "name an axis and one of its labels",
                )
            out[str(a)] = lab
        if not any(all(r.labels.get(a) == lab for a, lab in out.items()) for r in runs):
            raise self.w.error("baseline", f"no run has {out}", "choose labels some run has")
        return out


def _entry_rows(
    entry: tuple[tuple[str, tuple[str, ...]], ...],
) -> list[tuple[tuple[str, str], ...]]:
    """An entry's rows: one value of each of its (zipped) axes, in step."""
    n = len(entry[0][1])
    return [tuple((axis, labels[i]) for axis, labels in entry) for i in range(n)]


def _matches(rule: dict[str, tuple[str, ...]], picked: dict[str, str]) -> bool:
    return all(picked.get(a) in labels for a, labels in rule.items())
