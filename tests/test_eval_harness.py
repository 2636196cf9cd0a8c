"""The lm-eval adapter on a tiny trained checkpoint: exact loglikelihoods, parity with the
harness's own Hugging Face model on the exported weights, and tools/evaluate.py offline."""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import shared_path
from tables_support import unpadded

from pretrain.config import ModelConfig
from pretrain.model import Transformer
from pretrain.weights import (
    CHECKPOINTS_DIR,
    LATEST_FILE,
    load_weights,
    save_weights,
    step_tag,
)


def load_cli():
    """tools/evaluate.py's program (pretrain/cli/evaluate.py)."""
    from pretrain.cli import evaluate

    return evaluate


MAX_LEN = 128
STEPS = 10


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory) -> Path:
    """A run folder holding one checkpoint of a 2-layer Pythia-shaped model (GPT-NeoX
    tokenizer) after a few AdamW steps on real web text."""
    from pretrain.data.tokenizer import load_tokenizer

    tok = load_tokenizer(shared_path("tokenizers", "gpt-neox-20b_tokenizer.json"))
    texts = [
        json.loads(line)["text"]
        for line in shared_path("webtext", "fineweb_edu_10BT_150docs.jsonl").open()
    ][:30]
    cfg = ModelConfig(
        vocab_size=tok.vocab_size,
        n_layers=2,
        d_model=64,
        n_heads=4,
        d_ff=256,
        max_seq_len=MAX_LEN,
        block="parallel",
        norm="layernorm",
        norm_bias=True,
        mlp="gelu",
        attn_bias=True,
        mlp_bias=True,
        rope_fraction=0.25,
    )
    torch.manual_seed(0)
    model = Transformer(cfg)
    ids = [i for t in texts for i in tok.encode(t) + [tok.eod_id]]
    data = torch.tensor(ids[: len(ids) // (MAX_LEN + 1) * (MAX_LEN + 1)]).view(-1, MAX_LEN + 1)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(STEPS):
        batch = data[torch.randint(0, len(data), (2,))]
        loss = model(batch[:, :-1], batch[:, 1:]).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    run = tmp_path_factory.mktemp("run")
    wdir = run / CHECKPOINTS_DIR / step_tag(STEPS)
    save_weights(model, wdir, {"train": {"seed": 0}})
    tok.save(wdir / "tokenizer")
    (run / CHECKPOINTS_DIR / LATEST_FILE).write_text(step_tag(STEPS))
    return run


@pytest.fixture(scope="session")
def lm(tiny_run):
    from pretrain.eval.harness import PretrainLM

    return PretrainLM(path=str(tiny_run), device="cpu", batch_size=16)


def _instances(kind: str, args: list[tuple]) -> list:
    from lm_eval.api.instance import Instance

    return [Instance(kind, {}, a, i) for i, a in enumerate(args)]


def task_instances(task: str, limit: int, tmp_path: Path) -> list:
    """The requests the harness builds for `task` from the real local data."""
    from lm_eval.api.task import ConfigurableTask

    from pretrain.eval.tasks import local_task_configs

    cfg = local_task_configs([task], shared_path("evals"), tmp_path)[0]
    t = ConfigurableTask(config=copy.deepcopy(cfg))
    t.build_all_requests(limit=limit, rank=0, world_size=1)
    return t.instances


def reference_loglikelihood(
    model: Transformer, tok, context: str, continuation: str
) -> tuple[float, bool]:
    """Sum of log-probs of the continuation tokens, one forward pass per request, written
    from the harness's documented rules (trailing context spaces move to the continuation;
    an empty context is conditioned on end-of-document; keep the last max_len inputs)."""
    if context:
        n = len(context) - len(context.rstrip())
        if n:
            context, continuation = context[:-n], context[-n:] + continuation
        whole = tok.encode(context + continuation)
        cont = whole[len(tok.encode(context)) :]
    else:
        whole = [tok.eod_id] + tok.encode(continuation)
        cont = whole[1:]
    inp = whole[-(MAX_LEN + 1) :][:-1]
    with torch.no_grad():
        logp = F.log_softmax(model(torch.tensor([inp]))[0].double(), -1)
    pos = range(len(inp) - len(cont), len(inp))
    lp = sum(logp[p, t].item() for p, t in zip(pos, cont, strict=True))
    greedy = all(logp[p].argmax().item() == t for p, t in zip(pos, cont, strict=True))
    return lp, greedy


REQUESTS = [
    ("The capital of France is", " Paris"),
    ("The capital of France is ", "Paris"),  # trailing space moves to the continuation
    ("Water boils at", " 100 degrees Celsius at sea level."),
    ("", "A document with no context at all."),
    ("word " * 200, " end"),  # longer than max_seq_len: truncated on the left
    ("Question: 2+2=?\nAnswer:", " 4"),
    ("Question: 2+2=?\nAnswer:", " 5"),  # same context, one-token continuations share a forward
]


def test_loglikelihood_equals_direct_forward(tiny_run, lm):
    model, _ = load_weights(tiny_run / CHECKPOINTS_DIR / step_tag(STEPS))
    got = lm.loglikelihood(_instances("loglikelihood", REQUESTS), disable_tqdm=True)
    for (ctx, cont), (lp, greedy) in zip(REQUESTS, got, strict=True):
        ref_lp, ref_greedy = reference_loglikelihood(model, lm.tok, ctx, cont)
        assert lp == pytest.approx(ref_lp, abs=1e-4), (ctx[:30], cont)
        assert greedy == ref_greedy
        assert lp < 0


def test_batching_does_not_change_loglikelihoods(tiny_run, lm, tmp_path):
    from pretrain.eval.harness import PretrainLM

    reqs = (
        task_instances("pubmedqa", 4, tmp_path)
        + task_instances("arc_easy", 4, tmp_path)
        + _instances("loglikelihood", REQUESTS)
    )
    one = PretrainLM(path=str(tiny_run), device="cpu", batch_size=1).loglikelihood(
        reqs, disable_tqdm=True
    )
    many = lm.loglikelihood(reqs, disable_tqdm=True)
    tight_lm = PretrainLM(path=str(tiny_run), device="cpu", batch_size=64, max_batch_tokens=300)
    tight_lm.score_chunk_rows = 3  # the output layer over a few positions at a time
    tight = tight_lm.loglikelihood(reqs, disable_tqdm=True)
    for a, b, c in zip(one, many, tight, strict=True):
        assert a[0] == pytest.approx(b[0], abs=1e-4) and a[0] == pytest.approx(c[0], abs=1e-4)
        assert a[1] == b[1] == c[1]


def test_rolling_loglikelihood_equals_windowed_forward(tiny_run, lm):
    """The text's tokens in chunks of max_len; each chunk is predicted by one forward pass over
    the max_len inputs that end just before its last token (end-of-document in front)."""
    model, _ = load_weights(tiny_run / CHECKPOINTS_DIR / step_tag(STEPS))
    texts = ["Short text.", " ".join(f"token{i}" for i in range(150))]
    got = lm.loglikelihood_rolling(
        _instances("loglikelihood_rolling", [(t,) for t in texts]), disable_tqdm=True
    )
    for text, lp in zip(texts, got, strict=True):
        ids = lm.tok.encode(text)
        assert text == texts[0] or len(ids) > 2 * MAX_LEN  # the long text needs three windows
        full = [lm.tok.eod_id] + ids  # full[j] is the input that predicts ids[j]
        ref = 0.0
        for start in range(0, len(ids), MAX_LEN):
            end = min(start + MAX_LEN, len(ids))
            first = max(0, end - MAX_LEN)
            with torch.no_grad():
                logp = F.log_softmax(model(torch.tensor([full[first:end]]))[0].double(), -1)
            ref += sum(logp[j - first, ids[j]].item() for j in range(start, end))
        assert lp == pytest.approx(ref, abs=1e-3)


def test_generate_until_is_greedy_decoding(tiny_run, lm):
    model, _ = load_weights(tiny_run / CHECKPOINTS_DIR / step_tag(STEPS))
    prompts = ["The history of science", "The history of art", "Once upon a time there was"]
    reqs = _instances(
        "generate_until", [(p, {"until": ["\n\n"], "max_gen_toks": 12}) for p in prompts]
    )
    rows = []  # positions per sequence the output layer sees: one, at the prefill too
    hook = lm.model.lm_head.register_forward_hook(lambda m, i, o: rows.append(i[0].shape[1:-1]))
    got = lm.generate_until(reqs, disable_tqdm=True)
    hook.remove()
    assert rows and all(r.numel() <= 1 for r in rows)
    for prompt, text in zip(prompts, got, strict=True):
        ids = torch.tensor([lm.tok.encode(prompt)])
        out = model.generate(ids, max_new_tokens=12, temperature=0, eos_id=lm.tok.eod_id)[
            0, ids.shape[1] :
        ]
        new = [t for t in out.tolist()]
        if lm.tok.eod_id in new:
            new = new[: new.index(lm.tok.eod_id)]
        assert text == lm.tok.decode(new).split("\n\n")[0]


def test_hf_export_gives_the_same_loglikelihoods(tiny_run, lm, tmp_path):
    """`lm_eval --model hf` (the harness's HFLM) on the exported weights and our adapter."""
    from lm_eval.models.huggingface import HFLM
    from transformers import PreTrainedTokenizerFast

    from pretrain.hf import export_hf

    model, _ = load_weights(tiny_run / CHECKPOINTS_DIR / step_tag(STEPS))
    export = export_hf(model, tmp_path / "hf").path
    tok = PreTrainedTokenizerFast(
        tokenizer_file=str(shared_path("tokenizers", "gpt-neox-20b_tokenizer.json")),
        eos_token="<|endoftext|>",
    )
    hf = HFLM(pretrained=str(export), tokenizer=tok, device="cpu", dtype="float32", batch_size=8)
    assert hf.max_length == lm.max_length == MAX_LEN
    reqs = (
        task_instances("lambada_openai", 6, tmp_path)
        + task_instances("piqa", 4, tmp_path)
        + task_instances("pubmedqa", 2, tmp_path)
        + _instances("loglikelihood", REQUESTS)
    )
    ours = lm.loglikelihood(reqs, disable_tqdm=True)
    theirs = hf.loglikelihood(reqs, disable_tqdm=True)
    for a, b in zip(ours, theirs, strict=True):
        assert a[0] == pytest.approx(b[0], abs=1e-4)
        assert a[1] == b[1]
    texts = [("Short text.",), (" ".join(f"token{i}" for i in range(150)),)]
    r_ours = lm.loglikelihood_rolling(_instances("loglikelihood_rolling", texts), disable_tqdm=True)
    r_theirs = hf.loglikelihood_rolling(
        _instances("loglikelihood_rolling", texts), disable_tqdm=True
    )
    assert r_ours == pytest.approx(r_theirs, abs=1e-3)


def test_evaluate_offline_writes_both_tables(tiny_run, tmp_path, monkeypatch):
    cli = load_cli()

    monkeypatch.setenv("PRETRAIN_CACHE", str(tmp_path / "cache"))
    data = shared_path("evals")
    # lambada_standard has no local copy in ../shared: it is named as missing...
    rc = cli.main(
        [
            "--run",
            str(tiny_run),
            "--data-dir",
            str(data),
            "--limit",
            "20",
            "--output",
            str(tmp_path / "x"),
        ]
    )
    assert rc == 2 and not (tmp_path / "x").exists()
    # ...and every other task of the suite runs through the real harness offline.
    out = tmp_path / "eval"
    rc = cli.main(
        [
            "--run",
            str(tiny_run),
            "--data-dir",
            str(data),
            "--limit",
            "20",
            "--skip-missing",
            "--output",
            str(out),
            "--batch-size",
            "32",
            "--bootstrap-iters",
            "200",
        ]
    )
    assert rc == 0
    results = json.loads((out / "lm_eval_results.json").read_text())["results"]
    expected = {
        "arc_challenge",
        "arc_easy",
        "logiqa",
        "lambada_openai",
        "piqa",
        "sciq",
        "pubmedqa",
        "winogrande",
        "wsc273",
    }
    assert set(results) == expected
    for task, r in results.items():
        metric = "acc_norm,none" if "acc_norm,none" in r else "acc,none"
        assert 0.0 <= r[metric] <= 1.0, task
    ppl = results["lambada_openai"]["perplexity,none"]
    assert math.isfinite(ppl) and ppl > 1.0
    md = unpadded((out / "results.md").read_text())
    assert (
        "| model | ARC-C | ARC-E | LogiQA | LAMBADA OpenAI | LAMBADA standard | PIQA | SciQ | PubMedQA | WinoGrande | WSC |"
        in md
    )
    assert "| model | LAMBADA OpenAI ppl | LAMBADA standard ppl |" in md
    assert (
        f"{ppl:.4f}" in md
        and "--limit 20" in md
        and "skipped (no local data): lambada_standard" in md
    )


def test_missing_data_error_names_the_file(tiny_run, tmp_path, monkeypatch, capsys):
    cli = load_cli()

    monkeypatch.setenv("PRETRAIN_CACHE", str(tmp_path / "cache"))
    rc = cli.main(
        [
            "--run",
            str(tiny_run),
            "--data-dir",
            str(shared_path("evals")),
            "--tasks",
            "piqa,lambada_standard",
        ]
    )
    err = capsys.readouterr().err
    assert rc == 2 and "lambada_standard" in err and "lambada_test_plain_text.txt" in err
    assert err.count("\n") == 1  # one line, no traceback


def test_bad_input_errors_name_the_problem(tiny_run, tmp_path, capsys):
    cli = load_cli()

    empty = tmp_path / "empty_run"
    (empty / "checkpoints").mkdir(parents=True)
    assert cli.main(["--run", str(empty), "--data-dir", str(shared_path("evals"))]) == 2
    assert "no checkpoint with weights under" in capsys.readouterr().err
    assert (
        cli.main(["--run", str(tiny_run), "--step", "7", "--data-dir", str(shared_path("evals"))])
        == 2
    )
    assert "no weights for step 7" in capsys.readouterr().err
    assert (
        cli.main(
            [
                "--run",
                str(tiny_run),
                "--data-dir",
                str(shared_path("evals")),
                "--tasks",
                "hellaswagg",
            ]
        )
        == 2
    )
    err = capsys.readouterr().err
    assert "unknown task 'hellaswagg'" in err and "arc_easy" in err
    assert cli.main(["--run", str(tiny_run), "--data-dir", str(tmp_path / "nope")]) == 2
    assert "nope is not a folder" in capsys.readouterr().err


def test_hf_llama_export_gives_the_same_loglikelihoods(tmp_path):
    """The Llama shape (sequential SwiGLU RMSNorm, grouped-query attention), random weights."""
    from lm_eval.models.huggingface import HFLM
    from transformers import PreTrainedTokenizerFast

    from pretrain.data.tokenizer import load_tokenizer
    from pretrain.eval.harness import PretrainLM
    from pretrain.hf import export_hf

    tok_path = shared_path("tokenizers", "gpt-neox-20b_tokenizer.json")
    tok = load_tokenizer(tok_path)
    torch.manual_seed(1)
    model = Transformer(
        ModelConfig(
            vocab_size=tok.vocab_size,
            n_layers=2,
            d_model=64,
            n_heads=4,
            n_kv_heads=2,
            d_ff=96,
            max_seq_len=64,
        )
    ).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)  # norms and biases off their init too
    ours = PretrainLM(model=model, tokenizer=tok, batch_size=4)
    hf = HFLM(
        pretrained=str(export_hf(model, tmp_path / "hf", "llama").path),
        tokenizer=PreTrainedTokenizerFast(tokenizer_file=str(tok_path), eos_token="<|endoftext|>"),
        device="cpu",
        dtype="float32",
        batch_size=4,
    )
    reqs = task_instances("arc_challenge", 3, tmp_path) + _instances("loglikelihood", REQUESTS)
    for a, b in zip(
        ours.loglikelihood(reqs, disable_tqdm=True),
        hf.loglikelihood(reqs, disable_tqdm=True),
        strict=True,
    ):
        assert a[0] == pytest.approx(b[0], abs=1e-4)
        assert a[1] == b[1]


# ----------------------------------------------------------------------------- short contexts (issue 13)

_WORDS = (" the", " cat", " sat", " on", " a", " mat")  # one GPT-NeoX token each


def _text(n: int) -> str:
    return "".join(_WORDS[i % len(_WORDS)] for i in range(n))


def test_truncation_matches_the_hf_backend_and_is_counted_once(tmp_path, caplog):
    """Requests longer than a 64-token context, on a Llama-shaped model (full RoPE) and its
    Hugging Face export under the harness's own HFLM: the same loglikelihoods, the same
    requests cut (HFLM warns once per request, we once per call), and a continuation longer
    than the context refused by both, ours with the task's name."""
    import logging

    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM
    from transformers import PreTrainedTokenizerFast

    from pretrain.data.tokenizer import load_tokenizer
    from pretrain.eval.harness import ContinuationTooLong, PretrainLM
    from pretrain.hf import export_hf

    tok_path = shared_path("tokenizers", "gpt-neox-20b_tokenizer.json")
    tok = load_tokenizer(tok_path)
    L = 64
    torch.manual_seed(3)
    model = Transformer(
        ModelConfig(
            vocab_size=tok.vocab_size,
            n_layers=2,
            d_model=64,
            n_heads=4,
            n_kv_heads=2,
            d_ff=96,
            max_seq_len=L,
            rope_fraction=1.0,
        )
    ).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    ours = PretrainLM(model=model, tokenizer=tok, batch_size=4)
    hf = HFLM(
        pretrained=str(export_hf(model, tmp_path / "hf", "llama").path),
        tokenizer=PreTrainedTokenizerFast(tokenizer_file=str(tok_path), eos_token="<|endoftext|>"),
        device="cpu",
        dtype="float32",
        batch_size=4,
    )
    assert hf.max_length == ours.max_length == L
    pairs = [
        ("Story:" + _text(100), _text(5)),  # context cut
        ("Story:" + _text(30), _text(L)),  # the continuation fills the whole context
        ("Story:" + _text(5), _text(20)),
    ]  # short: nothing cut
    # Around the boundary: context + continuation of exactly L + 1 tokens is not cut, L + 2 is.
    base = len(ours.tok_encode("Story:"))
    pairs += [
        ("Story:" + _text(L + 1 - base - 10), _text(10)),
        ("Story:" + _text(L + 2 - base - 10), _text(10)),
    ]
    lengths = [sum(map(len, ours._encode_pair(c, x))) for c, x in pairs]
    assert [n > L + 1 for n in lengths] == [True, True, False, False, True] and lengths[3] == L + 1
    assert len(ours._encode_pair(*pairs[1])[1]) == L
    reqs = [
        Instance("loglikelihood", {}, p, i, metadata=("short_task", i, 1))
        for i, p in enumerate(pairs)
    ]
    with caplog.at_level(logging.WARNING):
        got = ours.loglikelihood(reqs, disable_tqdm=True)
        ours_warnings = [r for r in caplog.records if r.name == "pretrain.eval.harness"]
        caplog.clear()
        ref = hf.loglikelihood(reqs, disable_tqdm=True)
        hf_warnings = [r for r in caplog.records if "Truncating" in r.getMessage()]
    for a, b in zip(got, ref, strict=True):
        assert a[0] == pytest.approx(b[0], abs=1e-4)
        assert a[1] == b[1]
    assert ours.requests_truncated == len(hf_warnings) == 3 and ours.requests_scored == 5
    assert (
        len(ours_warnings) == 1 and "3 of 5 loglikelihood requests" in ours_warnings[0].getMessage()
    )
    # A continuation of L + 1 tokens: no truncation helps. HFLM asserts; we name the task.
    long = [
        Instance("loglikelihood", {}, ("Story:", _text(L + 1)), 0, metadata=("long_task", 0, 1)),
        Instance("loglikelihood", {}, ("Story:", _text(3)), 1, metadata=("long_task", 1, 1)),
    ]
    with pytest.raises(AssertionError):
        hf.loglikelihood(long, disable_tqdm=True)
    with pytest.raises(ContinuationTooLong) as err:
        ours.loglikelihood(long, disable_tqdm=True)
    assert err.value.tasks == {"long_task": (1, 2, L + 1)}
    assert str(err.value).startswith(
        f"continuations longer than max_length={L} tokens (task long_task: 1 of 2, "
        f"the longest {L + 1} tokens): "
    )


@pytest.fixture(scope="module")
def byte_run(tmp_path_factory) -> Path:
    """A byte-level model with a 128-token context, as the quickstart's: PIQA's answers are
    longer than that in bytes."""
    from pretrain.data.tokenizer import ByteTokenizer

    torch.manual_seed(0)
    model = Transformer(
        ModelConfig(
            vocab_size=257,
            n_layers=2,
            d_model=64,
            n_heads=4,
            d_ff=128,
            max_seq_len=MAX_LEN,
            rope_fraction=0.25,
        )
    )
    run = tmp_path_factory.mktemp("byte_run")
    wdir = run / CHECKPOINTS_DIR / step_tag(1)
    save_weights(model, wdir, {"train": {"seed": 0}})
    ByteTokenizer().save(wdir / "tokenizer")
    (run / CHECKPOINTS_DIR / LATEST_FILE).write_text(step_tag(1))
    return run


def test_evaluate_refuses_or_skips_tasks_whose_answers_do_not_fit(
    byte_run, tmp_path, monkeypatch, capsys
):
    cli = load_cli()
    monkeypatch.setenv("PRETRAIN_CACHE", str(tmp_path / "cache"))
    args = [
        "--run",
        str(byte_run),
        "--data-dir",
        str(shared_path("evals")),
        "--tasks",
        "piqa,arc_easy",
        "--limit",
        "20",
    ]
    assert cli.main([*args, "--output", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err  # also the datasets library's progress bars
    lines = [line for line in err.splitlines() if line.startswith("error")]
    assert "Traceback" not in err and len(lines) == 1 and err.splitlines()[-1] == lines[0]
    assert lines[0].startswith(
        f"error: continuations longer than max_length={MAX_LEN} tokens (task piqa: "
    )
    assert lines[0].endswith("or leave it out of --tasks, or pass --skip-missing to skip it")
    out = tmp_path / "eval"
    assert cli.main([*args, "--skip-missing", "--output", str(out)]) == 0
    results = json.loads((out / "lm_eval_results.json").read_text())
    assert set(results["results"]) == {"arc_easy"} and results["config"]["model"] == "pretrain"
    md = (out / "results.md").read_text()
    assert f"- skipped (continuations longer than the {MAX_LEN}-token context): piqa" in md
    assert (
        "loglikelihood requests were longer than the model's context: their contexts were cut on the left"
        in md
    )


def test_a_document_masked_run_is_scored_as_it_trained(tiny_run):
    """With data.document_mask + data.position_reset, the end-of-document prefix of a rolling
    window is its own document: the text is scored as the model alone on the prefix (for the
    first token) and alone on the text from position 0 (for the rest)."""
    from pretrain.data.documents import DocumentSwitches
    from pretrain.eval.harness import PretrainLM

    model, _ = load_weights(tiny_run / CHECKPOINTS_DIR / step_tag(STEPS))
    plain = PretrainLM(path=str(tiny_run), device="cpu", batch_size=4)
    switches = DocumentSwitches(plain.tok.eod_id, document_mask=True, position_reset=True)
    masked = PretrainLM(path=str(tiny_run), device="cpu", batch_size=4, documents=switches)
    text = "The quick brown fox jumps over the lazy dog."
    ids = plain.tok.encode(text)
    assert len(ids) < MAX_LEN
    [got] = masked.loglikelihood_rolling(_instances("loglikelihood_rolling", [(text,)]), True)
    [unmasked] = plain.loglikelihood_rolling(_instances("loglikelihood_rolling", [(text,)]), True)
    with torch.no_grad():
        first = F.log_softmax(model(torch.tensor([[plain.tok.eod_id]]))[0, -1].double(), -1)
        rest = F.log_softmax(model(torch.tensor([ids[:-1]]))[0].double(), -1)
    ref = first[ids[0]].item() + sum(rest[j - 1, ids[j]].item() for j in range(1, len(ids)))
    assert got == pytest.approx(ref, abs=1e-4)
    assert abs(got - unmasked) > 1e-3  # the switches change what the model sees


# ----------------------------------------------------------------------------- stop strings


def _stop_tokenizer(kind: str):
    from pretrain.data.tokenizer import ByteTokenizer, CharTokenizer, load_tokenizer

    if kind == "gpt-neox":
        return load_tokenizer(shared_path("tokenizers", "gpt-neox-20b_tokenizer.json"))
    if kind == "llama2":
        return load_tokenizer(shared_path("tokenizers", "llama2_tokenizer.model"))
    if kind == "bytes":
        return ByteTokenizer()
    return CharTokenizer.from_text(shared_path("tinyshakespeare.txt").read_text())


def _stop_text(kind: str) -> str:
    if kind == "chars":
        return shared_path("tinyshakespeare.txt").read_text()[:60_000]
    rows = shared_path("webtext", "fineweb_edu_10BT_150docs.jsonl").read_text().splitlines()
    # Web text with curly quotes, dashes and accents: characters of 2-3 UTF-8 bytes, which
    # byte-level tokens split.
    return "\n\n".join(json.loads(r)["text"] for r in rows[:40])


@pytest.mark.parametrize("kind", ["gpt-neox", "llama2", "bytes", "chars"])
def test_stop_strings_stop_where_decoding_everything_stops(kind):
    """generate_until's stop check (a decoded tail per token, pretrain/eval/stops.py) against
    the rule it replaces, `any(s in decode(new) for s in until)` after every token: on
    continuations cut from real text, and from random token ids (bytes cut inside characters,
    control and byte-fallback pieces), with stop strings taken from the continuation itself
    (1-12 characters, anywhere, across token boundaries; non-ASCII ones included), both
    stop at the same token, or neither does."""
    import random

    from pretrain.eval.stops import StopStrings

    tok = _stop_tokenizer(kind)
    ids = tok.encode(_stop_text(kind))
    rng = random.Random(0)
    streams = [ids[s : s + 160] for s in rng.sample(range(len(ids) - 160), 30)]
    vocab = tok.vocab_size - (0 if tok.eod_id is None else 1)  # eod ends a continuation
    streams += [[rng.randrange(vocab) for _ in range(120)] for _ in range(10)]
    # Text of multi-byte characters only: a tail of a few byte tokens holds few characters,
    # so the check must widen it to see a 12-character stop string.
    wide = "".join(c for c in _stop_text("bytes") if len(c.encode()) > 1)
    if kind != "chars":
        streams += [tok.encode(wide[i : i + 60]) for i in range(0, 600, 60)]
    checked = hits = 0
    for k, stream in enumerate(streams):
        text = tok.decode(stream)
        if k >= 40:  # the multi-byte streams: a stop string at the end
            until = [text.rstrip("\ufffd")[-12:]]
            stops = StopStrings(tok.decode, until)
            for n in range(1, len(stream) + 1):
                old = any(s in tok.decode(stream[:n]) for s in until)
                assert stops.found(stream[:n]) == old, (kind, until, n)
                checked += 1
                if old:
                    break
            hits += old
            continue
        until = []
        for _ in range(2):
            i, n = rng.randrange(len(text)), rng.randint(1, 12)
            until.append(text[i : i + n])
        until += rng.sample(["\n\n", "Question:", "’", "—", "é", "\ufffd", ". "], 2)
        stops, old = StopStrings(tok.decode, until), None
        for n in range(1, len(stream) + 1):
            new = stream[:n]
            old, fast = any(s in tok.decode(new) for s in until), stops.found(new)
            assert fast == old, (kind, until, n, tok.decode(new)[-40:])
            checked += 1
            if old:
                hits += 1
                break
    assert hits >= 30 and checked > 1000, (hits, checked)


def test_a_stop_string_seen_only_in_a_tail_is_confirmed_on_the_whole_output():
    """A tokenizer whose decode of a tail differs from the end of the whole decode by more
    than the check's margin (here a fake one: a tail starting on an odd id decodes with a
    stray "<" first): the check confirms a hit in the tail on the whole continuation, so it
    never stops earlier than the rule it replaces."""
    from pretrain.eval.stops import StopStrings

    def decode(ids):
        return ("<" if ids and ids[0] % 2 else "") + "".join(chr(97 + i % 26) for i in ids)

    until = ["<b"]  # in a tail that starts on id 1, never in the whole (it starts on id 2)
    stops, stream = StopStrings(decode, until), [2, 4] * 40 + [1, 0, 0] * 30
    for n in range(1, len(stream) + 1):
        assert stops.found(stream[:n]) == any(s in decode(stream[:n]) for s in until)
