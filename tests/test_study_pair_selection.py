"""studies/pair_selection.yaml and its base study (docs/pair_selection.md, "Which pairs to
keep, compared"): each continued run starts from its own seed's full-RoPE base run at the
base's last step, with the base model but for `rope_pairs`; each `usage` run reads its own
seed's base map; each selection resolves to the pairs its strategy names (written here from
the definitions), and the study loads before any base run or map exists."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from pretrain.study import Study, load_study
from pretrain.weights import parse_init_from

REPO = Path(__file__).resolve().parents[1]
STRATEGIES = ("high", "low", "uniform", "usage")


@pytest.fixture(scope="module")
def studies(tmp_path_factory: pytest.TempPathFactory) -> tuple[Study, Study]:
    """Both studies from a copy holding only them and the quickstart: no run, map or data."""
    root = tmp_path_factory.mktemp("repo")
    (root / "studies").mkdir()
    (root / "configs").mkdir()
    for name in ("pair_selection_base.yaml", "pair_selection.yaml"):
        shutil.copy(REPO / "studies" / name, root / "studies")
    shutil.copy(REPO / "configs" / "quickstart.yaml", root / "configs")
    return tuple(
        load_study(root / "studies" / f"{n}.yaml")
        for n in ("pair_selection_base", "pair_selection")
    )  # type: ignore[return-value]


def test_the_runs_and_where_each_starts(studies: tuple[Study, Study]) -> None:
    base_study, study = studies
    bases = {r.seed: r for r in base_study.runs}
    assert sorted(bases) == [1, 2] and len(study.runs) == 2 * (9 + 8)
    for run in study.runs:
        start, pos, seed = run.labels["start"], run.labels["pos"], run.seed
        base = bases[seed]
        pairs = run.config["model"]["rope_pairs"]
        assert run.config["model"] | {"rope_pairs": None} == base.config["model"], run.name
        if start == "cont":
            path, step = parse_init_from(run.config["checkpoint"]["init_from"])
            assert path == base.run_dir and step == base.config["train"]["train_iters"]
            assert step % base.config["checkpoint"]["interval"] == 0
        else:  # from scratch on as many tokens as base + continued
            assert run.config["checkpoint"]["init_from"] is None and pos != "full"
            cont = next(r for r in study.runs if r.name == run.name.replace("scratch", "cont"))
            assert run.config["train"]["train_iters"] == (
                base.config["train"]["train_iters"] + cont.config["train"]["train_iters"]
            )
        strategy, k = pairs["strategy"], pairs["pairs"]
        if pos == "full":
            assert (strategy, k) == ("high", 16)  # all 16 pairs: full RoPE
            continue
        assert pos == f"{strategy}{k}" and strategy in STRATEGIES and k in (2, 4)
        if strategy == "usage":  # read when the run starts: the map of its own seed's base
            assert pairs["selected"] is None
            assert pairs["usage_map"] == f"{base.run_dir}/frequency_use/frequency_use.json"
            continue
        want = {
            "high": list(range(k)),
            "low": list(range(16 - k, 16)),
            "uniform": [0, 8] if k == 2 else [0, 4, 8, 12],
        }[strategy]
        assert pairs["usage_map"] is None
        assert pairs["selected"] == [[want, want]] * 4, run.name  # 4 layers x 2 KV heads
