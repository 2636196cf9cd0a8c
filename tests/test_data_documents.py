"""Documents inside packed samples (data/documents.py): document ids, positions that restart
and the end-of-document loss mask, against megatron-core's own masks and position ids; the
samples TokenDataset gives with the switches on and off."""

from __future__ import annotations

import pytest
import torch
from conftest import shared_path

from pretrain.config import DataConfig
from pretrain.data.dataset import build_datasets, make_loader
from pretrain.data.documents import (
    DocumentError,
    DocumentSwitches,
    document_ids,
    document_positions,
    model_inputs_of,
)
from pretrain.data.megatron_compat import import_quietly

EOD = 256
SEQ = 64


def megatron_masks(tokens: torch.Tensor):
    """megatron-core's attention mask (True = may attend), loss mask and reset position ids of
    one packed sample, with every switch on."""
    gpt = import_quietly("megatron.core.datasets.gpt_dataset")
    masked, loss_mask, positions = gpt._get_ltor_masks_and_position_ids(
        tokens.clone(), EOD, True, True, True, True
    )
    return ~masked[0], loss_mask, positions


def packed_rows() -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    rows = torch.randint(0, 256, (6, 40), generator=g)
    rows[0, [3, 4, 17, 39]] = EOD  # two EODs in a row (an empty document), one at the end
    rows[1, [0, 20]] = EOD  # an EOD first: the sample starts with a document's end
    rows[2, 11] = EOD
    # rows 3-5: no EOD at all (one document, a piece of a long one)
    return rows


def test_document_ids_and_positions_equal_megatrons_masks_and_position_ids():
    rows = packed_rows()
    ids, pos = document_ids(rows, EOD), document_positions(document_ids(rows, EOD))
    assert ids.shape == pos.shape == rows.shape and ids.dtype == pos.dtype == torch.int64
    causal = torch.ones(40, 40, dtype=torch.bool).tril()
    for r in range(rows.shape[0]):
        attend, loss_mask, want_pos = megatron_masks(rows[r])
        same_doc = ids[r][:, None] == ids[r][None, :]
        assert torch.equal(causal & same_doc, attend)
        assert torch.equal(pos[r], want_pos)
        labels = torch.arange(40)
        masked = DocumentSwitches(EOD, eod_mask_loss=True).mask_labels(rows[r], labels)
        assert torch.equal(masked != -100, loss_mask.bool())
    assert ids[3].unique().tolist() == [0] and torch.equal(pos[3], torch.arange(40))
    assert ids[0, 3] == ids[0, 2] and pos[0, 5] == 0  # an EOD ends its own document


def test_switches_give_the_model_inputs_they_name():
    rows = packed_rows()
    assert DocumentSwitches(EOD).model_inputs(rows) == {}
    both = DocumentSwitches(EOD, document_mask=True, position_reset=True).model_inputs(rows)
    assert set(both) == {"document_ids", "position_ids"}
    assert set(DocumentSwitches(EOD, document_mask=True).model_inputs(rows)) == {"document_ids"}
    assert set(DocumentSwitches(EOD, position_reset=True).model_inputs(rows)) == {"position_ids"}
    labels = torch.arange(rows.numel()).view_as(rows)
    assert torch.equal(DocumentSwitches(EOD, document_mask=True).mask_labels(rows, labels), labels)
    batch = {"input_ids": rows, "labels": labels, **both}
    inputs = model_inputs_of(batch, "cpu")
    assert set(inputs) == {"document_ids", "position_ids", "max_position"}
    assert inputs["max_position"] == int(both["position_ids"].max())


def test_samples_carry_their_documents_and_are_otherwise_unchanged(paragraphs):
    plain_cfg = DataConfig(train=[str(paragraphs)], valid=[str(paragraphs)], num_workers=0)
    on_cfg = DataConfig(
        train=[str(paragraphs)],
        valid=[str(paragraphs)],
        num_workers=0,
        document_mask=True,
        position_reset=True,
        eod_mask_loss=True,
    )
    plain, plain_valid = build_datasets(plain_cfg, SEQ, 1234, 64, 16)
    on, on_valid = build_datasets(on_cfg, SEQ, 1234, 64, 16)
    assert set(plain[0]) == {"input_ids", "labels"}
    for ds, ref in ((on, plain), (on_valid, plain_valid)):
        for i in range(16):
            s, p = ds[i], ref[i]
            assert set(s) == {"input_ids", "labels", "document_ids", "position_ids"}
            assert torch.equal(s["input_ids"], p["input_ids"])  # the same samples
            attend, loss_mask, positions = megatron_masks(s["input_ids"])
            assert torch.equal(s["position_ids"], positions)
            same = s["document_ids"][:, None] == s["document_ids"][None, :]
            assert torch.equal(same.tril(), attend)
            want = p["labels"].masked_fill(loss_mask == 0, -100)
            assert torch.equal(s["labels"], want)
    assert sum(int((on[i]["input_ids"] == EOD).sum()) for i in range(64)) > 10
    # Batches from the loader carry them too, stacked, for any number of workers.
    batch = next(iter(make_loader(on, 8, 8, 0, 1, num_workers=0)))
    assert batch["document_ids"].shape == batch["position_ids"].shape == (8, SEQ)


def test_a_switch_without_an_end_of_document_token_is_one_line(tmp_path):
    from pretrain.data.recipes import prepare_tinyshakespeare

    chars = tmp_path / "chars"
    prepare_tinyshakespeare(chars, shared_path("tinyshakespeare.txt"), progress=False)
    with pytest.raises(DocumentError, match=r"data.position_reset needs an end-of-document"):
        build_datasets(
            DataConfig(train=[str(chars / "train")], position_reset=True, num_workers=0),
            SEQ,
            1,
            8,
            0,
        )


def test_attended_fraction_counts_the_pairs_the_mask_keeps(paragraphs):
    from pretrain.data.dataset import document_lengths
    from pretrain.data.documents import attended_fraction
    from pretrain.data.shards import read_manifest

    lengths = document_lengths([str(paragraphs)])
    manifest = read_manifest(paragraphs / "train")
    assert len(lengths) == manifest["documents"] and lengths.sum() == manifest["tokens"]
    # Brute force: the packed stream cut into rows, the mask's kept pairs counted.
    T, docs = 96, lengths[:2000]
    stream = torch.zeros(int(docs.sum()), dtype=torch.long)
    stream[torch.from_numpy(docs.cumsum() - 1)] = EOD  # each document ends with its EOD
    rows = stream[: (len(stream) // T) * T].view(-1, T)
    ids = document_ids(rows, EOD)
    kept = int(((ids[:, :, None] == ids[:, None, :]).tril()).sum())
    want = kept / (rows.shape[0] * T * (T + 1) / 2)
    assert attended_fraction(docs, T) == pytest.approx(want, rel=1e-12)
    assert 0.05 < want < 0.9  # short paragraphs: masking keeps a small share of the pairs
    assert attended_fraction([10 * T], T) == 1.0  # rows inside one document: all pairs
    assert attended_fraction([1] * T, T) == pytest.approx(2 / (T + 1))  # one-token documents
