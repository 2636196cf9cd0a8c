"""Loss by position and evaluation past the training length (pretrain/eval/positions.py)."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import socket

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import REPO

from pretrain.config import ModelConfig
from pretrain.eval.lengths import LengthError, parse_lengths, parse_rope_scaling
from pretrain.eval.metrics import evaluate_loss
from pretrain.eval.positions import (
    PositionLosses,
    bucket_edges,
    evaluate_length,
    stream_windows,
)
from pretrain.model import Transformer
from pretrain.model.loss import token_losses


def tiny(**kw) -> Transformer:
    torch.manual_seed(kw.pop("seed", 0))
    base = dict(
        vocab_size=97,
        pad_vocab_to_multiple=8,
        n_layers=2,
        d_model=32,
        n_heads=4,
        d_ff=64,
        max_seq_len=16,
        rope_fraction=0.5,
    )
    return Transformer(ModelConfig(**{**base, **kw})).eval()


def stream_of(n: int, seed: int = 3) -> np.ndarray:
    return torch.randint(0, 97, (n,), generator=torch.Generator().manual_seed(seed)).numpy()


def test_token_losses_equal_cross_entropy_per_token():
    torch.manual_seed(0)
    h, w = torch.randn(3, 50, 16), torch.randn(97, 16)
    t = torch.randint(0, 97, (3, 50))
    t[1, :7] = -100
    got = token_losses(h, w, t, chunk_tokens=32)  # several chunks, one ragged
    ref = F.cross_entropy(
        F.linear(h, w).view(-1, 97), t.view(-1), ignore_index=-100, reduction="none"
    ).view(3, 50)
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-5)
    assert torch.all(got[1, :7] == 0)


def test_bucket_edges_every_position_then_four_per_octave():
    e = bucket_edges(2048)
    assert e[:257] == list(range(257))
    assert e[257:] == [round(256 * 2 ** (k / 4)) for k in range(1, 12)] + [2048]
    assert bucket_edges(40) == list(range(41))


def test_per_position_weighted_by_tokens_equals_the_valid_loss():
    """The loss by position of --val's samples, weighted by its token counts, is the
    valid loss the model's own loss gives (evaluate_loss without positions) to 1e-6."""
    model = tiny(max_seq_len=32)
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, 97, (9, 32), generator=g)
    y = torch.randint(0, 97, (9, 32), generator=g)
    y[4, 20:] = -100  # unequal counts per position
    batches = [{"input_ids": x[i : i + 4], "labels": y[i : i + 4]} for i in range(0, 9, 4)]
    plain = evaluate_loss(model, batches)
    positions = PositionLosses(32)
    with_positions = evaluate_loss(model, batches, positions=positions)
    buckets = positions.buckets()
    weighted = sum(b.loss * b.tokens for b in buckets) / sum(b.tokens for b in buckets)
    assert abs(weighted - plain["loss"]) < 1e-6
    assert abs(with_positions["loss"] - plain["loss"]) < 1e-6
    assert sum(b.tokens for b in buckets) == plain["tokens"] == 9 * 32 - 12
    assert [b.tokens for b in buckets][20:] == [8] * 12


def _reference_window_losses(model, stream, begin, length) -> torch.Tensor:
    """Per-target losses of one window from whole logits (F.cross_entropy)."""
    x = torch.from_numpy(stream[begin : begin + length].copy())[None]
    y = torch.from_numpy(stream[begin + 1 : begin + length + 1].copy())
    with torch.no_grad():
        logits = model(x)[0].float()
    return F.cross_entropy(logits, y, reduction="none").double()


def test_stride_equal_to_the_window_equals_disjoint_windows():
    model = tiny()
    stream = stream_of(16 * 6 + 1)
    L = 16
    disjoint = evaluate_length(model, stream, L)
    same = evaluate_length(model, stream, L, stride=L)
    assert disjoint == same
    # Against whole-logit cross-entropy over the stream cut in rows of L.
    ref = torch.stack([_reference_window_losses(model, stream, b, L) for b in range(0, 96, L)])
    assert disjoint.windows == 6 and disjoint.tokens == 96
    assert abs(disjoint.loss - float(ref.mean())) < 1e-6
    per_position = ref.mean(0)
    for b in disjoint.buckets:
        assert abs(b.loss - float(per_position[b.start])) < 1e-6


def test_sliding_windows_score_each_target_once_with_its_window_context():
    model = tiny()
    L, S = 16, 4
    stream = stream_of(80)
    windows = stream_windows(64, L, S)
    assert windows[0] == (0, 0) and all(first == L - S for _, first in windows[1:])
    result = evaluate_length(model, stream, L, stride=S, n_targets=64)
    scored = {}
    for begin, first in windows:
        losses = _reference_window_losses(model, stream, begin, L)
        for p in range(first, L):
            assert begin + p not in scored  # each target once
            scored[begin + p] = float(losses[p])
    assert sorted(scored) == list(range(64))
    assert result.tokens == 64
    assert abs(result.loss - sum(scored.values()) / 64) < 1e-6


def _rank_main(rank: int, world: int, port: int, out_path: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    try:
        r = evaluate_length(tiny(), stream_of(16 * 5 + 1), 16, stride=8)
        with open(f"{out_path}.{rank}", "w") as f:
            json.dump(dataclasses.asdict(r), f)
    finally:
        torch.distributed.destroy_process_group()


def test_two_ranks_give_what_one_gives(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torch.multiprocessing.start_processes(
        _rank_main, args=(2, port, str(tmp_path / "out")), nprocs=2, join=True, start_method="spawn"
    )
    one = evaluate_length(tiny(), stream_of(16 * 5 + 1), 16, stride=8)
    for r in range(2):
        got = json.loads((tmp_path / f"out.{r}").read_text())
        assert got["tokens"] == one.tokens and got["windows"] == one.windows == 9
        assert abs(got["loss"] - one.loss) < 1e-9
        for a, b in zip(got["buckets"], one.buckets, strict=True):
            assert a["tokens"] == b.tokens and abs(a["loss"] - b.loss) < 1e-9


def test_past_the_training_length_partial_rope_and_nope_are_finite_and_unscaled_is_exact():
    """At 4x max_seq_len the grown cache gives what a model built for that length gives
    (same weights), and a scaling leaves NoPE untouched."""
    x = torch.randint(0, 97, (2, 64), generator=torch.Generator().manual_seed(5))
    for fraction in (0.5, 0.0):
        short = tiny(max_seq_len=16, rope_fraction=fraction)
        long = tiny(max_seq_len=64, rope_fraction=fraction)
        long.load_state_dict(short.state_dict())
        with torch.no_grad():
            a, b = short(x), long(x)
        assert torch.isfinite(a).all()
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    nope = tiny(max_seq_len=16, rope_fraction=0.0)
    with torch.no_grad():
        before = nope(x)
        nope.set_rope_scaling(parse_rope_scaling("yarn:4"))
        assert torch.equal(nope(x), before)


def test_length_and_scaling_flags_give_one_line_errors():
    assert parse_lengths("1x,2x,8192,2x", 2048) == [2048, 4096, 8192]
    assert parse_lengths("0.5x", 256) == [128]
    with pytest.raises(LengthError, match="'3y' is neither"):
        parse_lengths("1x,3y", 2048)
    with pytest.raises(LengthError, match="no lengths"):
        parse_lengths(",", 2048)
    s = parse_rope_scaling("yarn:4")
    assert (s.type, s.factor) == ("yarn", 4.0)
    s = parse_rope_scaling("{type: linear, factor: 2, original_max_seq_len: 256}")
    assert (s.type, s.factor, s.original_max_seq_len) == ("linear", 2.0, 256)
    assert parse_rope_scaling("none") is None
    with pytest.raises(LengthError, match="is not allowed"):
        parse_rope_scaling("rotate:2")
    with pytest.raises(LengthError, match="not a number"):
        parse_rope_scaling("yarn:big")
    with pytest.raises(Exception, match="factor=0.5 must be >= 1"):
        tiny().set_rope_scaling(parse_rope_scaling("linear:0.5"))


# ----------------------------------------------------------------------------- the program


@pytest.fixture(scope="module")
def byte_run(tmp_path_factory):
    """A saved model on byte-level data prepared by the real pipeline (valid split)."""
    from train_support import saved_byte_run

    return saved_byte_run(tmp_path_factory.mktemp("positions"), 32, rope_fraction=0.25)


def evaluate_cli(argv: list[str]) -> int:
    spec = importlib.util.spec_from_file_location("tools_evaluate", REPO / "tools" / "evaluate.py")
    cli = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cli)
    return cli.main(argv)


def test_evaluate_val_per_position_matches_its_valid_loss(byte_run, tmp_path):
    run, _ = byte_run
    out = tmp_path / "out"
    args = ["--run", str(run), "--tasks", "none", "--val", "--val-samples", "12"]
    assert evaluate_cli([*args, "--per-position", "--output", str(out)]) == 0
    assert evaluate_cli([*args, "--output", str(tmp_path / "plain")]) == 0
    plain = json.loads((tmp_path / "plain" / "valid_metrics.json").read_text())
    rec = json.loads((out / "positions.json").read_text())
    (r,) = rec["results"]
    assert (r["length"], r["windows"], rec["source"]) == (32, 12, "validation samples")
    weighted = sum(b["loss"] * b["tokens"] for b in r["buckets"]) / r["tokens"]
    assert abs(weighted - plain["loss"]) < 1e-6 and r["tokens"] == plain["tokens"]
    assert (out / "positions.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert len((out / "positions.csv").read_text().splitlines()) == 1 + 32
    assert "## Loss by position" in (out / "results.md").read_text()


def test_evaluate_lengths_past_the_training_length(byte_run, tmp_path):
    run, model = byte_run
    out = tmp_path / "out"
    argv = ["--run", str(run), "--tasks", "none", "--lengths", "1x,2x,4x", "--val-samples", "8"]
    assert evaluate_cli([*argv, "--output", str(out)]) == 0
    rec = json.loads((out / "positions.json").read_text())
    assert [r["length"] for r in rec["results"]] == [32, 64, 128]
    # Every length scores the same 256 targets: 8 samples x 32, a multiple of 128.
    assert [r["tokens"] for r in rec["results"]] == [256, 256, 256]
    assert [r["windows"] for r in rec["results"]] == [8, 4, 2]
    assert all(np.isfinite(r["loss"]) for r in rec["results"])
    # The 4x figure is the model's own loss on the first 2 windows of 128 of the stream.
    from pretrain.data.dataset import read_token_stream

    cfg = json.loads(json.dumps(rec))
    assert cfg["train_seq_len"] == 32
    entries = [str(run.parent / "data")]
    stream = read_token_stream(entries, 257)
    x = torch.from_numpy(stream[:256].reshape(2, 128).copy())
    y = torch.from_numpy(stream[1:257].reshape(2, 128).copy())
    with torch.no_grad():
        ref = F.cross_entropy(model(x).view(-1, 257), y.reshape(-1))
    assert abs(rec["results"][2]["loss"] - float(ref)) < 1e-5
    # With YaRN and a stride: the scaling is recorded and the stride slides.
    out2 = tmp_path / "yarn"
    assert (
        evaluate_cli([*argv, "--rope-scaling", "yarn:4", "--stride", "16", "--output", str(out2)])
        == 0
    )
    rec2 = json.loads((out2 / "positions.json").read_text())
    assert rec2["rope_scaling"]["type"] == "yarn" and rec2["rope_scaling"]["factor"] == 4.0
    assert [r["stride"] for r in rec2["results"]] == [16, 16, 16]


def test_evaluate_lengths_refuses_learned_positions_with_one_line(tmp_path, capsys):
    from pretrain.weights import save_weights

    model = tiny(max_seq_len=16, learned_pos_emb=True, rope_fraction=0.0)
    wdir = tmp_path / "run" / "checkpoints" / "step_0000001"
    save_weights(model, wdir, {"data": {"valid": [str(tmp_path)]}, "train": {"seq_len": 16}})
    from pretrain.data.tokenizer import load_tokenizer

    load_tokenizer("bytes").save(wdir / "tokenizer")
    (wdir.parent / "latest").write_text(wdir.name)
    code = evaluate_cli(["--run", str(tmp_path / "run"), "--tasks", "none", "--lengths", "1x,2x"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code != 0
    assert len(err) == 1 and "learned position table (16 positions" in err[0], err


def test_a_scaled_evaluation_never_overwrites_the_models_own(byte_run):
    """Without --output, --rope-scaling writes RUN/eval/<step>_<scaling>/: the model's own
    results stay, and two scalings differing in any field get two folders."""
    from pretrain.eval.lengths import parse_rope_scaling, scaling_tag

    run, _ = byte_run
    argv = ["--run", str(run), "--tasks", "none", "--lengths", "1x,2x", "--val-samples", "4"]
    assert evaluate_cli(argv) == 0
    own = run / "eval" / "step_0000001" / "positions.json"
    before = own.read_bytes()
    assert evaluate_cli([*argv, "--rope-scaling", "yarn:4"]) == 0
    assert own.read_bytes() == before
    scaled = json.loads((run / "eval" / "step_0000001_yarn4" / "positions.json").read_text())
    assert scaled["rope_scaling"]["factor"] == 4.0 and json.loads(before)["rope_scaling"] is None
    tags = {
        scaling_tag(parse_rope_scaling(s))
        for s in ("yarn:4", "yarn:2", "linear:4", "{type: yarn, factor: 4, beta_fast: 16}")
    }
    assert len(tags) == 4 and "yarn4" in tags and scaling_tag(None) == ""
    assert scaling_tag(parse_rope_scaling("linear:1.5")) == "linear1p5"
