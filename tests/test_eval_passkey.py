"""Passkey retrieval (pretrain/eval/passkey.py, tools/passkey.py): prompts of the requested
token length with the key at the requested depth, exact-match scoring, a perfect retriever
at 100%, random weights at chance, the heat map's files, and the program end to end.

Length tolerance (the module's docstring): prompt tokens + answer budget <= length, and the
prompt falls short of it by less than one filler sentence (the most tokens any one filler
sentence adds, with its joining space).
"""

from __future__ import annotations

import csv
import json
import re
from pathlib import Path

import pytest
import torch
from conftest import shared_path
from tables_support import unpadded

from pretrain.config import ModelConfig
from pretrain.data.tokenizer import CharTokenizer, load_tokenizer
from pretrain.eval import passkey as pk
from pretrain.eval.lengths import LengthError
from pretrain.model import Transformer
from pretrain.weights import CHECKPOINTS_DIR, LATEST_FILE, save_weights, step_tag

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def char_tokenizer() -> CharTokenizer:
    """A character vocabulary holding the prompt's letters and the digits."""
    text = " ".join(pk.FILLER) + pk.NEEDLE + pk.QUESTION + "0123456789"
    return CharTokenizer.from_text(text)


def pythia_tokenizer():
    return load_tokenizer(shared_path("tokenizers", "gpt-neox-20b_tokenizer.json"))


TOKENIZERS = {"chars": char_tokenizer, "pythia": pythia_tokenizer}


@pytest.fixture(scope="module", params=sorted(TOKENIZERS))
def tok(request):
    return TOKENIZERS[request.param]()


# ----------------------------------------------------------------------------- prompts


def _token_at(tok, ids: list[int], char_offset: int) -> int:
    """The index of the token that holds character `char_offset` of decode(ids): the first
    p with len(decode(ids[:p + 1])) > char_offset (prefix lengths grow with p)."""
    lo, hi = 0, len(ids) - 1
    while lo < hi:
        mid = (lo + hi) // 2
        if len(tok.decode(ids[: mid + 1])) > char_offset:
            hi = mid
        else:
            lo = mid + 1
    return lo


@pytest.mark.parametrize("length", [1000, 4096])
@pytest.mark.parametrize("depth", [0.0, 0.25, 0.5, 0.75, 1.0])
def test_prompt_has_the_requested_length_and_the_key_at_the_requested_depth(tok, length, depth):
    key = 68048
    p = pk.build_prompt(tok, length, depth, key)
    text = tok.decode(p.ids)
    assert text == p.text
    needle = pk.NEEDLE.format(key=key)
    assert text.count(needle) == 1 and text.count(str(key)) == 2
    assert text.endswith(" " + pk.QUESTION)
    # The rest is whole filler sentences, in their cycle.
    rest = text.replace(needle + " ", "").removesuffix(" " + pk.QUESTION).split(". ")
    cycle = [s.rstrip(".") for s in pk.FILLER]
    assert [s.rstrip(".") for s in rest] == [cycle[i % 5] for i in range(len(rest))]

    # Length: the answer " KEY." after the question, and the prompt, fit in `length`, short
    # of it by less than one filler sentence.
    answer = len(tok.encode(f"{pk.QUESTION} {key}.")) - len(tok.encode(pk.QUESTION))
    assert p.answer_tokens == answer
    sentence = max(len(tok.encode(" " + s)) for s in pk.FILLER)
    assert length - sentence < len(p.ids) + answer <= length

    # Depth: where the hidden line sits among the filler's tokens, found from the text.
    start = _token_at(tok, p.ids, text.index(needle))
    end = _token_at(tok, p.ids, text.index(needle) + len(needle) - 1) + 1
    question = _token_at(tok, p.ids, text.rindex(pk.QUESTION))
    assert tok.decode(p.ids[start:end]).strip() == needle
    assert p.needle_position == start
    before, after = start, question - end
    filler = before + after
    # Sentence boundaries and the 5-sentence cycle's uneven sentences: off by at most a cycle.
    cycle_tokens = len(tok.encode(" ".join(pk.FILLER))) + 1
    assert abs(before / filler - depth) <= cycle_tokens / filler
    if depth == 0:
        assert before == 0
    if depth == 1:
        assert after <= 1  # only the space before the question, where it is its own token


def test_keys_and_prompts_are_deterministic_from_the_seed():
    tok = char_tokenizer()
    keys = pk.passkey_keys(20, seed=3)
    assert keys == pk.passkey_keys(20, seed=3)
    assert keys != pk.passkey_keys(20, seed=4)
    assert all(10000 <= k <= 99999 for k in keys) and len(set(keys)) > 15
    a = pk.build_prompt(tok, 500, 0.3, keys[0])
    assert a == pk.build_prompt(tok, 500, 0.3, keys[0])
    # The search's hint changes nothing.
    assert pk.build_prompt(tok, 500, 0.3, keys[1], hint=a.filler_sentences + 7).ids == (
        pk.build_prompt(tok, 500, 0.3, keys[1]).ids
    )


# ----------------------------------------------------------------------------- models


class Retriever(torch.nn.Module):
    """Stands in for the model under test, with Transformer.generate's interface: it reads
    its input like a perfect retriever, finding the first "pass key is" among the last
    `window` tokens (all, by default) and emitting the tokens that follow it there.

    Legitimate because everything else is the real code: the prompts it reads come from
    build_prompt, and what it emits is decoded and scored by run_passkey. A prompt without the
    key, with the wrong key, or a scorer that misreads the continuation, fails it. With a
    window, the needle is found only when it lies near the end (a local-attention model)."""

    def __init__(self, tok, window: int | None = None) -> None:
        super().__init__()
        self.marker = tok.encode("The pass key is")[1:]  # no leading-space ambiguity
        self.window = window
        self.calls: list[tuple[int, int]] = []  # (prompt tokens, max_new_tokens)

    def generate(self, input_ids, max_new_tokens, temperature=1.0, **_):
        assert temperature == 0 and input_ids.shape[0] == 1
        ids = input_ids[0].tolist()
        self.calls.append((len(ids), max_new_tokens))
        m, first = len(self.marker), max(0, len(ids) - (self.window or len(ids)))
        at = next(i for i in range(first, len(ids) - m + 1) if ids[i : i + m] == self.marker)
        new = ids[at + m : at + m + max_new_tokens]  # empty when only the question is seen
        return torch.tensor([ids + new], dtype=input_ids.dtype)


class Says(torch.nn.Module):
    """Emits fixed text, cut to max_new_tokens as a model's generation is."""

    def __init__(self, tok, text: str) -> None:
        super().__init__()
        self.new = tok.encode(text)

    def generate(self, input_ids, max_new_tokens, temperature=1.0, **_):
        new = torch.tensor([self.new[:max_new_tokens]], dtype=input_ids.dtype)
        return torch.cat([input_ids, new], dim=1)


def test_a_perfect_retriever_scores_100_percent(tok):
    model = Retriever(tok)
    lengths, depths = [256, 700], [0.0, 0.3, 0.5, 1.0]
    grid = pk.run_passkey(model, tok, lengths, depths, trials=3, seed=1, progress=False)
    assert grid.accuracy == [[1.0, 1.0]] * 4 and grid.overall == 1.0
    assert grid.counts == [[3, 3]] * 4 and len(grid.records) == 24
    keys = pk.passkey_keys(3, 1)
    assert all(r.predicted == str(r.key) == str(keys[r.trial]) for r in grid.records)
    # Every prompt plus its answer fits the cell's length.
    cells = [(r.length, r.depth) for r in grid.records]
    for (n, new), (length, _) in zip(model.calls, cells, strict=True):
        assert n + new <= length


def test_scoring_is_an_exact_match_of_the_first_number():
    tok = char_tokenizer()
    key = pk.passkey_keys(1, 0)[0]
    prompt = pk.build_prompt(tok, 300, 0.5, key)
    cases = {
        f" {key}. Remember": True,
        f"?{key}": True,  # the first number, whatever comes before it
        f" {key}1": False,  # a longer number: the answer budget shows its sixth digit
        f" {str(key)[:4]}": False,
        f" {key + 1}.": False,
        " the pass key": False,
        f" 7 {key}": False,  # the first number is 7
    }
    for said, ok in cases.items():
        text, predicted, correct = pk.score_prompt(Says(tok, said), tok, prompt)
        assert correct is ok, (said, text, predicted)
    assert pk.first_number("ab 0123 45") == "0123" and pk.first_number("none") is None


def test_random_weights_score_at_chance():
    tok = char_tokenizer()
    torch.manual_seed(0)
    cfg = ModelConfig(
        vocab_size=tok.vocab_size, n_layers=2, d_model=64, n_heads=4, d_ff=128, max_seq_len=128
    )
    model = Transformer(cfg)
    grid = pk.run_passkey(model, tok, [128, 256], [0.0, 0.5, 1.0], trials=2, seed=0, progress=False)
    # 12 trials; a 5-digit exact match by chance is 1e-5 per trial.
    assert grid.counts == [[2, 2]] * 3 and sum(map(sum, grid.correct)) == 0
    assert all(r.answer_tokens == 7 and len(r.continuation) == 7 for r in grid.records)


def test_the_grid_files_put_depths_down_and_lengths_across(tmp_path):
    tok = char_tokenizer()
    # Sees only the last 300 tokens: the key at length 256 always, at 1024 only at depth 1.
    grid = pk.run_passkey(
        Retriever(tok, window=300), tok, [1024, 256], [0.0, 0.5, 1.0], 2, 0, progress=False
    )
    assert grid.lengths == [1024, 256]
    assert grid.accuracy == [[0.0, 1.0], [0.0, 1.0], [1.0, 1.0]]
    files = pk.write_passkey(grid, tmp_path / "out")
    assert [f.name for f in files] == ["passkey.json", "passkey.csv", "passkey.png"]
    data = json.loads(files[0].read_text())
    assert data["accuracy"] == grid.accuracy and data["depths"] == [0.0, 0.5, 1.0]
    assert data["counts"] == [[2, 2]] * 3 and len(data["records"]) == 12
    rows = list(csv.DictReader(files[1].open()))
    got = {(float(r["depth"]), int(r["length"])): float(r["accuracy"]) for r in rows}
    assert got == {
        (0.0, 1024): 0,
        (0.0, 256): 1,
        (0.5, 1024): 0,
        (0.5, 256): 1,
        (1.0, 1024): 1,
        (1.0, 256): 1,
    }
    assert files[2].read_bytes().startswith(PNG_MAGIC)
    assert not list((tmp_path / "out").glob(".*"))  # no temporary files left
    table = unpadded(grid.markdown())
    assert "| 0 | 0.00 (0/2) | 1.00 (2/2) |" in table and "| all | 0.33 (2/6) |" in table


def test_lengths_too_short_name_the_flag_and_a_minimum_that_is_exact():
    tok = char_tokenizer()
    model = Retriever(tok)
    with pytest.raises(LengthError) as e:
        pk.run_passkey(model, tok, [60, 500], [0.5], 4, 0, progress=False)
    msg = str(e.value)
    assert msg.startswith("--lengths 60: a passkey prompt needs at least ")
    need = int(re.search(r"at least (\d+) tokens", msg).group(1))
    assert not model.calls  # refused before anything ran
    grid = pk.run_passkey(model, tok, [need], [0.0, 1.0], 4, 0, progress=False)
    assert grid.overall == 1.0
    with pytest.raises(LengthError, match=f"--lengths {need - 1}: "):
        pk.run_passkey(model, tok, [need - 1], [0.5], 4, 0, progress=False)


# ----------------------------------------------------------------------------- the program

TRAIN_LEN = 128


def make_run(root: Path, learned: bool = False, train_len: int | None = TRAIN_LEN) -> Path:
    """A run folder with one checkpoint (step 1) of a tiny character-level model."""
    tok = char_tokenizer()
    torch.manual_seed(0)
    cfg = ModelConfig(
        vocab_size=tok.vocab_size,
        n_layers=1,
        d_model=32,
        n_heads=2,
        d_ff=64,
        max_seq_len=TRAIN_LEN,
        learned_pos_emb=learned,
        **({"rope_fraction": 0.0} if learned else {}),
    )
    wdir = root / CHECKPOINTS_DIR / step_tag(1)
    train = {"seed": 0, **({"seq_len": train_len} if train_len else {})}
    save_weights(Transformer(cfg), wdir, {"train": train})
    tok.save(wdir / "tokenizer")
    (root / CHECKPOINTS_DIR / LATEST_FILE).write_text(step_tag(1))
    return root


def test_the_program_writes_the_grid_the_table_and_the_heat_map(tmp_path, capsys):
    from pretrain.cli import passkey as cli

    run = make_run(tmp_path / "char_run")
    argv = ["--run", str(run), "--lengths", "1x,2x", "--depths", "0,0.5,1", "--trials", "2"]
    assert cli.main([*argv, "--device", "cpu", "--no-progress"]) == 0
    out = capsys.readouterr().out
    folder = run / "eval" / step_tag(1)
    names = ["passkey.json", "passkey.csv", "passkey.png"]
    assert [
        line.removeprefix("wrote ") for line in out.splitlines() if line.startswith("wrote")
    ] == [str(folder / n) for n in names]
    data = json.loads((folder / "passkey.json").read_text())
    assert data["lengths"] == [128, 256] and data["depths"] == [0.0, 0.5, 1.0]
    assert [len(row) for row in data["accuracy"]] == [2, 2, 2]
    assert data["counts"] == [[2, 2]] * 3 and len(data["records"]) == 12
    assert data["info"]["label"] == f"char_run@{step_tag(1)}" and data["info"]["train_len"] == 128
    assert data["info"]["rope_scaling"] is None
    assert len(list(csv.DictReader((folder / "passkey.csv").open()))) == 6
    assert (folder / "passkey.png").read_bytes().startswith(PNG_MAGIC)
    assert "| depth \\ length | 128 (1x) | 256 (2x) |" in unpadded(out)

    # Without train.seq_len, 1x is model.max_seq_len; --rope-scaling is applied and recorded.
    run2 = make_run(tmp_path / "no_train_len", train_len=None)
    args = ["--run", str(run2), "--lengths", "2x", "--depths", "1", "--trials", "1"]
    extra = ["--rope-scaling", "linear:2", "--output", str(tmp_path / "o"), "--no-progress"]
    assert cli.main([*args, *extra, "--device", "cpu"]) == 0
    data = json.loads((tmp_path / "o" / "passkey.json").read_text())
    assert data["lengths"] == [256] and data["info"]["rope_scaling"]["type"] == "linear"


def _one_line(capsys) -> str:
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert "Traceback" not in err and len(lines) == 1, err
    return lines[0]


def test_learned_positions_past_their_table_get_one_line(tmp_path, capsys):
    from pretrain.cli import passkey as cli

    run = make_run(tmp_path / "learned", learned=True)
    argv = ["--run", str(run), "--lengths", "1x,2x,4x", "--device", "cpu", "--no-progress"]
    assert cli.main(argv) == 2
    line = _one_line(capsys)
    assert line.startswith("error: --lengths 256, 512: longer than the model's learned position")
    assert "128 rows" in line
    assert not (run / "eval").exists()
    # Within the table it runs.
    assert cli.main([*argv[:3], "1x", *argv[4:], "--trials", "1", "--depths", "0"]) == 0


def test_a_length_too_short_gets_one_line_with_the_minimum(tmp_path, capsys):
    from pretrain.cli import passkey as cli

    run = make_run(tmp_path / "r")
    assert cli.main(["--run", str(run), "--lengths", "64,128", "--device", "cpu"]) == 2
    line = _one_line(capsys)
    assert re.fullmatch(
        r"error: --lengths 64: a passkey prompt needs at least (\d+) tokens .*; use --lengths \1 or more",
        line,
    ), line
