"""The run folder: every file name in it, the checkpoint step tags, atomic writes, metrics.

    RUN/config.yaml                    the resolved config of the run (rewritten at each start)
    RUN/metrics.jsonl                  one JSON object per logged step: {"step": 120, ...}
    RUN/tensorboard/                   TensorBoard event files
    RUN/checkpoints/latest             the tag of the newest complete checkpoint
    RUN/checkpoints/step_0001000/      one checkpoint: DeepSpeed's files, rng/, trainer_state.json,
                                       and a weights folder's files (model.safetensors,
                                       config.yaml, tokenizer/) that evaluation and export read
    RUN/eval/step_0001000/             evaluation results of that checkpoint
    RUN/hang/rank_3.txt                the hang watchdog's report: rank 3's Python stacks
                                       (pretrain/train/watchdog.py); only after a hang
    RUN/hang/injected_rank_1_step_5    an injected hang fault fired (it fires once per run)

Training writes the folder; evaluation, comparison, export and the Slurm launcher read it.
Nothing else spells these names. This module imports nothing of ours, so every layer (model
weights, training, evaluation, tools) may use it.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

CONFIG_FILE = "config.yaml"
METRICS_FILE = "metrics.jsonl"
TENSORBOARD_DIR = "tensorboard"
CHECKPOINTS_DIR = "checkpoints"
LATEST_FILE = "latest"
EVAL_DIR = "eval"
HANG_DIR = "hang"  # the hang watchdog's stack dumps, one file per rank
ROLLBACKS_FILE = "rollbacks.json"  # the run's loss-spike rollbacks (pretrain/train/spikes.py)
STATE_FILE = "trainer_state.json"  # in a checkpoint folder; written last
RNG_DIR = "rng"  # in a checkpoint folder: one file of RNG states per rank
# In a checkpoint folder: its optimizer state re-partitioned for any number of ranks
# (DeepSpeed's universal checkpoint; pretrain/train/reshard.py), made when first needed.
UNIVERSAL_DIR = "universal"
TMP_SUFFIX = ".tmp"  # a checkpoint folder being written
DELETING_SUFFIX = ".deleting"  # a checkpoint folder being removed


class CheckpointSaveError(RuntimeError):
    """Writing a checkpoint failed (disk full, quota, I/O error); the previous one is intact."""


_TAG = re.compile(r"^step_(\d+)$")


def step_tag(step: int) -> str:
    """The checkpoint folder name of `step`: step_0001000 (sorts by step)."""
    return f"step_{step:07d}"


def tag_step(tag: str) -> int | None:
    """The step of a checkpoint tag, or None when `tag` is not one."""
    m = _TAG.match(tag)
    return int(m.group(1)) if m else None


@dataclass(frozen=True)
class RunLayout:
    """Paths of one run folder. `checkpoints_override` is checkpoint.dir (null = RUN/checkpoints)."""

    root: Path
    checkpoints_override: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "root", Path(self.root))

    @property
    def config(self) -> Path:
        return self.root / CONFIG_FILE

    @property
    def metrics(self) -> Path:
        return self.root / METRICS_FILE

    @property
    def tensorboard(self) -> Path:
        return self.root / TENSORBOARD_DIR

    @property
    def checkpoints(self) -> Path:
        return (
            Path(self.checkpoints_override)
            if self.checkpoints_override
            else self.root / CHECKPOINTS_DIR
        )

    @property
    def latest(self) -> Path:
        return self.checkpoints / LATEST_FILE

    def checkpoint(self, step: int) -> Path:
        return self.checkpoints / step_tag(step)

    @property
    def hang(self) -> Path:
        return self.root / HANG_DIR

    def hang_report(self, rank: int) -> Path:
        return self.hang / f"rank_{rank}.txt"

    def injected_hang(self, rank: int, data_step: int) -> Path:
        """The marker an injected hang fault leaves (pretrain/faults.py): it fires once."""
        return self.hang / f"injected_rank_{rank}_step_{data_step}"

    def latest_tag(self) -> str | None:
        """The tag `latest` names (complete or not), or None."""
        try:
            return self.latest.read_text().strip() or None
        except (FileNotFoundError, NotADirectoryError):
            return None


def fsync_dir(path: Path) -> None:
    """Make a rename or a new file in `path` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: Path) -> None:
    """Make every file under `root`, and the folders' entries, durable (before a rename
    publishes the folder)."""
    for dirpath, _, files in os.walk(root):
        for name in files:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(Path(dirpath))


def atomic_write(
    path: str | Path, data: str | bytes, fsync: bool = True, mode: int | None = None
) -> Path:
    """Write `data` to `path` so that a crash leaves either the old file or the new one.

    The bytes go to a temporary file beside it (named per process, so two writers never share
    one), are flushed to disk when `fsync`, and replace the file with one atomic rename;
    `mode` sets its permissions first (0o755 for a script).
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}{TMP_SUFFIX}")
    raw = data.encode("utf-8") if isinstance(data, str) else data
    try:
        with open(tmp, "wb") as f:
            f.write(raw)
            if fsync:
                f.flush()
                os.fsync(f.fileno())
        if mode is not None:
            os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if fsync:
        fsync_dir(path.parent)
    return path


def read_metrics(run_dir: str | Path) -> list[dict]:
    """The rows of RUN/metrics.jsonl in file order ({"step": ..., key: value}); a line cut
    short by a kill is skipped. [] when the run has logged nothing yet."""
    path = Path(run_dir) / METRICS_FILE
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(row, dict) and "step" in row:
            rows.append(row)
    return rows
