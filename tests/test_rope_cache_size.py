"""tools/rope_cache_size.py: the table against the formula, the plot, and the model check."""

from __future__ import annotations

import math
import struct
import subprocess
import sys
from fractions import Fraction
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
TOOL = REPO / "tools" / "rope_cache_size.py"


def run_tool(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(TOOL), *args], cwd=REPO, capture_output=True, text=True, timeout=120
    )


def even_dims(fraction: str, head_dim: int) -> int:
    """The even number nearest fraction x head_dim, ties up, in exact rational arithmetic."""
    half = Fraction(fraction) * head_dim / 2
    return 2 * math.floor(half + Fraction(1, 2))


def table_rows(text: str, title_start: str) -> dict[str, list[str]]:
    """Rows of the table under the line starting with `title_start`, keyed by fraction."""
    lines = text.splitlines()
    i = next(n for n, line in enumerate(lines) if line.startswith(title_start))
    rows = {}
    for line in lines[i + 2 :]:
        if not line.strip():
            break
        cells = line.split()
        rows[cells[0]] = cells
    return rows


def test_paper_appendix_a_rotary_dims():
    # The paper's Appendix A, and the rounding rule computed here independently.
    from pretrain.config import rotary_dims_from_fraction

    appendix = {
        256: {"0.01": 2, "0.1": 26, "0.25": 64, "0.5": 128, "0.75": 192, "1": 256},
        64: {"0.04": 2, "0.1": 6, "0.25": 16, "0.5": 32, "0.75": 48, "1": 64},
        128: {"0.1": 12, "0.25": 32, "0.5": 64, "0.75": 96, "1": 128},
    }
    for hd, dims in appendix.items():
        for f, r in dims.items():
            assert even_dims(f, hd) == r
            assert rotary_dims_from_fraction(float(f), hd) == r


def test_table_matches_formula_and_ten_percent_saves_about_ten_times(tmp_path):
    seq = [2048, 1024 * 1024, 10 * 1024 * 1024]
    png = tmp_path / "img" / "cache.png"
    res = run_tool(
        "--head-dim",
        "256",
        "--units",
        "bytes",
        "--layers",
        "16",
        "--seq-lens",
        "2048,1M,10M",
        "--fractions",
        "0,1%,4%,10%,25%,50%,75%,100%",
        "--plot",
        str(png),
    )
    assert res.returncode == 0, res.stderr
    shared = table_rows(res.stdout, "RoPE cos/sin cache, one per model")
    per_layer = table_rows(res.stdout, "Per-layer layout")
    for label, f in [
        ("0%", "0"),
        ("1%", "0.01"),
        ("4%", "0.04"),
        ("10%", "0.1"),
        ("25%", "0.25"),
        ("50%", "0.5"),
        ("75%", "0.75"),
        ("100%", "1"),
    ]:
        r = even_dims(f, 256)
        row = shared[label]
        assert int(row[1]) == r
        assert [int(c) for c in row[2:5]] == [2 * T * r * 4 for T in seq]
        assert [int(c) for c in per_layer[label][2:5]] == [16 * 2 * T * r * 4 for T in seq]
        if r:
            assert float(row[5].rstrip("x")) == pytest.approx(256 / r, abs=0.005)
    assert shared["10%"][1] == "26"
    assert float(shared["10%"][5].rstrip("x")) == pytest.approx(256 / 26, abs=0.005)  # ~9.85x
    assert shared["0%"][5:] == ["no", "cache"]

    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    width, height = struct.unpack(">II", data[16:24])
    assert width > 300 and height > 200 and len(data) > 5000


def test_bf16_precision_halves_the_bytes_and_zero_dim_fractions_are_refused():
    from pretrain.analysis.rope_cache import cache_table

    fp32, bf16 = (cache_table(64, [4096], [0.01, 0.1], p, n_layers=2) for p in ("fp32", "bf16"))
    assert bf16[1].rotary_dims == 6 and bf16[1].shared_bytes == (2 * 4096 * 6 * 2,)
    assert fp32[1].shared_bytes == (2 * 4096 * 6 * 4,) and fp32[1].per_layer_bytes == (
        2 * 2 * 4096 * 6 * 4,
    )
    assert bf16[0].rotary_dims is None  # 0.64 dims rounds to 0: the config refuses it


def test_bad_flag_is_one_line_error():
    res = run_tool("--seq-lens", "2048,lots")
    assert res.returncode != 0
    assert "--seq-lens" in res.stderr and "Traceback" not in res.stderr


def test_check_passes_for_every_preset():
    # Every preset as written, and at NoPE and 10% (the tool's default adds 25, 50, 100%).
    res = run_tool("--check", "--fractions", "0,10%")
    assert res.returncode == 0, res.stdout + res.stderr
    presets = sorted(p.stem for p in (REPO / "configs" / "models").glob("*.yaml"))
    rope_part, kv_part = res.stdout.split("\n\n")
    body = rope_part.splitlines()
    for name in presets:
        assert any(line.split()[0] == name and line.split()[-1] == "ok" for line in body[2:-1])
    assert "MISMATCH" not in res.stdout
    assert body[1].split()[4:] == [
        "meta",
        "fp32",
        "meta",
        "->bf16",
        "cpu",
        "fp32",
        "cpu",
        "->bf16",
        "dtype",
        "ok",
    ]
    row = next(
        line.split() for line in body if line.startswith("pythia1b_paper rope_fraction=0.1 ")
    )
    # dims, max_seq_len, formula, then the four builds' buffer bytes; all fp32
    assert row[2:9] == ["26", "2048", *[str(2 * 2048 * 26 * 4)] * 5] and row[9] == "float32"
    # The K+V formula against the bytes our KVCache allocates, for every preset.
    kv = {line.split()[0]: line.split()[1:] for line in kv_part.splitlines()[2:]}
    assert sorted(kv) == presets and all(cells[-1] == "ok" for cells in kv.values())
    assert kv["llama1b"] == ["2048", *[str(2 * 16 * 8 * 64 * 2048 * 2)] * 2, "ok"]


def _small_cfg(**kw):
    from pretrain.config import ModelConfig

    base = dict(
        vocab_size=64,
        pad_vocab_to_multiple=1,
        n_layers=3,
        d_model=64,
        n_heads=1,
        d_ff=16,
        max_seq_len=128,
        rope_fraction=0.25,
    )
    return ModelConfig(**{**base, **kw})


def test_check_reports_a_wrong_formula_and_a_broken_cache():
    from pretrain.analysis.rope_cache import check_cache_formula, check_model
    from pretrain.model.transformer import Transformer

    cfg = _small_cfg()
    assert all(r.ok for r in check_cache_formula(cfg, "small"))
    wrong = check_cache_formula(cfg, "small", formula=lambda T, r, e: 2 * T * r * 2)  # bf16 bytes
    assert not any(r.ok for r in wrong)

    model = Transformer(cfg)
    model.rope.cos = model.rope.cos.bfloat16()  # a cache that followed the model to bf16
    assert not check_model(model, "small", "cpu").ok

    # A per-layer layout (a cache in every block) is what the check must catch.
    model = Transformer(cfg)
    for block in model.blocks:
        block.attn.register_buffer("rope_cos", model.rope.cos.clone(), persistent=False)
    res = check_model(model, "small", "cpu")
    assert not res.ok
    assert res.measured_bytes == res.expected_bytes * (1 + cfg.n_layers / 2)


def test_check_counts_storage_not_views():
    # A cache sliced from a full-head allocation keeps the full allocation alive.
    from pretrain.analysis.rope_cache import check_model
    from pretrain.model.transformer import Transformer

    cfg = _small_cfg()
    model = Transformer(cfg)
    full = torch.zeros(cfg.max_seq_len, cfg.head_dim)
    model.rope.cos = full[:, : cfg.rope_dims]
    res = check_model(model, "small", "cpu")
    assert not res.ok and res.measured_bytes > res.expected_bytes


# ----------------------------------------------------------------------------- --kv


def _kv_cfg(**kw):
    from pretrain.config import ModelConfig

    base = dict(vocab_size=64, pad_vocab_to_multiple=1, d_ff=32, max_seq_len=128)
    return ModelConfig(**{**base, **kw})


def test_kv_formulas_against_independent_arithmetic():
    from pretrain.analysis.kv_cache import model_kv, position_variants
    from pretrain.analysis.presets import load_preset

    # Llama-3.2-1B: 16 layers x 8 KV heads x head_dim 64 x (K, V) x 2 bytes = 32 KiB a token.
    llama = {
        pos: model_kv(c, "llama1b", pos) for pos, c in position_variants(load_preset("llama1b"))
    }
    assert list(llama) == ["100% RoPE", "1/4 of pairs", "1/8 of pairs", "10% RoPE", "NoPE"]
    for m in llama.values():
        assert m.kv_bytes(1, 2) == 32 * 1024 and m.kv_bytes(4096, 2) == 128 * 1024**2
    # The latent: per layer 8 heads x d_kv + 8 heads x rotary dims, x 16 layers x 2 bytes.
    for pos, r in [("100% RoPE", 64), ("1/4 of pairs", 16), ("1/8 of pairs", 8), ("NoPE", 0)]:
        assert llama[pos].rotary_dims == [r] * 16 * 8
        assert llama[pos].free_key_dims == [64 - r] * 16 * 8
        assert llama[pos].latent_bytes(1, 16, 2) == (8 * 16 + 8 * r) * 16 * 2
    # 10% of 64 dims is 6 (the paper's Appendix A); its cos/sin table 2 x T x 6 x 4 bytes.
    assert llama["10% RoPE"].table_bytes(1000) == 2 * 1000 * 6 * 4
    assert llama["1/8 of pairs"].kept_table_bytes(1000) == 2 * 1000 * 8 * 4
    assert llama["NoPE"].table_bytes(1000) == 0

    # A selection that keeps other pairs in each KV head: the same K+V and latent bytes, the
    # union of 8 heads x 4 pairs is all 32 of the table's (which our model holds whole).
    from pretrain.analysis.kv_cache import selection_variants

    sel = {
        label: model_kv(c, "llama1b", label)
        for label, c in selection_variants(load_preset("llama1b"))
    }
    high, apart = sel["rope_pairs=high 1/8"], sel["rope_pairs=apart 1/8"]
    assert high.rotary_dims == apart.rotary_dims == [8] * 16 * 8
    assert apart.latent_bytes(5, 16, 2) == high.latent_bytes(5, 16, 2) == 5 * 6 * 1024
    assert high.kept_table_bytes(1000) == 2 * 1000 * 2 * 4 * 4
    assert apart.kept_table_bytes(1000) == 2 * 1000 * 2 * 32 * 4
    assert high.table_bytes(1000) == apart.table_bytes(1000) == 2 * 1000 * 64 * 4

    # MHA2MLA's SmolLM-135M (30 layers, 9 heads, 3 KV heads, head_dim 64) at its
    # rope_dim_for_mla = 8 and low_rank d_kv = 8, 16, 32: its paper's -87.5%, -81.25%, -68.75%.
    smol = _kv_cfg(n_layers=30, d_model=576, n_heads=9, n_kv_heads=3)
    eighth = dict(position_variants(smol))["1/8 of pairs"]
    m = model_kv(eighth, "smollm135m", "1/8")
    for d_kv, saved in [(8, 0.875), (16, 0.8125), (32, 0.6875)]:
        assert 1 - Fraction(m.latent_bytes(1, d_kv, 2), m.kv_bytes(1, 2)) == Fraction(saved)

    # A latent wider than what it replaces replaces nothing: at most K+V.
    full = model_kv(smol, "smol", "full")
    assert full.latent_bytes(7, 10_000, 2) == full.kv_bytes(7, 2)

    # A sliding layer keeps its last W - 1 tokens: layers 0, 1 slide (W = 5), layer 2 is full.
    slide = model_kv(
        _kv_cfg(n_layers=3, d_model=32, n_heads=2, sliding_window=5, sliding_window_pattern=3),
        "s",
        "s",
    )
    assert slide.kv_bytes(100, 4) == (2 * 4 + 100) * 2 * 2 * 16 * 4
    assert slide.kv_bytes(3, 4) == 3 * 3 * 2 * 2 * 16 * 4


def test_kv_formula_equals_transformers_dynamic_cache():
    # The bytes transformers' DynamicCache holds after one forward of T tokens, full
    # attention (Llama) and sliding (Mistral: W - 1 tokens kept), against the formula.
    from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM

    from pretrain.analysis.kv_cache import model_kv

    T = 10
    shape = dict(vocab_size=64, hidden_size=64, intermediate_size=32, num_hidden_layers=3)
    heads = dict(num_attention_heads=4, num_key_value_heads=2)
    for hf, window in [
        (LlamaForCausalLM(LlamaConfig(**shape, **heads)), None),
        (MistralForCausalLM(MistralConfig(**shape, **heads, sliding_window=4)), 4),
    ]:
        model = hf.to(torch.bfloat16).eval()
        with torch.no_grad():
            out = model(torch.randint(0, 64, (1, T)), use_cache=True)
        cache = out.past_key_values
        held = sum(t.nbytes for layer in cache.layers for t in (layer.keys, layer.values))
        ours = _kv_cfg(n_layers=3, d_model=64, n_heads=4, n_kv_heads=2, sliding_window=window)
        assert held == model_kv(ours, "tiny", "as configured").kv_bytes(T, 2)
    assert held == 3 * 2 * 2 * 16 * (4 - 1) * 2  # the Mistral one: 3 tokens kept


def kv_table(text: str, model: str, heading: str) -> list[list[str]]:
    """The rows (cells split on two or more spaces) of table `heading` of `model`'s block."""
    import re

    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"{model}: "))
    i = next(n for n in range(start, len(lines)) if lines[n] == heading)
    rows = []
    for line in lines[i + 2 :]:
        if not line.strip():
            break
        rows.append(re.split(r" {2,}", line.strip()))
    return rows


def test_kv_table_rows_and_plot(tmp_path, capsys):
    from pretrain.cli.rope_cache_size import main

    png = tmp_path / "kv.png"
    code = main(
        ["--kv", "--preset", "llama1b,pythia1b_paper", "--units", "bytes",
         "--seq-lens", "4k,1M", "--latent-rank", "8,16", "--plot", str(png)]
    )  # fmt: skip
    res = capsys.readouterr()
    assert code == 0, res.err
    seq = [4096, 1024**2]
    for model, layers, kv_heads, hd in [("llama1b", 16, 8, 64), ("pythia1b_paper", 16, 8, 256)]:
        per_token = kv_table(res.out, model, "Per token:")
        at = {(r[0], r[1]): r[2:] for r in kv_table(res.out, model, "At each context length:")}
        kv_token = 2 * layers * kv_heads * hd * 2
        assert at[("every variant", "K+V")] == [str(kv_token * T) for T in seq]
        dims = {"100% RoPE": hd, "1/4 of pairs": hd // 4, "1/8 of pairs": hd // 8}
        dims |= {"10% RoPE": even_dims("0.1", hd), "NoPE": 0}
        assert [r[0] for r in per_token] == [p for p in dims for _ in (8, 16)]
        for row in per_token:
            pos, r, d_kv = row[0], dims[row[0]], int(row[6])
            latent = layers * (kv_heads * d_kv + kv_heads * r) * 2
            # A selection's layers read full RoPE's table (head_dim dims a position); the
            # pairs it keeps, the same in every head (strategy high), need r of them.
            held = hd if "pairs" in pos else r
            assert row[1:6] == [
                str(r),
                str(hd - r),
                str(2 * held * 4),
                str(2 * r * 4),
                str(kv_token),
            ]
            assert row[7:] == [str(latent), f"{100 * latent / kv_token:.2f}%"]
            assert at[(pos, f"latent d_kv={d_kv}")] == [str(latent * T) for T in seq]
            assert at[(pos, "cos/sin tables")] == [str(2 * T * held * 4) for T in seq]
            kept = at.get((pos, "cos/sin of kept pairs"), at[(pos, "cos/sin tables")])
            assert kept == [str(2 * T * r * 4) for T in seq]
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20000
    width, height = struct.unpack(">II", data[16:24])
    assert width >= 2 * 500 and height > 400  # a panel per model


@pytest.mark.parametrize(
    "args, names",
    [
        (["--kv", "--latent-rank", "16,0"], "--latent-rank"),
        (["--kv", "--head-dim", "64"], "--head-dim"),
        (["--latent-rank", "16"], "--latent-rank"),
        (["--kv", "--preset", "llama1b,nosuch"], "nosuch"),
    ],
)
def test_kv_bad_flag_is_one_line_error(args, names, capsys, monkeypatch):
    from pretrain.cli.rope_cache_size import main

    monkeypatch.delenv("PRETRAIN_DEBUG", raising=False)
    code = main(args)
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and names in err, err


def test_docs_kv_tables_are_what_the_tool_prints(capsys):
    # docs/pair_selection.md, "The KV cache a selection frees": its command and its tables.
    from pretrain.cli.rope_cache_size import main

    doc = (REPO / "docs" / "pair_selection.md").read_text()
    section = doc[doc.index("## The KV cache a selection frees") :]
    command = "python tools/rope_cache_size.py --kv --markdown --seq-lens 32k,1M"
    assert f"`{command}`" in section
    assert main(command.split()[2:]) == 0
    printed = capsys.readouterr().out.strip()
    assert printed.count("| latent d_kv=") == 3 * 5 and printed in section, (
        "docs/pair_selection.md's KV tables are stale; paste what this prints:\n" + command
    )


def test_kv_reads_a_run_config_with_its_pair_selection(tmp_path, capsys):
    # A run config (inherit: resolved) whose selection is none of the tool's rows gets a row.
    from pretrain.cli.rope_cache_size import main

    run = tmp_path / "uniform.yaml"
    run.write_text(
        f"inherit:\n  model: {REPO / 'configs' / 'models' / 'llama1b.yaml'}\n"
        "model:\n  rope_pairs: {strategy: uniform, pairs: 4}\n"
    )
    assert main(["--kv", "--config", str(run), "--units", "bytes", "--seq-lens", "1k"]) == 0
    out = capsys.readouterr().out
    assert "as configured: 4 of 32 pairs per KV head (uniform 4" in out.splitlines()[0]
    row = kv_table(out, "uniform", "Per token:")[0]
    # 8 dims of 64 rotate in each of 8 KV heads; the table our model holds is full RoPE's
    # (2 x 64 x 4 bytes a position), the 4 kept pairs (0, 8, 16, 24 in every head) need 8 dims.
    latent = 16 * (8 * 16 + 8 * 8) * 2
    assert row == ["as configured", "8", "56", "512", "64", "32768", "16", str(latent), "18.75%"]
