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
    body = res.stdout.splitlines()
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
