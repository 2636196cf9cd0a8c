"""`study list`: a study's runs in order, each with its sequence length, batch layout and
tokens (the paper's budget table in docs/reproduce.md is `list studies/partial_rope.yaml
--markdown`). Read from the resolved configs only: nothing is traced (`study plan` does)."""

from __future__ import annotations

from pretrain.study.runs import Study
from pretrain.tables import pipe_table, text_table

COLUMNS = (
    "run",
    "seq len",
    "global batch",
    "micro batch",
    "accum",
    "tokens/step",
    "total tokens",
    "nodes x GPUs",
)


def _tokens(n: int) -> str:
    """100.7B, 12.3M, 409,600."""
    if n >= 1e9:
        return f"{n / 1e9:.1f}B"
    return f"{n / 1e6:.1f}M" if n >= 1e6 else f"{n:,}"


def format_run_table(study: Study, markdown: bool = False) -> str:
    """The study's runs as an aligned table, or a markdown one: how many tokens each trains
    and how its batch is laid out (a run without Slurm is one process)."""
    rows = []
    for r in study.runs:
        t = r.config["train"]
        seq = t["seq_len"] or r.config["model"]["max_seq_len"]
        nodes, per_node = (r.slurm.nodes, r.slurm.tasks_per_node) if r.slurm else (1, 1)
        per_step = t["global_batch_size"] * seq
        rows.append(
            (
                r.name,
                str(seq),
                f"{t['global_batch_size']:,}",
                str(t["micro_batch_size"]),
                str(t["global_batch_size"] // (t["micro_batch_size"] * nodes * per_node)),
                f"{per_step:,}",
                _tokens(per_step * t["train_iters"]),
                f"{nodes} x {per_node}",
            )
        )
    if markdown:
        return pipe_table(COLUMNS, rows, align=["left"] + ["right"] * (len(COLUMNS) - 1))
    return text_table(COLUMNS, rows)


__all__ = ["format_run_table"]
