"""Studies are files: studies/NAME.yaml -> runs (`load_study`, spec.py), their plan (plan.py),
their configs and job scripts (write.py). docs/studies.md describes the file."""

from __future__ import annotations

from pretrain.study.file import StudyError
from pretrain.study.runs import Study, StudyRun
from pretrain.study.spec import load_study

__all__ = ["Study", "StudyError", "StudyRun", "load_study"]
