"""Which pairs rotate (model.rope_pairs, docs/pair_selection.md) against references written
here: the strategies from their definitions, `usage` from a real frequency_use map of a tiny
model, the rotation by 2x2 matrices in fp64 per KV head, full RoPE and p-RoPE (after the
permutation of q/k rows derived here), the surgery from a full-RoPE run, the export through
our remote code, and what the planner counts."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from train_support import tiny_config, write_config

from pretrain.analysis.frequency_use import frequency_use
from pretrain.config import Config, ConfigError, ModelConfig, from_dict, load_config
from pretrain.hf import HFConversionError, choose_target, export_hf, read_hf_folder
from pretrain.model import Transformer
from pretrain.model.pairs import resolve_pairs
from pretrain.model.position import layer_positions
from pretrain.train.trainer import Trainer
from pretrain.weights import init_from_summary, load_initial_weights, save_weights

# 3 layers, 4 query heads on 2 KV heads of 16 dims: 8 pairs per head.
SHAPE = dict(
    vocab_size=97, pad_vocab_to_multiple=1, n_layers=3, d_model=64, n_heads=4, n_kv_heads=2
)
SHAPE |= dict(d_ff=64, max_seq_len=32, mlp_bias=False)
# Per layer, per KV head: pairs that differ between the heads, one head keeping all, a NoPE layer.
SELECTED = [[[0, 3, 5], [1, 2]], [[7], [0, 1, 2, 3, 4, 5, 6, 7]], [[], []]]


def model_of(seed: int = 0, **keys) -> Transformer:
    torch.manual_seed(seed)
    model = Transformer(ModelConfig(**{**SHAPE, **keys})).eval()
    with torch.no_grad():  # norms away from 1, so a wrong head or dim shows
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model


def rotate_by_hand(x: torch.Tensor, kept: list[list[int]], theta: float) -> torch.Tensor:
    """x (B, heads, T, D) with each head's listed pairs rotated by their 2x2 matrices, in fp64:
    pair j = dims (j, j + D/2) at angle t theta^(-2j/D) for token t; query head h reads KV head
    h // (heads / len(kept)). The other dims are x's."""
    B, heads, T, D = x.shape
    out = x.double().clone()
    for h in range(heads):
        for j in kept[h // (heads // len(kept))]:
            for t in range(T):
                a = t * theta ** (-2 * j / D)
                rot = torch.tensor([[math.cos(a), -math.sin(a)], [math.sin(a), math.cos(a)]])
                pair = x[:, h, t, [j, j + D // 2]].double()  # (B, 2)
                out[:, h, t, [j, j + D // 2]] = pair @ rot.T.double()
    return out


def heads_by_hand(attn, x: torch.Tensor, kept: list[list[int]] | None, theta: float):
    """q, k, v of one attention layer: its projection (and QK-Norm), rotated by hand."""
    B, T, _ = x.shape
    H, KV, D = attn.n_heads, attn.n_kv_heads, attn.head_dim
    q, k, v = attn.qkv(x).split([H * D, KV * D, KV * D], dim=-1)
    q, k, v = q.view(B, T, H, D), k.view(B, T, KV, D), v.view(B, T, KV, D)
    if attn.q_norm is not None:
        q, k = attn.q_norm(q), attn.k_norm(k)
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    if kept is None or not any(kept):
        return q, k, v
    return (
        rotate_by_hand(q, kept, theta).to(q.dtype),
        rotate_by_hand(k, kept, theta).to(k.dtype),
        v,
    )


# ----------------------------------------------------------------------------- the config


def test_each_strategy_keeps_the_pairs_its_definition_says():
    P = 8  # head_dim 16
    for K in (1, 3, 4, 8):
        want = {
            "high": list(range(K)),  # the K highest frequencies: j = 0 .. K-1
            "low": [P - K + i for i in range(K)],  # the K lowest
            "uniform": [math.floor(i * P / K) for i in range(K)],
        }
        if P % K == 0:  # MHA2MLA's uniform: every P/K-th pair from the highest
            assert want["uniform"] == list(range(0, P, P // K))
        for strategy, pairs in want.items():
            cfg = ModelConfig(
                **SHAPE, nope_layers=[1], rope_pairs={"strategy": strategy, "pairs": K}
            )
            assert cfg.rope_pairs.selected == [[pairs, pairs], [[], []], [pairs, pairs]]
    # a fraction of the head's dims, rounded as rope_fraction rounds: 0.3 x 16 = 4.8 -> 4 dims
    cfg = ModelConfig(**SHAPE, rope_pairs={"strategy": "low", "fraction": 0.3})
    assert cfg.rope_pairs.selected[0] == [[6, 7], [6, 7]]
    # the resolved config reads back as itself, and a config with `selected` alone is that
    again = ModelConfig(**cfg.model_dump(by_alias=True))
    assert again == cfg
    explicit = ModelConfig(**SHAPE, rope_pairs={"selected": SELECTED})
    positions = Transformer(explicit).layer_positions()
    assert [p.pairs for p in positions] == [((0, 3, 5), (1, 2)), ((7,), tuple(range(8))), None]
    assert [p.kv_rotary_dims(2) for p in positions] == [(6, 4), (2, 16), (0, 0)]
    assert [p.cache_frequencies() for p in positions] == [5, 8, 0]  # the union of the heads'
    assert "RoPE pairs 2-3/8 per KV head" in positions[0].describe()


HIGH_2 = {"strategy": "high", "pairs": 2}


@pytest.mark.parametrize(
    "keys, words",
    [
        (dict(rope_fraction=0.5, rope_pairs=HIGH_2), "leave rope_fraction at 1"),
        (dict(rope_spectrum="p_rope", rope_pairs=HIGH_2), "rope_spectrum p_rope is not supported"),
        (dict(rope_scaling={"type": "yarn", "factor": 2.0}, rope_pairs=HIGH_2), "rope_scaling"),
        (dict(rope_pairs={"strategy": "high"}), "model.rope_pairs.pairs (K per KV head)"),
        (dict(rope_pairs={"strategy": "high", "pairs": 9}), "exceeds the head's 8 pairs"),
        (dict(rope_pairs={"pairs": 2}), "needs a strategy (high, low, uniform, usage)"),
        (dict(rope_pairs={"pairs": 1, "selected": [[[0], [0]]] * 3}), "set model.rope_pairs.strat"),
        (dict(rope_pairs={"selected": [[[0]]]}), "one list per KV head (2) for each of the 3"),
        (dict(rope_pairs={"selected": [[[1, 0], [1]]] * 3}), "selected[0][0]=[1, 0] must list"),
        (dict(rope_pairs={"selected": [[[8], [1]]] * 3}), "past the 8 pairs"),
        (
            dict(nope_layers=[2], rope_pairs={"selected": [[[1], [1]]] * 3}),
            "selected[2][0]=[1]: layer 2 is NoPE",
        ),
        (
            dict(rope_pairs={"strategy": "low", "pairs": 1, "selected": [[[0], [0]]] * 3}),
            "is not what strategy low with 1 pairs keeps",
        ),
        (dict(rope_pairs={"strategy": "high", "pairs": 1, "usage_map": "x"}), "usage_map goes"),
    ],
)
def test_a_selection_that_cannot_be_is_one_line_naming_the_field(keys, words):
    with pytest.raises(ConfigError) as e:
        ModelConfig(**{**SHAPE, **keys})
    assert words in str(e.value) and "\n" not in str(e.value), str(e.value)
    assert "model.rope_pairs" in str(e.value)


@pytest.fixture(scope="module")
def usage_map(tmp_path_factory) -> tuple[Path, Transformer]:
    """(frequency_use.json, the full-RoPE model it measured): the map as tools/frequency_use.py
    writes it, over random tokens."""
    model = model_of(1)
    g = torch.Generator().manual_seed(0)
    use = frequency_use(model, [torch.randint(0, 97, (2, 24), generator=g)], source="tiny")
    path = tmp_path_factory.mktemp("usage") / "frequency_use.json"
    path.write_text(json.dumps(use.to_dict()))
    return path, model


def test_usage_keeps_the_pairs_of_largest_summed_use_of_each_kv_group(usage_map, tmp_path):
    path, _ = usage_map
    layers = json.loads(path.read_text())["layers"]
    given = ModelConfig(
        **SHAPE, rope_pairs={"strategy": "usage", "pairs": 3, "usage_map": str(path)}
    )
    assert given.rope_pairs.selected is None  # a config is read without reading the map
    cfg = resolve_pairs(given)
    assert layer_positions(given) == layer_positions(cfg)  # a model built from it reads it
    for i, layer in enumerate(layers):
        for g in range(2):  # KV head g serves query heads 2g and 2g + 1
            score = [
                layer["per_head"][2 * g][j] + layer["per_head"][2 * g + 1][j] for j in range(8)
            ]
            left, kept = list(range(8)), []
            for _ in range(3):  # the largest left, the first (lowest j) of equals
                best = left[0]
                for j in left[1:]:
                    if score[j] > score[best]:
                        best = j
                kept.append(best)
                left.remove(best)
            assert cfg.rope_pairs.selected[i][g] == sorted(kept)
    # ties go to the lower pair: a map whose use is the same everywhere keeps 0, 1, 2
    flat = json.loads(path.read_text())
    for layer in flat["layers"]:
        layer["per_head"] = [[1.0] * 8 for _ in range(4)]
    (tmp_path / "flat.json").write_text(json.dumps(flat))
    tied = resolve_pairs(
        ModelConfig(
            **SHAPE,
            rope_pairs={"strategy": "usage", "pairs": 3, "usage_map": str(tmp_path / "flat.json")},
        )
    )
    assert tied.rope_pairs.selected == [[[0, 1, 2], [0, 1, 2]]] * 3
    # once resolved, the config needs no map: the run is reproducible without the file
    (tmp_path / "flat.json").unlink()
    assert ModelConfig(**tied.model_dump(by_alias=True)) == tied


def test_a_missing_or_mismatched_usage_map_is_one_line_naming_field_and_file(usage_map, tmp_path):
    path, _ = usage_map
    partial = ModelConfig(**SHAPE, rope_fraction=0.5)
    use = frequency_use(Transformer(partial).eval(), [torch.randint(0, 97, (1, 8))])
    (tmp_path / "partial.json").write_text(json.dumps(use.to_dict()))
    (tmp_path / "junk.json").write_text("[1, 2")
    cases = {
        str(tmp_path / "absent.json"): "not found",
        str(tmp_path / "junk.json"): "is not a frequency-usage map",
        str(tmp_path / "partial.json"): "layer 0 was measured with 8 rotary dims of 16",
    }
    for where, words in cases.items():
        keys = {"strategy": "usage", "pairs": 2, "usage_map": where}
        with pytest.raises(ConfigError) as e:
            Transformer(ModelConfig(**SHAPE, rope_pairs=keys))
        line = str(e.value)
        assert f"model.rope_pairs.usage_map={where}" in line and words in line, line
        assert "\n" not in line
    with pytest.raises(ConfigError, match="holds 3 layers; the model has 2"):
        keys = {"strategy": "usage", "pairs": 2, "usage_map": str(path)}
        resolve_pairs(ModelConfig(**{**SHAPE, "n_layers": 2}, rope_pairs=keys))


# ----------------------------------------------------------------------------- the rotation


@pytest.mark.parametrize("qk_norm", [False, True])
def test_each_kv_head_rotates_exactly_its_pairs(qk_norm):
    """q and k of every layer against the 2x2 rotations by hand (fp64), each query head
    following its KV group: the kept pairs within fp32 rounding, the others bit-exact; the
    training path (autograd Function) equals the inference path bit for bit."""
    model = model_of(2, qk_norm=qk_norm, rope_pairs={"selected": SELECTED}, rope_theta=500.0)
    x = torch.randn(2, 12, 64, generator=torch.Generator().manual_seed(1))
    cos, sin = model.rope(0, 12)
    for i, block in enumerate(model.blocks):
        layer_cos = cos if model.layer_positions()[i].rope else cos[:, :0]
        layer_sin = sin if model.layer_positions()[i].rope else sin[:, :0]
        with torch.no_grad():
            got = block.attn.heads(x, layer_cos, layer_sin)
            want = heads_by_hand(block.attn, x, SELECTED[i], 500.0)
        for g_, w_ in zip(got[:2], want[:2], strict=True):
            assert (g_.double() - w_.double()).abs().max() < 2e-6
        for h in range(4):
            kept = SELECTED[i][h // 2]
            still = [d for d in range(16) if d % 8 not in kept]
            assert torch.equal(got[0][:, h, :, still], want[0][:, h, :, still])
        xg = x.clone().requires_grad_()
        trained = block.attn.heads(xg, layer_cos, layer_sin)
        assert all(torch.equal(a, b) for a, b in zip(trained, got, strict=True))


def test_every_pair_kept_is_full_rope_bit_for_bit():
    full = model_of(3)
    every = Transformer(ModelConfig(**SHAPE, rope_pairs={"strategy": "high", "pairs": 8}))
    every.load_state_dict(full.state_dict())
    ids = torch.randint(0, 97, (2, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(every(ids), full(ids))
    losses = []
    for model in (full, every):
        model.zero_grad()
        loss = model.train()(ids, ids).loss
        loss.backward()
        losses.append((loss.detach(), [p.grad.clone() for p in model.parameters()]))
    assert torch.equal(losses[0][0], losses[1][0])
    assert all(torch.equal(a, b) for a, b in zip(losses[0][1], losses[1][1], strict=True))


def test_the_highest_pairs_are_p_rope_after_permuting_the_qk_rows():
    """K = r/2 highest pairs of the full spectrum = rope_spectrum p_rope on r dims, once the q
    and k rows of each head move from p-RoPE's layout (pair j = dims j, j + r/2, the rest
    after r) to full RoPE's (pair j = dims j, j + D/2)."""
    D, r = 16, 8
    p_rope = model_of(4, rope_fraction=r / D, rope_spectrum="p_rope", rope_theta=300.0)
    selection = Transformer(
        ModelConfig(**SHAPE, rope_theta=300.0, rope_pairs={"strategy": "high", "pairs": r // 2})
    ).eval()
    # where each p-RoPE dim goes: its pairs to (j, j + D/2), its pass-through dims in order
    # to what is left
    to = [j for j in range(r // 2)] + [D // 2 + j for j in range(r // 2)]
    to += [d for d in range(D) if d not in to]
    assert sorted(to) == list(range(D))
    state = p_rope.state_dict()
    H, KV = 4, 2
    for i in range(3):
        w = state[f"blocks.{i}.attn.qkv.weight"]
        moved = w.clone()
        for head in range(H + KV):  # q heads, then k heads; v rows stay
            for d in range(D):
                moved[head * D + to[d]] = w[head * D + d]
        state[f"blocks.{i}.attn.qkv.weight"] = moved
    selection.load_state_dict(state)
    ids = torch.randint(0, 97, (2, 24), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        diff = (selection(ids) - p_rope(ids)).abs().max().item()
    assert diff < 1e-5, diff  # the same terms of each q.k, summed in another order


def test_a_few_training_steps_lower_the_loss_and_every_weight_learns():
    model = model_of(5, rope_pairs={"strategy": "uniform", "pairs": 3}, sliding_window=8)
    ids = torch.randint(0, 97, (4, 24), generator=torch.Generator().manual_seed(2))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    losses = []
    for _ in range(4):
        opt.zero_grad()
        loss = model(ids, ids).loss
        loss.backward()
        assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.05, losses


# ----------------------------------------------------------------------------- surgery


def surgery_case(usage_map_dir: Path) -> tuple[Transformer, Config, Path]:
    """(a full-RoPE model saved as a run's checkpoint, the run config that starts from it with
    the usage top-2 of that model's own map, the checkpoint): 16-dim heads, GQA, QK-Norm."""
    data = usage_map_dir / "data"  # the run is never started: no data is read
    shape = dict(rope_fraction=1.0, n_heads=2, n_kv_heads=1, qk_norm=True)
    base = tiny_config(usage_map_dir / "source", data, model=shape)
    torch.manual_seed(0)
    source_model = Transformer(from_dict(Config, base).model).eval()
    with torch.no_grad():
        for p in source_model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    folder = usage_map_dir / "source" / "checkpoints" / "step_0000004"
    save_weights(source_model, folder, base)
    g = torch.Generator().manual_seed(1)
    use = frequency_use(source_model, [torch.randint(0, 257, (2, 32), generator=g)])
    (usage_map_dir / "use.json").write_text(json.dumps(use.to_dict()))
    pairs = {"strategy": "usage", "pairs": 2, "usage_map": str(usage_map_dir / "use.json")}
    cfg = tiny_config(
        usage_map_dir / "run",
        data,
        model={**shape, "rope_pairs": pairs},
        checkpoint={"init_from": str(usage_map_dir / "source")},
    )
    config = load_config(write_config(usage_map_dir / "run.yaml", cfg))
    assert config.model.rope_pairs.selected is None  # read from the map when the run starts:
    trainer = Trainer(config, save_checkpoints=False)  # the config the run records has it
    selected = trainer.cfg.model.rope_pairs.selected
    assert selected is not None and trainer.resolved["model"]["rope_pairs"]["selected"] == selected
    return source_model, trainer.cfg, folder


def test_surgery_from_a_full_rope_run_keeps_every_weight(tmp_path):
    """checkpoint.init_from a full-RoPE run into the usage top-2 of that run's own map: every
    weight kept (no re-pairing: pair j keeps dims j, j + head_dim/2 and its frequency), one
    line says what changed, and the first step's logits are the brute-force rotation of the
    source weights (the functions the trainer calls at its start)."""
    source_model, config, folder = surgery_case(tmp_path)
    selected = config.model.rope_pairs.selected
    spec = config.checkpoint.init_from
    line = init_from_summary(spec, config.model)
    want = f"RoPE: full 8 pairs -> 2 of 8 pairs per KV head (usage top-2 of {tmp_path / 'use.json'}"
    assert f"initialised from {folder} (its step 4), every weight kept" in line
    assert want in line and f"layer 0 kv 0: {','.join(map(str, selected[0][0]))})" in line, line
    surgered = Transformer(config.model).eval()
    load_initial_weights(surgered, spec)
    ours, theirs = surgered.state_dict(), source_model.state_dict()
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)

    def by_hand(block_index: int):
        attn = source_model.blocks[block_index].attn
        return lambda x, cos, sin: heads_by_hand(attn, x, selected[block_index], 10000.0)

    reference = Transformer(config.model.replace(rope_pairs=None)).eval()  # full RoPE's code
    reference.load_state_dict(theirs)
    for i, block in enumerate(reference.blocks):
        block.attn.heads = by_hand(i)
    ids = torch.randint(0, 257, (2, 32), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert (surgered(ids) - reference(ids)).abs().max() < 1e-5


# ----------------------------------------------------------------------------- export, memory


def test_export_is_remote_code_holding_the_selection_and_imports_back(tmp_path):
    """Native classes rotate the same dims of every head and refuse in one line; the remote
    code carries the selection (its logits are compared in transformers' own process by
    tests/test_hf_export.py) and the folder imports back to the same config and weights."""
    model = model_of(6, rope_pairs={"selected": SELECTED}, qk_norm=True)
    assert choose_target(model.cfg) == "rope_lm"
    for target in ("llama", "smollm3", "qwen3", "phi3"):
        with pytest.raises(HFConversionError, match="model.rope_pairs: 1-8 of 8 pairs"):
            choose_target(model.cfg, target)
    export = export_hf(model, tmp_path / "hf", card=False)
    written = json.loads((export.path / "config.json").read_text())
    assert written["rope_pairs"] == SELECTED
    back, _, _ = read_hf_folder(export.path)
    assert back.cfg == model.cfg
    ids = torch.randint(0, 97, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(back(ids), model(ids))
    # the remote modeling code itself, in this process
    from pretrain.hf.convert import to_hf_state_dict
    from pretrain.hf.targets import get_target

    target = get_target("rope_lm")
    hf_cfg = target.config_class().from_pretrained(export.path)
    hf_model = target.empty_model(hf_cfg).eval()
    hf_model.load_state_dict(
        to_hf_state_dict(model.state_dict(), model.cfg, "rope_lm"), strict=False
    )
    with torch.no_grad():
        assert (hf_model(ids).logits - model(ids)).abs().max() < 1e-5


def test_the_cache_and_the_plan_count_what_a_selection_allocates():
    """A selection reads full RoPE's table (T x head_dim fp32 cos and sin) and holds a bool
    mask of (heads + KV heads) x head_dim per layer that keeps a pair; its step traces as full
    RoPE's with the same NoPE layer (the select writes in place: no tensor more)."""
    from pretrain.planner import GPUS, plan_run

    PICKED = {"selected": SELECTED}

    model = model_of(7, rope_pairs={"selected": SELECTED})
    buffers = sum(t.numel() * t.element_size() for t in (model.rope.cos, model.rope.sin))
    assert model.rope.cache_bytes() == buffers == 2 * 32 * 16 * 4
    over = ["model.n_layers=3", "model.d_model=64", "model.n_heads=4", "model.n_kv_heads=2"]
    over += ["model.d_ff=64", "model.max_seq_len=32", "model.vocab_size=97", "train.seq_len=32"]
    over += ["train.compile=false", "train.activation_checkpointing=0", "train.precision=fp32"]
    over += ["train.micro_batch_size=2", "train.global_batch_size=2"]
    full = load_config(Path(__file__).parents[1] / "configs/paper/llama1b_rope10.yaml", over)
    picked = full.replace(model=full.model.replace(rope_fraction=1.0, rope_pairs=PICKED))
    # full RoPE on the layers that keep pairs, NoPE on the one that keeps none
    full = full.replace(model=full.model.replace(rope_fraction=1.0, nope_layers=[2]))
    plans = [plan_run(c, GPUS["h100"], 1, 2, 0, "cpu") for c in (full, picked)]
    masks = 2 * (4 + 2) * 16  # two layers keep pairs; the third is NoPE
    assert plans[1].static["RoPE pair masks"] == masks
    assert "RoPE pair masks" not in plans[0].static
    assert plans[1].static["RoPE cos/sin cache"] == plans[0].static["RoPE cos/sin cache"]
    assert plans[1].trace.train == plans[0].trace.train
