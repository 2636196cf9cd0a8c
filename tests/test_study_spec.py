"""Study files (pretrain/study/spec.py, docs/studies.md): the shipped studies write today's
files byte for byte; a study with every feature expands to the runs spelled out here; every
refusal is one line naming the study file, the field or axis, and the fix (exit 2 from the
program)."""

from __future__ import annotations

import copy
import shutil
from pathlib import Path
from typing import Any

import pytest
import yaml

from pretrain.cli.study import main as study_main
from pretrain.errors import UserError
from pretrain.study import StudyError, load_study
from pretrain.study.write import study_files

REPO = Path(__file__).resolve().parents[1]


def checkout(tmp_path: Path) -> Path:
    """A repository with the model presets a study inherits; studies go in its studies/."""
    shutil.copytree(REPO / "configs" / "models", tmp_path / "configs" / "models")
    (tmp_path / "studies").mkdir()
    return tmp_path


def write_study_file(repo: Path, data: dict[str, Any] | str, name: str = "s") -> Path:
    path = repo / "studies" / f"{name}.yaml"
    path.write_text(data if isinstance(data, str) else yaml.safe_dump(data, sort_keys=False))
    return path


# ----------------------------------------------------------------------------- shipped studies


def test_shipped_studies_write_todays_files_byte_for_byte():
    """The paper's 50 configs and job scripts, the 19 character-level configs: what the
    study files write is what is checked in, and they are all of configs/paper, configs/char
    and the run scripts of slurm/."""
    written: dict[str, str] = {}
    for name in ("partial_rope", "char_theta", "nanogpt_rope_enwik8"):
        written.update(study_files(load_study(REPO / "studies" / f"{name}.yaml")))
    on_disk = {
        p.relative_to(REPO).as_posix()
        for folder in ("configs/paper", "configs/char")
        for p in (REPO / folder).glob("*.yaml")
    }
    on_disk |= {
        p.relative_to(REPO).as_posix()
        for p in (REPO / "slurm").glob("*.sh")
        if p.name not in ("launch.sh", "submit.sh", "evaluate.sh", "env.sh")
    }
    assert set(written) == on_disk
    for rel, text in written.items():
        assert (REPO / rel).read_text() == text, rel
    paper = load_study(REPO / "studies" / "partial_rope.yaml")
    assert len(paper.runs) == 50 and paper.baseline == {"rope": "100"}
    run = next(r for r in paper.runs if r.name == "llama1b_seq8192_rope0_qknorm")
    assert run.description == "Llama-1B, NoPE + QK-Norm, seq 8192, FineWeb"
    assert run.labels == {
        "model": "llama1b",
        "data": "fineweb",
        "seq": "8192",
        "rope": "0",
        "qknorm": "on",
    }
    assert run.config["train"]["micro_batch_size"] == 16  # the rule's table
    eight = next(r for r in paper.runs if r.name == "llama8b_rope10")
    assert eight.config["train"]["micro_batch_size"] == 4  # the axis value beats the rule
    assert eight.slurm.signal_margin_s == 900  # the grid's own Slurm change


# ----------------------------------------------------------------------------- every feature

EVERY_FEATURE = """
description: every feature
config:
  inherit: {model: configs/models/gpt_char.yaml}
  model: {vocab_size: 65, rope_theta: 10000, max_seq_len: 256}
  data: {train: [data/a], valid: [data/a]}
  optim: {lr: 1.0e-3}
  train: {train_iters: 10, global_batch_size: 64, micro_batch_size: 8, seq_len: 128}
  logging: {run_dir: set-by-layout}
rules:
  model.max_seq_len: {train.seq_len: {64: 128, 128: 256}}
  train.global_batch_size: {train.seq_len: {64: 128, 128: 64}}  # 8192 tokens per step
  train.micro_batch_size: {train.seq_len: {64: 16, 128: 8}}
  train.eval_iters: train.train_iters  # a copy
axes:
  corpus:  # keys moved together
    keys: [data.train, data.valid, model.vocab_size]
    values:
      a: [[data/a], [data/a], 65]
      b: [[data/b], [data/b], 27]
  theta:  # labels from the values
    key: model.rope_theta
    values: [500, 10000]
  lr:  # labels given
    key: optim.lr
    values: [1.0e-3, 3.0e-4]
    labels: [hi, lo]
  seq:
    key: train.seq_len
    values: [64, 128]
  size:  # settings per value; `wide` sets the micro batch a rule would derive
    values:
      small: {}
      wide: {model.d_model: 768, train.micro_batch_size: 4}
    text: {small: small model, wide: wide model}
grids:
  - run_name: "{corpus}_t{theta}_{lr}{seq}"
    run_description: "{corpus} at theta {theta}"
    product: [corpus, theta, {zip: [lr, seq]}]
    exclude: [{corpus: b, theta: 500}]
  - run_name: "wide_{corpus}"
    run_description: "{size.text} on {corpus}"
    product: [{corpus: a}, {size: wide}]
    slurm: {time: "2:00:00"}
exclude: [{corpus: b, lr: lo}]
seeds: [1, 2]
baseline: {theta: 10000}
layout:
  config: "configs/every/{stem}.yaml"
  script: "slurm/every/{name}.sh"
  run_dir: "runs/every/{name}"
  job_name: "every_{name}"
slurm: {nodes: 1, gpus_per_node: 2, cpus_per_task: null, exclusive: false, mem: null,
        time: "1:00:00", signal_margin_s: 60}
"""


def test_every_axis_feature_expands_to_the_expected_runs(tmp_path):
    repo = checkout(tmp_path)
    study = load_study(write_study_file(repo, EVERY_FEATURE))
    groups = ["a_t500_hi64", "a_t500_lo128", "a_t10000_hi64", "a_t10000_lo128", "b_t10000_hi64"]
    groups.append("wide_a")
    assert [r.name for r in study.runs] == [f"{g}_s{s}" for g in groups for s in (1, 2)]
    assert study.baseline == {"theta": "10000"} and study.seeds == (1, 2)
    by = {r.name: r for r in study.runs}

    r = by["a_t500_lo128_s2"]
    assert r.labels == {"corpus": "a", "theta": "500", "lr": "lo", "seq": "128"}
    assert r.group == "corpus=a,theta=500,lr=lo,seq=128" and r.seed == 2
    assert r.description == "a at theta 500"
    # The seeds of a group share its config; each gets its seed and run folder as --set.
    assert r.config_path == "configs/every/a_t500_lo128.yaml"
    assert r.overrides == ("train.seed=2", "logging.run_dir=runs/every/a_t500_lo128_s2")
    assert (r.run_dir, r.job_name) == ("runs/every/a_t500_lo128_s2", "every_a_t500_lo128_s2")
    assert r.script_path == "slurm/every/a_t500_lo128_s2.sh"
    c = r.config
    assert (c["model"]["rope_theta"], c["optim"]["lr"], c["train"]["seq_len"]) == (500, 3e-4, 128)
    assert (c["train"]["seed"], c["logging"]["run_dir"]) == (2, r.run_dir)
    # Rules: the tables' 64 sequences of 128 tokens and micro batch, max_seq_len 2 x 128, a copy.
    t = c["train"]
    assert (t["global_batch_size"], t["micro_batch_size"], c["model"]["max_seq_len"]) == (
        64,
        8,
        256,
    )
    assert t["eval_iters"] == t["train_iters"] == 10
    assert r.slurm.time == "1:00:00" and r.slurm.ranks == 2
    # The file holds the group's run folder and the base's seed; paths from its own folder.
    assert r.config_file["inherit"] == {"model": "../models/gpt_char.yaml"}
    assert r.config_file["logging"] == {"run_dir": "runs/every/a_t500_lo128"}
    assert "seed" not in r.config_file["train"]
    assert list(r.config_file) == ["inherit", "model", "data", "optim", "train", "logging"]

    r = by["b_t10000_hi64_s1"]  # keys moved together; seq 64 -> 128 sequences of 64
    c = r.config
    assert (c["data"]["train"], c["data"]["valid"], c["model"]["vocab_size"]) == (
        ["data/b"],
        ["data/b"],
        27,
    )
    assert (c["train"]["global_batch_size"], c["train"]["micro_batch_size"]) == (128, 16)

    r = by["wide_a_s1"]  # an axis value beats the rule; the grid's own Slurm time
    assert r.labels == {"corpus": "a", "size": "wide"} and r.description == "wide model on a"
    assert (r.config["model"]["d_model"], r.config["train"]["micro_batch_size"]) == (768, 4)
    assert r.slurm.time == "2:00:00"

    # With {name} in the config's path, every seed has its own file, seed and folder inside.
    text = EVERY_FEATURE.replace('config: "configs/every/{stem}.yaml"', 'config: "c/{name}.yaml"')
    r = load_study(write_study_file(repo, text)).runs[1]
    assert (r.config_path, r.overrides) == ("c/a_t500_hi64_s2.yaml", ())
    assert r.config_file["train"]["seed"] == 2
    assert r.config_file["logging"]["run_dir"] == "runs/every/a_t500_hi64_s2"


def test_a_study_without_slurm_or_axes_is_one_run(tmp_path):
    repo = checkout(tmp_path)
    data = yaml.safe_load(EVERY_FEATURE)
    for k in ("axes", "grids", "exclude", "seeds", "baseline", "slurm", "layout", "rules"):
        del data[k]
    (run,) = load_study(write_study_file(repo, data, "solo")).runs
    assert (run.name, run.script_path, run.config_path) == (
        "solo",
        None,
        "studies/solo/configs/solo.yaml",
    )
    assert (run.run_dir, run.labels, run.group, run.seed) == ("runs/solo/solo", {}, "", None)


# ----------------------------------------------------------------------------- refusals

VALID: dict[str, Any] = {
    "config": {
        "inherit": {"model": "configs/models/gpt_char.yaml"},
        "model": {"vocab_size": 65},
        "data": {"train": ["data/a"], "valid": ["data/a"]},
        "train": {"train_iters": 10, "global_batch_size": 8, "micro_batch_size": 4, "seq_len": 64},
    },
    "axes": {
        "theta": {"key": "model.rope_theta", "values": [500, 10000]},
        "lr": {"key": "optim.lr", "values": [1.0e-3, 3.0e-4], "labels": ["hi", "lo"]},
    },
    "seeds": [1, 2],
    "slurm": {"nodes": 1, "gpus_per_node": 2, "time": "1:00:00", "signal_margin_s": 60},
}


def _set(path: str, value: Any):
    def edit(d: dict) -> None:
        *parents, last = path.split("/")
        for p in parents:
            d = d[p]
        if value is DELETE:
            del d[last]
        else:
            d[last] = value

    return edit


DELETE = object()

# (id, change to VALID, what the line names, the fix it says)
REFUSALS = [
    (
        "unknown-field",
        _set("axis", {}),
        "unknown key axis (did you mean axes?)",
        "known keys of the study file: ",
    ),
    (
        "unknown-axis-field",  # inside a mapping of named sections
        _set("axes/theta/kye", 1),
        "unknown key axes.theta.kye (did you mean axes.theta.key?)",
        "known keys of axes.theta: key, keys, values, labels, text",
    ),
    (
        "unknown-field-beside-a-bad-value",  # the mistake to report is the key
        _set("slurm", {"nodes": 0, "nodse": 1}),
        "unknown key slurm.nodse (did you mean slurm.nodes?)",
        "known keys of slurm: nodes, gpus_per_node",
    ),
    ("seeds-empty", _set("seeds", []), "seeds=[] has the wrong number of items", "docs"),
    ("seeds-not-a-list", _set("seeds", {"values": [1]}), "seeds={'values': [1]}", "docs"),
    ("axis-not-a-mapping", _set("axes/theta", 5), "axes.theta=5 must be a mapping", "docs"),
    ("no-config", _set("config", DELETE), "config: missing", "give the base config"),
    (
        "inherit-missing-file",
        _set("config/inherit", {"model": "configs/models/nope.yaml"}),
        "config inherit: config file not found: ",
        "give paths relative to the repository root",
    ),
    (
        "inherit-not-a-path",
        _set("config/inherit", 5),
        "config inherit: ",
        "give paths relative to the repository root",
    ),
    (
        "unknown-config-key",
        _set("axes/theta/key", "model.rope_thetta"),
        "axis theta: unknown config key model.rope_thetta (did you mean model.rope_theta?)",
        "fix the axis's key",
    ),
    (
        "value-the-config-refuses",
        _set("axes/mb", {"key": "train.micro_batch_size", "values": [4, "x"]}),
        "run theta500_lrhi_mbx_s1 (axis mb (x)): train.micro_batch_size='x' must be an integer",
        "fix the axis mb",
    ),
    (
        "two-runs-one-name",
        _set("run_name", "theta{theta}"),
        "run_name: the runs theta=500,lr=hi and theta=500,lr=lo are both named theta500_s1",
        "put every axis that varies in run_name",
    ),
    (
        "empty-grid",
        _set("exclude", [{"theta": [500, 10000]}]),
        "grid: no runs: every combination is excluded",
        "loosen exclude: or add values",
    ),
    (
        "exclusion-matching-nothing",
        lambda d: d.update(product=[{"theta": 500}, "lr"], exclude=[{"theta": 10000}]),
        "exclude[0]: matches no run",
        "fix its labels or remove it",
    ),
    (
        "unknown-axis",
        _set("product", ["theta", "rate"]),
        "grid product: unknown axis 'rate'",
        "define it under axes:",
    ),
    (
        "unknown-label",
        _set("product", [{"theta": 700}, "lr"]),
        "grid product axis theta: no value labelled '700'",
        "use one of 500, 10000",
    ),
    (
        "zip-lengths",
        lambda d: d.update(product=[{"zip": ["theta", {"lr": ["hi"]}]}]),
        "grid product zip: the zipped axes have different numbers of values theta: 2, lr: 1",
        "give every zipped axis the same number of values",
    ),
    (
        "label-twice",
        _set("axes/theta/values", [500, 500]),
        "axis theta: label '500' appears twice",
        "give every value its own label",
    ),
    (
        "labels-count",
        _set("axes/lr/labels", ["hi"]),
        "axis lr: 1 labels for 2 values",
        "give one label per value",
    ),
    (
        "keys-together-count",
        _set("axes/data", {"keys": ["data.train", "data.valid"], "values": {"a": [["data/a"]]}}),
        "axis data value a: [['data/a']] is not a list of 2 values for data.train, data.valid",
        "give one value per key",
    ),
    (
        "rule-unknown-key",
        _set("rules", {"train.global_batch": 64}),
        "rule train.global_batch: unknown config key train.global_batch (did you mean train.global_batch_size?)",
        "fix the rule's key",
    ),
    (
        "rule-unknown-name",
        _set("rules", {"train.global_batch_size": "tokens / train.seq_len"}),
        "rule train.global_batch_size: unknown config key tokens / train.seq_len",
        "a rule copies another config key, or looks its value up in a table",
    ),
    (
        "rule-table-miss",
        _set("rules", {"train.micro_batch_size": {"train.seq_len": {128: 4}}}),
        "run theta500_lrhi_s1 rule train.micro_batch_size: train.seq_len=64 is not in its table (128)",
        "add it to the table",
    ),
    (
        "rule-not-whole",
        _set("rules", {"train.global_batch_size": {"train.seq_len": {64: 15.625}}}),
        "run theta500_lrhi_s1 (rule train.global_batch_size): train.global_batch_size=15.625 must be an integer",
        "fix the rule",
    ),
    ("seeds-repeat", _set("seeds", [1, 1]), "seeds: [1, 1] repeats a seed", "list each seed once"),
    (
        "slurm-partition",
        _set("slurm/partition", "gpu"),
        "slurm.partition: cluster options stay out of the study",
        "SBATCH_PARTITION in the environment",
    ),
    (
        "slurm-max-running",
        _set("slurm/max_running", 0),
        "slurm.max_running=0 must be >= 1",
        "see docs/studies.md",
    ),
    (
        "layout-cannot-hold-the-batch",
        _set("slurm/nodes", 3),
        "run theta500_lrhi_s1 (config) on 6 ranks of the Slurm layout: train.global_batch_size=8 is not divisible",
        "fix the config or the Slurm layout",
    ),
    (
        "signal-margin",
        _set("slurm/signal_margin_s", 3600),
        "slurm.signal_margin_s=3600 is not below slurm.time=1:00:00",
        "lengthen time or shorten signal_margin_s",
    ),
    (
        "slurm-time-form",
        _set("slurm/time", "1h"),
        "slurm.time='1h' has the wrong form (MM, HH:MM:SS or D-HH:MM:SS)",
        "see docs/studies.md",
    ),
    (
        "template-field",
        _set("layout", {"run_dir": "runs/{nam}"}),
        "layout run_dir: {nam} is not known here (did you mean name?)",
        "use {study}",
    ),
    (
        "two-groups-one-config",
        _set("layout", {"config": "configs/x/{theta}.yaml"}),
        "run theta500_lrlo_s1: writes the config configs/x/500.yaml of another group",
        "put {name} or {stem} in layout config",
    ),
    (
        "baseline-label",
        _set("baseline", {"theta": 7}),
        "baseline axis theta: no value labelled '7'",
        "use one of 500, 10000",
    ),
]


@pytest.mark.parametrize("change, names, fix", [pytest.param(*c[1:], id=c[0]) for c in REFUSALS])
def test_a_bad_study_is_refused_in_one_line(tmp_path, change, names, fix):
    repo = checkout(tmp_path)
    data = copy.deepcopy(VALID)
    change(data)
    path = write_study_file(repo, data)
    with pytest.raises(StudyError) as e:
        load_study(path)
    line = str(e.value)
    assert isinstance(e.value, UserError) and "\n" not in line
    assert line.startswith(f"{path}: "), line
    assert names in line, line
    assert fix in line.split("; ")[-1] or fix in line, line


def test_unreadable_study_files(tmp_path):
    repo = checkout(tmp_path)
    with pytest.raises(StudyError, match=r"nope.yaml: no such study file; check the path"):
        load_study(repo / "studies" / "nope.yaml")
    path = write_study_file(repo, "axes: [\n")
    with pytest.raises(StudyError, match=r"s.yaml:2:1: not valid YAML"):
        load_study(path)
    path = write_study_file(repo, "- a list\n")
    with pytest.raises(StudyError, match="the top level must be a mapping"):
        load_study(path)


def test_the_program_says_one_line_and_exits_2(tmp_path, capsys):
    repo = checkout(tmp_path)
    data = copy.deepcopy(VALID)
    data["axes"]["theta"]["key"] = "model.rope_thetta"
    path = write_study_file(repo, data)
    for command in ("plan", "write"):
        assert study_main([command, str(path)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1
        assert err.startswith(f"study error: {path}: axis theta: unknown config key")
    assert not (repo / "studies" / "s").exists()  # nothing written
    with pytest.raises(SystemExit) as e:
        study_main(["write", str(path), "--max-running", "2"])
    assert e.value.code == 2
    assert "--max-running needs --array" in capsys.readouterr().err
