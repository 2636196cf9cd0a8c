"""tools/compare_runs.py: per-run values and mean ± std over seeds of equal configs."""

from __future__ import annotations

import csv
import io
import json
import statistics

import yaml

from pretrain.config import Config, to_dict
from pretrain.run_layout import CONFIG_FILE, RunLayout
from pretrain.train.callbacks import MetricsFile, StepOutput


def load_cli():
    """tools/compare_runs.py's program (pretrain/cli/compare_runs.py)."""
    from pretrain.cli import compare_runs

    return compare_runs


def write_metrics(run, rows, resume_step=0):
    """Rows {step: scalars} through training's own writer, as a run (resumed at
    `resume_step`) writes them."""
    from types import SimpleNamespace

    writer = MetricsFile()
    trainer = SimpleNamespace(is_main=True, layout=RunLayout(run), step=resume_step)
    writer.on_train_start(trainer)
    for step, scalars in rows:
        writer.on_step_end(
            trainer, StepOutput(step, 0.0, None, 0.0, 0, 0.0, False, None, False, scalars=scalars)
        )
    writer.on_fit_end(trainer, 0)


def make_run(root, name, seed, theta, valid_losses, arc_easy=None, lambada_ppl=None):
    run = root / name
    cfg = to_dict(Config())
    cfg["train"]["seed"] = seed
    cfg["model"]["rope_theta"] = theta
    cfg["logging"]["run_dir"] = str(run)
    run.mkdir(parents=True)
    (run / CONFIG_FILE).write_text(yaml.safe_dump(cfg))
    write_metrics(
        run,
        [
            (step, {"train/loss": loss + 0.1, "valid/loss": loss, "valid/bits_per_byte": loss / 3})
            for step, loss in valid_losses
        ],
    )
    if arc_easy is not None:
        ev = run / "eval" / "step_0000100"
        ev.mkdir(parents=True)
        results = {
            "results": {
                "arc_easy": {
                    "acc,none": arc_easy - 0.05,
                    "acc_norm,none": arc_easy,
                    "acc_norm_stderr,none": 0.01,
                },
                "lambada_openai": {
                    "acc,none": 0.3,
                    "perplexity,none": lambada_ppl,
                    "perplexity_stderr,none": 1.0,
                },
            }
        }
        (ev / "lm_eval_results.json").write_text(json.dumps(results))
        older = run / "eval" / "step_0000050"  # an older evaluation is not the one reported
        older.mkdir(parents=True)
        (older / "lm_eval_results.json").write_text(
            json.dumps({"results": {"arc_easy": {"acc_norm,none": 0.0}}})
        )
    return run


def test_compare_groups_seeds_of_equal_configs(tmp_path, capsys):
    a1 = make_run(
        tmp_path, "rope10_seed1", 1, 10000.0, [(50, 4.0), (100, 3.5), (150, 3.6)], 0.40, 20.0
    )
    a2 = make_run(
        tmp_path, "rope10_seed2", 2, 10000.0, [(50, 4.1), (100, 3.7), (150, 3.4)], 0.44, 30.0
    )
    b1 = make_run(tmp_path, "rope500_seed1", 1, 500.0, [(50, 4.2), (100, 3.9)], 0.35, 40.0)
    cli = load_cli()
    csv_path, md_path = tmp_path / "out" / "c.csv", tmp_path / "out" / "c.md"
    assert (
        cli.main([str(a1), str(a2), str(b1), "--csv", str(csv_path), "--markdown", str(md_path)])
        == 0
    )
    md = md_path.read_text()
    assert "| rope10_seed1 | 1 | 3.6000 | 3.5000 |" in md  # final and best valid loss
    assert "| rope10_seed2 | 2 | 3.4000 | 3.4000 |" in md
    mean = statistics.fmean([0.40, 0.44])
    std = statistics.stdev([0.40, 0.44])
    assert (
        f"| rope10 | 2 | {statistics.fmean([3.6, 3.4]):.4f} ± {statistics.stdev([3.6, 3.4]):.4f} |"
        in md
    )
    assert f"{mean:.4f} ± {std:.4f}" in md
    assert "| rope500 | 1 | 3.9000 |" in md
    rows = list(csv.DictReader(io.StringIO(csv_path.read_text())))
    groups = {r["name"]: r for r in rows if r["kind"] == "group"}
    assert set(groups) == {"rope10", "rope500"}
    assert float(groups["rope10"]["arc_easy/acc_norm"]) == mean
    assert float(groups["rope10"]["arc_easy/acc_norm_std"]) == std
    assert float(groups["rope10"]["lambada_openai/perplexity"]) == 25.0
    runs = {r["name"]: r for r in rows if r["kind"] == "run"}
    assert (
        runs["rope500_seed1"]["group"] == "rope500"
        and runs["rope500_seed1"]["arc_easy/acc_norm_std"] == ""
    )
    assert runs["rope10_seed2"]["valid_bits_per_byte"] == str(3.4 / 3)


def test_compare_without_eval_and_bad_run(tmp_path, capsys):
    a = make_run(tmp_path, "only_loss", 1234, 10000.0, [(10, 5.0)])
    cli = load_cli()
    assert cli.main([str(a)]) == 0
    out = capsys.readouterr().out
    assert "| only_loss | 1234 | 5.0000 | 5.0000 |" in out and "–" in out
    assert cli.main([str(a), str(tmp_path / "missing_run")]) == 2
    assert "run folder not found" in capsys.readouterr().err


def test_welch_t_test_against_a_baseline(tmp_path, capsys):
    import math

    from scipy import stats

    base = [3.50, 3.55, 3.47]
    other = [3.60, 3.66, 3.58]
    runs = [
        make_run(tmp_path, f"theta10000_seed{i}", i, 10000.0, [(100, v)])
        for i, v in enumerate(base)
    ]
    runs += [
        make_run(tmp_path, f"theta500_seed{i}", i, 500.0, [(100, v)]) for i, v in enumerate(other)
    ]
    runs += [make_run(tmp_path, "theta50000_seed0", 0, 50000.0, [(100, 3.5)])]  # one seed: no test
    cli = load_cli()
    assert cli.main([str(r) for r in runs] + ["--baseline", "theta10000"]) == 0
    out = capsys.readouterr().out
    # Welch's t and Welch-Satterthwaite degrees of freedom, written out.
    m1, m2 = statistics.fmean(other), statistics.fmean(base)
    v1, v2 = statistics.variance(other) / 3, statistics.variance(base) / 3
    t = (m1 - m2) / math.sqrt(v1 + v2)
    df = (v1 + v2) ** 2 / (v1**2 / 2 + v2**2 / 2)
    p = 2 * stats.t.sf(abs(t), df)
    row = f"| theta500 | valid_loss_best | {m1:.4f} | {m2:.4f} | {100 * (m1 - m2) / m2:+.2f}% | {t:.3f} | {df:.1f} | {p:.4f} |"
    assert row in out
    assert "theta50000 | valid_loss" not in out
    assert cli.main([str(r) for r in runs] + ["--baseline", "nope"]) == 2
    assert "--baseline 'nope' is none of the groups" in capsys.readouterr().err


def test_loss_plot_reads_curves_spikes_skips_and_rollbacks(tmp_path):
    from pretrain.eval.plots import plot_loss_curves, read_curves

    run = make_run(tmp_path, "r", 1, 10000.0, [(10, 3.0), (20, 2.5)])
    rows = [(step, {"train/loss": 5.0 / step}) for step in range(1, 31)]
    marks = [
        (17, {"spikes/loss": 9.0, "spikes/score": 12.0}),
        (12, {"spikes/skipped": 1.0, "spikes/skipped_steps": 1.0}),
        (13, {"spikes/skipped_steps": 1.0}),  # a count on a normal step is no skip
        (15, {"spikes/rollbacks": 1.0, "spikes/rollback_from": 19.0}),
    ]
    write_metrics(run, [*rows, *marks], resume_step=20)
    c = read_curves(run)
    assert [s for s, _ in c.valid] == [10, 20] and c.spikes == [(17, 9.0)]
    assert c.skipped == [12] and c.rollbacks == [(15, 19)]
    assert len(c.train) == 30 + 2  # make_run logged train/loss with each valid/loss
    png = plot_loss_curves([run], tmp_path / "plot" / "loss.png")
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
