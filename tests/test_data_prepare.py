"""Corpus -> indexed shards, on the real files in ../shared/data, read back through megatron-core."""

from __future__ import annotations

import gzip
import json
import multiprocessing as mp
import os
from pathlib import Path

import numpy as np
import pytest
from conftest import shared_path

from pretrain.data.megatron_compat import import_quietly
from pretrain.data.prepare import prepare
from pretrain.data.recipes import prepare_enwik8, prepare_tinyshakespeare
from pretrain.data.shards import PrepareError, read_manifest
from pretrain.data.sources import SourceError
from pretrain.data.tokenize_workers import in_valid
from pretrain.data.tokenizer import load_tokenizer

NEOX = ("tokenizers", "gpt-neox-20b_tokenizer.json")
# Small but real: 150 FineWeb-Edu documents, 30 C4 and 20 CCNet documents (gzip).
SMALL = ("fineweb_edu_10BT_150docs.jsonl", "c4-sample.0*.json.gz", "ccnet_cc_en_head-*.jsonl.gz")


def _inputs(patterns=SMALL) -> list[str]:
    webtext = shared_path("webtext")
    return [str(webtext / p) for p in patterns]


def _read_docs(patterns=SMALL) -> list[str]:
    """The documents in the order prepare reads them (each glob sorted), read independently."""
    docs = []
    for pattern in patterns:
        for path in sorted(shared_path("webtext").glob(pattern)):
            opener = gzip.open if path.name.endswith(".gz") else open
            with opener(path, "rt", encoding="utf-8") as f:
                docs += [json.loads(line)["text"] for line in f if line.strip()]
    return [d for d in docs if d]


def _documents(split_dir: Path) -> list[np.ndarray]:
    """Every document of every shard, through megatron-core's own reader."""
    IndexedDataset = import_quietly("megatron.core.datasets.indexed_dataset").IndexedDataset
    manifest = read_manifest(split_dir)
    out = []
    for shard in manifest["shards"]:
        ds = IndexedDataset(str(split_dir / shard["prefix"]))
        out += [np.array(ds[i]) for i in range(len(ds))]  # copies: the mmap closes with ds
    return out


def _files(out: Path) -> dict[str, bytes]:
    return {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.rglob("shard_*"))}


@pytest.fixture(scope="module")
def neox_out(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("neox1")
    prepare(
        out,
        str(shared_path(*NEOX)),
        inputs=_inputs(),
        workers=1,
        shard_tokens=40_000,
        docs_per_unit=16,
        valid_fraction=0.1,
        progress=False,
    )
    return out


ALL = (*SMALL, "fineweb_10BT_legal-prefiltered_500docs.jsonl.gz")  # every web-text file


@pytest.fixture(scope="module")
def full_out(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("full")
    prepare(out, load_tokenizer(shared_path(*NEOX)), inputs=_inputs(ALL), workers=1, progress=False)
    return out


def test_round_trip_pythia_tokenizer(full_out):
    """Every document decodes back exactly, in input order, with one EOD after each."""
    tok = load_tokenizer(full_out / "tokenizer")
    docs = _read_docs(ALL)
    got = _documents(full_out / "train")
    assert len(got) == len(docs) == 700
    for text, ids in zip(docs, got, strict=True):
        assert ids[-1] == tok.eod_id == 0 and tok.eod_id not in ids[:-1]
        assert tok.decode(ids[:-1]) == text
    manifest = read_manifest(full_out / "train")
    assert manifest["documents"] == 700 and manifest["tokens"] == sum(map(len, got))
    assert manifest["tokenizer"]["sha256"] == tok.sha256 and manifest["dtype"] == "uint16"
    assert len(manifest["sources"]) == 7 and manifest["complete"]


def test_valid_split_is_document_disjoint(neox_out):
    tok = load_tokenizer(neox_out / "tokenizer")
    train = {tok.decode(d[:-1]) for d in _documents(neox_out / "train")}
    valid = {tok.decode(d[:-1]) for d in _documents(neox_out / "valid")}
    docs = _read_docs()
    assert train | valid == set(docs) and not train & valid
    # Exactly the documents whose hash falls under the fraction, in about that proportion.
    assert valid == {d for d in docs if in_valid(d, 0.1)}
    assert 0.03 < len(valid) / len(docs) < 0.2
    assert len(read_manifest(neox_out / "train")["shards"]) >= 3  # shard limit respected


def test_one_and_two_workers_write_identical_bytes(neox_out, tmp_path):
    prepare(
        tmp_path,
        str(shared_path(*NEOX)),
        inputs=_inputs(),
        workers=2,
        shard_tokens=40_000,
        docs_per_unit=16,
        valid_fraction=0.1,
        progress=False,
    )
    assert _files(tmp_path) == _files(neox_out) and len(_files(tmp_path)) >= 8


def _prepare_then_crash(out: str, after_units: int) -> None:
    os.environ["PRETRAIN_TEST_KILL_AT"] = f"prepare_units_written:{after_units}"
    prepare(
        out,
        str(shared_path(*NEOX)),
        inputs=_inputs(),
        workers=2,
        shard_tokens=40_000,
        docs_per_unit=16,
        valid_fraction=0.1,
        progress=False,
    )


def test_killed_run_resumes_to_identical_files(neox_out, tmp_path):
    # A crash mid-run (the process exits at once after 9 units: no clean-up at all).
    proc = mp.get_context("fork").Process(target=_prepare_then_crash, args=(str(tmp_path), 9))
    proc.start()
    proc.join(120)
    assert proc.exitcode == 137  # pretrain/faults.py die(): as kill -9, no clean-up
    partial = read_manifest(tmp_path / "train")
    assert not partial["complete"] and 1 <= len(partial["shards"]) < len(
        read_manifest(neox_out / "train")["shards"]
    )
    # Both splits record the same resume point, so the small valid split does not force a restart.
    assert read_manifest(tmp_path / "valid")["next_unit"] == partial["next_unit"] > 0
    assert list(tmp_path.rglob("*.tmp.*")), "the crash should leave a half-written shard"
    prepare(
        tmp_path,
        str(shared_path(*NEOX)),
        inputs=_inputs(),
        workers=1,
        shard_tokens=40_000,
        docs_per_unit=16,
        valid_fraction=0.1,
        progress=False,
    )
    assert _files(tmp_path) == _files(neox_out)
    assert not list(tmp_path.rglob("*.tmp.*"))
    # A finished output is not rewritten.
    mtimes = {p: p.stat().st_mtime_ns for p in tmp_path.rglob("shard_*")}
    prepare(
        tmp_path,
        str(shared_path(*NEOX)),
        inputs=_inputs(),
        workers=1,
        shard_tokens=40_000,
        docs_per_unit=16,
        valid_fraction=0.1,
        progress=False,
    )
    assert mtimes == {p: p.stat().st_mtime_ns for p in tmp_path.rglob("shard_*")}


def test_parquet_input_matches_jsonl(neox_out, tmp_path):
    """FineWeb-style parquet (one file per jsonl input, row groups of 16 = the jsonl units)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    inputs = []
    for k, pattern in enumerate(SMALL):
        for path in sorted(shared_path("webtext").glob(pattern)):
            opener = gzip.open if path.name.endswith(".gz") else open
            with opener(path, "rt", encoding="utf-8") as f:
                docs = [json.loads(line)["text"] for line in f if line.strip()]
            inputs.append(tmp_path / f"{k}_{path.name.replace('.', '_')}.parquet")
            pq.write_table(
                pa.table({"id": list(range(len(docs))), "text": docs}),
                inputs[-1],
                row_group_size=16,
            )
    prepare(
        tmp_path / "pq",
        str(shared_path(*NEOX)),
        inputs=[str(tmp_path / "*.parquet")],
        workers=2,
        shard_tokens=40_000,
        valid_fraction=0.1,
        progress=False,
    )
    assert sorted(inputs) == inputs
    assert _files(tmp_path / "pq") == _files(neox_out)


def test_sentencepiece_round_trip(tmp_path):
    tok = load_tokenizer(shared_path("tokenizers", "llama2_tokenizer.model"))
    prepare(tmp_path, tok, inputs=_inputs(SMALL[:1]), workers=1, progress=False)
    docs = _read_docs(SMALL[:1])
    got = _documents(tmp_path / "train")
    assert [tok.decode(ids[:-1]) for ids in got] == docs
    assert all(ids[-1] == 2 for ids in got)


def test_tinyshakespeare_recipe(tmp_path):
    path = shared_path("tinyshakespeare.txt")
    text = path.read_text()
    prepare_tinyshakespeare(tmp_path, path, progress=False)
    tok = load_tokenizer(tmp_path / "tokenizer")
    assert tok.vocab_size == 65 and tok.eod_id is None
    n = int(len(text) * 0.9)  # nanoGPT: data[:int(n*0.9)]
    (train,), (valid,) = _documents(tmp_path / "train"), _documents(tmp_path / "valid")
    assert tok.decode(train) == text[:n] and tok.decode(valid) == text[n:]
    assert len(train) + len(valid) == len(text) == 1_115_394  # no end-of-document tokens added


def test_enwik8_recipe_splits_bytes(tmp_path):
    import zipfile

    # The real enwik8 is not in ../shared; a zip of real text exercises the same code path.
    raw = shared_path("tinyshakespeare.txt").read_bytes() + "naïve".encode()
    with zipfile.ZipFile(tmp_path / "enwik8.zip", "w") as z:
        z.writestr("enwik8", raw)
    sizes = (1_000_000, 50_000, 50_000)
    prepare_enwik8(tmp_path / "out", tmp_path / "enwik8.zip", sizes=sizes, progress=False)
    tok = load_tokenizer(tmp_path / "out" / "tokenizer")
    splits = [
        tok.decode(_documents(tmp_path / "out" / s)[0]).encode("latin-1")
        for s in ("train", "valid", "test")
    ]
    assert splits == [raw[:1_000_000], raw[1_000_000:1_050_000], raw[1_050_000:1_100_000]]
    assert tok.vocab_size == len(set(raw))  # bytes that occur, one token each
    with pytest.raises(PrepareError, match="fewer than"):
        prepare_enwik8(tmp_path / "o2", tmp_path / "enwik8.zip", progress=False)


def test_clear_errors(tmp_path, neox_out):
    tok = str(shared_path(*NEOX))
    with pytest.raises(SourceError, match="input file not found"):
        prepare(tmp_path / "o", tok, inputs=[str(tmp_path / "nope.jsonl")], progress=False)
    with pytest.raises(SourceError, match="no field 'content'.*--text-field"):
        prepare(
            tmp_path / "o", tok, inputs=_inputs(SMALL[:1]), text_field="content", progress=False
        )
    bad = tmp_path / "bad.parquet"
    bad.write_bytes(b"PAR1 this is not parquet")
    with pytest.raises(SourceError, match="not a readable parquet file"):
        prepare(tmp_path / "o", tok, inputs=[str(bad)], progress=False)
    empty = tmp_path / "empty.jsonl"
    empty.write_bytes(b"")
    with pytest.raises(SourceError, match="empty"):
        prepare(tmp_path / "o", tok, inputs=[str(empty)], progress=False)
    with pytest.raises(
        PrepareError, match="prepared with tokenizer .*gpt-neox.* but this run uses .*llama2"
    ):
        prepare(
            neox_out,
            str(shared_path("tokenizers", "llama2_tokenizer.model")),
            inputs=_inputs(),
            valid_fraction=0.1,
            progress=False,
        )
    with pytest.raises(PrepareError, match="different settings"):
        prepare(
            neox_out,
            tok,
            inputs=_inputs(),
            workers=1,
            shard_tokens=40_000,
            docs_per_unit=8,
            valid_fraction=0.1,
            progress=False,
        )


def test_cli_help_and_error():
    import subprocess
    import sys

    repo = Path(__file__).resolve().parents[1]
    r = subprocess.run(
        [
            sys.executable,
            "tools/prepare_data.py",
            "--input",
            "missing.jsonl",
            "--tokenizer",
            "bytes",
            "--output",
            "/tmp/never",
        ],
        cwd=repo,
        capture_output=True,
        text=True,
    )
    assert (
        r.returncode == 2
        and r.stderr.strip().splitlines()[-1] == "error: input file not found: missing.jsonl"
    )


def test_hugging_face_dataset_path(tmp_path):
    """--hf-dataset goes through `datasets.load_dataset(..., streaming=True)`; offline here, a
    local dataset folder stands in for a hub name and must give the same bytes as --input."""
    import shutil

    src = shared_path("webtext", SMALL[0])
    (tmp_path / "hub").mkdir()
    shutil.copy(src, tmp_path / "hub" / src.name)
    tok = str(shared_path("tokenizers", "llama2_tokenizer.model"))
    m = prepare(
        tmp_path / "hf",
        tok,
        hf_dataset=str(tmp_path / "hub"),
        docs_per_unit=64,
        workers=1,
        progress=False,
    )
    prepare(tmp_path / "local", tok, inputs=[str(src)], docs_per_unit=64, workers=1, progress=False)
    assert _files(tmp_path / "hf") == _files(tmp_path / "local")
    assert m["train"]["documents"] == 150 and m["train"]["sources"][0]["hf_dataset"] == str(
        tmp_path / "hub"
    )
    with pytest.raises(SourceError, match="no field 'body'"):
        prepare(
            tmp_path / "hf2",
            tok,
            hf_dataset=str(tmp_path / "hub"),
            text_field="body",
            progress=False,
        )


# ----------------------------------------------------------------------------- bad input (issue 13)


def _gappy_records() -> list[dict]:
    """40 real documents with null (8), missing (6) and empty (5) texts between them."""
    records = []
    for i, doc in enumerate(_read_docs(SMALL[:1])[:40]):
        records.append({"id": f"doc{i}", "text": doc})
        if i % 5 == 0:
            records.append({"id": f"null{i}", "text": None})
        if i % 7 == 0:
            records.append({"id": f"missing{i}"})
        if i % 9 == 0:
            records.append({"id": f"empty{i}", "text": ""})
    return records


def _write_jsonl(path: Path, records: list[dict], blank_after: int | None = None) -> Path:
    lines = [json.dumps(r) for r in records]
    if blank_after is not None:
        lines.insert(blank_after, "")
    path.write_text("\n".join(lines) + "\n")
    return path


def test_null_missing_and_empty_texts_are_skipped_and_counted_in_every_format(tmp_path):
    """jsonl, parquet and a Hugging Face dataset with the same gaps write the bytes of the real
    documents alone, and every manifest counts what was skipped."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    records = _gappy_records()
    docs = [r["text"] for r in records if r.get("text")]
    tok = str(shared_path(*NEOX))
    jsonl = _write_jsonl(tmp_path / "gappy.jsonl", records, blank_after=3)
    parquet = tmp_path / "gappy.parquet"
    pq.write_table(
        pa.table({"id": [r["id"] for r in records], "text": [r.get("text") for r in records]}),
        parquet,
        row_group_size=16,
    )
    (tmp_path / "hub").mkdir()
    _write_jsonl(tmp_path / "hub" / "data.jsonl", records)
    clean = _write_jsonl(tmp_path / "clean.jsonl", [{"text": d} for d in docs])
    common = dict(valid_fraction=0.2, docs_per_unit=8, workers=2, progress=False)
    ref = prepare(tmp_path / "clean", tok, inputs=[str(clean)], **common)
    assert ref["train"]["skipped_documents"] == {"no_text": 0, "empty_text": 0}
    outs = {
        "jsonl": prepare(tmp_path / "jsonl", tok, inputs=[str(jsonl)], **common),
        "parquet": prepare(tmp_path / "parquet", tok, inputs=[str(parquet)], **common),
        "hf": prepare(tmp_path / "hf", tok, hf_dataset=str(tmp_path / "hub"), **common),
    }
    for name, manifests in outs.items():
        assert _files(tmp_path / name) == _files(tmp_path / "clean"), name
        for split in ("train", "valid"):
            assert manifests[split]["skipped_documents"] == {"no_text": 14, "empty_text": 5}, (
                name,
                split,
            )
            assert read_manifest(tmp_path / name / split)["skipped_documents"] == {
                "no_text": 14,
                "empty_text": 5,
            }
    assert ref["train"]["documents"] + ref["valid"]["documents"] == len(docs) == 40


def test_skipped_counts_survive_a_crash_and_a_damaged_shard(tmp_path):
    records = _gappy_records()
    src = _write_jsonl(tmp_path / "gappy.jsonl", records)
    settings = dict(
        inputs=[str(src)],
        workers=1,
        shard_tokens=3_000,
        docs_per_unit=4,
        valid_fraction=0.2,
        progress=False,
    )
    tok = str(shared_path(*NEOX))
    whole = prepare(tmp_path / "whole", tok, **settings)
    assert len(whole["train"]["shards"]) >= 4
    # A crash after 5 units (no clean-up), then the same command again.
    proc = mp.get_context("fork").Process(
        target=_prepare_gappy_then_crash, args=(tmp_path / "out", settings, 5)
    )
    proc.start()
    proc.join(120)
    assert proc.exitcode == 137  # pretrain/faults.py die(): as kill -9, no clean-up
    partial = read_manifest(tmp_path / "out" / "train")
    assert 0 < partial["skipped_documents"]["no_text"] < 14  # counted up to the resume point only
    resumed = prepare(tmp_path / "out", tok, **settings)
    assert _files(tmp_path / "out") == _files(tmp_path / "whole")
    for split in ("train", "valid"):
        assert (
            resumed[split]["skipped_documents"]
            == whole[split]["skipped_documents"]
            == {"no_text": 14, "empty_text": 5}
        )
    # A damaged shard is rewritten from its start: the counts restart from there, not from zero.
    (tmp_path / "out" / "train" / f"{whole['train']['shards'][2]['prefix']}.bin").write_bytes(b"")
    again = prepare(tmp_path / "out", tok, **settings)
    assert _files(tmp_path / "out") == _files(tmp_path / "whole")
    assert again["train"]["skipped_documents"] == {"no_text": 14, "empty_text": 5}


def _prepare_gappy_then_crash(out: Path, settings: dict, after_units: int) -> None:
    os.environ["PRETRAIN_TEST_KILL_AT"] = f"prepare_units_written:{after_units}"
    prepare(out, str(shared_path(*NEOX)), **settings)


def _load_cli():
    """tools/prepare_data.py's program, run in this process (or a fork of it), which has
    megatron-core imported already; a fresh interpreter spends 5-20 s importing it."""
    from pretrain.cli import prepare_data

    return prepare_data


def test_non_string_text_and_wrong_field_are_one_line_errors(tmp_path, capfd):
    import pyarrow as pa
    import pyarrow.parquet as pq

    tok = str(shared_path(*NEOX))
    records = [
        {"text": "A first document."},
        {"text": None},
        {"text": "Another one."},
        {"text": 42},
        {"text": "Never reached."},
    ]
    bad = _write_jsonl(tmp_path / "bad.jsonl", records, blank_after=2)  # line 5 holds the 42
    with pytest.raises(SourceError) as err:
        prepare(tmp_path / "o", tok, inputs=[str(bad)], docs_per_unit=2, workers=1, progress=False)
    assert str(err.value).startswith(f"{bad}:5: field 'text' is 42 (int), not a string;")
    # The same through the command line with two workers: one line, no traceback.
    capfd.readouterr()
    rc = _load_cli().main(
        [
            "--input",
            str(bad),
            "--tokenizer",
            tok,
            "--output",
            str(tmp_path / "cli"),
            "--workers",
            "2",
            "--docs-per-unit",
            "1",
            "--no-progress",
        ]
    )
    stderr = capfd.readouterr().err  # the file descriptor: the workers' output too
    assert rc == 2 and "Traceback" not in stderr
    assert stderr.strip().splitlines()[-1] == f"error: {err.value}"
    # parquet: a text column that does not hold strings
    pq.write_table(pa.table({"text": [1, 2, 3]}), tmp_path / "ints.parquet")
    with pytest.raises(
        SourceError, match=r"ints.parquet: column 'text' holds int64, not text; pass --text-field"
    ):
        prepare(tmp_path / "o", tok, inputs=[str(tmp_path / "ints.parquet")], progress=False)
    # jsonl: a field that no early record has is a wrong --text-field...
    body = _write_jsonl(tmp_path / "body.jsonl", [{"body": f"text {i}"} for i in range(150)])
    with pytest.raises(
        SourceError,
        match=r"its first 100 records have no field 'text' \(fields: body\); pass --text-field",
    ):
        prepare(tmp_path / "o", tok, inputs=[str(body)], progress=False)
    # ...but one record without it is a missing text, skipped and counted.
    late = _write_jsonl(
        tmp_path / "late.jsonl", [{"id": 0}] + [{"text": f"text {i}"} for i in range(3)]
    )
    m = prepare(tmp_path / "late", tok, inputs=[str(late)], workers=1, progress=False)
    assert m["train"]["documents"] == 3 and m["train"]["skipped_documents"]["no_text"] == 1


def _cli_with_stderr(argv: list[str], stderr_path: str) -> None:
    import sys

    os.dup2(os.open(stderr_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), 2)  # workers inherit it
    sys.stderr = open(2, "w", closefd=False)  # not pytest's capture  # noqa: SIM115
    code = _load_cli().main(argv)
    sys.stderr.flush()
    os._exit(code)


def _cli_paused_after_shards(argv: list[str], stderr_path: str, paused_path: str) -> None:
    """tools/prepare_data.py's main, held still once 2 train shards are recorded: it touches
    `paused_path` and sleeps until a signal stops it. A fork of the test process runs this, so
    the patch lives and dies with it; the signal is the only way the run can go on or end."""
    import signal
    import time

    from pretrain.data.shards import SplitWriter

    # Ctrl-C in a terminal. A suite started in the background (`nohup ... &`) inherits an
    # ignored SIGINT, which prepare_data rightly leaves ignored; the test is about the keypress.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    close_shard = SplitWriter.close_shard

    def close_and_hold(self, end_unit: int) -> None:
        close_shard(self, end_unit)  # the shard and the manifest naming it are on disk now
        if self.dir.name == "train" and len(self.manifest["shards"]) >= 2:
            Path(paused_path).touch()
            while True:  # stop_on_signals' handler raises out of this sleep
                time.sleep(3600)

    SplitWriter.close_shard = close_and_hold
    _cli_with_stderr(argv, stderr_path)


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGINT"])
def test_signal_stops_cleanly_with_one_line(tmp_path, sig):
    """A real signal to tools/prepare_data.py's main process in the middle of a 2-worker run:
    exit 128+signal, one line naming the shards kept, no traceback from it or its workers.

    The run holds still after its 2nd shard until the signal comes (_cli_paused_after_shards),
    so the signal lands mid-run however fast or slow this machine is."""
    import signal
    import time

    one = gzip.decompress(
        shared_path("webtext", "fineweb_10BT_legal-prefiltered_500docs.jsonl.gz").read_bytes()
    )
    big = tmp_path / "big.jsonl"
    big.write_bytes(one)  # about 750k tokens: many more shards than the 2 the run stops after
    out, err_path, paused = tmp_path / "out", tmp_path / "stderr.txt", tmp_path / "paused"
    argv = [
        "--input",
        str(big),
        "--tokenizer",
        str(shared_path(*NEOX)),
        "--output",
        str(out),
        "--workers",
        "2",
        "--docs-per-unit",
        "8",
        "--shard-tokens",
        "20000",
    ]
    import_quietly("megatron.core.datasets.indexed_dataset")  # once, before the fork
    proc = mp.get_context("fork").Process(
        target=_cli_paused_after_shards, args=(argv, str(err_path), str(paused))
    )
    proc.start()
    try:
        deadline = time.time() + 300  # a generous bound for a slow machine, not a race
        while not paused.exists():
            if not proc.is_alive():
                pytest.fail(
                    f"exited ({proc.exitcode}) before its 2nd shard: {err_path.read_text()}"
                )
            if time.time() > deadline:
                pytest.fail("no 2nd shard within 300 s")
            time.sleep(0.02)
        os.kill(proc.pid, getattr(signal, sig))
        proc.join(60)
    finally:
        if proc.is_alive():
            proc.kill()
    assert proc.exitcode == 128 + getattr(signal, sig)
    err = err_path.read_text()
    assert "Traceback" not in err and "Error" not in err, err
    kept = len(read_manifest(out / "train")["shards"])
    assert not read_manifest(out / "train")["complete"] and kept == 2  # where it was held
    assert err.strip().splitlines()[-1] == (
        f"interrupted by {sig}; {kept} shards complete; rerun the same command to resume"
    )
