"""The training step in every setting it accepts, against every numeric fault
(tests/fault_matrix.py): each cell trains to its end and resumes, with the bad step visible
in metrics.jsonl and TensorBoard, ending as docs/spikes.md's table says.

`make test` runs a sample that holds every value of every axis (fault_matrix.sample_cells);
`make test-faults` (and CI) the whole matrix, PRETRAIN_FAULT_MATRIX=full. Cells run in
batches, one launch per batch (tests/fault_cells.py), 1-rank cells on one process and 2-rank
cells on two: a cell is a whole run of the real engine, not a process start.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import fault_matrix
import pytest
import warm_start
from fault_matrix import Cell
from train_support import REPO, child_env, stdlib_data

FULL = os.environ.get("PRETRAIN_FAULT_MATRIX") == "full"
BATCH = 96  # cells per launch in the full matrix: about two minutes on 2 cores


def _batches() -> list:
    if not FULL:
        cells = fault_matrix.sample_cells()
        return [
            pytest.param([c for c in cells if c.ranks == n], id=f"sample-{n}rank")
            for n in fault_matrix.RANKS
        ]
    out = []
    for n in fault_matrix.RANKS:
        cells = [c for c in fault_matrix.all_cells() if c.ranks == n]
        for i in range(0, len(cells), BATCH):
            out.append(
                pytest.param(
                    cells[i : i + BATCH],
                    id=f"full-{n}rank-{i // BATCH}",
                    marks=pytest.mark.slow(reason=f"{BATCH} whole runs and their resumes"),
                )
            )
    return out


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return stdlib_data(tmp_path_factory)


@pytest.mark.parametrize("cells", _batches())
def test_every_cell_ends_as_documented(cells: list[Cell], tmp_path: Path, data: Path):
    (tmp_path / "cells.json").write_text(json.dumps([c.__dict__ for c in cells]))
    out = tmp_path / "seen.jsonl"
    argv = [str(REPO / "tests" / "fault_cells.py"), str(tmp_path / "cells.json"), str(data)]
    argv += [str(tmp_path / "runs"), str(out)]
    r = warm_start.run_ranks(argv, child_env(), REPO, 60 * 30, cells[0].ranks)
    seen = [json.loads(line) for line in out.read_text().splitlines()] if out.exists() else []
    assert r.returncode == 0 and len(seen) == len(cells), (
        f"{len(seen)} of {len(cells)} cells ran; the next one's log is under {tmp_path}/runs\n"
        + r.stderr[-3000:]
    )
    failed = {}
    for s in seen:
        cell = Cell(**s["cell"])
        if found := fault_matrix.problems(cell, s):
            failed[cell.id] = (fault_matrix.expected(cell).describe(), found)
    assert not failed, json.dumps(failed, indent=1)


def test_the_sample_holds_every_value_of_every_axis():
    cells = fault_matrix.sample_cells()
    for axis, values in fault_matrix.AXES.items():
        assert {getattr(c, axis) for c in cells} == set(values), axis
    for fault in fault_matrix.FAULTS:
        assert {c.mitigation for c in cells if c.fault == fault} == set(fault_matrix.MITIGATIONS)
    assert all(c.accepted for c in cells)
    # The paper's default (bf16 with fp32 accumulation, ZeRO-1, no mitigation), every fault.
    paper = {c.fault for c in cells if (c.precision, c.zero, c.mitigation) == ("bf16", 1, "off")}
    assert paper == set(fault_matrix.FAULTS)


def test_the_matrix_is_every_accepted_setting():
    """Refused settings are refused by the config, not left out silently."""
    from pretrain.config import Config, ConfigError, from_dict

    cells = fault_matrix.all_cells()
    assert len(cells) == len({c.id for c in cells})
    refused = [Cell("bf16", 0, 1, "first", "off", 1, "nan")]
    for cell in refused:
        assert not cell.accepted
        with pytest.raises(ConfigError, match="zero_stage=0 cannot accumulate bf16"):
            from_dict(Config, fault_matrix.config(cell, Path("run"), Path("data")))


def test_the_docs_table_is_the_rules():
    doc = (REPO / "docs" / "spikes.md").read_text()
    table = doc.split("<!-- fault-outcomes -->\n")[1].split("\n<!-- /fault-outcomes -->")[0]
    assert table == fault_matrix.outcome_table()
    assert f"{len(fault_matrix.all_cells()):,} cells" in doc
    assert f"a sample of {len(fault_matrix.sample_cells())} cells" in doc


def test_the_papers_default_trains_through_a_skipped_step_seen_by_every_sink(
    tmp_path, tmp_path_factory
):
    """The reproduction that once crashed at the next flush: bf16 with fp32 accumulation at
    ZeRO-1, no mitigation, a NaN loss at step 3 inside a logging window of 4. The run trains
    to its last step; step 3 is in metrics.jsonl, TensorBoard and W&B with a NaN loss, an
    infinite gradient norm (DeepSpeed skipped the update) and spikes/skipped 1."""
    import math

    from train_support import metrics, run_main, tiny_config, wandb_rows, write_config

    pytest.importorskip("wandb", reason="pip install wandb (the dev extras hold it)")
    run = tmp_path / "run"
    cfg = tiny_config(
        run,
        stdlib_data(tmp_path_factory),
        train={"train_iters": 6, "precision": "bf16", "zero_stage": 1},
        spikes={"faults": [{"step": 3, "kind": "nan"}]},
        logging={"log_interval": 4},
    )
    cfg["wandb"] = {"enabled": True, "project": "test", "mode": "offline"}
    r = run_main(
        write_config(tmp_path / "run.yaml", cfg), WANDB_MODE="offline", WANDB_SILENT="true"
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "step 6/6 |" in r.stdout and "step 3 skipped: no update applied" in r.stdout
    rows = metrics(run)
    assert sorted(rows) == [1, 2, 3, 4, 5, 6]
    assert math.isnan(rows[3]["train/loss"]) and rows[3]["train/grad_norm"] == math.inf
    assert rows[3]["spikes/skipped"] == 1.0
    assert all(math.isfinite(rows[s]["train/grad_norm"]) for s in (1, 2, 4, 5, 6))
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run / "tensorboard"), size_guidance={"scalars": 0})
    acc.Reload()
    loss = {e.step: e.value for e in acc.Scalars("train/loss")}
    norm = {e.step: e.value for e in acc.Scalars("train/grad_norm")}
    assert sorted(loss) == sorted(norm) == [1, 2, 3, 4, 5, 6]
    assert math.isnan(loss[3]) and norm[3] == math.inf
    assert [e.step for e in acc.Scalars("spikes/skipped")] == [3]
    logged = {int(row["train/step"]): row for row in wandb_rows(run)}
    assert sorted(logged) == [1, 2, 3, 4, 5, 6]
    assert math.isnan(logged[3]["train/loss"]) and logged[3]["train/grad_norm"] == math.inf
    assert logged[3]["spikes/skipped"] == 1.0
