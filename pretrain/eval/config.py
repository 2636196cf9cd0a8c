"""The `downstream:` section: in-loop downstream evaluation (docs/evaluation.md), the offline
tool's tasks scored between steps. Task names are checked here, against the task configs the
package ships; their data on this machine (data_dir) is pretrain/preflight.py's."""

from __future__ import annotations

from pydantic import Field, model_validator

from pretrain.eval.tasks import TASKS_DIR, resolve_tasks
from pretrain.eval.tasks.convert import EvalDataError
from pretrain.schema import ConfigError, Int, Section


class DownstreamConfig(Section):
    """In-loop downstream evaluation; off while `tasks` is empty (the paper's runs evaluated
    offline only)."""

    key = "downstream"

    tasks: list[str] = Field(default_factory=list)
    """task names or the suite `paper`, as `tools/evaluate.py --tasks`; any task with local data (pretrain/eval/tasks/*.yaml)"""
    data_dir: str | None = None
    """the local task data, the folder `tools/evaluate.py --data-dir` reads (e.g. `../shared/data/evals`); required with tasks"""
    examples: Int = Field(500, gt=0)
    """documents per task (all when a task has fewer): the same ones at every evaluation, drawn with `seed`, recorded in RUN/downstream/examples.json"""
    seed: Int = 1234
    """the draw of the examples (each task its own generator: adding a task changes no other's)"""
    interval: Int = Field(1000, ge=0)
    """evaluate every N steps and at the end; 0 = at the end only"""
    batch_size: Int = Field(64, gt=0)
    """sequences per forward (the adapter's batch_size)"""
    max_batch_tokens: Int | None = Field(None, gt=0)
    """padded tokens per forward; null = the adapter's default (65,536 on GPU, 16,384 on CPU)"""

    @model_validator(mode="after")
    def _check(self) -> DownstreamConfig:
        if not self.tasks:
            return self
        offline = sorted(p.stem for p in TASKS_DIR.glob("*.yaml"))  # tasks with local configs
        try:
            tasks = resolve_tasks(",".join(self.tasks))
        except EvalDataError as e:
            raise ConfigError(f"downstream.tasks: {e}") from None
        for task in tasks:
            if task not in offline:
                raise ConfigError(
                    f"downstream.tasks: unknown task {task!r}; tasks with local data: "
                    f"{', '.join(offline)} (or the suite 'paper')"
                )
        return self
