"""Passkey retrieval (Mohtashami & Jaggi 2023, "Landmark Attention"), generated here: no download.

A prompt is filler text with one hidden line at a chosen depth, then a question:

    The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again.
    The grass is green. ... The pass key is 68048. Remember it. 68048 is the pass key. The grass
    is green. ... There and back again. What is the pass key? The pass key is

and the model passes a trial when the first number of its greedy continuation is the key.

- Keys: 5-digit numbers drawn from `random.Random(seed)`, one per trial index; trial t uses
  the same key in every (depth, length) cell, so cells differ only in depth and length.
- Depth: the hidden line goes after round(depth x n) of the prompt's n filler sentences
  (a sentence boundary): 0 = before all filler, 1 = right before the question.
- Length, in tokens of the run's tokenizer: the prompt (encoded whole, as the model reads it)
  plus the answer budget fit in `length`; n is the largest number of filler sentences that
  fits, so the prompt falls short of the budget by less than one filler sentence (the most
  tokens one filler sentence adds with its joining space). The answer budget is the tokens
  of " KEY." after the question: the key and one token more, so that a longer number
  ("680481") shows and scores wrong.
- Scoring: `model.generate(ids, answer_tokens, temperature=0)`, decoded; exact match of the
  first run of digits in the continuation with the key.

`run_passkey` fills a `PasskeyGrid` (accuracy per depth x length, counts, every trial), and
`write_passkey` writes passkey.json, passkey.csv and passkey.png (the heat map).
"""

from __future__ import annotations

import csv
import io
import json
import random
import re
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from pretrain.eval.lengths import LengthError
from pretrain.eval.plots import save_png
from pretrain.eval.tables import markdown_table
from pretrain.run_layout import atomic_write

FILLER = (
    "The grass is green.",
    "The sky is blue.",
    "The sun is yellow.",
    "Here we go.",
    "There and back again.",
)
NEEDLE = "The pass key is {key}. Remember it. {key} is the pass key."
QUESTION = "What is the pass key? The pass key is"
KEY_RANGE = (10000, 99999)  # 5-digit keys, both ends included

JSON_FILE = "passkey.json"
CSV_FILE = "passkey.csv"
PNG_FILE = "passkey.png"

_NUMBER = re.compile(r"\d+")


@dataclass
class PasskeyPrompt:
    """One trial's prompt: its text and token ids, and where the hidden line went."""

    text: str
    ids: list[int]
    key: int
    length: int  # the requested length: len(ids) + answer_tokens <= length
    depth: float  # the requested depth
    answer_tokens: int  # tokens generated for the answer (max_new_tokens)
    filler_sentences: int  # n
    needle_sentence: int  # the hidden line follows this many filler sentences
    needle_position: int  # token index where the hidden line starts


@dataclass
class PasskeyTrial:
    depth: float
    length: int
    trial: int
    key: int
    prompt_tokens: int
    needle_position: int
    answer_tokens: int
    continuation: str  # the decoded greedy continuation
    predicted: str | None  # its first number, or None
    correct: bool


@dataclass
class PasskeyGrid:
    """Accuracy per (depth, length): rows follow `depths`, columns follow `lengths`."""

    lengths: list[int]
    depths: list[float]
    trials: int
    seed: int
    correct: list[list[int]]
    counts: list[list[int]]
    records: list[PasskeyTrial] = field(default_factory=list)
    info: dict[str, Any] = field(default_factory=dict)  # provenance: model, tokenizer, scaling

    @property
    def accuracy(self) -> list[list[float]]:
        return [
            [c / n if n else float("nan") for c, n in zip(crow, nrow, strict=True)]
            for crow, nrow in zip(self.correct, self.counts, strict=True)
        ]

    def accuracy_at(self, depth: float, length: int) -> float:
        return self.accuracy[self.depths.index(depth)][self.lengths.index(length)]

    @property
    def overall(self) -> float:
        total = sum(map(sum, self.counts))
        return sum(map(sum, self.correct)) / total if total else float("nan")

    def to_dict(self) -> dict[str, Any]:
        return {
            "task": "passkey",
            "lengths": self.lengths,
            "depths": self.depths,
            "trials": self.trials,
            "seed": self.seed,
            "accuracy": self.accuracy,
            "correct": self.correct,
            "counts": self.counts,
            "overall": self.overall,
            "info": self.info,
            "records": [asdict(r) for r in self.records],
        }

    def markdown(self) -> str:
        """Depths down, lengths across; each cell `accuracy (correct/trials)`; a mean row."""
        train_len = self.info.get("train_len")

        def head(n: int) -> str:
            return f"{n} ({n / train_len:g}x)" if train_len else str(n)

        rows = [
            [f"{d:g}"] + [f"{a:.2f} ({c}/{n})" for a, c, n in zip(arow, crow, nrow, strict=True)]
            for d, arow, crow, nrow in zip(
                self.depths, self.accuracy, self.correct, self.counts, strict=True
            )
        ]
        means = []
        for j in range(len(self.lengths)):
            c = sum(row[j] for row in self.correct)
            n = sum(row[j] for row in self.counts)
            means.append(f"{c / n:.2f} ({c}/{n})" if n else "–")
        rows.append(["all"] + means)
        return markdown_table(["depth \\ length"] + [head(n) for n in self.lengths], rows)


# ----------------------------------------------------------------------------- prompts


def passkey_keys(trials: int, seed: int) -> list[int]:
    """The key of each trial index: deterministic from `seed`."""
    rng = random.Random(seed)
    return [rng.randint(*KEY_RANGE) for _ in range(trials)]


def _filler(n: int) -> list[str]:
    return [FILLER[i % len(FILLER)] for i in range(n)]


def _prompt_text(n: int, k: int, key: int) -> tuple[str, str]:
    """(prompt text, the text before the hidden line) with n filler sentences, the hidden
    line after the first k."""
    sentences = _filler(n)
    before = " ".join(sentences[:k])
    parts = [*sentences[:k], NEEDLE.format(key=key), *sentences[k:], QUESTION]
    return " ".join(parts), before + (" " if k else "")


def _needle_sentence(depth: float, n: int) -> int:
    return int(depth * n + 0.5)  # round half up: depth 0.5 of 5 sentences -> after 3


def answer_budget(tokenizer, key: int) -> int:
    """Tokens of the answer " KEY." after the question: the key and one token more."""
    return len(tokenizer.encode(f"{QUESTION} {key}.")) - len(tokenizer.encode(QUESTION))


def _encode_prompt(tokenizer, n: int, depth: float, key: int, memo: dict[int, list[int]]):
    if n not in memo:
        text, _ = _prompt_text(n, _needle_sentence(depth, n), key)
        memo[n] = list(tokenizer.encode(text))
    return memo[n]


def _largest_fit(count: Callable[[int], int], target: int, guess: int, step: int) -> int:
    """The largest n >= 0 with count(n) <= target (count non-decreasing, count(0) <= target),
    searched outwards from `guess` in steps doubling from `step`: a few encodes when the
    guess is close."""
    guess = max(guess, 0)
    step = max(1, step)
    if count(guess) <= target:
        lo, hi = guess, guess + step
        while count(hi) <= target:
            lo, step = hi, step * 2
            hi = lo + step
    else:
        hi, lo = guess, max(guess - step, 0)
        while lo > 0 and count(lo) > target:
            hi, step = lo, step * 2
            lo = max(hi - step, 0)
    while hi - lo > 1:  # count(lo) fits, count(hi) does not
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if count(mid) <= target else (lo, mid)
    return lo


def minimum_length(tokenizer, key: int) -> int:
    """The shortest length that holds the hidden line, the question and the answer."""
    text, _ = _prompt_text(0, 0, key)
    return len(tokenizer.encode(text)) + answer_budget(tokenizer, key)


def build_prompt(
    tokenizer, length: int, depth: float, key: int, hint: int | None = None
) -> PasskeyPrompt:
    """The prompt of `length` tokens (prompt + answer budget; see the module docstring) with
    the hidden line at `depth`. `hint`: the filler sentences of a prompt of the same length
    with another key (the search starts there; the result is the same without it)."""
    if not 0.0 <= depth <= 1.0:
        raise LengthError(f"--depths: {depth:g} is not a fraction in [0, 1]")
    answer = answer_budget(tokenizer, key)
    target = length - answer
    memo: dict[int, list[int]] = {}

    def count(n: int) -> int:
        return len(_encode_prompt(tokenizer, n, depth, key, memo))

    if count(0) > target:
        raise LengthError(
            f"--lengths {length}: a passkey prompt needs at least {count(0) + answer} tokens "
            f"of this tokenizer (the hidden line, the question and the {answer}-token answer); "
            f"use --lengths {count(0) + answer} or more"
        )
    if hint is None:
        per_sentence = len(tokenizer.encode(" " + " ".join(FILLER))) / len(FILLER)
        guess = int((target - count(0)) / per_sentence)
        n = _largest_fit(count, target, guess, guess // 256)
    else:
        n = _largest_fit(count, target, hint, 1)
    k = _needle_sentence(depth, n)
    text, before = _prompt_text(n, k, key)
    ids = _encode_prompt(tokenizer, n, depth, key, memo)
    # The first token that differs from the filler's own encoding starts the hidden line
    # (the joining space goes with it or before it, as the tokenizer has it).
    head = tokenizer.encode(before) if k else []
    position = next(
        (p for p, (a, b) in enumerate(zip(ids, head, strict=False)) if a != b),
        min(len(head), len(ids)),
    )
    return PasskeyPrompt(
        text=text,
        ids=ids,
        key=key,
        length=length,
        depth=depth,
        answer_tokens=answer,
        filler_sentences=n,
        needle_sentence=k,
        needle_position=position,
    )


# ----------------------------------------------------------------------------- scoring


def first_number(text: str) -> str | None:
    """The first run of digits in `text`, or None."""
    m = _NUMBER.search(text)
    return m.group(0) if m else None


def _device(model: torch.nn.Module) -> torch.device:
    p = next(iter(model.parameters()), None)
    return p.device if p is not None else torch.device("cpu")


@torch.inference_mode()
def score_prompt(model, tokenizer, prompt: PasskeyPrompt) -> tuple[str, str | None, bool]:
    """Greedy continuation of `prompt` -> (decoded text, its first number, exact match)."""
    ids = torch.tensor([prompt.ids], dtype=torch.long, device=_device(model))
    out = model.generate(ids, prompt.answer_tokens, temperature=0)
    continuation = tokenizer.decode(out[0, ids.shape[1] :].tolist())
    predicted = first_number(continuation)
    return continuation, predicted, predicted == str(prompt.key)


def _check_lengths(model, tokenizer, lengths: Sequence[int], keys: Sequence[int]) -> None:
    """One line before anything runs: lengths past a learned position table, or too short."""
    limit = getattr(model, "max_positions", None)
    too_long = [n for n in lengths if limit is not None and n > limit]
    if too_long:
        raise LengthError(
            f"--lengths {', '.join(map(str, too_long))}: longer than the model's learned "
            f"position table ({limit} rows = model.max_seq_len; model.learned_pos_emb): learned "
            f"positions cannot run past the length they were trained at; use lengths up to "
            f"{limit}"
        )
    need = max(minimum_length(tokenizer, key) for key in keys)
    short = [n for n in lengths if n < need]
    if short:
        raise LengthError(
            f"--lengths {', '.join(map(str, short))}: a passkey prompt needs at least {need} "
            f"tokens of this tokenizer (the hidden line, the question and the answer); use "
            f"--lengths {need} or more"
        )


def run_passkey(
    model,
    tokenizer,
    lengths: list[int],
    depths: list[float],
    trials: int,
    seed: int,
    *,
    progress: bool = True,
) -> PasskeyGrid:
    """Score `trials` prompts in every (depth, length) cell with greedy decoding.

    `model` needs `generate(ids, max_new_tokens, temperature=0)` (Transformer's) and, for
    learned positions, `max_positions`; `tokenizer` needs `encode` and `decode`."""
    if trials < 1:
        raise LengthError(f"--trials {trials}: at least 1 trial per cell")
    bad = [d for d in depths if not 0.0 <= d <= 1.0]
    if bad or not depths:
        raise LengthError(
            f"--depths: {', '.join(f'{d:g}' for d in bad) or 'none given'}; give fractions in "
            f"[0, 1] (0 = the key first, 1 = right before the question)"
        )
    lengths, depths = list(lengths), list(depths)
    keys = passkey_keys(trials, seed)
    _check_lengths(model, tokenizer, lengths, keys)
    grid = PasskeyGrid(
        lengths=lengths,
        depths=depths,
        trials=trials,
        seed=seed,
        correct=[[0] * len(lengths) for _ in depths],
        counts=[[0] * len(lengths) for _ in depths],
        info={"tokenizer": getattr(tokenizer, "identifier", type(tokenizer).__name__)},
    )
    bar = tqdm(
        total=len(lengths) * len(depths) * trials,
        desc="passkey",
        unit="trial",
        disable=not progress,
    )
    with bar:
        for j, length in enumerate(lengths):
            for i, depth in enumerate(depths):
                bar.set_postfix(length=length, depth=f"{depth:g}")
                hint = None
                for t, key in enumerate(keys):
                    prompt = build_prompt(tokenizer, length, depth, key, hint)
                    hint = prompt.filler_sentences
                    text, predicted, ok = score_prompt(model, tokenizer, prompt)
                    grid.counts[i][j] += 1
                    grid.correct[i][j] += int(ok)
                    grid.records.append(
                        PasskeyTrial(
                            depth=depth,
                            length=length,
                            trial=t,
                            key=key,
                            prompt_tokens=len(prompt.ids),
                            needle_position=prompt.needle_position,
                            answer_tokens=prompt.answer_tokens,
                            continuation=text,
                            predicted=predicted,
                            correct=ok,
                        )
                    )
                    bar.update(1)
    return grid


# ----------------------------------------------------------------------------- files


def parse_depths(text: str, flag: str = "--depths") -> list[float]:
    """'0,0.25,0.5,0.75,1' -> fractions in [0, 1], in the given order, each once."""
    out: list[float] = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        try:
            value = float(part)
        except ValueError:
            raise LengthError(f"{flag}: {part!r} is not a number; e.g. {flag} 0,0.5,1") from None
        if not 0.0 <= value <= 1.0:
            raise LengthError(
                f"{flag}: {part} is not a fraction in [0, 1] (0 = the key first, "
                f"1 = right before the question)"
            )
        if value not in out:
            out.append(value)
    if not out:
        raise LengthError(f"no depths given; e.g. {flag} 0,0.25,0.5,0.75,1")
    return out


def _csv(grid: PasskeyGrid) -> str:
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(["depth", "length", "trials", "correct", "accuracy"])
    for i, depth in enumerate(grid.depths):
        for j, length in enumerate(grid.lengths):
            n, c = grid.counts[i][j], grid.correct[i][j]
            w.writerow([f"{depth:g}", length, n, c, f"{c / n:.4f}" if n else ""])
    return buf.getvalue()


def plot_passkey(grid: PasskeyGrid, out: str | Path) -> Path:
    """The heat map: depth down (0 = key at the start, on top), length across, accuracy
    0..1 in colour and written in each cell; a dashed line past the trained length
    (`grid.info["train_len"]`, when known)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    acc = grid.accuracy
    nd, nl = len(grid.depths), len(grid.lengths)
    # At least a title's width and a y label's height, for a grid of one or two cells.
    fig, ax = plt.subplots(
        figsize=(max(4.5, 2.2 + 1.1 * nl), max(3.2, 1.6 + 0.5 * nd)), layout="constrained"
    )
    im = ax.imshow(acc, cmap="RdYlGn", vmin=0.0, vmax=1.0, aspect="auto")
    for i in range(nd):
        for j in range(nl):
            a = acc[i][j]
            ax.text(
                j,
                i,
                f"{a:.2f}",
                ha="center",
                va="center",
                fontsize=9,
                color="white" if a < 0.2 or a > 0.85 else "black",
            )
    train_len = grid.info.get("train_len")
    xlabels = [f"{n}\n({n / train_len:g}x)" if train_len else str(n) for n in grid.lengths]
    ax.set_xticks(range(nl), xlabels, fontsize=8)
    if train_len:  # a dashed line where the lengths pass the trained one
        inside = sum(n <= train_len for n in grid.lengths)
        if 0 < inside < nl and grid.lengths == sorted(grid.lengths):
            ax.axvline(inside - 0.5, color="black", linestyle="--", linewidth=1.2)
    ax.set_yticks(range(nd), [f"{d:g}" for d in grid.depths], fontsize=8)
    ax.set_xlabel("prompt length (tokens)")
    ax.set_ylabel("depth of the key (0 = start)")
    label = grid.info.get("label", "model")
    ax.set_title(  # the label on a line of its own: a run's name at a step is long
        f"passkey retrieval\n{label}\n{grid.trials} trials per cell, greedy, exact match",
        fontsize=9,
    )
    fig.colorbar(im, ax=ax, label="accuracy")
    return save_png(fig, out)


def write_passkey(grid: PasskeyGrid, out_dir: str | Path) -> list[Path]:
    """passkey.json (the grid and every trial), passkey.csv (one row per cell) and
    passkey.png (the heat map) in `out_dir` (created)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    files = [
        atomic_write(out_dir / JSON_FILE, json.dumps(grid.to_dict(), indent=2) + "\n"),
        atomic_write(out_dir / CSV_FILE, _csv(grid)),
        plot_passkey(grid, out_dir / PNG_FILE),
    ]
    return [Path(f) for f in files]
