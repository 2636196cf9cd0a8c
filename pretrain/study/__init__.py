"""Studies are files: studies/NAME.yaml -> runs (spec.py), their plan (plan.py), their
configs and job scripts (write.py). docs/studies.md describes the file.

    study = load_study("studies/theta.yaml")   # every field checked: StudyError, one line
    print(plan.format_plan_table(plan.plan_rows(study, "h100")))   # pretrain.study.plan
    write.write_study(study, study.repo)   # pretrain.study.write: the paths that changed
"""

from __future__ import annotations

from pretrain.study.fields import StudyError
from pretrain.study.runs import Headers, Study, StudyRun, as_array
from pretrain.study.slurm import Slurm, time_limit_s
from pretrain.study.spec import load_study

__all__ = [
    "Headers",
    "Slurm",
    "Study",
    "StudyError",
    "StudyRun",
    "as_array",
    "load_study",
    "time_limit_s",
]
