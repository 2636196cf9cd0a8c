"""Every error a user can cause ends in one line that names the thing, exit code 2, and no
traceback (issue 13 item 3); PRETRAIN_DEBUG=1 brings the traceback back.

A table of bad inputs over every program: each case is the program, its argv (`{t}` is the
test's tmp_path), a setup that writes the files it needs, and a substring that the one line
must contain. Programs run in-process (`main(argv)`), so the table is fast.
"""

from __future__ import annotations

import importlib
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from train_support import LAUNCH_VARS, REPO, child_env, tiny_config

PROGRAMS = {
    "main": "pretrain.cli.train:main",
    "prepare_data": "pretrain.cli.prepare_data:main",
    "evaluate": "pretrain.cli.evaluate:main",
    "export_hf": "pretrain.cli.export_hf:main",
    "import_hf": "pretrain.cli.import_hf:main",
    "frequency_use": "pretrain.cli.frequency_use:main",
    "compare_runs": "pretrain.cli.compare_runs:main",
    "study": "pretrain.cli.study:main",
    "model_info": "pretrain.cli.model_info:main",
    "rope_cache_size": "pretrain.cli.rope_cache_size:main",
    "plan": "pretrain.cli.plan:main",
    "check_checkpoint": "pretrain.cli.check_checkpoint:main",
    "reshard_checkpoint": "pretrain.cli.reshard_checkpoint:main",
    "train_tokenizer": "pretrain.cli.train_tokenizer:main",
    "benchmark": "pretrain.cli.benchmark:main",
    "prepare_tasks": "pretrain.cli.prepare_tasks:main",
    "passkey": "pretrain.cli.passkey:main",
    "gpu_check": "pretrain.cli.gpu_check:main",
    "config_schema": "pretrain.cli.config_schema:main",
}


# ------------------------------------------------------------------------- setups


def _write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def run_cfg(**sections) -> Callable[[Path], None]:
    """A tiny valid run config at {t}/run.yaml (data: an existing folder) with `sections`
    merged in; a value None deletes the key."""

    def setup(t: Path) -> None:
        (t / "data").mkdir(exist_ok=True)
        cfg = tiny_config(t / "run", t / "data")
        for name, values in sections.items():
            if isinstance(values, dict):
                merged = {**cfg.get(name, {}), **values}
                cfg[name] = {k: v for k, v in merged.items() if v is not None}
            else:
                cfg[name] = values
        _write(t / "run.yaml", yaml.safe_dump(cfg))

    return setup


def text(name: str, content: str) -> Callable[[Path], None]:
    return lambda t: _write(t / name, content)


def both(*setups: Callable[[Path], None]) -> Callable[[Path], None]:
    def setup(t: Path) -> None:
        for s in setups:
            s(t)

    return setup


def weights(name: str = "w") -> Callable[[Path], None]:
    """A tiny weights folder at {t}/NAME (what evaluation and export read)."""

    def setup(t: Path) -> None:
        from pretrain.config import ModelConfig
        from pretrain.model.transformer import Transformer
        from pretrain.weights import save_weights

        cfg = ModelConfig(
            vocab_size=64,
            pad_vocab_to_multiple=1,
            n_layers=1,
            d_model=16,
            n_heads=2,
            d_ff=32,
            max_seq_len=16,
        )
        save_weights(Transformer(cfg), t / name)

    return setup


def study_file(**changes) -> Callable[[Path], None]:
    """A study at {t}/studies/s.yaml over the tiny config, with `changes`: a config section
    (a dict whose name is a config section) merged into its config, else a study field."""

    def setup(t: Path) -> None:
        cfg = tiny_config(t / "run", t / "data")
        study: dict = {"config": cfg}
        for name, value in changes.items():
            if name in cfg:
                cfg[name] = {**cfg[name], **value}
            else:
                study[name] = value
        _write(t / "studies" / "s.yaml", yaml.safe_dump(study))

    return setup


def run_with_config(name: str, content: str) -> Callable[[Path], None]:
    """A run folder whose config.yaml holds `content` (compare_runs reads it)."""
    return text(f"{name}/config.yaml", content)


def hf_folder(config: dict) -> Callable[[Path], None]:
    return text("hf/config.json", json.dumps(config))


# ------------------------------------------------------------------------- the table


@dataclass
class Case:
    id: str
    program: str
    argv: list[str]
    expect: str  # the one line contains this ({t} = tmp_path)
    setup: Callable[[Path], None] | None = None


CFG = ["--config", "{t}/run.yaml"]

CASES = [
    # pretrain/main.py: the config file, its keys, types and values, --set, paths, data
    Case("main-no-config-flag", "main", [], "--config"),
    Case("main-unknown-flag", "main", CFG + ["--bogus"], "--bogus"),
    Case("main-config-missing", "main", ["--config", "{t}/nope.yaml"], "{t}/nope.yaml"),
    Case("main-config-is-folder", "main", ["--config", "{t}"], "config file not found"),
    Case(
        "main-yaml-syntax",
        "main",
        CFG,
        "run.yaml:3:4",
        text("run.yaml", "train:\n  a: [1, 2\n  b: 3\n"),
    ),
    Case("main-yaml-tab", "main", CFG, "run.yaml:2:1", text("run.yaml", "train:\n\tseq_len: 3\n")),
    Case(
        "main-yaml-not-mapping",
        "main",
        CFG,
        "top level must be a mapping",
        text("run.yaml", "- 1\n- 2\n"),
    ),
    Case(
        "main-inherit-missing", "main", CFG, "base.yaml", text("run.yaml", "inherit: base.yaml\n")
    ),
    Case(
        "main-inherit-cycle",
        "main",
        CFG,
        "inherit cycle",
        both(text("run.yaml", "inherit: b.yaml\n"), text("b.yaml", "inherit: run.yaml\n")),
    ),
    Case(
        "main-inherit-bad-yaml",
        "main",
        CFG,
        "b.yaml:1:",
        both(text("run.yaml", "inherit: b.yaml\n"), text("b.yaml", "a: b: c\n")),
    ),
    Case("main-unknown-section", "main", CFG, "trian", run_cfg(trian={"x": 1})),
    Case(
        "main-unknown-key",
        "main",
        CFG,
        "train.micro_batch_sise",
        run_cfg(train={"micro_batch_sise": 4}),
    ),
    Case("main-wrong-type", "main", CFG, "optim.lr", run_cfg(optim={"lr": "fast"})),
    Case("main-wrong-literal", "main", CFG, "train.precision", run_cfg(train={"precision": "fp8"})),
    Case("main-set-no-equals", "main", CFG + ["--set", "optim.lr"], "optim.lr", run_cfg()),
    Case("main-set-bad-key", "main", CFG + ["--set", "optim..lr=1"], "optim..lr", run_cfg()),
    Case("main-set-unknown-key", "main", CFG + ["--set", "optim.lrr=1"], "optim.lrr", run_cfg()),
    Case(
        "main-set-wrong-type",
        "main",
        CFG + ["--set", "train.train_iters=many"],
        "train.train_iters",
        run_cfg(),
    ),
    Case(
        "main-batch-indivisible",
        "main",
        CFG,
        "train.global_batch_size=10",
        run_cfg(train={"global_batch_size": 10, "micro_batch_size": 4}),
    ),
    Case(
        "main-batch-zero",
        "main",
        CFG,
        "train.micro_batch_size",
        run_cfg(train={"micro_batch_size": 0}),
    ),
    Case("main-lr-negative", "main", CFG, "optim.lr", run_cfg(optim={"lr": -1.0})),
    Case(
        "main-set-async-not-bool",
        "main",
        CFG + ["--set", "checkpoint.async=maybe"],
        "checkpoint.async='maybe' must be true or false",
        run_cfg(),
    ),
    Case(
        "main-async-other-writer",
        "main",
        CFG,
        "checkpoint.async=true needs DeepSpeed's default checkpoint engine",
        run_cfg(
            checkpoint={"async": True},
            train={"deepspeed": {"checkpoint": {"writer": {"type": "fast"}}}},
        ),
    ),
    Case("main-heads-indivisible", "main", CFG, "model.", run_cfg(model={"n_heads": 5})),
    Case("main-rope-fraction", "main", CFG, "rope_fraction", run_cfg(model={"rope_fraction": 1.5})),
    Case(
        "main-data-missing", "main", CFG, "data.train[0]", run_cfg(data={"train": ["{t}/nowhere"]})
    ),
    Case("main-data-empty-list", "main", CFG, "data.train is empty", run_cfg(data={"train": []})),
    Case(
        "main-data-weights-count",
        "main",
        CFG,
        "data.train_weights",
        run_cfg(data={"train_weights": [1.0, 2.0]}),
    ),
    Case(
        "main-valid-missing", "main", CFG, "data.valid[0]", run_cfg(data={"valid": ["{t}/nowhere"]})
    ),
    Case(
        "main-run-dir-under-file",
        "main",
        CFG,
        "logging.run_dir",
        both(text("afile", "x"), run_cfg(logging={"run_dir": "{t}/afile/run"})),
    ),
    Case(
        "main-run-dir-is-file",
        "main",
        CFG,
        "is a file, not a folder",
        both(text("afile", "x"), run_cfg(logging={"run_dir": "{t}/afile"})),
    ),
    Case(
        "main-checkpoint-dir-under-file",
        "main",
        CFG,
        "checkpoint.dir",
        both(text("afile", "x"), run_cfg(checkpoint={"dir": "{t}/afile/ck"})),
    ),
    Case(
        "main-callback-no-module",
        "main",
        CFG,
        "callbacks[0].class",
        run_cfg(callbacks=[{"class": "no_such_module_xyz.Cb"}]),
    ),
    Case(
        "main-callback-not-dotted",
        "main",
        CFG,
        "callbacks[0].class",
        run_cfg(callbacks=[{"class": "Cb"}]),
    ),
    Case(
        "main-callback-not-callback",
        "main",
        CFG,
        "is not a subclass of pretrain.train.callbacks.Callback,",
        run_cfg(callbacks=[{"class": "pathlib.Path"}]),
    ),
    Case(
        "main-callback-bad-kwargs",
        "main",
        CFG,
        "does not accept",
        run_cfg(callbacks=[{"class": "callback_probe.HookRecorder", "bogus_arg": 1}]),
    ),
    Case(
        "main-wandb-mode",
        "main",
        CFG,
        "wandb.mode='sometimes' is not allowed",
        run_cfg(wandb={"mode": "sometimes"}),
    ),
    Case("main-wandb-type", "main", CFG, "wandb.tags", run_cfg(wandb={"tags": 5})),
    Case(
        "main-schedule",
        "main",
        CFG,
        "schedule.warmup_steps=-3 must be >= 0",
        run_cfg(schedule={"warmup_steps": -3}),
    ),
    Case(
        "main-logging-interval",
        "main",
        CFG,
        "logging.log_interval=0 must be > 0",
        run_cfg(logging={"log_interval": 0}),
    ),
    Case(
        "main-hang-fault-without-rank",
        "main",
        CFG,
        "spikes.faults[0].rank=None",
        run_cfg(spikes={"faults": [{"step": 2, "kind": "hang"}]}),
    ),
    Case(
        "main-hang-timeout-negative",
        "main",
        CFG,
        "train.hang_timeout=-5 must be >= 0 (seconds; 0 or null = off)",
        run_cfg(train={"hang_timeout": -5}),
    ),
    # what the file alone decides (issue 42): refused as the config is read
    Case(
        "main-seed-negative",
        "main",
        CFG,
        "train.seed=-1 must be in [0, 4294967295] (a seed NumPy can take)",
        run_cfg(train={"seed": -1}),
    ),
    Case(
        "main-size-negative",
        "main",
        CFG,
        "model.d_ff=-64 must be > 0",
        run_cfg(model={"d_ff": -64}),
    ),
    Case(
        "main-lr-nan",
        "main",
        CFG,
        "optim.lr=nan must be a number, not NaN",
        run_cfg(optim={"lr": float("nan")}),
    ),
    Case(
        "main-set-lr-nan",
        "main",
        CFG + ["--set", "optim.lr=.nan"],
        "optim.lr=nan must be a number, not NaN",
        run_cfg(),
    ),
    Case(
        "main-list-for-number",
        "main",
        CFG,
        "train.train_iters=[8] must be an integer",
        run_cfg(train={"train_iters": [8]}),
    ),
    Case(
        "main-mapping-for-list",
        "main",
        CFG,
        "data.valid={'a': 1} must be a list",
        run_cfg(data={"valid": {"a": 1}}),
    ),
    Case(
        "study-seed-negative",
        "study",
        ["write", "{t}/studies/s.yaml"],
        "train.seed=-1 must be in [0, 4294967295] (a seed NumPy can take)",
        study_file(seeds=[7, -1]),
    ),
    Case(
        "study-size-zero",
        "study",
        ["plan", "{t}/studies/s.yaml"],
        "train.micro_batch_size=0 must be > 0",
        study_file(train={"micro_batch_size": 0}),
    ),
    Case(
        "study-lr-nan",
        "study",
        ["write", "{t}/studies/s.yaml"],
        "optim.lr=nan must be a number, not NaN",
        study_file(optim={"lr": float("nan")}),
    ),
    Case(
        "study-list-for-number",
        "study",
        ["write", "{t}/studies/s.yaml"],
        "train.train_iters=[8] must be an integer",
        study_file(train={"train_iters": [8]}),
    ),
    Case(
        "study-mapping-for-list",
        "study",
        ["write", "{t}/studies/s.yaml"],
        "data.valid={'a': 1} must be a list",
        study_file(data={"valid": {"a": 1}}),
    ),
    Case(
        "study-unknown-field",
        "study",
        ["write", "{t}/studies/s.yaml"],
        "unknown key axis (did you mean axes?)",
        study_file(axis={}),
    ),
    # tools/config_schema.py
    Case("config-schema-bad-flag", "config_schema", ["--bogus"], "--bogus"),
    Case(
        "config-schema-no-docs",
        "config_schema",
        ["--check", "--repo", "{t}"],
        "docs/configuration.md",
    ),
    # tools/prepare_data.py
    Case("prep-no-output", "prepare_data", ["--tokenizer", "bytes"], "--output"),
    Case(
        "prep-output-is-file",
        "prepare_data",
        ["--output", "{t}/afile", "--tokenizer", "bytes", "--input", "{t}/in.txt"],
        "{t}/afile is a file",
        both(text("afile", "x"), text("in.txt", "hello")),
    ),
    Case(
        "prep-output-under-file",
        "prepare_data",
        ["--output", "{t}/afile/out", "--tokenizer", "bytes", "--input", "{t}/in.txt"],
        "{t}/afile",
        both(text("afile", "x"), text("in.txt", "hello")),
    ),
    Case(
        "prep-no-tokenizer",
        "prepare_data",
        ["--output", "{t}/out", "--input", "{t}/in.txt"],
        "--tokenizer",
        text("in.txt", "hello"),
    ),
    Case(
        "prep-input-missing",
        "prepare_data",
        ["--output", "{t}/out", "--tokenizer", "bytes", "--input", "{t}/missing.jsonl"],
        "missing.jsonl",
    ),
    Case(
        "prep-tokenizer-missing",
        "prepare_data",
        ["--output", "{t}/out", "--tokenizer", "{t}/tok.json", "--input", "{t}/in.txt"],
        "tok.json",
        text("in.txt", "hello"),
    ),
    Case(
        "prep-bad-recipe", "prepare_data", ["--output", "{t}/out", "--recipe", "wiki"], "--recipe"
    ),
    Case(
        "prep-recipe-needs-input",
        "prepare_data",
        ["--output", "{t}/out", "--recipe", "enwik8"],
        "--recipe enwik8 needs --input",
    ),
    Case(
        "prep-workers-type",
        "prepare_data",
        ["--output", "{t}/out", "--workers", "two"],
        "--workers",
    ),
    # tools/evaluate.py
    Case("eval-no-run", "evaluate", [], "--run"),
    Case("eval-run-missing", "evaluate", ["--run", "{t}/nope"], "{t}/nope does not exist"),
    Case(
        "eval-run-no-checkpoint",
        "evaluate",
        ["--run", "{t}/empty"],
        "no checkpoint with weights",
        lambda t: (t / "empty").mkdir(),
    ),
    Case(
        "eval-step-missing",
        "evaluate",
        ["--run", "{t}/w", "--step", "7"],
        "no weights for step 7",
        weights(),
    ),
    Case(
        "eval-nothing-to-do",
        "evaluate",
        ["--run", "{t}/w", "--tasks", "none"],
        "--tasks none",
        weights(),
    ),
    Case(
        "eval-val-no-valid-data",
        "evaluate",
        ["--run", "{t}/w", "--tasks", "none", "--val"],
        "has no tokenizer/ folder",
        weights(),
    ),
    Case("eval-dtype", "evaluate", ["--run", "{t}/w", "--dtype", "int8"], "--dtype"),
    Case(
        "eval-data-dir-missing",
        "evaluate",
        ["--run", "{t}/w", "--tasks", "piqa", "--data-dir", "{t}/nodata"],
        "{t}/nodata",
        weights(),
    ),
    Case(
        "eval-config-bad-yaml",
        "evaluate",
        ["--run", "{t}/w", "--tasks", "none", "--val"],
        "config.yaml:2:1",
        both(weights(), text("w/config.yaml", "model: {a: [\n")),
    ),
    # tools/export_hf.py, tools/import_hf.py
    Case("export-no-out", "export_hf", ["--run", "{t}/w"], "--out"),
    Case("export-run-missing", "export_hf", ["--run", "{t}/nope", "--out", "{t}/x"], "{t}/nope"),
    Case(
        "export-bad-target",
        "export_hf",
        ["--run", "{t}/w", "--out", "{t}/x", "--target", "gpt2"],
        "--target",
    ),
    Case(
        "export-tokenizer-missing",
        "export_hf",
        ["--run", "{t}/w", "--out", "{t}/x", "--tokenizer", "{t}/tok.json"],
        "tok.json",
        weights(),
    ),
    Case(
        "import-out-not-empty",
        "import_hf",
        ["--hf", "{t}/hf", "--out", "{t}/full"],
        "{t}/full",
        text("full/x", "x"),
    ),
    Case("import-hf-missing", "import_hf", ["--hf", "{t}/nohf", "--out", "{t}/o"], "{t}/nohf"),
    Case(
        "import-hf-unsupported",
        "import_hf",
        ["--hf", "{t}/hf", "--out", "{t}/o"],
        "bert",
        hf_folder({"model_type": "bert", "architectures": ["BertModel"]}),
    ),
    # a config.json that is not a JSON object (broken weights, shards, index: test_broken_*)
    Case(
        "import-hf-config-not-json",
        "import_hf",
        ["--hf", "{t}/hf", "--out", "{t}/o"],
        "{t}/hf/config.json is not JSON (Expecting value at line 1 column 1); download",
        text("hf/config.json", "model_type: llama\n"),
    ),
    Case(
        "import-hf-config-list",
        "import_hf",
        ["--hf", "{t}/hf", "--out", "{t}/o"],
        "{t}/hf/config.json holds a JSON list, not an object",
        text("hf/config.json", '[{"model_type": "llama"}]'),
    ),
    Case(
        "freq-hf-config-not-text",
        "frequency_use",
        ["--hf", "{t}/hf", "--data", "{t}/d", "--out", "{t}/o"],
        "{t}/hf/config.json is not JSON (its bytes are not text)",
        lambda t: (t / "hf").mkdir() or (t / "hf/config.json").write_bytes(b"\x93\xff" * 64),
    ),
    Case(
        "freq-hf-config-list",
        "frequency_use",
        ["--hf", "{t}/hf", "--data", "{t}/d", "--out", "{t}/o"],
        "{t}/hf/config.json holds a JSON list",
        text("hf/config.json", "[]"),
    ),
    # tools/compare_runs.py
    Case("compare-no-runs", "compare_runs", [], "runs"),
    Case("compare-run-missing", "compare_runs", ["{t}/nope"], "{t}/nope"),
    Case(
        "compare-bad-yaml",
        "compare_runs",
        ["{t}/r1"],
        "config.yaml:2:1",
        run_with_config("r1", "seed: [\n"),
    ),
    Case(
        "compare-eval-step-type", "compare_runs", ["{t}/r1", "--eval-step", "last"], "--eval-step"
    ),
    # tools/study.py (its study files' refusals: tests/test_study_spec.py)
    Case("study-no-command", "study", [], "COMMAND"),
    Case("study-unknown-command", "study", ["launch"], "launch"),
    Case("study-run-dir-missing", "study", ["run-dir", "{t}/nope.yaml"], "nope.yaml"),
    Case(
        "study-run-dir-bad-yaml",
        "study",
        ["run-dir", "{t}/run.yaml"],
        "run.yaml:2:1",
        text("run.yaml", "logging: {run_dir: [\n"),
    ),
    Case("study-list-extra", "study", ["list", "studies/partial_rope.yaml", "--bogus"], "--bogus"),
    Case("study-check-missing", "study", ["write", "{t}/nope.yaml", "--check"], "nope.yaml"),
    # tools/model_info.py
    Case("info-nothing", "model_info", [], "--preset"),
    Case("info-unknown-preset", "model_info", ["--preset", "llama99b"], "llama99b"),
    Case(
        "info-bad-set",
        "model_info",
        ["--preset", "llama1b", "--set", "rope_fraction=2"],
        "rope_fraction",
    ),
    Case("info-seq-len", "model_info", ["--preset", "llama1b", "--seq-len", "0"], "--seq-len"),
    Case(
        "info-preset-bad-yaml",
        "model_info",
        ["--preset", "{t}/m.yaml"],
        "m.yaml:2:1",
        text("m.yaml", "d_model: [\n"),
    ),
    # tools/rope_cache_size.py
    Case("cache-seq-lens", "rope_cache_size", ["--seq-lens", "2k,lots"], "lots"),
    Case("cache-fractions", "rope_cache_size", ["--fractions", "150%"], "150"),
    Case("cache-head-dim", "rope_cache_size", ["--head-dim", "7"], "--head-dim"),
    Case("cache-layers", "rope_cache_size", ["--layers", "0"], "--layers"),
    Case("cache-precision", "rope_cache_size", ["--precision", "fp7"], "--precision"),
    Case("cache-preset", "rope_cache_size", ["--preset", "nope_model"], "nope_model"),
    # tools/plan.py
    Case("plan-no-config", "plan", [], "CONFIG"),
    Case("plan-config-missing", "plan", ["{t}/nope.yaml"], "nope.yaml"),
    Case(
        "plan-micro-batch",
        "plan",
        ["{t}/run.yaml", "--micro-batch", "0"],
        "--micro-batch",
        run_cfg(),
    ),
    Case(
        "plan-bad-set",
        "plan",
        ["{t}/run.yaml", "--set", "train.seq_len=long"],
        "train.seq_len='long' must be an integer",
        run_cfg(),
    ),
    Case("plan-gpu", "plan", ["{t}/run.yaml", "--gpu", "tpu"], "--gpu", run_cfg()),
    Case("plan-gpus-type", "plan", ["{t}/run.yaml", "--gpus", "many"], "--gpus"),
    # tools/prepare_tasks.py
    Case("tasks-no-output", "prepare_tasks", ["--data-dir", "{t}"], "--output"),
    Case(
        "tasks-missing-file",
        "prepare_tasks",
        ["--data-dir", "{t}", "--output", "{t}/out", "--tasks", "logiqa"],
        "logiqa",
    ),
    # tools/check_checkpoint.py
    Case("ckpt-missing", "check_checkpoint", ["{t}/nope"], "{t}/nope"),
    Case("ckpt-is-file", "check_checkpoint", ["{t}/afile"], "{t}/afile", text("afile", "x")),
    Case("ckpt-no-arg", "check_checkpoint", [], "run"),
    # tools/reshard_checkpoint.py
    Case("reshard-missing", "reshard_checkpoint", ["--run", "{t}/nope"], "{t}/nope"),
    Case(
        "reshard-weights-only",
        "reshard_checkpoint",
        ["--run", "{t}/w"],
        "no complete checkpoint under {t}/w",
        weights(),
    ),
    Case("reshard-workers", "reshard_checkpoint", ["--run", "{t}", "--workers", "0"], "--workers"),
    # tools/train_tokenizer.py
    Case("tok-no-input", "train_tokenizer", ["--output", "{t}/tok"], "--input"),
    Case(
        "tok-input-missing",
        "train_tokenizer",
        ["--input", "{t}/none.txt", "--output", "{t}/tok"],
        "none.txt",
    ),
    Case(
        "tok-bad-kind",
        "train_tokenizer",
        ["--input", "a", "--output", "b", "--kind", "wordpiece"],
        "--kind",
    ),
    Case(
        "tok-vocab-type",
        "train_tokenizer",
        ["--input", "a", "--output", "b", "--vocab-size", "big"],
        "--vocab-size",
    ),
    # tools/passkey.py (lengths past a learned table, too short: tests/test_eval_passkey.py)
    Case("passkey-no-run", "passkey", [], "--run"),
    Case("passkey-run-missing", "passkey", ["--run", "{t}/nope"], "{t}/nope does not exist"),
    Case(
        "passkey-no-tokenizer", "passkey", ["--run", "{t}/w"], "has no tokenizer/ folder", weights()
    ),
    Case(
        "passkey-depth-range", "passkey", ["--run", "{t}/w", "--depths", "0,1.5"], "--depths: 1.5"
    ),
    Case("passkey-depth-text", "passkey", ["--run", "{t}/w", "--depths", "mid"], "--depths: 'mid'"),
    Case("passkey-trials", "passkey", ["--run", "{t}/w", "--trials", "0"], "--trials 0"),
    Case(
        "passkey-rope-scaling",
        "passkey",
        ["--run", "{t}/w", "--rope-scaling", "yarn:big"],
        "the factor 'big' is not a number",
    ),
    # tools/benchmark.py (flags only: a benchmark itself is slow)
    Case("bench-no-area", "benchmark", [], "AREA"),
    Case("bench-unknown-area", "benchmark", ["gpu"], "gpu"),
    Case("bench-bad-flag", "benchmark", ["model", "--bogus"], "--bogus"),
    Case(
        "bench-comms-one-rank", "benchmark", ["comms", "--ranks", "1"], "--ranks 1: give at least 2"
    ),
    # tools/gpu_check.py (flags only: the smoke is tests/test_gpu_check.py)
    Case("gpu-check-stage", "gpu_check", ["--cpu-smoke", "--stage", "gpu"], "--stage gpu"),
    Case("gpu-check-budget", "gpu_check", ["--budget", "-1"], "--budget -1 must be >= 0"),
    Case("gpu-check-report", "gpu_check", ["--report"], "--report needs --results DIR"),
]


@pytest.fixture
def isolated_env(monkeypatch):
    """main() maps launcher variables into os.environ; keep that out of the test process."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS and k != "PRETRAIN_DEBUG"}
    monkeypatch.setattr(os, "environ", env)
    return env


def _call(program: str, argv: list[str]) -> int:
    module, name = PROGRAMS[program].split(":")
    main = getattr(importlib.import_module(module), name)
    try:
        return main(argv)
    except SystemExit as e:  # argparse
        return e.code if isinstance(e.code, int) else 1


def _fill(value, t: Path):
    if isinstance(value, str):
        return value.replace("{t}", str(t))
    if isinstance(value, list):
        return [_fill(v, t) for v in value]
    if isinstance(value, dict):
        return {k: _fill(v, t) for k, v in value.items()}
    return value


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input_gives_one_line_and_exit_2(case, tmp_path, capfd, isolated_env, monkeypatch):
    monkeypatch.chdir(tmp_path)  # nothing a case does lands in the checkout
    if case.setup:
        case.setup(tmp_path)
        cfg = tmp_path / "run.yaml"
        if cfg.is_file():  # setups write `{t}` into configs too
            cfg.write_text(cfg.read_text().replace("{t}", str(tmp_path)))
    capfd.readouterr()
    code = _call(case.program, _fill(case.argv, tmp_path))
    err = capfd.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert "Traceback" not in err, err
    assert len(lines) == 1, err
    assert code == 2, err
    assert _fill(case.expect, tmp_path) in lines[0], lines[0]


def test_the_table_covers_every_program():
    assert len(CASES) >= 60
    assert {c.program for c in CASES} == set(PROGRAMS)
    assert len({c.id for c in CASES}) == len(CASES)


# ------------------------------------------------- broken model folders: real files, damaged

SHARD = "model-00002-of-{n}.safetensors"  # {n}: the export's shard count


def _cut(path: Path) -> None:
    """The file's first half, as an interrupted download or copy leaves it."""
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _garbage(path: Path) -> None:
    path.write_bytes(bytes(range(256)) * 8)


@pytest.fixture(scope="module")
def model_folders(tmp_path_factory):
    """One tiny model as a one-file export, a sharded export and a weights folder, and one
    with a Hugging Face tokenizer (tokenizer.json, tokenizer_config.json), built once; each
    test damages a copy."""
    from pretrain.config import ModelConfig
    from pretrain.data.tokenizer import ByteTokenizer, HFTokenizer
    from pretrain.hf.folder import export_hf
    from pretrain.hf.tokenizer import hf_tokenizer_json
    from pretrain.model.transformer import Transformer
    from pretrain.weights import save_weights

    root = tmp_path_factory.mktemp("model_folders")
    dims = dict(pad_vocab_to_multiple=1, n_layers=2, d_model=16, n_heads=2, d_ff=32, max_seq_len=16)
    model = Transformer(ModelConfig(vocab_size=64, **dims))
    export_hf(model, root / "one", card=False)
    sharded = export_hf(model, root / "sharded", card=False, max_shard_size="3KB")
    n = sum(f.endswith(".safetensors") for f in sharded.files)
    assert n > 2
    save_weights(model, root / "w")
    # The bytes tokenizer as a tokenizer.json (kind "hf"): import reads both of its files
    tok = HFTokenizer(hf_tokenizer_json(ByteTokenizer()).encode(), "bytes-hf")
    with_tok = Transformer(ModelConfig(vocab_size=tok.vocab_size, **dims))
    assert "tokenizer.json" in export_hf(with_tok, root / "tok", card=False, tokenizer=tok).files
    return root, f"{n:05d}"


# (folder, file in it, damage, what the one line says after the file's path)
HF_DAMAGES = {
    "weights-garbage": ("one", "model.safetensors", _garbage, "is not a safetensors file"),
    "weights-cut": ("one", "model.safetensors", _cut, "is cut short"),
    "shard-missing": ("sharded", SHARD, Path.unlink, "is missing (named in"),
    "shard-cut": ("sharded", SHARD, _cut, "is cut short"),
    "index-not-json": (
        "sharded",
        "model.safetensors.index.json",
        lambda p: p.write_text('{"weight_map": {'),
        "is not JSON",
    ),
    "tokenizer-not-json": (
        "tok",
        "tokenizer.json",
        lambda p: p.write_text('{"model": {'),
        "is not JSON (Expecting",
    ),
    "tokenizer-not-text": (
        "tok",
        "tokenizer.json",
        lambda p: p.write_bytes(b"\x93\xff" * 64),
        "is not JSON (its bytes are not text)",
    ),
    "tokenizer-refused": (  # a JSON object, but no tokenizer the `tokenizers` library reads
        "tok",
        "tokenizer.json",
        lambda p: p.write_text('{"model": 3}'),
        "is not a tokenizer the tokenizers library reads (",
    ),
    "tokenizer-config-list": (
        "tok",
        "tokenizer_config.json",
        lambda p: p.write_text('[{"eos_token": "<|endoftext|>"}]'),
        "holds a JSON list, not an object",
    ),
    "tokenizer-config-not-json": (
        "tok",
        "tokenizer_config.json",
        lambda p: p.write_text('{"eos_token": '),
        "is not JSON (Expecting",
    ),
    "record-not-object": (  # our record in config.json, damaged
        "one",
        "config.json",
        lambda p: p.write_text(json.dumps({**json.loads(p.read_text()), "pretrain": [1]})),
        "holds a 'pretrain' record that is not an object",
    ),
}
# Every program that reads a Hugging Face folder ({f}: the folder, {t}: tmp_path)
HF_READERS = {
    "import_hf": ["--hf", "{f}", "--out", "{t}/o"],
    "frequency_use": ["--hf", "{f}", "--data", "{t}/d", "--out", "{t}/o"],
}
WEIGHTS_DAMAGES = {"garbage": _garbage, "cut": _cut}
# Programs that read our own weights folder (model.safetensors + config.yaml)
WEIGHTS_READERS = {
    "export_hf": ["--run", "{f}", "--out", "{t}/o"],
    "evaluate": ["--run", "{f}", "--tasks", "none", "--val"],
    "frequency_use": ["--run", "{f}", "--data", "{t}/d", "--out", "{t}/o"],
}


def _refused(program: str, argv: list[str], file: Path, words: str, capfd) -> str:
    capfd.readouterr()
    code = _call(program, argv)
    err = capfd.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert "Traceback" not in err, err
    assert len(lines) == 1 and code == 2, (code, err)
    assert lines[0].startswith(f"error: {file} {words}"), lines[0]
    return lines[0]


@pytest.mark.parametrize("program", HF_READERS)
@pytest.mark.parametrize("damage", HF_DAMAGES)
def test_broken_hf_folder_gives_one_line_naming_the_file(
    damage, program, model_folders, tmp_path, capfd, isolated_env, monkeypatch
):
    monkeypatch.chdir(tmp_path)
    root, n = model_folders
    source, name, hurt, words = HF_DAMAGES[damage]
    folder = tmp_path / "hf"
    shutil.copytree(root / source, folder)
    file = folder / name.format(n=n)
    hurt(file)
    argv = [
        a.replace("{f}", str(folder)).replace("{t}", str(tmp_path)) for a in HF_READERS[program]
    ]
    line = _refused(program, argv, file, words, capfd)
    if damage != "shard-missing":  # a damaged file is fetched again; a missing one named
        assert "download the folder again or export it again" in line, line


@pytest.mark.parametrize("program", WEIGHTS_READERS)
@pytest.mark.parametrize("damage", WEIGHTS_DAMAGES)
def test_broken_weights_file_gives_one_line_naming_it(
    damage, program, model_folders, tmp_path, capfd, isolated_env, monkeypatch
):
    """A weights folder without a checkpoint's marker (imported, or copied out of a run):
    nothing recorded its size, so the file itself is checked."""
    monkeypatch.chdir(tmp_path)
    root, _ = model_folders
    folder = tmp_path / "w"
    shutil.copytree(root / "w", folder)
    file = folder / "model.safetensors"
    WEIGHTS_DAMAGES[damage](file)
    argv = [
        a.replace("{f}", str(folder)).replace("{t}", str(tmp_path))
        for a in WEIGHTS_READERS[program]
    ]
    words = "is cut short" if damage == "cut" else "is not a safetensors file"
    line = _refused(program, argv, file, words, capfd)
    assert line.endswith("; write it again or use an earlier checkpoint"), line


def _tool(name: str, *args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(REPO / "tools" / f"{name}.py"), *args],
        cwd=REPO,
        env=child_env(**env),
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_a_tool_as_a_program_gives_one_line_and_exit_2(tmp_path):
    """The same through `python tools/X.py` (a process, as users run it)."""
    bad = _write(tmp_path / "bad.yaml", "d_model: [\n")
    r = _tool("model_info", "--preset", str(bad), PRETRAIN_DEBUG="")
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"config error: {bad}:2:1: not valid YAML: "), (
        r.stderr
    )
    assert "Traceback" not in r.stderr and str(bad) in r.stderr


@pytest.mark.parametrize(
    ("name", "content", "record", "words"),
    [
        (
            "tokenizer.json",
            '{"model": 3}',
            True,
            "is not a tokenizer the tokenizers library reads (",
        ),
        ("tokenizer_config.json", "[]", False, "holds a JSON list, not an object"),
    ],
    ids=["tokenizer-refused", "hub-folder-tokenizer-config-list"],
)
def test_broken_tokenizer_through_import_hf_gives_one_line(
    name, content, record, words, model_folders, tmp_path
):
    """`python tools/import_hf.py --hf` on an export whose tokenizer is damaged; without our
    record in config.json (a folder from the Hub) tokenizer_config.json gives the eos token."""
    root, _ = model_folders
    folder = tmp_path / "hf"
    shutil.copytree(root / "tok", folder)
    if not record:
        config = json.loads((folder / "config.json").read_text())
        del config["pretrain"]
        (folder / "config.json").write_text(json.dumps(config))
    (folder / name).write_text(content)
    r = _tool("import_hf", "--hf", str(folder), "--out", str(tmp_path / "o"), PRETRAIN_DEBUG="")
    lines = r.stderr.strip().splitlines()
    assert "Traceback" not in r.stderr, r.stderr
    assert r.returncode == 2 and len(lines) == 1, r.stderr
    assert lines[0].startswith(f"error: {folder / name} {words}"), lines[0]
    assert lines[0].endswith("; download the folder again or export it again"), lines[0]


def test_pretrain_debug_brings_the_traceback_back(tmp_path):
    bad = _write(tmp_path / "bad.yaml", "d_model: [\n")
    r = _tool("model_info", "--preset", str(bad), PRETRAIN_DEBUG="1")
    assert r.returncode == 1, r.stderr
    assert "Traceback" in r.stderr and "ConfigError" in r.stderr and str(bad) in r.stderr
