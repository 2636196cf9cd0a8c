"""A study's files: one config per run (or per group whose seeds share it), one job script
per run or one Slurm job array. Writing is idempotent: a file whose text is already right is
left alone, and `write_study` returns only the paths it changed."""

from __future__ import annotations

import shlex
from pathlib import Path

import yaml

from pretrain.run_layout import atomic_write
from pretrain.slurm_limits import time_limit_s
from pretrain.study.runs import Study, StudyRun, as_array, relative_path

LAUNCH = "slurm/launch.sh"


class _Dumper(yaml.SafeDumper):
    """Block-style mappings, one-line lists: `betas: [0.9, 0.95]`."""


_Dumper.add_representer(
    list,
    lambda dumper, data: dumper.represent_sequence("tag:yaml.org,2002:seq", data, flow_style=True),
)


def _header(study: Study, name: str, description: str, script: str | None = None) -> list[str]:
    """The comment lines above a written config, or above a job script's #SBATCH lines."""
    lines = [f"# {name}: {description}.", f"# {study.generated}"]
    if script is not None:
        lines.append(f"# Submit from the repository root: sbatch {script} [--set key=value ...]")
    return lines


def _launch_args(run: StudyRun) -> str:
    """The run's config and `--set`s, as its launch passes them (shell-quoted)."""
    args = [run.config_path]
    for o in run.overrides:
        args += ["--set", o]
    return " ".join(map(shlex.quote, args))


def render_run_config(study: Study, run: StudyRun) -> str:
    """The config file of a run: the header's comment lines, then the YAML."""
    name = run.stem if run.overrides else run.name  # a shared file is the group's
    text = yaml.dump(run.config_file, Dumper=_Dumper, sort_keys=False, width=100)
    return "\n".join([*_header(study, name, run.description), text])


def render_run_script(study: Study, run: StudyRun) -> str:
    """The sbatch script of one run: its header, the #SBATCH lines, the shared launcher."""
    assert run.slurm is not None
    return "\n".join(
        [
            "#!/bin/bash",
            *_header(study, run.name, run.description, run.script_path),
            *run.slurm.lines(run.job_name),
            "",
            f'exec {LAUNCH} {_launch_args(run)} "$@"',
            "",
        ]
    )


def render_array_script(study: Study) -> str:
    """One sbatch script for every run: task i runs the study's run i (in `plan`'s order)."""
    assert study.array_script is not None
    n = len(study.runs)
    cap = f"%{study.max_running}" if study.max_running else ""
    # One header for every task: the study's layout at the longest time of its runs.
    slurms = [r.slurm for r in study.runs if r.slurm is not None] or [study.slurm]
    header = max(slurms, key=lambda s: time_limit_s(s.time))
    lines = [
        "#!/bin/bash",
        *_header(
            study,
            study.name,
            f"{study.description or 'a study'}; a Slurm job array of {n} runs",
            study.array_script,
        ),
        "# Task i trains run i of `python tools/study.py list "
        f"{relative_path(study.path, study.repo)}` (the case below names each).",
        *header.lines(study.name, array=f"0-{n - 1}{cap}"),
        "",
        'case "${SLURM_ARRAY_TASK_ID:?submit with sbatch: this script is a job array}" in',
    ]
    for i, run in enumerate(study.runs):
        lines.append(f'  {i}) set -- {_launch_args(run)} "$@" ;;  # {run.name}')
    lines += [
        '  *) echo "no run for array task $SLURM_ARRAY_TASK_ID" >&2; exit 2 ;;',
        "esac",
        f'exec {LAUNCH} "$@"',
        "",
    ]
    return "\n".join(lines)


def study_files(
    study: Study, array: bool = False, max_running: int | None = None
) -> dict[str, str]:
    """Repository-relative path -> text of every file the study writes."""
    if array or max_running is not None:
        study = as_array(study, max_running)
    out: dict[str, str] = {}
    for run in study.runs:
        out.setdefault(run.config_path, render_run_config(study, run))
        if run.script_path is not None:
            out[run.script_path] = render_run_script(study, run)
    if study.array and study.array_script is not None:
        out[study.array_script] = render_array_script(study)
    return out


def write_study(
    study: Study, repo: Path, array: bool = False, max_running: int | None = None
) -> list[str]:
    """Write the study's files whose text differs under `repo` (atomically; scripts
    executable); the paths written."""
    changed = []
    for rel, text in study_files(study, array, max_running).items():
        path = Path(repo) / rel
        if path.is_file() and path.read_text() == text:
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, text, fsync=False, mode=0o755 if rel.endswith(".sh") else 0o644)
        changed.append(rel)
    return changed


def stale_files(
    studies: list[Study], repo: Path, array: bool = False, max_running: int | None = None
) -> list[str]:
    """What `study write --check` lists: the studies' files that are missing or differ from
    what `write` (with `array`, `max_running`) writes, then files in their folders that carry
    a study's `generated` line but that no run writes any more (the per-run scripts and the
    job array, whichever `array` leaves out, still count as written)."""
    want: dict[str, str] = {}
    known: set[str | None] = set()  # every path a study writes, one script per run or as an array
    for study in studies:
        arrayed = study.slurm is not None and (array or max_running is not None)
        want.update(study_files(study, arrayed, max_running if arrayed else None))
        known |= {r.script_path for r in study.runs} | {study.array_script}
    known |= set(want)
    bad = [
        p for p, text in want.items() if not (repo / p).is_file() or (repo / p).read_text() != text
    ]
    marks = {s.generated for s in studies}
    for d in sorted({str(Path(p).parent) for p in want}):
        for path in sorted((repo / d).glob("*")):
            rel = path.relative_to(repo).as_posix()
            if not path.is_file() or path.suffix not in (".yaml", ".sh") or rel in known:
                continue
            if any(m in path.read_text() for m in marks):
                bad.append(rel)
    return bad
