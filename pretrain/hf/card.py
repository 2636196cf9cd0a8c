"""The model card (README.md) of an export: architecture, training, evaluation, parity, usage."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from pretrain.data.tokenizer import Tokenizer
from pretrain.eval.checkpoint_eval import RESULTS_JSON, VALID_JSON, default_output_dir
from pretrain.model.position import LayerPosition
from pretrain.model.transformer import Transformer
from pretrain.run_layout import CONFIG_FILE, STATE_FILE
from pretrain.tables import pipe_table
from pretrain.weights import CHECKPOINTS_DIR

log = logging.getLogger(__name__)

TRAINER_STATE = STATE_FILE  # written by pretrain/train/checkpoint.py


@dataclass
class RunInfo:
    """What the card says about training and evaluation; every field may be unknown."""

    source: str | None = None  # the weights folder exported
    name: str | None = None  # run@step
    step: int | None = None
    tokens: int | None = None  # training tokens consumed
    data: list[str] = field(default_factory=list)
    seq_len: int | None = None
    eval_results: dict[str, Any] | None = None  # lm-eval's results JSON
    valid: dict[str, float] | None = None  # validation loss, perplexity, bits per byte/char
    parity: dict[str, Any] | None = None  # from pretrain.hf.check


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def run_info(weights_dir: str | Path) -> RunInfo:
    """Training and evaluation facts of a weights folder, read from the run's files when present:
    the run config, the checkpoint's marker and RUN/eval/<step>/ (tools/evaluate.py)."""

    wdir = Path(weights_dir)
    info = RunInfo(source=str(wdir))
    info.name = (
        f"{wdir.parent.parent.name}@{wdir.name}"
        if wdir.parent.name == CHECKPOINTS_DIR
        else wdir.name
    )
    try:
        config = yaml.safe_load((wdir / CONFIG_FILE).read_text()) or {}
    except (OSError, yaml.YAMLError):
        config = {}
    train, model = config.get("train") or {}, config.get("model") or {}
    info.seq_len = train.get("seq_len") or model.get("max_seq_len")
    info.data = list((config.get("data") or {}).get("train") or [])
    state = _read_json(wdir / TRAINER_STATE) or {}
    info.step = state.get("step")
    info.tokens = state.get("consumed_tokens")
    if (
        info.tokens is None
        and info.step is not None
        and train.get("global_batch_size")
        and info.seq_len
    ):
        info.tokens = info.step * train["global_batch_size"] * info.seq_len
    eval_dir = default_output_dir(wdir)
    info.eval_results = _read_json(eval_dir / RESULTS_JSON)
    info.valid = _read_json(eval_dir / VALID_JSON)
    return info


def _fmt_int(n: int | None) -> str:
    if n is None:
        return "unknown"
    for unit, div in (("B", 1e9), ("M", 1e6)):
        if n >= div:
            return f"{n:,} ({n / div:.2f}{unit})"
    return f"{n:,}"


def _eval_rows(results: dict[str, Any]) -> list[list[str]]:
    """task, metric, value (± stderr) of each metric the harness reported."""
    rows = []
    for task, r in sorted((results.get("results") or {}).items()):
        for metric in ("acc", "acc_norm", "perplexity", "word_perplexity", "bits_per_byte"):
            if f"{metric},none" in r:
                value = r[f"{metric},none"]
                err = r.get(f"{metric}_stderr,none")
                err = f" ± {err:.4f}" if isinstance(err, (int, float)) else ""
                rows.append([task, metric, f"{value:.4f}{err}"])
    return rows


def _layer_runs(layers: list[LayerPosition], text) -> str:
    """'text' of every layer when they agree, else runs: 'layers 0-2: x; layer 3: y'."""
    texts = [text(p) for p in layers]
    if len(set(texts)) == 1:
        return texts[0]
    runs, start = [], 0
    for i in range(1, len(texts) + 1):
        if i == len(texts) or texts[i] != texts[start]:
            span = f"layer {start}" if i - 1 == start else f"layers {start}-{i - 1}"
            runs.append(f"{span}: {texts[start]}")
            start = i
    return "; ".join(runs)


def positions_text(layers: list[LayerPosition]) -> tuple[str, str]:
    """The card's RoPE and attention rows from each layer's positions
    (`Transformer.layer_positions()`): one phrase when every layer agrees, else per run of
    layers (NoPE layers, another theta on the global layers, sliding windows, ALiBi)."""

    def rope(p: LayerPosition) -> str:
        if not p.rope:
            return "none (NoPE)"
        if p.pairs is not None:
            counts = sorted({len(kept) for kept in p.pairs})
            n = f"{counts[0]}" if len(counts) == 1 else f"{counts[0]} to {counts[-1]}"
            return (
                f"{n} of {p.head_dim // 2} frequency pairs per key-value head (a pair "
                f"selection, full RoPE's frequencies), theta {p.theta:g}"
            )
        pct = 100 * p.rotary_dims / p.head_dim
        spectrum = ""
        if p.spectrum == "p_rope" and p.rotary_dims < p.head_dim:
            spectrum = ", p-RoPE: the highest frequencies of full RoPE"
        return (
            f"{p.rotary_dims} of {p.head_dim} dims per head ({pct:.3g}%), theta {p.theta:g}"
            + spectrum
        )

    def attention(p: LayerPosition) -> str:
        span = "causal" if p.window is None else f"sliding window of {p.window} tokens"
        return span + (", ALiBi" if p.alibi else "")

    return _layer_runs(layers, rope), _layer_runs(layers, attention)


def card_text(export, model: Transformer, tokenizer: Tokenizer | None, run: RunInfo | None) -> str:
    """README.md of an export (`export` is a folder.Export)."""
    import transformers

    cfg = model.cfg
    run = run or RunInfo()
    remote = export.remote_code
    rope, attention = positions_text(model.layer_positions())
    heads = f"{cfg.n_heads} query / {cfg.kv_heads} key-value" + (
        " (grouped-query)" if cfg.kv_heads < cfg.n_heads else ""
    )
    block = {
        "sequential": "sequential (x + attn(norm(x)), then + mlp(norm(.)))",
        "parallel": "parallel (x + attn(norm1(x)) + mlp(norm2(x)))",
    }[cfg.block]
    biases = (
        ", ".join(
            n
            for n, on in (
                ("attention", cfg.attn_bias),
                ("MLP", cfg.mlp_bias),
                ("LayerNorm", cfg.norm == "layernorm" and cfg.norm_bias),
            )
            if on
        )
        or "none"
    )
    architecture = [
        [
            "parameters",
            f"{_fmt_int(model.num_params())} ({_fmt_int(model.num_params(exclude_embeddings=True))} without embeddings)",
        ],
        ["layers / d_model / d_ff", f"{cfg.n_layers} / {cfg.d_model} / {cfg.d_ff}"],
        ["attention heads", f"{heads}, head_dim {cfg.head_dim}"],
        ["block", block],
        ["norm", f"{'RMSNorm' if cfg.norm == 'rmsnorm' else 'LayerNorm'} (eps {cfg.norm_eps:g})"],
        ["MLP", "SwiGLU" if cfg.mlp == "swiglu" else "GeLU"],
        ["biases", biases],
        ["RoPE", rope],
        ["attention", attention],
        ["QK-Norm", "yes, per head over head_dim, before RoPE" if cfg.qk_norm else "no"],
        ["learned positions", f"yes, {cfg.max_seq_len}" if cfg.learned_pos_emb else "no"],
        ["context", f"{cfg.max_seq_len} tokens"],
        [
            "vocabulary",
            f"{cfg.vocab_size} (embedding padded to {cfg.padded_vocab_size}; padded ids are never generated)",
        ],
        ["tied embeddings", "yes" if cfg.tie_embeddings else "no"],
        ["tokenizer", tokenizer.identifier if tokenizer is not None else "not included"],
    ]
    lines = [
        "---",
        "library_name: transformers",
        "pipeline_tag: text-generation",
        "tags: [pretrain, rope, partial-rope" + (", custom_code" if remote else "") + "]",
        "---",
        "",
        f"# {run.name or export.path.name}",
        "",
        f"A decoder-only language model trained with the `pretrain` toolkit, exported as "
        f"`{export.class_name}` ({'remote code in this folder: load with trust_remote_code=True' if remote else 'native transformers class'}).",
        "",
        "## Architecture",
        "",
        pipe_table(["", ""], architecture),
        "",
        "## Training",
        "",
        f"- training tokens: {_fmt_int(run.tokens)}"
        + (f" (step {run.step})" if run.step is not None else ""),
    ]
    if run.seq_len:
        lines.append(f"- sequence length: {run.seq_len}")
    if run.data:
        lines.append(f"- data: {', '.join(f'`{d}`' for d in run.data)}")
    if run.source:
        lines.append(f"- exported from: `{run.source}`")
    lines += ["", "## Evaluation", ""]
    if run.eval_results:
        lines += [
            "lm-evaluation-harness, from the run's `eval/` folder (tools/evaluate.py):",
            "",
            pipe_table(["task", "metric", "value"], _eval_rows(run.eval_results)),
        ]
    if run.valid:
        lines += [
            "",
            "Validation:",
            "",
            pipe_table(
                ["metric", "value"],
                [[k, f"{v:.4f}"] for k, v in run.valid.items() if isinstance(v, (int, float))],
            ),
        ]
    if not run.eval_results and not run.valid:
        lines.append(
            "No evaluation results were found beside the checkpoint (run tools/evaluate.py before exporting)."
        )
    if run.parity:
        p = run.parity
        lines += [
            "",
            "## Parity with the toolkit's model",
            "",
            f"Checked at export (`--check`, transformers {p.get('transformers')}): {p['sequences']} random "
            f"sequences of {p['length']} tokens, fp32 on {p.get('device', 'cpu')}. Max |logit difference| "
            f"{p['max_logit_diff']:.3g} (full forward) and {p['max_cached_diff']:.3g} (token by token with "
            f"the KV cache); tolerance {p['tolerance']:g}. Greedy generation of {p['greedy_tokens']} tokens: "
            f"{'identical' if p['greedy_identical'] else 'different'}.",
        ]
    load = ", trust_remote_code=True" if remote else ""
    lines += [
        "",
        "## Use",
        "",
        "```python",
        "from transformers import AutoModelForCausalLM, AutoTokenizer",
        "",
        f'model = AutoModelForCausalLM.from_pretrained("PATH"{load})',
    ]
    if tokenizer is not None and export.tokenizer_note is None:
        lines += [
            f'tok = AutoTokenizer.from_pretrained("PATH"{load})',
            'ids = tok("The meaning of life is", return_tensors="pt").input_ids',
            "print(tok.decode(model.generate(ids, max_new_tokens=32, do_sample=False)[0]))",
        ]
    lines += ["```", "", "PATH: this folder, or the hub repository it is uploaded to."]
    if tokenizer is not None and tokenizer.eod_id is not None:
        lines.append(
            f"Training saw documents separated by the end-of-document token (id {tokenizer.eod_id}), "
            "no other special token; it is the tokenizer's eos and bos."
        )
    lines.append("")
    if tokenizer is not None and export.tokenizer_note is None:
        lines += [
            f"lm-eval: `lm_eval --model hf --model_args pretrained=PATH{',trust_remote_code=True' if remote else ''} --tasks ...`",
            "",
        ]
    if export.tokenizer_note:
        lines += [f"No tokenizer files: {export.tokenizer_note}.", ""]
    if remote:
        lines += [
            "`modeling_rope_lm.py` and `configuration_rope_lm.py` need only torch and transformers "
            f"(written for transformers {transformers.__version__.split('.')[0]}.x).",
            "",
        ]
    return "\n".join(lines)


def write_card(
    export, model: Transformer, tokenizer: Tokenizer | None, run: RunInfo | None
) -> Path:
    path = export.path / "README.md"
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(card_text(export, model, tokenizer, run), encoding="utf-8")
    tmp.replace(path)
    return path
