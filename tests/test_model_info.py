"""tools/model_info.py: parameter counts against transformers' models, FLOPs and cache bytes
against formulas written here."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
TOOL = REPO / "tools" / "model_info.py"


def info(*args: str) -> dict:
    res = subprocess.run(
        [sys.executable, str(TOOL), *args, "--json"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)


@pytest.fixture(scope="module")
def presets() -> dict[str, dict]:
    """Every preset's figures from one `--all --json` run of the tool."""
    return {i["name"]: i for i in info("--all")}


def hf_param_count(model_cls, config) -> int:
    with torch.device("meta"):
        model = model_cls(config)
    return sum(p.numel() for p in model.parameters())


def test_llama1b_params_match_transformers_llama(presets):
    import transformers

    got = presets["llama1b"]
    cfg = transformers.LlamaConfig(
        vocab_size=50304,
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        mlp_bias=True,
        attention_bias=False,
        tie_word_embeddings=False,
    )
    assert got["params"] == hf_param_count(transformers.LlamaForCausalLM, cfg)
    assert got["params"] - got["params_no_embeddings"] == 2 * 50304 * 2048
    assert (got["head_dim"], got["rotary_dims"], got["kv_heads"]) == (64, 64, 8)


def test_pythia1b_params_match_transformers_gpt_neox(presets):
    # Pythia-1B as published: 1,011,781,632 parameters.
    import transformers

    got = presets["pythia1b"]
    cfg = transformers.GPTNeoXConfig(
        vocab_size=50304,
        hidden_size=2048,
        num_hidden_layers=16,
        num_attention_heads=8,
        intermediate_size=8192,
        rotary_pct=0.25,
        use_parallel_residual=True,
        tie_word_embeddings=False,
    )
    assert got["params"] == hf_param_count(transformers.GPTNeoXForCausalLM, cfg) == 1_011_781_632
    assert got["rotary_dims"] == 64


def test_flops_and_rope_cache_follow_their_formulas():
    got = info("--preset", "pythia1b_paper", "--set", "rope_fraction=0.1", "--seq-len", "1024")
    L, d, H, hd, ff, V, T = 16, 2048, 8, 256, 2816, 50304, 1024
    # Linear weights per layer: qkv (3 d^2), proj (d^2), SwiGLU in (2 ff d) and out (ff d).
    matmul = L * (4 * d * d + 3 * ff * d) + V * d  # + lm_head
    assert got["flops_per_token"] == 6 * matmul + 12 * L * H * hd * T
    assert got["rotary_dims"] == 26
    assert got["rope_cache_bytes"] == 2 * 2048 * 26 * 4
    assert got["per_layer_rope_cache_bytes"] == 16 * 2 * 2048 * 26 * 4


def test_all_lists_every_preset_and_errors_are_one_line(presets):
    assert set(presets) == {p.stem for p in (REPO / "configs" / "models").glob("*.yaml")}
    res = subprocess.run(
        [sys.executable, str(TOOL), "--preset", "llama1b", "--set", "rope_fractoin=0.1"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode != 0 and "rope_fraction" in res.stderr and "Traceback" not in res.stderr


def _doc_value(cell: str):
    cell = cell.strip().strip("`")
    if cell in ("null", "true", "false"):
        return {"null": None, "true": True, "false": False}[cell]
    try:
        return float(cell)
    except ValueError:
        return cell


def test_docs_list_every_model_field_with_its_default():
    from pretrain.config import ModelConfig

    doc = (REPO / "docs" / "model.md").read_text()
    rows = {}
    for line in doc.splitlines():
        cells = [c.strip() for c in line.split("|")]
        if len(cells) > 3 and cells[1].startswith("`") and cells[1].endswith("`"):
            rows[cells[1].strip("`")] = cells[2]
    for field, f in ModelConfig.model_fields.items():
        name = f.alias or field
        assert name in rows, f"docs/model.md does not describe model.{name}"
        want = f.default
        got = _doc_value(rows[name])
        assert got == (
            float(want) if isinstance(want, (int, float)) and not isinstance(want, bool) else want
        ), name


def test_docs_presets_table_is_what_the_tool_prints():
    from pretrain.analysis.model_info import format_info_table, model_info
    from pretrain.analysis.presets import load_preset, preset_names

    table = format_info_table([model_info(load_preset(n), n) for n in preset_names()])
    doc = (REPO / "docs" / "model.md").read_text()
    for row in table.splitlines()[2:]:
        assert row in doc, f"docs/model.md presets table is stale; expected the row\n{row}"
