"""Parity of an export: load the folder with transformers, compare logits with our model."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import torch

from pretrain.model.transformer import Transformer

DEFAULT_TOLERANCE = 1e-4


@torch.no_grad()
def check_parity(
    model: Transformer,
    folder: str | Path,
    *,
    tolerance: float = DEFAULT_TOLERANCE,
    sequences: int = 3,
    length: int = 64,
    greedy_tokens: int = 16,
    device: str = "cpu",
    seed: int = 0,
) -> dict[str, Any]:
    """Compare our model with `AutoModelForCausalLM.from_pretrained(folder)` in fp32.

    Three figures on `sequences` random sequences of `length` tokens (real vocabulary ids):
    max |logit difference| of one full forward; the same, fed token by token through the
    exported model's KV cache after a prefill of half the sequence; and whether greedy
    generation of `greedy_tokens` tokens after the first quarter gives the same tokens.
    Weights saved in bf16/fp16 are compared with our model's weights rounded the same way,
    so only the conversion is measured. Returns the figures, "ok" (both maxima within
    `tolerance` and the greedy tokens identical: a broken KV cache can leave the single-step
    logits right and still decode other text) and "problems", what failed, in words.
    """
    import transformers
    from transformers import AutoModelForCausalLM

    cfg = model.cfg
    hf = (
        AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, trust_remote_code=True)
        .to(device)
        .eval()
    )
    written = json.loads((Path(folder) / "config.json").read_text())
    saved = getattr(torch, str(written.get("dtype") or written.get("torch_dtype") or "float32"))
    ours = model
    if saved != torch.float32 or next(model.parameters()).dtype != torch.float32:
        ours = copy.deepcopy(model).float()
        for p in ours.parameters():
            p.data = p.data.to(saved).float()
    ours = ours.to(device).eval()

    length = min(length, cfg.max_seq_len)
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, cfg.vocab_size, (sequences, length), generator=g).to(device)
    a = ours(x).float()
    b = hf(x).logits.float()
    full = (a - b).abs().max().item()

    half = length // 2
    # transformers 5.24 renamed the KV cache argument and output `past_key_values` -> `cache`
    from pretrain.hf.remote_code.modeling_rope_lm import CACHE_FIELD as name

    out = hf(x[:, :half], use_cache=True)
    cache, steps = getattr(out, name), [out.logits]
    for t in range(half, length):
        out = hf(x[:, t : t + 1], use_cache=True, **{name: cache})
        cache = getattr(out, name)
        steps.append(out.logits)
    cached = (a - torch.cat(steps, dim=1).float()).abs().max().item()

    prompt = x[:, : max(1, min(length // 4, cfg.max_seq_len - greedy_tokens))]
    n = min(greedy_tokens, cfg.max_seq_len - prompt.shape[1])
    mine = ours.generate(prompt, max_new_tokens=n, temperature=0)
    theirs = hf.generate(
        prompt,
        max_new_tokens=n,
        do_sample=False,
        eos_token_id=None,
        attention_mask=torch.ones_like(prompt),
    )  # no stop at eos, as ours
    identical = torch.equal(mine, theirs)
    problems = [
        f"max |logit difference| {v:.3g} {what} is above the tolerance {tolerance:g}"
        for v, what in ((full, "in a full forward"), (cached, "with the KV cache"))
        if not v <= tolerance  # NaN fails too
    ]
    if not identical:
        problems.append(f"greedy generation of {n} tokens gives different tokens")
    return {
        "max_logit_diff": full,
        "max_cached_diff": cached,
        "tolerance": tolerance,
        "ok": not problems,
        "problems": problems,
        "sequences": sequences,
        "length": length,
        "greedy_tokens": n,
        "greedy_identical": identical,
        "device": str(device),
        "transformers": transformers.__version__,
        "class": type(hf).__name__,
    }
