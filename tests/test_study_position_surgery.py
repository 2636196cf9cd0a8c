"""studies/position_surgery.yaml, the worked example of docs/surgery.md ("Worked example:
position surgery"): 2 full-RoPE base runs, 4 position encodings continued from them and the
same 4 from scratch, two seeds each. Each continued run starts from the base run of its own
seed at that run's last step (a rule keyed on train.seed: the rules see the run's seed),
changes only fields position surgery may change, and trains as many steps in all as its
scratch run; the base runs come first in the study's order."""

from __future__ import annotations

import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest

from pretrain.config import ModelConfig, from_dict
from pretrain.model.position import layer_positions
from pretrain.study import Study, load_study
from pretrain.study.report import baseline_pairs
from pretrain.weights import INIT_FROM_FREE, parse_init_from

REPO = Path(__file__).resolve().parents[1]
VARIANTS = ("rope100", "neox25", "prope25", "nope4")
# variant -> each of the 4 layers' (rotary dims, p-RoPE?); head_dim 32
LAYERS = {
    "rope100": [(32, False)] * 4,
    "neox25": [(8, False)] * 4,
    "prope25": [(8, True)] * 4,
    "nope4": [(32, False)] * 3 + [(0, False)],
}


@pytest.fixture(scope="module")
def study(tmp_path_factory: pytest.TempPathFactory) -> Study:
    """Loaded from a copy holding only the study and the quickstart config: no data needed."""
    root = tmp_path_factory.mktemp("repo")
    (root / "studies").mkdir()
    (root / "configs").mkdir()
    shutil.copy(REPO / "studies" / "position_surgery.yaml", root / "studies")
    shutil.copy(REPO / "configs" / "quickstart.yaml", root / "configs")
    return load_study(root / "studies" / "position_surgery.yaml")


def test_eighteen_runs_bases_first(study: Study) -> None:
    names = [r.name for r in study.runs]
    assert names == (
        ["base_s1", "base_s2"]
        + [f"scratch_{v}_s{s}" for v in VARIANTS for s in (1, 2)]
        + [f"cont_{v}_s{s}" for v in VARIANTS for s in (1, 2)]
    )
    assert [r.config["train"]["seed"] for r in study.runs] == [r.seed for r in study.runs]
    assert study.baseline == {"start": "scratch"}


def test_continued_runs_start_from_their_own_seeds_base(study: Study) -> None:
    by_name = {r.name: r for r in study.runs}
    for run in study.runs:
        init_from = run.config["checkpoint"]["init_from"]
        if run.labels["start"] != "cont":
            assert init_from is None, run.name
            continue
        path, step = parse_init_from(init_from)
        base = by_name[f"base_s{run.seed}"]
        assert path == base.run_dir and step == base.config["train"]["train_iters"], run.name
        assert step % base.config["checkpoint"]["interval"] == 0  # a checkpoint is saved there
        scratch = by_name[run.name.replace("cont_", "scratch_")]
        assert step + run.config["train"]["train_iters"] == scratch.config["train"]["train_iters"]
        # surgery: only the fields init_from lets change differ from the base model
        changed = {k for k, v in run.config["model"].items() if v != base.config["model"][k]}
        assert changed <= set(INIT_FROM_FREE), (run.name, changed)
        # ... and the continued run's model is its scratch run's
        assert run.config["model"] == scratch.config["model"], run.name


def test_layers_get_the_intended_positions(study: Study) -> None:
    for run in study.runs:
        cfg = from_dict(ModelConfig, run.config["model"], "model")
        got = [(p.rotary_dims, p.spectrum == "p_rope") for p in layer_positions(cfg)]
        variant = run.labels.get("pos", "rope100")  # the base runs: full RoPE
        assert got == LAYERS[variant], run.name
        assert cfg.qk_norm and cfg.max_seq_len == run.config["train"]["seq_len"] == 128


def test_report_pairs_each_continued_variant_with_its_scratch_run(study: Study) -> None:
    groups = {r.group: SimpleNamespace(label=r.group, labels=dict(r.labels)) for r in study.runs}
    pairs = {g.label: b.label for g, b in baseline_pairs(list(groups.values()), study.baseline)}
    assert pairs == {f"start=cont,pos={v}": f"start=scratch,pos={v}" for v in VARIANTS}
