"""Run cells of the fault matrix (tests/fault_matrix.py) on this rank, one after another in
one process group: `python tests/fault_cells.py CELLS.json DATA ROOT OUT.jsonl`, on 1 or 2
ranks (tests/test_train_faults.py launches it). Each cell is a whole run and its resume, with
its own run folder under ROOT; rank 0 appends what it saw of each cell to OUT, one JSON line
per cell, as each ends (a line per cell so far survives a crash of a later one)."""

from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path

import fault_matrix


def main(cells_file: str, data: str, root: str, out: str) -> int:
    from pretrain.train import distributed as dist_utils

    env = dist_utils.setup_env()
    cells = [fault_matrix.Cell(**c) for c in json.loads(Path(cells_file).read_text())]
    for cell in cells:
        log = Path(root) / f"{cell.id}.rank{env.rank}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        with log.open("w") as f, contextlib.redirect_stdout(f), contextlib.redirect_stderr(f):
            seen = fault_matrix.run_cell(cell, Path(root), Path(data))
        if env.rank == 0:
            with open(out, "a") as f:
                f.write(json.dumps(seen) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
