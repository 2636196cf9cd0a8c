"""Validation metrics: token-weighted loss, perplexity, bits per token / byte / character."""

from __future__ import annotations

import json
import math
import os
import socket

import pytest
import torch
import torch.nn.functional as F
from conftest import shared_path

from pretrain.config import ModelConfig
from pretrain.eval.metrics import (
    bytes_per_token,
    bytes_per_token_of_texts,
    evaluate_loss,
    loss_metrics,
)
from pretrain.model import Transformer


def tiny_model(seed: int = 0) -> Transformer:
    torch.manual_seed(seed)
    return Transformer(
        ModelConfig(
            vocab_size=97,
            pad_vocab_to_multiple=8,
            n_layers=1,
            d_model=32,
            n_heads=2,
            d_ff=64,
            max_seq_len=16,
            dropout=0.1,
        )
    )


def batches_of(seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 97, (7, 16), generator=g)
    y = torch.randint(0, 97, (7, 16), generator=g)
    y[5, 4:] = -100  # a partly ignored row and a short last batch: unequal token counts
    y[6, :] = -100
    return (
        x,
        y,
        [
            {"input_ids": x[:4], "labels": y[:4]},
            {"input_ids": x[4:6], "labels": y[4:6]},
            {"input_ids": x[6:], "labels": y[6:]},
        ],
    )


def test_loss_is_the_token_weighted_mean_over_all_batches():
    model = tiny_model()
    x, y, batches = batches_of()
    model.train()
    out = evaluate_loss(model, batches, bytes_per_token=4.0, chars_per_token=3.5)
    assert model.training  # mode restored
    model.eval()
    with torch.no_grad():
        ref = F.cross_entropy(
            model(x).double().view(-1, model.cfg.padded_vocab_size), y.view(-1), ignore_index=-100
        ).item()
    assert out["loss"] == pytest.approx(ref, abs=1e-6)  # eval mode: no dropout
    assert out["tokens"] == int((y != -100).sum())
    loss = out["loss"]
    assert out["ppl"] == pytest.approx(math.exp(loss), rel=1e-12)
    assert out["bits_per_token"] == pytest.approx(loss / math.log(2), rel=1e-12)
    assert out["bits_per_byte"] == pytest.approx(loss / math.log(2) / 4.0, rel=1e-12)
    assert out["bits_per_char"] == pytest.approx(loss / math.log(2) / 3.5, rel=1e-12)
    # max_batches: only the first batch
    first = evaluate_loss(model, batches, max_batches=1)
    with torch.no_grad():
        ref1 = F.cross_entropy(
            model(x[:4]).view(-1, model.cfg.padded_vocab_size), y[:4].reshape(-1)
        ).item()
    assert first["loss"] == pytest.approx(ref1, abs=1e-6)


def test_no_target_tokens_is_an_error():
    model = tiny_model()
    x = torch.zeros(2, 16, dtype=torch.long)
    with pytest.raises(ValueError, match="no target tokens"):
        evaluate_loss(model, [{"input_ids": x, "labels": torch.full_like(x, -100)}])
    with pytest.raises(ValueError, match="no target tokens"):
        evaluate_loss(model, [])


def test_bytes_per_token_on_real_text():
    from pretrain.data.tokenizer import load_tokenizer

    texts = [
        json.loads(line)["text"]
        for line in shared_path("webtext", "fineweb_edu_10BT_150docs.jsonl").open()
    ][:20]
    tok = load_tokenizer(shared_path("tokenizers", "gpt-neox-20b_tokenizer.json"))
    seqs = [tok.encode(t) for t in texts]
    n_bytes = sum(len(t.encode("utf-8")) for t in texts)
    n_tokens = sum(len(s) for s in seqs)
    assert bytes_per_token_of_texts(tok, texts) == pytest.approx(n_bytes / n_tokens)
    assert bytes_per_token(tok, seqs) == pytest.approx(n_bytes / n_tokens)  # decode round-trips
    assert 3.0 < n_bytes / n_tokens < 6.0  # English web text with a 50k BPE
    assert bytes_per_token(tok, seqs, unit="char") == pytest.approx(sum(map(len, texts)) / n_tokens)
    # Byte-level tokens: one byte per token, so bits per byte = bits per token.
    byte_tok = load_tokenizer("bytes")
    assert bytes_per_token(byte_tok, [byte_tok.encode(t) for t in texts]) == 1.0
    m = loss_metrics(1.2, 10, bytes_per_token=1.0)
    assert m["bits_per_byte"] == m["bits_per_token"]


def _rank_main(rank: int, world: int, port: int, out_path: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    try:
        model = tiny_model()
        _, _, batches = batches_of()
        mine = batches[rank::world]  # each rank its own shard, of unequal token counts
        out = evaluate_loss(model, mine)
        with open(f"{out_path}.{rank}", "w") as f:
            json.dump(out, f)
    finally:
        torch.distributed.destroy_process_group()


def test_ranks_agree_with_one_process(tmp_path):
    """Two gloo ranks with different shards return the single-process figures on all data."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torch.multiprocessing.start_processes(
        _rank_main, args=(2, port, str(tmp_path / "out")), nprocs=2, join=True, start_method="spawn"
    )
    results = [json.loads((tmp_path / f"out.{r}").read_text()) for r in range(2)]
    single = evaluate_loss(tiny_model(), batches_of()[2])
    for r in results:
        assert r["loss"] == pytest.approx(single["loss"], abs=1e-6)
        assert r["tokens"] == single["tokens"]


def test_evaluate_val_on_a_prepared_split(tmp_path, monkeypatch):
    """tools/evaluate.py --val on byte-level data prepared by the real pipeline: the loss of
    the same validation samples computed here, and bits per byte from their text."""
    import importlib.util

    from conftest import REPO
    from train_support import saved_byte_run

    from pretrain.config import DataConfig
    from pretrain.data.dataset import build_datasets

    run, model = saved_byte_run(tmp_path, 64, max_bytes=300_000, seed=7)
    data = run.parent / "data"

    spec = importlib.util.spec_from_file_location(
        "pretrain_tools_evaluate", REPO / "tools" / "evaluate.py"
    )
    cli = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cli)
    assert (
        cli.main(
            [
                "--run",
                str(tmp_path / "run"),
                "--tasks",
                "none",
                "--val",
                "--val-samples",
                "24",
                "--batch-size",
                "5",
            ]
        )
        == 0
    )
    got = json.loads(
        (tmp_path / "run" / "eval" / "step_0000001" / "valid_metrics.json").read_text()
    )
    assert "bits/byte" in (tmp_path / "run" / "eval" / "step_0000001" / "results.md").read_text()

    _, valid = build_datasets(DataConfig(train=[str(data)], valid=[str(data)]), 64, 7, 1, 24)
    x = torch.stack([valid[i]["input_ids"] for i in range(24)])
    y = torch.stack([valid[i]["labels"] for i in range(24)])
    with torch.no_grad():
        ref = F.cross_entropy(
            model.eval()(x).double().view(-1, 257), y.view(-1), ignore_index=-100
        ).item()
    assert got["loss"] == pytest.approx(ref, abs=1e-5)
    assert got["samples"] == 24 and got["tokens"] == int((y != -100).sum())
    n_bytes = sum(len(bytes(t for t in row.tolist() if t != 256)) for row in x)
    assert got["bytes_per_token"] == pytest.approx(n_bytes / x.numel())
    assert got["bits_per_byte"] == pytest.approx(got["loss"] / math.log(2) / got["bytes_per_token"])

    # A validation split that yields no scored token is a one-line error naming the data, not
    # a traceback (the fault is simulated: every label masked).
    import pretrain.eval.validation as validation_module

    real = validation_module.evaluate_loss

    def all_masked(model, batches, **kw):
        return real(
            model, ({**b, "labels": torch.full_like(b["labels"], -100)} for b in batches), **kw
        )

    monkeypatch.setattr(validation_module, "evaluate_loss", all_masked)
    assert cli.main(["--run", str(tmp_path / "run"), "--tasks", "none", "--val"]) == 2
