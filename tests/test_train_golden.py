"""Golden numbers: a fixed tiny CPU run gives exactly the losses and grad norms recorded in
tests/golden/tiny_run.json, on 1 rank and on 2 ranks (30 steps, an evaluation every 10 steps,
a checkpoint at 15). A refactor of the training loop must leave them bit-identical; a change
that alters the numerics on purpose regenerates the file and says why in its commit:

    .venv/bin/python tests/test_train_golden.py --write
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import pytest
from train_support import metrics, prepare_stdlib, run_main, tiny_config, write_config

GOLDEN = Path(__file__).parent / "golden" / "tiny_run.json"
KEYS = ("train/loss", "train/grad_norm", "valid/loss")


def golden_run(root: Path, nproc: int) -> dict[str, dict[str, float]]:
    data = prepare_stdlib(root / "data")
    run = root / f"run{nproc}"
    cfg = tiny_config(
        run,
        data,
        train={"train_iters": 30, "eval_interval": 10},
        checkpoint={"interval": 15, "keep_last": 1},
        logging={"log_interval": 5},
    )
    r = run_main(write_config(root / f"run{nproc}.yaml", cfg), nproc=nproc, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert (run / "checkpoints" / "step_0000030").is_dir()
    return {str(step): {k: row[k] for k in KEYS if k in row} for step, row in metrics(run).items()}


@pytest.mark.parametrize("nproc", [1, 2])
def test_losses_equal_the_golden_file(tmp_path, nproc):
    want = json.loads(GOLDEN.read_text())[str(nproc)]
    got = golden_run(tmp_path, nproc)
    assert sorted(got, key=int) == [str(s) for s in range(1, 31)]
    assert [s for s in got if "valid/loss" in got[s]] == ["10", "20", "30"]
    for step in want:  # bit-identical: floats compared exactly, step by step
        assert got[step] == want[step], f"step {step} ({nproc} rank(s))"


if __name__ == "__main__":
    if sys.argv[1:] != ["--write"]:
        sys.exit(__doc__)
    with tempfile.TemporaryDirectory() as tmp:
        out = {str(n): golden_run(Path(tmp), n) for n in (1, 2)}
    GOLDEN.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {GOLDEN}")
