"""`study list`: a study's runs in order, each with its sequence length, batch layout and
tokens (the paper's budget table in docs/reproduce.md is `list studies/partial_rope.yaml
--markdown`). Read from the resolved configs only: nothing is traced (`study plan` does)."""

from __future__ import annotations

from pretrain.study.runs import Study, StudyRun
from pretrain.study.slurm import Slurm
from pretrain.tables import pipe_table, text_table

TABLE_COLUMNS = (
    "run",
    "seq len",
    "global batch",
    "micro batch",
    "accum",
    "tokens/step",
    "total tokens",
    "nodes x GPUs",
)


def table_rows(runs: tuple[StudyRun, ...] | list[StudyRun]) -> list[tuple[str, ...]]:
    """One row per run: how many tokens it trains and how the batch is laid out (a run
    without Slurm is one process)."""
    rows = []
    for r in runs:
        t = r.config["train"]
        seq = t["seq_len"] or r.config["model"]["max_seq_len"]
        slurm = r.slurm or Slurm(nodes=1, gpus_per_node=1)
        accum = t["global_batch_size"] // (t["micro_batch_size"] * slurm.ranks)
        per_step = t["global_batch_size"] * seq
        rows.append(
            (
                r.name,
                str(seq),
                f"{t['global_batch_size']:,}",
                str(t["micro_batch_size"]),
                str(accum),
                f"{per_step:,}",
                _tokens(per_step * t["train_iters"]),
                f"{slurm.nodes} x {slurm.tasks_per_node}",
            )
        )
    return rows


def _tokens(n: int) -> str:
    """100.7B, 12.3M, 409,600."""
    if n >= 1e9:
        return f"{n / 1e9:.1f}B"
    return f"{n / 1e6:.1f}M" if n >= 1e6 else f"{n:,}"


def format_run_table(study: Study, markdown: bool = False) -> str:
    """The study's runs as an aligned table, or a markdown one."""
    rows = table_rows(study.runs)
    if markdown:
        return pipe_table(
            TABLE_COLUMNS, rows, align=["left"] + ["right"] * (len(TABLE_COLUMNS) - 1)
        )
    return text_table(TABLE_COLUMNS, rows)


__all__ = ["TABLE_COLUMNS", "format_run_table", "table_rows"]
