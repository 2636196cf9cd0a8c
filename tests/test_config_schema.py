"""The config as one schema (issue 42): every config and study resolves as before the schema
was pydantic, the published JSON Schemas and docs tables are the code's, what the file alone
decides is refused as it is read, and what needs the machine only when a run starts."""

from __future__ import annotations

import copy
import functools
import gzip
import json
import math
import re
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import jsonschema
import pytest
import referencing
import yaml
from resolved_configs import RECORD, REPO, default_of, resolve_all

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


def test_every_config_and_study_run_resolves_as_recorded_before_the_schema():
    """tests/data/resolved_configs.json.gz was recorded with the dataclass loader (commit
    e332bc0): every field of the 77 configs and of every run of the five studies, and the file
    `write` gives each run. A field added since is absent from the record: unchanged where it
    holds its default (a config that sets it is new too, and shows here)."""
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
        and not (key not in a and default_of(key) == (True, b[key]))
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


@functools.cache
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
    # A study's Slurm layout is typed as well: the editor refuses what the loader refuses.
    for slurm in ({"nodes": 0}, {"max_running": 0}, {"array": "yes"}, {"partition": "gpu"}):
        assert list(study.iter_errors({"config": "c.yaml", "slurm": slurm})), slurm
    assert not list(study.iter_errors({"config": "c.yaml", "slurm": {"array": True}}))


# ----------------------------------------------------------------------------- one rule, two places

# Every rule of one field is a constraint of the field (pretrain/schema.py), so the JSON Schema
# an editor checks a file against and the loader refuse the same values.
_BOUND_KEYWORDS = ("minimum", "exclusiveMinimum", "maximum", "exclusiveMaximum")


def _ruled(schema: dict, defs: dict, key: str = "") -> Iterator[tuple[str, dict]]:
    """(dotted key, subschema) of every value below `schema` with a numeric bound or choices:
    a section's fields, a union's members, a list's items (`KEY[0]`), a tuple's places."""
    if "$ref" in schema:
        schema = defs[schema["$ref"].rpartition("/")[2]]
    if any(k in schema for k in (*_BOUND_KEYWORDS, "enum", "const")):
        yield key, schema
    for name, sub in schema.get("properties", {}).items():
        if name != "inherit":
            yield from _ruled(sub, defs, f"{key}.{name}" if key else name)
    for sub in schema.get("anyOf", []):
        yield from _ruled(sub, defs, key)
    if isinstance(schema.get("items"), dict):
        yield from _ruled(schema["items"], defs, f"{key}[0]")
    for i, sub in enumerate(schema.get("prefixItems", [])):
        yield from _ruled(sub, defs, f"{key}[{i}]")


def _edges(rule: dict) -> tuple[list, list]:
    """(values just outside the rule, values it accepts: at an inclusive bound, just inside an
    exclusive one, every choice)."""
    integer = rule.get("type") == "integer"
    outside, inside = [], []
    choices = rule.get("enum", [rule["const"]] if "const" in rule else [])
    if choices:
        inside += choices
        numbers = all(isinstance(c, int) and not isinstance(c, bool) for c in choices)
        outside.append(max(choices) + 1 if numbers else "not-a-choice")
    # keyword: (the accepted value, the refused one), in steps from the bound
    for word, (ok, past) in {
        "minimum": (0, -1),
        "exclusiveMinimum": (1, 0),
        "maximum": (0, 1),
        "exclusiveMaximum": (-1, 0),
    }.items():
        if word in rule:
            bound = rule[word]
            step = 1 if integer else 1e-6 * max(abs(bound), 1)
            inside.append(bound + ok * step)
            outside.append(bound + past * step)
    return outside, inside


# What a value needs from its neighbours to meet the rules across fields (a validator's), so
# that only its own rule decides: KEY (and the keys below it) or KEY=VALUE -> other values.
COMPANIONS: dict[str, dict[str, object]] = {
    "spikes.faults[0]": {"spikes.faults[0].step": 1},  # a fault needs its step
    "spikes.faults[0].seconds": {"spikes.faults[0].kind": "slow"},  # seconds: slow only
    "spikes.faults[0].kind=slow": {"spikes.faults[0].seconds": 1.0},  # slow needs seconds
    "spikes.skip_data[0]": {"spikes.skip_data[0][0]": 1, "spikes.skip_data[0][1]": 1},
    "train.zero_stage": {"train.grad_accum_dtype": "bf16"},  # ZeRO 0: no fp32 accumulation
    "train.hang_timeout_long": {"train.hang_timeout": 0},  # long >= hang_timeout
    "model.d_model": {"model.n_heads": 1},  # d_model divisible by n_heads
    "model.rope_scaling.beta_fast": {"model.rope_scaling.beta_slow": 1e-7},  # fast > slow
    "model.rope_scaling.high_freq_factor": {"model.rope_scaling.low_freq_factor": 1e-7},
    "model.sliding_window_pattern": {"model.sliding_window": 4},
    "model.global_rope_theta": {"model.sliding_window": 4, "model.sliding_window_pattern": 2},
    "model.layer_types[0]": {"model.sliding_window": 4, "model.n_layers": 1},
    # a pair selection of one layer of one 8-dim head (4 pairs), as given or from a strategy
    "model.rope_pairs": {
        "model.n_layers": 1,
        "model.d_model": 8,
        "model.n_heads": 1,
        "model.rope_pairs.selected": [[[0]]],
    },
    "model.rope_pairs.strategy=low": {"model.rope_pairs.selected": [[[3]]]},  # the lowest
    "model.rope_pairs.strategy=usage": {"model.rope_pairs.usage_map": "frequency_use.json"},
    "model.rope_pairs.pairs": {
        "model.rope_pairs.strategy": "high",
        "model.rope_pairs.selected": None,
    },
    "model.rope_pairs.fraction": {
        "model.rope_pairs.strategy": "high",
        "model.rope_pairs.selected": None,
    },
}


def _put(data: dict, key: str, value: object) -> None:
    """Set a dotted key with list places (`spikes.faults[0].step`) in nested data."""
    parts = [int(p) if p.isdigit() else p for p in re.findall(r"[^.\[\]]+", key)]
    node: Any = data
    for part, below in zip(parts, parts[1:], strict=False):
        if isinstance(part, int):
            while len(node) <= part:
                node.append([] if isinstance(below, int) else {})
        else:
            node.setdefault(part, [] if isinstance(below, int) else {})
        node = node[part]
    if isinstance(parts[-1], int):
        while len(node) <= parts[-1]:
            node.append(None)
    node[parts[-1]] = value


def _config_with(key: str, value: object) -> dict:
    data: dict = {}
    for rule, others in COMPANIONS.items():
        if rule == f"{key}={value}" or key == rule or key.startswith((rule + ".", rule + "[")):
            for other, v in others.items():
                _put(data, other, v)
    _put(data, key, value)
    return data


def _verdicts(data: dict) -> tuple[str | None, list[str]]:
    """(the loader's refusal or None, the JSON Schema's errors) for a run config."""
    try:
        from_dict(Config, copy.deepcopy(data), "")
        refused = None
    except ConfigError as e:
        refused = str(e)
    return refused, [e.message for e in _validator("config.schema.json").iter_errors(data)]


def test_the_json_schema_and_the_loader_agree_on_every_single_field_rule():
    """For every field of every section with a numeric bound or choices in the JSON Schema, a
    value just outside is refused by both, and one at the bound (just inside an exclusive
    one) and every choice is accepted by both."""
    schema = json_schemas()["config.schema.json"]
    ruled = list(_ruled(schema, schema["$defs"]))
    keys = {key for key, _ in ruled}
    # The walk reaches every kind of place a rule sits (else this test would prove nothing).
    assert {
        "optim.lr", "schedule.min_lr_ratio", "train.zero_stage", "train.seed",
        "train.activation_checkpointing", "train.hang_timeout", "checkpoint.interval",
        "logging.log_interval", "spikes.window", "spikes.faults[0].step",
        "spikes.faults[0].kind", "spikes.skip_data[0][0]", "data.train_weights[0]",
        "model.rope_scaling.factor", "model.layer_types[0]", "downstream.examples",
    } <= keys, sorted(keys)  # fmt: skip
    assert len(ruled) >= 80, len(ruled)
    # A bound pydantic writes under its own name (`ge`) is one no editor enforces.
    leaked = re.findall(r'"(?:ge|gt|le|lt)": ', json.dumps(json_schemas()))
    assert not leaked, leaked
    wrong = []
    for key, rule in ruled:
        outside, inside = _edges(rule)
        for value, expect in [(v, "refused") for v in outside] + [(v, "ok") for v in inside]:
            refused, errors = _verdicts(_config_with(key, value))
            loader = "refused" if refused else "ok"
            editor = "refused" if errors else "ok"
            if (loader, editor) != (expect, expect):
                wrong.append(
                    f"{key}={value!r}: loader {loader} ({refused}), schema {editor} {errors[:1]}"
                )
    assert not wrong, "\n".join(wrong)


# Rules that were a section validator's only, invisible to the JSON Schema until issue "A field
# in one place for real": the loader's line names the key, the value and what is allowed.
FORMER_VALIDATOR_RULES = [
    ("optim.lr", -1, "optim.lr=-1 must be > 0"),
    ("optim.lr", 0.0, "optim.lr=0.0 must be > 0"),
    ("optim.grad_clip", -0.5, "optim.grad_clip=-0.5 must be >= 0 (0 = no clipping)"),
    ("schedule.warmup_steps", -3, "schedule.warmup_steps=-3 must be >= 0 (steps of warmup)"),
    (
        "schedule.warmup_fraction",
        1.5,
        "schedule.warmup_fraction=1.5 must be in [0, 1] (0.05 = 5% of train_iters)",
    ),
    (
        "schedule.min_lr_ratio",
        2,
        "schedule.min_lr_ratio=2 must be in [0, 1] (0.1 = decay to 10% of optim.lr)",
    ),
    ("train.train_iters", 0, "train.train_iters=0 must be > 0"),
    ("train.global_batch_size", 0, "train.global_batch_size=0 must be > 0"),
    ("train.micro_batch_size", -4, "train.micro_batch_size=-4 must be > 0"),
    ("train.seq_len", 0, "train.seq_len=0 must be > 0 (null = model.max_seq_len)"),
    (
        "train.zero_stage",
        3,
        "train.zero_stage=3 is not allowed; use one of 0, 1, 2 (1 shards optimizer states, "
        "2 also gradients)",
    ),
    ("train.seed", -1, "train.seed=-1 must be in [0, 4294967295] (a seed NumPy can take)"),
    ("train.seed", 2**32, "train.seed=4294967296 must be in [0, 4294967295]"),
    ("train.eval_interval", -1, "train.eval_interval=-1 must be >= 0 (0 = no evaluation)"),
    ("train.eval_iters", -1, "train.eval_iters=-1 must be >= 0 (0 = no evaluation)"),
    ("train.z_loss", -1e-4, "train.z_loss=-0.0001 must be >= 0 (0 = off; PaLM 1e-4)"),
    ("train.hang_timeout", -5, "train.hang_timeout=-5 must be >= 0 (seconds; 0 or null = off)"),
    ("train.hang_timeout_long", -1.0, "train.hang_timeout_long=-1.0 must be >= 0 (seconds;"),
    (
        "train.activation_checkpointing",
        -1,
        "train.activation_checkpointing=-1 must be >= 0 (a number of layers",
    ),
    ("checkpoint.interval", 0, "checkpoint.interval=0 must be > 0"),
    ("checkpoint.keep_last", 0, "checkpoint.keep_last=0 must be > 0"),
    ("logging.log_interval", 0, "logging.log_interval=0 must be > 0"),
    ("logging.max_logit_interval", -1, "logging.max_logit_interval=-1 must be >= 0 (0 = off)"),
    ("spikes.faults[0].step", 0, "spikes.faults[0].step=0 must be >= 1"),
    ("spikes.faults[0].seconds", 0, "spikes.faults[0].seconds=0 must be > 0"),
    ("spikes.faults[0].rank", -1, "spikes.faults[0].rank=-1 must be >= 0"),
    ("spikes.skip_data[0][0]", 0, "spikes.skip_data[0][0]=0 must be >= 1"),
    ("data.train_weights[0]", -1, "data.train_weights[0]=-1 must be >= 0"),
    ("model.vocab_size", 0, "model.vocab_size=0 must be > 0"),
    ("model.n_layers", -2, "model.n_layers=-2 must be > 0"),
    ("model.d_model", 0, "model.d_model=0 must be > 0"),
    ("model.n_heads", 0, "model.n_heads=0 must be > 0"),
    ("model.n_kv_heads", 0, "model.n_kv_heads=0 must be > 0"),
    ("model.head_dim", 0, "model.head_dim=0 must be > 0 (null = d_model / n_heads)"),
    ("model.d_ff", -64, "model.d_ff=-64 must be > 0"),
    ("model.max_seq_len", 0, "model.max_seq_len=0 must be > 0"),
    ("model.rope_fraction", 1.5, "model.rope_fraction=1.5 must be in [0, 1]"),
    ("model.rotary_dims", -2, "model.rotary_dims=-2 must be >= 0"),
    ("model.dropout", 1.0, "model.dropout=1.0 must be in [0, 1)"),
    ("model.attn_logit_softcap", -1, "model.attn_logit_softcap=-1 must be >= 0 (0 = off)"),
    ("model.nope_layers[0]", -1, "model.nope_layers[0]=-1 must be >= 0"),
    ("model.sliding_window", 0, "model.sliding_window=0 must be >= 1"),
    ("model.sliding_window_pattern", 1, "model.sliding_window_pattern=1 must be >= 2"),
    ("model.global_rope_theta", 0, "model.global_rope_theta=0 must be > 0"),
    ("model.rope_scaling.factor", 0.5, "model.rope_scaling.factor=0.5 must be >= 1 (1 = no"),
    (
        "model.rope_scaling.original_max_seq_len",
        0,
        "model.rope_scaling.original_max_seq_len=0 must be > 0",
    ),
    ("model.rope_scaling.beta_slow", 0, "model.rope_scaling.beta_slow=0 must be > 0"),
    ("model.rope_scaling.low_freq_factor", 0, "model.rope_scaling.low_freq_factor=0 must be > 0"),
]


@pytest.mark.parametrize(
    "key,value,line", FORMER_VALIDATOR_RULES, ids=[f"{k}={v}" for k, v, _ in FORMER_VALIDATOR_RULES]
)
def test_a_former_validator_rule_is_refused_by_the_json_schema_too(key, value, line):
    refused, errors = _verdicts(_config_with(key, value))
    assert refused is not None and line in refused and "\n" not in refused, refused
    assert errors, f"the JSON Schema accepts {key}={value!r}"


def test_a_stale_generated_file_fails_the_check_in_one_line_naming_it_and_the_command(
    tmp_path, capsys
):
    """`make lint` runs `tools/config_schema.py --check`: a schema edited by hand fails it."""
    for rel in ("docs/configuration.md", *(f"schemas/{n}" for n in json_schemas())):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text((REPO / rel).read_text())
    path = tmp_path / "schemas/config.schema.json"
    path.write_text(path.read_text().replace('"exclusiveMinimum": 0', '"minimum": 0', 1))
    capsys.readouterr()
    assert config_schema(["--check", "--repo", str(tmp_path)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "schemas/config.schema.json" in err[0], err
    assert "python tools/config_schema.py" in err[0], err
    makefile = (REPO / "Makefile").read_text()
    lint = makefile[makefile.index("\nlint:") :].split("\n\n")[0]
    assert "tools/config_schema.py --check" in lint, lint


# ----------------------------------------------------------------------------- refusals

BAD = [
    ({"train": {"seed": -1}}, "train.seed=-1 must be in [0, 4294967295] (a seed NumPy can take)"),
    ({"train": {"seed": 2**32}}, "train.seed=4294967296 must be in [0, 4294967295]"),
    ({"train": {"micro_batch_size": 0}}, "train.micro_batch_size=0 must be > 0"),
    ({"model": {"n_layers": -2}}, "model.n_layers=-2 must be > 0"),
    ({"train": {"seq_len": 0}}, "train.seq_len=0 must be > 0 (null = model.max_seq_len)"),
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
        ([7, -1], "seeds", "run s_s-1 (config): train.seed=-1 must be in [0, 4294967295]"),
        ([1], "config", "train.micro_batch_size=0 must be > 0"),
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
