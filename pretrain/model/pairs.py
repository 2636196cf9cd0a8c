"""Which pairs rotate (`model.rope_pairs`, docs/pair_selection.md): the `usage` strategy's
ranking from a frequency-usage map, and the line that says what a selection keeps.

`high`, `low` and `uniform` need only the config and are resolved when it is read
(model/config.py). `usage` reads a file that another run wrote, as `checkpoint.init_from`
reads weights, so it is resolved when a model is built or a run starts (`resolve_pairs`):
a study whose usage runs read its own base runs' maps loads and writes before those runs
have trained, and the run's resolved config records the pairs, so nothing after its start
reads the map again.
"""

from __future__ import annotations

import json
from pathlib import Path

from pretrain.model.config import ModelConfig, RopePairsConfig
from pretrain.schema import ConfigError


def _need(cond: bool, msg: str) -> None:
    if not cond:
        raise ConfigError(msg)


def usage_scores(path: str, cfg: ModelConfig) -> list[list[list[float]]]:
    """[layer][kv head][pair]: the summed `use` of the query heads of each KV group, from a
    frequency-usage map (tools/frequency_use.py's JSON) of a model of cfg's shape measured
    with full RoPE's pairs (rotary dims = head_dim); one line naming the file otherwise."""
    where = f"model.rope_pairs.usage_map={path}"
    file = Path(path)
    _need(
        file.is_file(),
        f"{where} not found; give the frequency_use.json that tools/frequency_use.py wrote "
        f"for a full-RoPE run of this shape",
    )
    try:
        layers = json.loads(file.read_text())["layers"]
        shapes = [(d["heads"], d["kv_heads"], d["head_dim"], d["rotary_dims"]) for d in layers]
        use = [d["per_head"] for d in layers]
    except (ValueError, KeyError, TypeError) as e:
        raise ConfigError(
            f"{where} is not a frequency-usage map ({type(e).__name__}: {e}); give the JSON "
            f"tools/frequency_use.py writes"
        ) from None
    H, KV, D, nope = cfg.n_heads, cfg.kv_heads, cfg.head_dim, cfg.nope_layer_set
    _need(
        len(layers) == cfg.n_layers,
        f"{where} holds {len(layers)} layers; the model has {cfg.n_layers}: measure a run of "
        f"this shape",
    )
    out = []
    for i, ((h, kv, d, r), per_head) in enumerate(zip(shapes, use, strict=True)):
        if i in nope:
            out.append([[] for _ in range(KV)])
            continue
        _need(
            (h, kv, d) == (H, KV, D),
            f"{where}: layer {i} was measured with {h} heads, {kv} KV heads of {d} dims; the "
            f"model has {H}, {KV} of {D}: measure a run of this shape",
        )
        _need(
            r == D and len(per_head) == H and all(len(row) == D // 2 for row in per_head),
            f"{where}: layer {i} was measured with {r} rotary dims of {D}, whose pairs are not "
            f"full RoPE's (dims j, j + head_dim/2); measure a full-RoPE run",
        )
        group = H // KV  # query heads g*group .. (g+1)*group - 1 read KV head g
        rows = [per_head[g * group : (g + 1) * group] for g in range(KV)]
        out.append([[sum(col) for col in zip(*heads, strict=True)] for heads in rows])
    return out


def top_pairs(scores: list[float], k: int) -> list[int]:
    """The k pairs of largest score, ties to the lower pair, in increasing order."""
    return sorted(sorted(range(len(scores)), key=lambda j: (-scores[j], j))[:k])


def resolve_pairs(cfg: ModelConfig) -> ModelConfig:
    """cfg with a `usage` strategy's `selected` read from its map (each layer and KV head
    keeps its top K); any other config as it is."""
    p = cfg.rope_pairs
    if p is None or p.selected is not None:
        return cfg
    k = p.kept(cfg.head_dim) or 0
    scores = usage_scores(str(p.usage_map), cfg)
    selected = [[top_pairs(s, k) for s in layer] for layer in scores]
    return cfg.model_copy(update={"rope_pairs": p.model_copy(update={"selected": selected})})


def describe(p: RopePairsConfig, head_dim: int) -> str:
    """'8 of 32 pairs per KV head (usage top-8 of FILE, layer 0 kv 0: 0,1,3,...)'."""
    sel = p.selected or []
    counts = sorted({len(kept) for layer in sel if any(layer) for kept in layer} or {0})
    n = f"{counts[0]}" if len(counts) == 1 else f"{counts[0]}-{counts[-1]}"
    k = p.kept(head_dim)
    k = n if k is None else k  # a resolved config may give the pairs alone
    how = {None: "as selected", "usage": f"usage top-{k} of {p.usage_map}"}
    first = [(i, g, kept) for i, layer in enumerate(sel) for g, kept in enumerate(layer) if kept]
    at = ""
    if first:
        i, g, kept = first[0]
        at = f", layer {i} kv {g}: {','.join(map(str, kept))}"
    text = how.get(p.strategy, f"{p.strategy} {k}")
    return f"{n} of {head_dim // 2} pairs per KV head ({text}{at})"
