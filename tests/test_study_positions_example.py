"""studies/positions_example.yaml, the worked example of docs/length_generalisation.md
("Worked example: five position encodings compared"): it validates and expands into 5
position encodings x 2 seeds on the quickstart's model, each run differing from full RoPE only in its position fields, and the
NoPE arm's every-4th layer exists in the quickstart's 4 layers."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from pretrain.config import ModelConfig, from_dict
from pretrain.model.position import layer_positions
from pretrain.study import Study, load_study

REPO = Path(__file__).resolve().parents[1]

# arm -> the model fields it sets on top of the quickstart's (everything else equal)
POSITION_FIELDS = {
    "rope100": {"rope_fraction": 1.0, "rope_spectrum": "neox", "nope_every": None, "alibi": False},
    "neox25": {"rope_fraction": 0.25, "rope_spectrum": "neox", "nope_every": None, "alibi": False},
    "prope25": {
        "rope_fraction": 0.25,
        "rope_spectrum": "p_rope",
        "nope_every": None,
        "alibi": False,
    },
    "nope4": {"rope_fraction": 1.0, "rope_spectrum": "neox", "nope_every": 4, "alibi": False},
    "alibi": {"rope_fraction": 0.0, "rope_spectrum": "neox", "nope_every": None, "alibi": True},
}
# arm -> each of the 4 layers' (rotary dims, p-RoPE?, ALiBi?); head_dim 32
LAYERS = {
    "rope100": [(32, False, False)] * 4,
    "neox25": [(8, False, False)] * 4,
    "prope25": [(8, True, False)] * 4,
    "nope4": [(32, False, False)] * 3 + [(0, False, False)],
    "alibi": [(0, False, True)] * 4,
}


@pytest.fixture(scope="module")
def study(tmp_path_factory: pytest.TempPathFactory) -> Study:
    """Loaded from a copy holding only the study and the quickstart config: no data needed."""
    root = tmp_path_factory.mktemp("repo")
    (root / "studies").mkdir()
    (root / "configs").mkdir()
    shutil.copy(REPO / "studies" / "positions_example.yaml", root / "studies")
    shutil.copy(REPO / "configs" / "quickstart.yaml", root / "configs")
    return load_study(root / "studies" / "positions_example.yaml")


def test_ten_runs_five_arms_two_seeds(study: Study) -> None:
    assert [r.name for r in study.runs] == [
        f"{arm}_s{seed}" for arm in POSITION_FIELDS for seed in (1, 2)
    ]
    assert {r.labels["pos"] for r in study.runs} == set(POSITION_FIELDS)
    assert [r.seed for r in study.runs] == [1, 2] * 5
    assert [r.config["train"]["seed"] for r in study.runs] == [1, 2] * 5
    assert study.baseline == {"pos": "rope100"}
    for run in study.runs:
        assert run.run_dir == f"runs/positions_example/{run.name}"
        assert run.config["logging"]["run_dir"] == run.run_dir


def test_each_arm_changes_only_its_position_fields(study: Study) -> None:
    quickstart = study.runs[0].config["model"]  # full RoPE: the quickstart at fraction 1
    for run in study.runs:
        model = run.config["model"]
        for key, value in POSITION_FIELDS[run.labels["pos"]].items():
            assert model[key] == value, (run.name, key)
        changed = {k for k in model if model[k] != quickstart[k]}
        assert changed <= set(POSITION_FIELDS["rope100"]), (run.name, changed)
        assert model["n_layers"] == 4 and model["d_model"] == 128 and model["n_heads"] == 4
        assert model["max_seq_len"] == run.config["train"]["seq_len"] == 128
        # the training is the same for every arm
        assert run.config["train"]["train_iters"] == study.runs[0].config["train"]["train_iters"]


def test_layers_get_the_intended_positions(study: Study) -> None:
    for run in study.runs[::2]:
        cfg = from_dict(ModelConfig, run.config["model"], "model")
        got = [(p.rotary_dims, p.spectrum == "p_rope", p.alibi) for p in layer_positions(cfg)]
        assert got == LAYERS[run.labels["pos"]], run.name
        assert all(p.attention == "full" for p in layer_positions(cfg))
