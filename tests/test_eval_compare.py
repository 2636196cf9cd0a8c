"""tools/compare_runs.py: per-run values and mean ± std over seeds of equal configs."""

from __future__ import annotations

import csv
import io
import json
import math
import statistics

import pytest
import yaml
from tables_support import unpadded

from pretrain.config import Config, to_dict
from pretrain.run_layout import CONFIG_FILE, RunLayout
from pretrain.train.records import StepOutput
from pretrain.train.sinks import MetricsFile
from pretrain.train.spikes import Verdict


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
    writer.open(trainer)
    for step, scalars in rows:
        verdict = Verdict(step, step, scalars.get("train/loss", 0.0), None)
        writer.write(StepOutput(step, False, scalars, verdict, (), {}))
    writer.close(trainer, 0)


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
    md = unpadded(md_path.read_text())
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
    out = unpadded(capsys.readouterr().out)
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
    out = unpadded(capsys.readouterr().out)
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


# Loss at each length and by position: RUN/eval/<step>/positions.json of
# `tools/evaluate.py --val --per-position --lengths ...`, written here by hand.

TRAIN_LEN = 256


def _bucket_edges(length):
    """Every position up to 256, then doubling spans (the evaluator's buckets)."""
    edges = list(range(min(length, 256) + 1))
    while edges[-1] < length:
        edges.append(min(2 * edges[-1], length))
    return edges


def positions_result(length, stride, windows, loss_at):
    """One results[] entry: per-position losses loss_at(p) averaged over each bucket."""
    edges = _bucket_edges(length)
    buckets = []
    for start, end in zip(edges, edges[1:], strict=False):
        buckets.append(
            {
                "start": start,
                "end": end,
                "loss": statistics.fmean(loss_at(p) for p in range(start, end)),
                "tokens": windows * (end - start),
            }
        )
    tokens = sum(b["tokens"] for b in buckets)
    loss = sum(b["loss"] * b["tokens"] for b in buckets) / tokens
    return {
        "length": length,
        "stride": stride,
        "windows": windows,
        "loss": loss,
        "tokens": tokens,
        "buckets": buckets,
    }


def loss_curve(base, growth):
    """Falls with position inside the training length, rises by `growth` per doubling past it."""

    def loss_at(p):
        beyond = math.log2((p + 1) / TRAIN_LEN) if p >= TRAIN_LEN else 0.0
        return base + 2.0 / (p + 1) + growth * beyond

    return loss_at


def write_positions(run, base, growth, step=100, rope_scaling=None, folder_suffix=""):
    """positions.json at 1x, 2x, 4x (disjoint windows) and 8x with overlapping windows; 4x
    also with overlapping windows (listed first, and lower: the table and the plot take the
    disjoint ones)."""
    loss_at = loss_curve(base, growth)
    overlapping = positions_result(4 * TRAIN_LEN, TRAIN_LEN, 13, lambda p: loss_at(p) - 0.5)
    results = [overlapping] + [
        positions_result(n, n, 4096 // n, loss_at)
        for n in (TRAIN_LEN, 2 * TRAIN_LEN, 4 * TRAIN_LEN)
    ]
    results.append(positions_result(8 * TRAIN_LEN, 4 * TRAIN_LEN, 3, loss_at))  # stride < length
    data = {
        "label": f"{run.name}@step_{step:07d}",
        "train_seq_len": TRAIN_LEN,
        "rope_scaling": rope_scaling,
        "results": results,
    }
    ev = run / "eval" / f"step_{step:07d}{folder_suffix}"
    ev.mkdir(parents=True, exist_ok=True)
    (ev / "positions.json").write_text(json.dumps(data))
    return data


def _loss(data, length):
    """The loss at `length`: of its disjoint windows where it has them."""
    found = [r for r in data["results"] if r["length"] == length]
    return next((r for r in found if r["stride"] == length), found[0])["loss"]


def _cell(xs):
    return (
        f"{xs[0]:.4f}"
        if len(xs) == 1
        else f"{statistics.fmean(xs):.4f} ± {statistics.stdev(xs):.4f}"
    )


def test_loss_at_each_length_table_csv_and_plot(tmp_path, capsys):
    from pretrain.eval.compare import compare, position_curves
    from pretrain.eval.position_plots import position_x

    a1 = make_run(tmp_path, "rope10k_seed1", 1, 10000.0, [(100, 3.5)])
    a2 = make_run(tmp_path, "rope10k_seed2", 2, 10000.0, [(100, 3.6)])
    b1 = make_run(tmp_path, "rope500_seed1", 1, 500.0, [(100, 3.7)])
    nope = make_run(tmp_path, "rope50k_seed1", 1, 50000.0, [(100, 3.8)])  # no positions.json
    da1 = write_positions(a1, 2.0, 0.10)
    da2 = write_positions(a2, 2.1, 0.30)
    db1 = write_positions(b1, 2.5, 0.05, rope_scaling={"type": "yarn", "factor": 4.0})
    write_positions(a1, 9.0, 9.0, step=50)  # an older evaluation is not the one reported
    runs = [str(a1), str(a2), str(b1), str(nope)]
    out = tmp_path / "out"
    argv = runs + ["--csv", str(out / "c.csv"), "--positions-plot", str(out / "pos.png")]
    assert load_cli().main(argv) == 0
    md = unpadded(capsys.readouterr().out)
    assert "## Loss at each length" in md  # on without --positions: some run has the file
    header = "| config | seeds | rope scaling | 256 (1x) | 512 (2x) | 1024 (4x) | 2048 (8x) |"
    assert header in md
    lengths = (256, 512, 1024, 2048)
    row_a = "| rope10k | 2 | none | " + " | ".join(
        _cell([_loss(da1, n), _loss(da2, n)]) for n in lengths
    )
    row_b = "| rope500 | 1 | yarn x4 | " + " | ".join(_cell([_loss(db1, n)]) for n in lengths)
    assert row_a + " |" in md and row_b + " |" in md
    assert "| rope50k | 0 | – | – | – | – | – |" in md
    assert "missing (no positions.json): rope50k_seed1" in md
    # The length's loss is the token-weighted mean of its buckets, and rises past 1x here.
    assert _loss(da1, 256) < _loss(da1, 512) < _loss(da1, 1024)

    rows = [r for r in csv.DictReader(io.StringIO((out / "c.csv").read_text()))]
    by = {(r["name"], int(r["length"])): r for r in rows if r["kind"] == "length"}
    assert set(by) == {(g, n) for g in ("rope10k", "rope500") for n in lengths}
    a512 = [_loss(da1, 512), _loss(da2, 512)]
    assert float(by["rope10k", 512]["length_loss"]) == statistics.fmean(a512)
    assert float(by["rope10k", 512]["length_loss_std"]) == statistics.stdev(a512)
    assert by["rope10k", 512]["n"] == "2"
    assert float(by["rope500", 1024]["length_loss"]) == _loss(db1, 1024)
    assert by["rope500", 1024]["length_loss_std"] == "" and by["rope500", 1024]["n"] == "1"

    # The plot's data: the longest length with disjoint windows (1024, not the 2048 windows
    # that overlap), x by position_plots' one rule, mean and sample std over seeds per bucket.
    _, groups = compare(runs)
    curves = {c.label: c for c in position_curves(groups)}
    assert set(curves) == {"rope10k", "rope500"}
    a, b = curves["rope10k"], curves["rope500"]
    assert (a.length, a.train_seq_len, a.n, b.n) == (1024, 256, 2, 1)
    edges = _bucket_edges(1024)
    assert edges[-3:] == [256, 512, 1024] and len(edges) == 259
    assert a.spans == list(zip(edges, edges[1:], strict=False))
    assert a.x == [position_x(s, e) for s, e in a.spans] and a.x[:2] == [1.0, 2.0]
    seed_buckets = [
        [bk["loss"] for bk in next(r for r in d["results"] if r["stride"] == 1024)["buckets"]]
        for d in (da1, da2)
    ]
    assert a.mean == [statistics.fmean(v) for v in zip(*seed_buckets, strict=True)]
    assert a.std == [statistics.stdev(v) for v in zip(*seed_buckets, strict=True)]
    assert b.std is None and b.mean[0] == loss_curve(2.5, 0.05)(0)
    assert b.mean[-1] == statistics.fmean(loss_curve(2.5, 0.05)(p) for p in range(512, 1024))
    png = (out / "pos.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000

    # --eval-step picks the evaluation of that step.
    assert load_cli().main([str(a1), "--eval-step", "50"]) == 0
    md50 = unpadded(capsys.readouterr().out)
    older = json.loads((a1 / "eval" / "step_0000050" / "positions.json").read_text())
    assert f"| rope10k | 1 | none | {_loss(older, 256):.4f} | {_loss(older, 512):.4f} |" in md50


def test_welch_t_test_at_each_length(tmp_path, capsys):
    from scipy import stats

    base = [(2.0, 0.10), (2.1, 0.30), (1.9, 0.20)]
    other = [(2.2, 0.02), (2.3, 0.05)]
    data = {}
    runs = []
    for name, theta, params in (("rope10k", 10000.0, base), ("rope500", 500.0, other)):
        for i, (level, growth) in enumerate(params):
            run = make_run(tmp_path, f"{name}_seed{i}", i, theta, [(100, 3.5 + level / 10)])
            data[name, i] = write_positions(run, level, growth)
            runs.append(str(run))
    single = make_run(tmp_path, "rope50k_seed0", 0, 50000.0, [(100, 3.5)])  # one seed: no test
    write_positions(single, 2.0, 0.1)
    assert load_cli().main(runs + [str(single), "--baseline", "rope10k"]) == 0
    out = unpadded(capsys.readouterr().out)
    assert "## Welch t-tests against rope10k, loss at each length" in out
    for length, title in ((256, "256 (1x)"), (1024, "1024 (4x)")):
        xs = [_loss(data["rope500", i], length) for i in range(2)]
        ys = [_loss(data["rope10k", i], length) for i in range(3)]
        m1, m2 = statistics.fmean(xs), statistics.fmean(ys)
        v1, v2 = statistics.variance(xs) / 2, statistics.variance(ys) / 3
        t = (m1 - m2) / math.sqrt(v1 + v2)
        df = (v1 + v2) ** 2 / (v1**2 / 1 + v2**2 / 2)
        p = 2 * stats.t.sf(abs(t), df)
        rel = 100 * (m1 - m2) / m2
        row = f"| rope500 | loss at {title} | {m1:.4f} | {m2:.4f} | {rel:+.2f}% | {t:.3f} | {df:.1f} | {p:.4f} |"
        assert row in out
    assert "| rope50k | loss at" not in out


def test_positions_missing_and_damaged(tmp_path, capsys):
    cli = load_cli()
    a = make_run(tmp_path, "plain_seed1", 1, 10000.0, [(100, 3.5)])
    assert cli.main([str(a)]) == 0  # no positions.json anywhere, not asked for: no table
    assert "Loss at each length" not in capsys.readouterr().out
    for flags in (["--positions"], ["--positions-plot", str(tmp_path / "p.png")]):
        assert cli.main([str(a), *flags]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "no run has an eval/<step>/positions.json" in err
        assert "tools/evaluate.py --run RUN --val --per-position --lengths" in err
    assert not (tmp_path / "p.png").exists()

    b = make_run(tmp_path, "broken_seed1", 1, 500.0, [(100, 3.5)])
    bad = b / "eval" / "step_0000100" / "positions.json"
    bad.parent.mkdir(parents=True)
    bad.write_text('{"train_seq_len": 256, "results": [')
    assert cli.main([str(a), str(b)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{bad}: not valid JSON" in err
    data = write_positions(b, 2.0, 0.1)
    del data["results"][1]["buckets"][3]["loss"]
    bad.write_text(json.dumps(data))
    assert cli.main([str(a), str(b)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(bad) in err and "results[1].buckets[3]: 'loss'" in err


def test_seeds_evaluated_at_fewer_lengths(tmp_path, capsys):
    from pretrain.eval.compare import compare, position_curves

    s1 = make_run(tmp_path, "rope10k_seed1", 1, 10000.0, [(100, 3.5)])
    s2 = make_run(tmp_path, "rope10k_seed2", 2, 10000.0, [(100, 3.6)])
    d1 = write_positions(s1, 2.0, 0.1)
    d2 = write_positions(s2, 2.2, 0.2)
    d2["results"] = [r for r in d2["results"] if r["length"] <= 512]  # evaluated at 1x, 2x only
    (s2 / "eval" / "step_0000100" / "positions.json").write_text(json.dumps(d2))
    assert load_cli().main([str(s1), str(s2), "--positions"]) == 0
    row = (
        f"| rope10k | 2 | none | {_cell([_loss(d1, 256), _loss(d2, 256)])} | "
        f"{_cell([_loss(d1, 512), _loss(d2, 512)])} | {_loss(d1, 1024):.4f} (n=1) |"
    )
    assert row in unpadded(capsys.readouterr().out)
    (curve,) = position_curves(compare([s1, s2])[1])
    assert (curve.length, curve.n, len(curve.x)) == (512, 2, 257)  # the longest both have


def test_evaluations_with_rope_scaling_are_compared_apart(tmp_path, capsys):
    """tools/evaluate.py --rope-scaling yarn:4 writes RUN/eval/<step>_yarn4/; compare_runs reads
    the model's own evaluations by default and those with --rope-scaling yarn:4, never a mix."""
    cli = load_cli()
    run = make_run(tmp_path, "rope10_seed1", 1, 10000.0, [(100, 3.0)])
    own = write_positions(run, 2.0, 0.5)
    scaled = write_positions(
        run, 2.0, 0.1, step=50, rope_scaling={"type": "yarn", "factor": 4.0}, folder_suffix="_yarn4"
    )
    write_positions(run, 9.0, 0.1, step=100, folder_suffix="_linear2")  # another scaling

    def losses(argv):
        assert cli.main([str(run), "--positions", *argv, "--csv", str(tmp_path / "c.csv")]) == 0
        rows = csv.DictReader(io.StringIO((tmp_path / "c.csv").read_text()))
        return {int(r["length"]): float(r["length_loss"]) for r in rows if r["kind"] == "length"}

    lengths = [TRAIN_LEN, 2 * TRAIN_LEN, 4 * TRAIN_LEN, 8 * TRAIN_LEN]
    assert losses([]) == {n: _loss(own, n) for n in lengths}
    assert "yarn" not in capsys.readouterr().out
    assert losses(["--rope-scaling", "yarn:4"]) == {n: _loss(scaled, n) for n in lengths}
    assert "yarn x4" in capsys.readouterr().out
    assert cli.main([str(run), "--positions", "--rope-scaling", "ntk:2"]) == 2
    assert "no run has an eval/<step>/positions.json" in capsys.readouterr().err


def test_per_octave_merges_buckets_into_exact_token_weighted_losses(tmp_path, capsys):
    from pretrain.eval.compare_positions import coarsen, parse_positions

    run = make_run(tmp_path, "rope10_seed1", 1, 10000.0, [(100, 3.0)])
    data = write_positions(run, 2.0, 0.3)
    result = next(r for r in parse_positions(data).results if r.length == r.stride == 4 * TRAIN_LEN)
    merged = coarsen(result.buckets, 8)
    # The merged buckets tile the window, and each loss is the loss over its positions.
    assert merged[0].start == 0 and merged[-1].end == 4 * TRAIN_LEN
    assert all(a.end == b.start for a, b in zip(merged, merged[1:], strict=False))
    assert [b.end - b.start for b in merged[:8]] == [1] * 8  # the first positions stay apart
    assert 8 * 6 < len(merged) <= 8 * 10 + 1  # about 8 per octave of 1024 positions
    assert sum(b.tokens for b in merged) == result.tokens
    for b in merged:
        inner = [x for x in result.buckets if b.start <= x.start < b.end]
        want = sum(x.loss * x.tokens for x in inner) / sum(x.tokens for x in inner)
        assert b.loss == pytest.approx(want, rel=1e-12)
    png = tmp_path / "p.png"
    assert load_cli().main([str(run), "--positions-plot", str(png), "--per-octave", "8"]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        load_cli().main([str(run), "--positions-plot", str(png), "--per-octave", "0"])
    assert e.value.code == 2 and "--per-octave 0" in capsys.readouterr().err
