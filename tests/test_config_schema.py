"""The config as one schema (issue 42): every config and study resolves as before the schema
was pydantic, the published JSON Schemas and docs tables are the code's, what the file alone
decides is refused as it is read, and what needs the machine only when a run starts."""

from __future__ import annotations

import gzip
import json
import math
import subprocess
import sys

import jsonschema
import pytest
import referencing
import yaml
from resolved_configs import RECORD, REPO, resolve_all

from pretrain.cli.config_schema import json_schemas
from pretrain.cli.config_schema import main as config_schema
from pretrain.config import Config, ConfigError, from_dict, load_config
from pretrain.preflight import preflight


def _flat(d: object, prefix: str = "") -> dict[str, object]:
    if not isinstance(d, dict):
        return {prefix: d}
    out: dict[str, object] = {}
    for k, v in d.items():
        out.update(_flat(v, f"{prefix}.{k}" if prefix else k))
    return out


# Fields added since the record, at their defaults (a config that sets them is new too):
# llama3 RoPE scaling's (issue 44), the straggler line's (issue 45).
ADDED_SINCE_RECORD = {
    "rope_scaling.low_freq_factor": 1.0,
    "rope_scaling.high_freq_factor": 4.0,
    "train.straggler_fraction": 0.5,
    "train.straggler_steps": 3,
    "model.head_dim": None,
}


def _added(key: str, value) -> bool:
    return any(key.endswith(k) and value == v for k, v in ADDED_SINCE_RECORD.items())


def test_every_config_and_study_run_resolves_as_recorded_before_the_schema():
    """tests/data/resolved_configs.json.gz was recorded with the dataclass loader (commit
    e332bc0): every field of the 77 configs and of every run of the five studies, and the file
    `write` gives each run; fields added since (ADDED_SINCE_RECORD) at their defaults."""
    with gzip.open(RECORD, "rt") as f:
        before = json.load(f)
    now = resolve_all()
    assert set(before) <= set(now)  # every recorded run resolves; studies added since are new
    diffs = [
        f"{name}: {key} {a.get(key, '<absent>')!r} -> {b.get(key, '<absent>')!r}"
        for name in before
        for a, b in [(_flat(before[name]), _flat(now[name]))]
        for key in sorted(set(a) | set(b))
        if a.get(key, "<absent>") != b.get(key, "<absent>")
        and not (key not in a and _added(key, b.get(key)))
    ]
    assert not diffs, "\n".join(diffs[:20])
    assert len(before) == 77 + 121  # configs, then the studies' runs


def test_the_resolved_config_keeps_its_key_order():
    """RUN/config.yaml is dumped in the schema's order (sort_keys=False): the sections, then
    each section's fields, as the dataclasses had them."""
    from pretrain.config import to_dict

    keys = list(to_dict(Config()))
    assert keys == [
        "model", "data", "optim", "schedule", "train", "checkpoint", "logging", "spikes",
        "wandb", "downstream", "callbacks",
    ]  # fmt: skip
    assert list(to_dict(Config())["checkpoint"])[-1] == "async"


def test_the_published_schemas_and_docs_tables_are_the_codes(tmp_path):
    assert config_schema(["--check"]) == 0
    # The check fails when a table drifts: a copy of the docs with one meaning changed.
    for rel in ("docs/configuration.md", "schemas/config.schema.json"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text((REPO / rel).read_text())
    for name in ("model", "study"):
        (tmp_path / f"schemas/{name}.schema.json").write_text(
            (REPO / f"schemas/{name}.schema.json").read_text()
        )
    doc = tmp_path / "docs/configuration.md"
    text = doc.read_text()
    assert text.count("| peak learning rate ") == 1
    doc.write_text(text.replace("| peak learning rate ", "| the learning rate  "))
    assert config_schema(["--check", "--repo", str(tmp_path)]) == 1
    assert config_schema(["--repo", str(tmp_path)]) == 0
    assert config_schema(["--check", "--repo", str(tmp_path)]) == 0


def _registry() -> referencing.Registry:
    return referencing.Registry().with_resources(
        (name, referencing.Resource.from_contents(schema))
        for name, schema in json_schemas().items()
    )


def _validator(name: str) -> jsonschema.Draft202012Validator:
    schema = json_schemas()[name]
    return jsonschema.Draft202012Validator(schema, registry=_registry())


def test_an_editor_validates_every_shipped_file_with_the_json_schemas():
    """What the YAML language server does with schemas/*.schema.json: every file under
    configs/ and studies/ is valid as written (with its `inherit:`), and a typo is not."""
    run, model, study = (_validator(f"{n}.schema.json") for n in ("config", "model", "study"))
    for path in sorted((REPO / "configs").rglob("*.yaml")):
        data = yaml.safe_load(path.read_text())
        v = model if path.parent.name == "models" else run
        errors = [e.message for e in v.iter_errors(data)]
        assert not errors, (path, errors[:3])
    for path in sorted((REPO / "studies").glob("*.yaml")):
        errors = [e.message for e in study.iter_errors(yaml.safe_load(path.read_text()))]
        assert not errors, (path, errors[:3])
    bad = {"train": {"micro_batch_sise": 4}, "optim": {"lr": "fast"}}
    assert len(list(run.iter_errors(bad))) == 2
    assert list(study.iter_errors({"config": {"trian": {}}, "axis": {}}))


# ----------------------------------------------------------------------------- refusals

BAD = [
    ({"train": {"seed": -1}}, "train.seed=-1 is not a seed NumPy can take"),
    ({"train": {"seed": 2**32}}, "train.seed=4294967296 is not a seed NumPy can take"),
    ({"train": {"micro_batch_size": 0}}, "train.micro_batch_size=0 must be a positive integer"),
    ({"model": {"n_layers": -2}}, "model.n_layers=-2 must be a positive integer"),
    ({"train": {"seq_len": 0}}, "train.seq_len=0 must be a positive integer"),
    ({"optim": {"lr": math.nan}}, "optim.lr=nan must be a number, not NaN"),
    ({"optim": {"lr": "nan"}}, "optim.lr='nan' must be a number, not NaN"),
    ({"optim": {"lr": [1e-3]}}, "optim.lr=[0.001] must be a number"),
    ({"model": {"d_model": {"x": 1}}}, "model.d_model={'x': 1} must be an integer"),
    ({"data": {"train": {"a": 1}}}, "data.train={'a': 1} must be a list"),
    ({"logging": {"sample_prompts": "hi"}}, "logging.sample_prompts='hi' must be a list"),
    (
        {"train": {"compile": "yes"}},
        "train.compile='yes' has the wrong type; expected bool or 'auto'",
    ),
    ({"checkpoint": {"async": 1}}, "checkpoint.async=1 must be true or false"),
    ({"downstream": {"tasks": ["piqq"]}}, "downstream.tasks: unknown task 'piqq'"),
    ({"spikes": {"faults": [{"step": 3, "kind": "boom"}]}}, "spikes.faults[0].kind='boom'"),
    ({"spikes": {"faults": [{"kind": "nan"}]}}, "spikes.faults[0].step is missing"),
    (
        {"model": {"rope_scaling": {"factor": "x"}}},
        "model.rope_scaling.factor='x' must be a number",
    ),
]


@pytest.mark.parametrize("sections,line", BAD, ids=[b[1][:40] for b in BAD])
def test_what_the_file_alone_decides_is_refused_as_it_is_read(sections, line):
    with pytest.raises(ConfigError) as e:
        from_dict(Config, sections, "")
    assert line in str(e.value) and "\n" not in str(e.value)


def test_a_study_refuses_a_seed_numpy_cannot_take_before_writing_anything(tmp_path):
    from pretrain.study import StudyError, load_study

    study = tmp_path / "studies" / "s.yaml"
    study.parent.mkdir()
    base = {"model": {"n_layers": 2, "d_model": 32, "n_heads": 4, "d_ff": 64, "max_seq_len": 32}}
    base["train"] = {"global_batch_size": 4, "micro_batch_size": 4, "train_iters": 2}
    for seeds, bad, line in (
        ([7, -1], "seeds", "run s_s-1 (config): train.seed=-1 is not a seed NumPy can take"),
        ([1], "config", "train.micro_batch_size=0 must be a positive integer"),
        ([1], "lr", "optim.lr=nan must be a number, not NaN"),
    ):
        config = (
            dict(base, train={**base["train"], "micro_batch_size": 0}) if bad == "config" else base
        )
        spec = {"config": config, "seeds": seeds}
        if bad == "lr":
            spec["axes"] = {"lr": {"key": "optim.lr", "values": [math.nan], "labels": ["nan"]}}
        study.write_text(yaml.safe_dump(spec))
        with pytest.raises(StudyError) as e:
            load_study(study)
        assert line in str(e.value) and "\n" not in str(e.value), str(e.value)


GPU_STUDY = """
description: a GPU-only study
config:
  model: {n_layers: 2, d_model: 64, n_heads: 4, d_ff: 128, max_seq_len: 64}
  data: {train: [data/nowhere]}
  train: {global_batch_size: 8, micro_batch_size: 4, train_iters: 4, seq_len: 64, fp8: tensorwise, compile: true}
axes:
  fp8: {key: train.fp8, values: [tensorwise, rowwise]}
slurm: {nodes: 1, gpus_per_node: 2, time: "1:00:00", signal_margin_s: 60}
"""


@pytest.mark.skipif(
    __import__("torch").cuda.is_available(), reason="shows the refusal on a machine without CUDA"
)
def test_a_gpu_study_plans_writes_and_submits_from_a_cpu_machine_and_its_run_is_refused_there(
    tmp_path, monkeypatch, capsys
):
    """fp8 and compile need a GPU and a compiler: the preflight's, when the run starts; the
    study on a CPU login node is planned and written all the same."""
    from pretrain.cli.study import main as study
    from pretrain.cli.train import main as train

    (tmp_path / "studies").mkdir()
    path = tmp_path / "studies" / "gpu.yaml"
    path.write_text(GPU_STUDY)
    monkeypatch.chdir(tmp_path)
    assert study(["plan", str(path)]) == 0
    assert study(["write", str(path)]) == 0
    # `submit` loads the study the same way (what refused it before was load_study); it
    # needs a Slurm to ask, which only the slurm-marked tests start.
    out = capsys.readouterr().out
    assert "fp8tensorwise" in out and "wrote studies/gpu/slurm/fp8tensorwise.sh" in out, out
    config = tmp_path / "studies/gpu/configs/fp8tensorwise.yaml"
    assert load_config(config).train.fp8 == "tensorwise"
    # The same run, started here: one line, exit 2, before anything is built.
    assert train(["--config", str(config)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "train.fp8=tensorwise needs a CUDA GPU" in err[0], err
    with pytest.raises(ConfigError, match=r"train.fp8=tensorwise needs a CUDA GPU"):
        preflight(load_config(config), world_size=2, check_data=False)


def test_reading_a_study_or_a_config_imports_no_torch():
    code = (
        "import sys\n"
        "from pretrain.study import load_study\n"
        "from pretrain.config import load_config\n"
        "load_study('studies/partial_rope.yaml')\n"
        "load_config('configs/paper/llama1b_rope10.yaml')\n"
        "heavy = sorted(m for m in ('torch', 'deepspeed', 'numpy') if m in sys.modules)\n"
        "print(','.join(heavy))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "", out.stdout


def test_study_write_check_and_status_of_the_paper_study_need_no_trace(tmp_path):
    """`write --check` and `status` read files only: no planner, no torch (their time is
    docs/studies.md's)."""
    code = (
        "import sys\n"
        "from pretrain.cli.study import main\n"
        "rc = main(['write', 'studies/partial_rope.yaml', '--check'])\n"
        "print(rc, 'torch' in sys.modules)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True
    )
    assert out.stdout.split()[-2:] == ["0", "False"], out.stdout + out.stderr
