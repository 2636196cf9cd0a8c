"""Training samples and the loader: megatron-core GPTDataset/blending over prepared real text."""

from __future__ import annotations

import gc
import json
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import shared_path

from pretrain.config import DataConfig
from pretrain.data import megatron_compat
from pretrain.data.dataset import build_datasets, make_loader
from pretrain.data.megatron_compat import import_quietly
from pretrain.data.prefixes import DataError, tokenizer_for_data
from pretrain.data.prepare import prepare
from pretrain.data.shards import read_manifest
from pretrain.data.tokenizer import ByteTokenizer

SEQ = 64


@pytest.fixture(scope="module")
def corpora(tmp_path_factory, paragraphs) -> dict[str, Path]:
    """Byte-level: Tiny Shakespeare paragraphs (4 shards + valid; conftest) and FineWeb-Edu
    documents."""
    root = tmp_path_factory.mktemp("corpora")
    prepare(
        root / "edu",
        "bytes",
        inputs=[str(shared_path("webtext", "fineweb_edu_10BT_150docs.jsonl"))],
        workers=1,
        progress=False,
    )
    return {"shakespeare": paragraphs, "edu": root / "edu"}


def _rows(loader) -> list[list[int]]:
    return [row.tolist() for batch in loader for row in batch["input_ids"]]


def test_samples_are_shifted_windows_across_documents(corpora):
    data = DataConfig(train=[str(corpora["shakespeare"])], valid=[str(corpora["shakespeare"])])
    train, valid = build_datasets(data, seq_len=SEQ, seed=1234, train_samples=500, valid_samples=50)
    assert len(train) >= 500 and len(valid) >= 50
    assert len(read_manifest(corpora["shakespeare"] / "train")["shards"]) == 4
    text = shared_path("tinyshakespeare.txt").read_bytes()
    crossings = 0
    for i in range(0, 500, 7):
        s = train[i]
        assert (
            s["input_ids"].shape == s["labels"].shape == (SEQ,)
            and s["input_ids"].dtype == torch.long
        )
        assert torch.equal(s["input_ids"][1:], s["labels"][:-1])
        window = s["input_ids"].tolist() + [s["labels"][-1].item()]
        crossings += 256 in window[:-1]
        # Each piece between end-of-document ids is real Shakespeare.
        for part in _split_eod(window):
            assert bytes(part) in text
    assert crossings > 10  # paragraphs are short: many samples span documents


def _split_eod(window: list[int]) -> list[list[int]]:
    parts, cur = [], []
    for t in window:
        if t == 256:
            parts.append(cur)
            cur = []
        else:
            cur.append(t)
    return [p for p in [*parts, cur] if p]


def test_order_is_fixed_by_seed_and_cached(corpora):
    data = DataConfig(train=[str(corpora["edu"])])
    a, _ = build_datasets(data, SEQ, seed=7, train_samples=200, valid_samples=0)
    b, _ = build_datasets(data, SEQ, seed=7, train_samples=200, valid_samples=0)  # from the cache
    c, _ = build_datasets(data, SEQ, seed=8, train_samples=200, valid_samples=0)
    ids = [a[i]["input_ids"] for i in range(50)]
    assert all(torch.equal(x, b[i]["input_ids"]) for i, x in enumerate(ids))
    assert not all(torch.equal(x, c[i]["input_ids"]) for i, x in enumerate(ids))
    assert list((corpora["edu"] / "train" / "cache").glob("*shuffle_index.npy"))


def test_two_ranks_see_what_one_rank_sees_and_resume_is_exact(corpora):
    data = DataConfig(train=[str(corpora["shakespeare"])])
    ds, _ = build_datasets(data, SEQ, seed=1234, train_samples=8 * 12, valid_samples=0)
    gb, mb = 8, 2
    one = _rows(make_loader(ds, gb, mb, 0, 1, 0, num_workers=0))
    assert len(one) == (len(ds) // gb) * gb
    assert one[:gb] == [ds[i]["input_ids"].tolist() for i in range(gb)]
    r0 = _rows(make_loader(ds, gb, mb, 0, 2, 0, num_workers=0))
    r1 = _rows(make_loader(ds, gb, mb, 1, 2, 0, num_workers=0))
    merged = []
    for g in range(len(one) // gb):  # global batch g: rank 0's half, then rank 1's half
        merged += r0[g * gb // 2 : (g + 1) * gb // 2] + r1[g * gb // 2 : (g + 1) * gb // 2]
    assert merged == one
    # Resuming after 5 global batches gives exactly the following samples, with workers too.
    resumed = _rows(make_loader(ds, gb, mb, 0, 1, consumed_samples=5 * gb, num_workers=1))
    assert resumed == one[5 * gb :]
    with pytest.raises(ValueError, match="multiple of train.micro_batch_size"):
        make_loader(ds, 10, 4, 0, 2, 0, 0)


def test_blend_weights_are_honoured(corpora):
    data = DataConfig(
        train=[str(corpora["shakespeare"]), str(corpora["edu"])], train_weights=[0.25, 0.75]
    )
    n = 2000
    ds, _ = build_datasets(data, 128, seed=1, train_samples=n, valid_samples=0)
    shakespeare = shared_path("tinyshakespeare.txt").read_bytes()
    from_shakespeare = 0
    for i in range(n):
        window = ds[i]["input_ids"].tolist()
        longest = max(_split_eod(window), key=len)
        from_shakespeare += bytes(longest) in shakespeare
    sd = (n * 0.25 * 0.75) ** 0.5
    assert abs(from_shakespeare - 0.25 * n) < 3 * sd, from_shakespeare


def test_tokenizer_from_manifest_and_mismatch(corpora):
    tok = tokenizer_for_data(DataConfig(train=[str(corpora["shakespeare"])]))
    assert isinstance(tok, ByteTokenizer)
    neox = str(shared_path("tokenizers", "gpt-neox-20b_tokenizer.json"))
    with pytest.raises(
        DataError, match="tokenized with bytes:utf8.* but data.tokenizer=.*gpt-neox"
    ):
        tokenizer_for_data(DataConfig(train=[str(corpora["shakespeare"])], tokenizer=neox))


def _copy_prefix(src: Path, dst: Path) -> Path:
    for ext in (".bin", ".idx"):
        shutil.copy(f"{src}{ext}", f"{dst}{ext}")
    return dst


def test_raw_megatron_prefix_and_damaged_files(corpora, tmp_path):
    shard = corpora["shakespeare"] / "train" / "shard_00000"
    good = _copy_prefix(shard, tmp_path / "neox_style_text_document")
    data = DataConfig(
        train=[str(good)], tokenizer="bytes"
    )  # data made by another tool: no manifest
    ds, _ = build_datasets(data, SEQ, seed=1, train_samples=10, valid_samples=0)
    assert len(ds) >= 10
    with pytest.raises(DataError, match="no data.train entry has a manifest"):
        tokenizer_for_data(DataConfig(train=[str(good)]))

    def expect(match: str, prefix: Path) -> None:
        with pytest.raises(DataError, match=match):
            build_datasets(DataConfig(train=[str(prefix)], tokenizer="bytes"), SEQ, 1, 10, 0)

    truncated = _copy_prefix(shard, tmp_path / "truncated")
    with open(f"{truncated}.bin", "r+b") as f:
        f.truncate(1000)
    expect("truncated or the .idx belongs to another dataset", truncated)
    mixed = _copy_prefix(shard, tmp_path / "mixed")
    shutil.copy(corpora["shakespeare"] / "train" / "shard_00001.idx", f"{mixed}.idx")
    expect("truncated or the .idx belongs to another dataset", mixed)
    empty = _copy_prefix(shard, tmp_path / "empty")
    Path(f"{empty}.idx").write_bytes(b"")
    expect("is empty", empty)
    garbage = _copy_prefix(shard, tmp_path / "garbage")
    Path(f"{garbage}.idx").write_bytes(np.arange(100, dtype=np.int64).tobytes())
    expect("not a megatron indexed-dataset index", garbage)
    expect("not found", tmp_path / "nothing_here")


def test_incomplete_prepared_folder_is_refused(corpora, tmp_path):
    folder = tmp_path / "partial"
    shutil.copytree(corpora["edu"], folder)
    manifest = json.loads((folder / "train" / "manifest.json").read_text())
    manifest["complete"] = False
    (folder / "train" / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(DataError, match="only partly prepared; rerun the same prepare_data.py"):
        build_datasets(DataConfig(train=[str(folder)]), SEQ, 1, 10, 0)


def _vm_flags(path: str) -> list[set[str]]:
    """VmFlags of this process's mappings of `path` (/proc/self/smaps; "rr" = MADV_RANDOM)."""
    flags, current = [], False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        if line[:1] in "0123456789abcdef" and "-" in line.split(" ", 1)[0]:
            current = line.endswith(" " + path)
        elif current and line.startswith("VmFlags:"):
            flags.append(set(line.split()[1:]))
    return flags


def test_read_modes_return_the_same_samples(corpora):
    """random (MADV_RANDOM on the .bin maps), readahead (the old mmap) and file (megatron's
    file reader): the same samples, directly and through forked loader workers."""
    from pretrain.data.dataset import bin_mappings

    got = {}
    for mode in ("readahead", "random", "file"):
        data = DataConfig(
            train=[str(corpora["shakespeare"]), str(corpora["edu"])],
            train_weights=[0.5, 0.5],
            read_mode=mode,
        )
        ds, _ = build_datasets(data, SEQ, seed=3, train_samples=256, valid_samples=0)
        maps = bin_mappings(ds.inner)
        assert len(maps) == (0 if mode == "file" else len(ds.prefixes)), (mode, len(maps))
        if mode != "file":
            flags = _vm_flags(ds.prefixes[0].path + ".bin")
            assert flags and all(("rr" in f) == (mode == "random") for f in flags), (mode, flags)
        direct = [ds[i]["input_ids"].tolist() for i in range(256)]
        loader = make_loader(
            ds, global_batch=32, micro_batch=8, dp_rank=0, dp_world=1, num_workers=2
        )
        assert _rows(loader) == direct, mode
        got[mode] = direct
        del ds, maps, loader
        gc.collect()  # the next mode's maps of the same files are the only ones
    assert got["random"] == got["readahead"] == got["file"]


def test_megatron_datasets_load_without_the_package_init():
    """import_quietly registers megatron.core without running its __init__ (which imports the
    model-parallel layers: 6.7 s of an 11.5 s tiny training run); the dataset modules load."""
    gpt = import_quietly("megatron.core.datasets.gpt_dataset")
    assert hasattr(gpt, "GPTDataset")
    assert getattr(sys.modules["megatron.core"], megatron_compat.BARE, False)
    assert "megatron.core.tensor_parallel" not in sys.modules
