"""A study expanded (by pretrain/study/spec.py): its runs, the `Study`, and the study as one
Slurm job array."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path

from pretrain.study.file import Headers, Where
from pretrain.study.slurm import Slurm


@dataclass(frozen=True)
class StudyRun:
    name: str  # unique in the study, e.g. "llama1b_rope10" or "shakespeare_theta500_s2"
    labels: dict[str, str]  # axis name -> value label, seed not included
    seed: int | None
    group: str  # the labels without the seed, "model=llama1b,rope=10": seeds pooled in reports
    config: dict  # the resolved config (pretrain.config.to_dict of the loaded Config)
    config_path: str  # repo-relative path `write` puts the config at
    script_path: str | None  # repo-relative job script; None with a job array or no Slurm
    run_dir: str  # logging.run_dir
    job_name: str
    description: str = ""
    # `--set`s the launch adds to a config file the group's seeds share: seed and run folder.
    overrides: tuple[str, ...] = ()
    slurm: Slurm | None = None  # this run's header (its time limit, the grid's changes)
    # What `write` dumps below the header: the study's config with the run's values.
    config_file: dict = field(default_factory=dict)
    stem: str = ""  # the name without the seed (the shared config's name)


@dataclass(frozen=True)
class Study:
    name: str
    path: Path  # the study file
    runs: tuple[StudyRun, ...]
    baseline: dict[str, str] | None  # labels of the baseline group (`baseline:`)
    out_dir: Path  # studies/NAME/ (report/ goes under it)
    slurm: Slurm | None  # the study's Slurm layout (a run's own header: StudyRun.slurm)
    description: str = ""
    repo: Path = Path(".")  # the folder above studies/: every path in the study is relative to it
    gpu: str = "h200"  # the cluster's GPU: plan's default and the plan file's fit
    array: bool = False  # the study is one Slurm job array (`slurm: {array: true}`)
    max_running: int | None = None  # the array's %N: at most N runs at once
    array_script: str | None = None  # repo-relative script of the array
    headers: Headers | None = None  # with `generated` given
    seeds: tuple[int, ...] = ()


def relative_path(path: Path, repo: Path) -> str:
    """`path` from the repository root when it is inside it, else as it is."""
    try:
        return Path(path).resolve().relative_to(Path(repo).resolve()).as_posix()
    except ValueError:
        return str(path)


def as_array(study: Study, max_running: int | None = None) -> Study:
    """The study as one Slurm job array: no per-run scripts, one header for every task (the
    longest time limit of its runs); refuses runs whose layouts differ otherwise."""
    w = Where(study.path)
    if study.slurm is None or study.array_script is None:
        raise w.error(
            "slurm", "the study has no Slurm layout, so no job array", "add slurm: to the study"
        )
    if len({r.slurm.replace(time="0") for r in study.runs if r.slurm is not None}) > 1:
        raise w.error(
            "slurm",
            "its runs have different Slurm layouts (a grid's slurm:), and an array has one header",
            "write one script per run (no --array), or give every grid the same layout",
        )
    if max_running is not None and max_running < 1:
        raise w.error("--array %N", f"{max_running}", "give a positive number of runs at once")
    return replace(
        study,
        runs=tuple(replace(r, script_path=None) for r in study.runs),
        array=True,
        max_running=max_running if max_running is not None else study.max_running,
    )


__all__ = ["Study", "StudyRun", "as_array", "relative_path"]
