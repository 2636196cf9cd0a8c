"""In-loop downstream evaluation (downstream.*): the offline tool's figures, during training."""

from __future__ import annotations

import json
import random
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from conftest import shared_path
from train_support import baseline_run, metrics, run_main, tiny_config, write_config

from pretrain.config import Config, ConfigError, from_dict
from pretrain.preflight import check_downstream_data

TASKS = ["piqa", "arc_easy", "lambada_openai"]
EXAMPLES = 6


def downstream_cfg(tmp_path: Path, data: Path, **over) -> dict:
    # A byte-level model needs room for PIQA's solutions (bytes, not words); it trains on 32.
    # Dropout: the evaluation must switch it off, and leave training's draws as they were.
    cfg = tiny_config(tmp_path / "run", data, model={"max_seq_len": 512, "dropout": 0.1})
    cfg["checkpoint"] = {"interval": 4, "keep_last": 3}
    cfg["downstream"] = {
        "tasks": TASKS,
        "data_dir": str(shared_path("evals")),
        "examples": EXAMPLES,
        "interval": 4,
        **over,
    }
    return cfg


_runs: dict[int, Path] = {}


def trained(tmp_path_factory, nproc: int) -> Path:
    """The run folder of the downstream config trained on `nproc` ranks (once a session)."""
    if nproc not in _runs:
        data, _ = baseline_run(tmp_path_factory)
        root = tmp_path_factory.mktemp(f"downstream_{nproc}")
        r = run_main(write_config(root / "run.yaml", downstream_cfg(root, data)), nproc)
        assert r.returncode == 0, r.stdout + r.stderr
        _runs[nproc] = root / "run"
    return _runs[nproc]


@pytest.mark.parametrize("nproc", [1, 2])
def test_in_loop_figures_equal_the_offline_tool_on_that_steps_checkpoint(tmp_path_factory, nproc):
    from pretrain.eval.suite import (
        downstream_scalars,
        local_tasks,
        run_harness,
        sample_loglikelihoods,
    )

    run = trained(tmp_path_factory, nproc)
    chosen = json.loads((run / "downstream" / "examples.json").read_text())["samples"]
    assert sorted(chosen) == sorted(TASKS) and all(len(v) == EXAMPLES for v in chosen.values())
    m = metrics(run)
    _, task_objs = local_tasks(TASKS, shared_path("evals"))
    worst = 0.0
    for step in (4, 8):
        offline, _, _ = run_harness(
            {"path": str(run), "step": step, "device": "cpu", "dtype": "float32"},
            TASKS,
            data_dir=shared_path("evals"),
            samples=chosen,
            log_samples=True,
            bootstrap_iters=0,
        )
        want = downstream_scalars(offline, task_objs)
        for key, value in want.items():
            got = m[step][f"downstream/{key}"]
            if key.endswith(("/acc", "/acc_norm")):
                assert got == value, (step, key)
            else:
                assert abs(got - value) <= 1e-4 * max(1.0, abs(value)), (step, key, got, value)
        assert {k for k in m[step] if k.startswith("downstream/")} == {
            f"downstream/{k}" for k in want
        } | {"downstream/seconds"}
        in_loop = json.loads((run / "downstream" / f"step_{step:07d}.json").read_text())
        off_ll = sample_loglikelihoods(offline)
        for task in TASKS:
            ours = {int(k): v for k, v in in_loop["loglikelihoods"][task].items()}
            assert sorted(ours) == chosen[task]
            for doc, lls in off_ll[task].items():
                worst = max(worst, *(abs(a - b) for a, b in zip(ours[doc], lls, strict=True)))
    print(f"{nproc} rank(s): max |loglikelihood difference| {worst:.2e}")
    assert worst < 1e-4


def test_training_is_bit_identical_with_and_without_it(tmp_path_factory, tmp_path):
    data, _ = baseline_run(tmp_path_factory)
    run = trained(tmp_path_factory, 1)
    cfg = downstream_cfg(tmp_path, data)
    del cfg["downstream"]
    r = run_main(write_config(tmp_path / "run.yaml", cfg))
    assert r.returncode == 0, r.stdout + r.stderr
    with_, without = metrics(run), metrics(tmp_path / "run")
    for step in range(1, 9):
        for key in ("train/loss", "train/grad_norm", "valid/loss"):
            if key in without[step]:
                assert with_[step][key] == without[step][key], (step, key)
    assert "downstream/piqa/acc" in with_[4] and "train/loss" in without[1]
    from safetensors.torch import load_file

    a, b = (
        load_file(r / "checkpoints" / "step_0000008" / "model.safetensors")
        for r in (run, tmp_path / "run")
    )
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# ----------------------------------------------------------------------------- bad input


def _cfg(**downstream) -> Config:
    return from_dict(Config, {"downstream": downstream})


def test_unknown_task_and_missing_data_are_refused_with_the_fix(tmp_path):
    evals = str(shared_path("evals"))
    # What the file decides (the task's name, a data folder named) is refused as it is read;
    # whether this machine holds the data is the preflight's.
    with pytest.raises(ConfigError, match=r"unknown task 'piqq'.*tasks with local data"):
        _cfg(tasks=["piqa", "piqq"], data_dir=evals)
    (tmp_path / "piqa_validation.jsonl").write_text("{}\n")
    with pytest.raises(ConfigError, match=r"task arc_easy: no data file .* leave arc_easy out"):
        check_downstream_data(_cfg(tasks=["piqa", "arc_easy"], data_dir=str(tmp_path)))
    with pytest.raises(ConfigError, match="downstream.data_dir is not set"):
        check_downstream_data(_cfg(tasks=["piqa"]))
    with pytest.raises(ConfigError, match="is not a folder on this machine"):
        check_downstream_data(_cfg(tasks=["piqa"], data_dir=str(tmp_path / "nowhere")))
    check_downstream_data(_cfg())  # off: nothing to check


def test_a_task_longer_than_the_context_is_refused_before_the_first_step(
    tmp_path_factory, tmp_path
):
    data, _ = baseline_run(tmp_path_factory)
    cfg = downstream_cfg(tmp_path, data)
    cfg["model"]["max_seq_len"] = 32
    r = run_main(write_config(tmp_path / "run.yaml", cfg))
    assert r.returncode != 0
    lines = [ln for ln in (r.stdout + r.stderr).splitlines() if "downstream.tasks" in ln]
    assert lines and "piqa" in lines[-1] and "raise model.max_seq_len" in lines[-1], r.stderr
    assert not (tmp_path / "run" / "metrics.jsonl").exists() or not metrics(tmp_path / "run")


# ----------------------------------------------------------------------------- in process


def _fake_trainer(tmp_path: Path):
    from pretrain.config import ModelConfig
    from pretrain.data.tokenizer import load_tokenizer
    from pretrain.model.transformer import Transformer

    torch.manual_seed(0)
    shape = dict(vocab_size=257, pad_vocab_to_multiple=1, n_layers=1, d_model=32, n_heads=2)
    model = Transformer(ModelConfig(**shape, d_ff=64, max_seq_len=512)).train()
    cfg = from_dict(
        Config,
        {
            "downstream": {
                "tasks": ["arc_easy", "lambada_openai"],
                "data_dir": str(shared_path("evals")),
                "examples": 4,
                "interval": 2,
            }
        },
    )
    logs: list[str] = []
    return SimpleNamespace(
        cfg=cfg,
        run=SimpleNamespace(
            module=SimpleNamespace(model=model),
            data=SimpleNamespace(tokenizer=load_tokenizer("bytes")),
            device=torch.device("cpu"),
        ),
        layout=SimpleNamespace(root=tmp_path),
        is_main=True,
        log=logs.append,
        logs=logs,
    )


def test_a_failing_task_is_logged_and_left_out_and_training_state_is_untouched(
    tmp_path, monkeypatch
):
    import pretrain.train.evaluators.downstream as ds

    trainer = _fake_trainer(tmp_path)
    ev = ds.DownstreamEvaluation(trainer.cfg.downstream)
    ev.setup(trainer)
    assert trainer.run.module.model.training
    real = ds.harness_on

    def flaky(lm, tasks, manager, samples):
        if "arc_easy" in tasks:
            raise RuntimeError("disk gone")
        return real(lm, tasks, manager, samples)

    monkeypatch.setattr(ds, "harness_on", flaky)
    states = (random.getstate(), np.random.get_state()[1].copy(), torch.get_rng_state())
    # Through the trainer's runner, as training runs it (the generators are its to keep).
    from pretrain.train.evaluators import run_due
    from pretrain.train.metrics import StepRecord

    record = StepRecord(step=2, lr=0.0, tokens=0, stopping=False, first_input=None, log=False)
    out = run_due([ev], trainer, record, last=False)
    assert random.getstate() == states[0]
    assert (np.random.get_state()[1] == states[1]).all()
    assert torch.equal(torch.get_rng_state(), states[2])
    assert trainer.run.module.model.training  # back in training mode (dropout as it was)
    assert "downstream/lambada_openai/perplexity" in out
    assert not any(k.startswith("downstream/arc_easy") for k in out)
    assert ev.failed == {"arc_easy": "RuntimeError: disk gone"}
    assert any("arc_easy failed at step 2" in line for line in trainer.logs)
    out = ev.run(trainer, SimpleNamespace(step=4))  # left out from now on, the rest goes on
    assert "downstream/lambada_openai/acc" in out


def test_due_by_step_alone_so_rollbacks_rerun_and_resumes_neither_repeat_nor_skip():
    from pretrain.config import DownstreamConfig
    from pretrain.train.evaluators.downstream import DownstreamEvaluation

    ev = DownstreamEvaluation(DownstreamConfig(tasks=["piqa"], interval=4))
    steps = [s for s in range(1, 13) if ev.due(s, s == 12, False)]
    assert steps == [4, 8, 12]
    # A rollback from step 10 to the step-4 checkpoint revisits 5..10: step 8 again.
    revisited = [s for s in range(5, 11) if ev.due(s, False, False)]
    assert revisited == [8]
    end_only = DownstreamEvaluation(DownstreamConfig(tasks=["piqa"], interval=0))
    assert [s for s in range(1, 13) if end_only.due(s, s == 12, False)] == [12]
    assert not DownstreamEvaluation(DownstreamConfig()).due(4, True, False)


# ----------------------------------------------------------------------------- seen, planned


def test_compare_curves_against_tokens_with_a_seed_band_and_the_last_value_of_a_revisited_step(
    tmp_path,
):
    import yaml

    from pretrain.eval.compare import compare, downstream_bands, plot_downstream

    for seed, accs in ((1, (0.25, 0.5, 0.75)), (2, (0.35, 0.4, 0.65))):
        run = tmp_path / f"exp_seed{seed}"
        run.mkdir()
        cfg = {"train": {"seed": seed, "global_batch_size": 4, "seq_len": 8}, "model": {}}
        (run / "config.yaml").write_text(yaml.safe_dump(cfg))
        rows = [{"step": 4 * (i + 1), "downstream/piqa/acc": a} for i, a in enumerate(accs)]
        # A rollback revisited step 8: the second value is the one the run went on with.
        rows.insert(1, {"step": 8, "downstream/piqa/acc": 0.0})
        rows.insert(2, {"step": 8, "downstream/seconds": 1.0})
        (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    _, groups = compare([tmp_path / "exp_seed1", tmp_path / "exp_seed2"])
    [(label, xs, means, stds)] = downstream_bands(groups)["piqa/acc"]
    assert label == "exp" and xs == [128, 256, 384]
    assert means == pytest.approx([0.3, 0.45, 0.7]) and stds[0] == pytest.approx(0.070711, abs=1e-6)
    png = plot_downstream(groups, tmp_path / "downstream.png")
    assert png.read_bytes()[:4] == b"\x89PNG"
    # The same through compare_runs' flag.
    from pretrain.cli.compare_runs import main as compare_runs

    out = tmp_path / "cli.png"
    runs = [str(tmp_path / "exp_seed1"), str(tmp_path / "exp_seed2")]
    assert compare_runs([*runs, "--downstream-plot", str(out)]) == 0
    assert out.read_bytes()[:4] == b"\x89PNG"


def test_the_planner_counts_each_evaluation_and_its_share_of_the_run():
    from pretrain.planner.downstream import downstream_cost

    cfg = from_dict(
        Config,
        {
            "model": {"n_layers": 2, "d_model": 64, "n_heads": 4, "max_seq_len": 128},
            "train": {"train_iters": 2500},
            "downstream": {"tasks": ["piqa", "winogrande"], "examples": 100, "interval": 1000},
        },
    )
    cost = downstream_cost(cfg, train_flops=1e15, run_seconds=3600.0, n_matmul=1e5)
    assert cost is not None and cost.evaluations == 3  # steps 1000, 2000 and the end, 2500
    attention = 4 * 2 * 4 * 16
    want = 100 * 70.7 * (2e5 + attention * 128) + 100 * 43.0 * (2e5 + attention * 38)
    assert cost.flops_per_evaluation == pytest.approx(want)
    assert cost.share == pytest.approx(3 * want / 1e15) and cost.seconds == cost.share * 3600
    assert downstream_cost(from_dict(Config, {}), 1e15, 3600.0, 1e5) is None
    # Without n_matmul: the model's own count of its matmul weights.
    from pretrain.model.transformer import Transformer

    with torch.device("meta"):
        n = Transformer(cfg.model).matmul_params()
    assert downstream_cost(cfg, 1e15, 3600.0) == downstream_cost(cfg, 1e15, 3600.0, float(n))
    # A harness task without a measurement is named, not a KeyError.
    cfg.downstream.tasks = ["piqa", "hellaswag"]
    other = downstream_cost(cfg, 1e15, 3600.0, 1e5)
    assert other.unplanned == ("hellaswag",)
    assert other.flops_per_evaluation == pytest.approx(100 * 70.7 * (2e5 + attention * 128))


def test_the_planners_document_counts_are_the_local_task_datas():
    """DOCUMENTS (pretrain/planner/downstream.py) against the task files it was counted from
    (the one-document-per-line ones)."""
    from pretrain.planner.downstream import DOCUMENTS

    files = {
        "arc_challenge": "arc_challenge_validation.jsonl",
        "arc_easy": "arc_easy_validation.jsonl",
        "lambada_openai": "lambada_openai_test.jsonl",
        "piqa": "piqa_validation.jsonl",
        "sciq": "sciq_validation.jsonl",
        "winogrande": "winogrande_xl_validation.jsonl",
    }
    for task, name in files.items():
        lines = shared_path("evals", name).read_text().splitlines()
        assert DOCUMENTS[task] == sum(1 for ln in lines if ln.strip()), task


def test_a_resumed_run_neither_repeats_nor_skips_an_evaluation(tmp_path_factory, tmp_path):
    data, _ = baseline_run(tmp_path_factory)
    cfg = downstream_cfg(tmp_path, data, tasks=["lambada_openai"], examples=4, interval=2)
    path = write_config(tmp_path / "run.yaml", cfg)
    # Killed once the step-4 checkpoint is committed: the resume starts at step 5.
    r = run_main(path, PRETRAIN_TEST_KILL_AT="before_retention:4")
    assert r.returncode != 0
    r = run_main(path)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "resum" in r.stdout.lower()
    rows = [json.loads(ln) for ln in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows if "downstream/lambada_openai/acc" in row] == [2, 4, 6, 8]
