"""Hugging Face export of every config in configs/, checked against transformers.

Every config is shrunk to 2 layers of its own head_dim (so its own rotary dims, theta,
grouping, norms, MLP, block, QK-Norm, positions and tying) with a 500-token vocabulary,
given random weights (norms and biases too), and exported. Each family (configs that share
an architecture) is also exported once with the config's own vocabulary and tokenizer. A
child process that cannot import `pretrain` (python -S, only the site-packages of torch and
transformers on its path) loads every folder with AutoModelForCausalLM
(trust_remote_code=True) and AutoTokenizer, and returns logits, 32 greedy tokens and token
ids; those are compared here with the toolkit's model, and the class it instantiated with
the one config.json names in `architectures`. The folders are then imported back
(bit-exact), and lm-eval's `hf` model scores requests as the toolkit's own harness does.

`PRETRAIN_HF_PYTHONS` (colon-separated interpreters of small environments that hold only
torch, transformers and safetensors; `make test-hf-compat` builds them with the oldest and
the newest transformers the range admits) runs the same child with each of them too.
"""

from __future__ import annotations

import ast
import functools
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import REPO, shared_path
from tables_support import unpadded

from pretrain.config import ModelConfig, load_model_config
from pretrain.data.tokenizer import ByteTokenizer, CharTokenizer, load_tokenizer
from pretrain.hf import HFConversionError, choose_target, export_hf, hf_config, read_hf_folder
from pretrain.hf.convert import CLASS_NAMES, REMOTE
from pretrain.hf.folder import shard_plan
from pretrain.hf.targets.remote import REMOTE_CODE_DIR, REMOTE_FILES
from pretrain.model import Transformer
from pretrain.weights import load_weights, save_weights

CONFIG_FILES = sorted((REPO / "configs").rglob("*.yaml"))
GEN_TOKENS = 32
PROMPT_LEN = 16
TEXT = "Hello world! The 2 quick brown foxes jumped over 13 lazy dogs.\n  def f(x): return x ** 2\n"


def family(cfg: ModelConfig) -> str:
    """A readable name for the architecture of `cfg` (what a family of configs shares)."""
    rope = (
        "nope"
        if cfg.rope_dims == 0
        else "full_rope"
        if cfg.rope_dims == cfg.head_dim
        else "partial_rope"
    )
    parts = [cfg.block, cfg.norm, cfg.mlp, "gqa" if cfg.kv_heads < cfg.n_heads else "mha", rope]
    parts += [
        name
        for name, on in (
            ("qknorm", cfg.qk_norm),
            ("learned_pos", cfg.learned_pos_emb),
            ("tied", cfg.tie_embeddings),
        )
        if on
    ]
    return "-".join(parts)


def shrink(cfg: ModelConfig) -> ModelConfig:
    """2 layers, head_dim 16, the same ratios of heads, rotary dims and everything else."""
    heads = min(cfg.n_heads, 4)
    kv = heads if cfg.kv_heads == cfg.n_heads else max(1, heads * cfg.kv_heads // cfg.n_heads)
    hd, r = 16, cfg.rope_dims
    rotary = (
        hd
        if r == cfg.head_dim
        else 0
        if r == 0
        else min(hd - 2, max(2, 2 * round(r / cfg.head_dim * hd / 2)))
    )
    return cfg.replace(
        n_layers=2,
        d_model=heads * hd,
        n_heads=heads,
        n_kv_heads=None if kv == heads else kv,
        d_ff=96,
        max_seq_len=min(cfg.max_seq_len, 64),
        rope_fraction=None,
        rotary_dims=rotary,
    )


def random_model(cfg: ModelConfig, seed: int) -> Transformer:
    torch.manual_seed(seed)
    model = Transformer(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return model


def shrink_keeping_heads(cfg: ModelConfig) -> ModelConfig:
    """2 layers of the config's own head_dim and rotary dims, 4 query heads on 1 key/value head
    for GQA (2 heads otherwise), d_ff 96, a 500-token vocabulary (padded to 512, so the export
    suppresses 12 ids): every architecture field of the config, at a size 76 exports afford."""
    ratio = cfg.n_heads // cfg.kv_heads
    heads = min(cfg.n_heads, max(2, ratio))
    return cfg.replace(
        n_layers=2,
        d_model=heads * cfg.head_dim,
        n_heads=heads,
        n_kv_heads=None if ratio == 1 else max(1, heads // ratio),
        d_ff=96,
        max_seq_len=min(cfg.max_seq_len, 64),
        rope_fraction=None,
        rotary_dims=cfg.rope_dims,
        vocab_size=500,
        pad_vocab_to_multiple=64,
    )


@functools.cache
def _neox_tokenizer():
    return load_tokenizer(shared_path("tokenizers", "gpt-neox-20b_tokenizer.json"))


def tokenizer_for(cfg: ModelConfig):
    """The tokenizer a config's runs use: GPT-NeoX (paper), bytes (quickstart), characters."""
    if cfg.vocab_size == 50277:
        return _neox_tokenizer()
    if cfg.vocab_size == 257:
        return ByteTokenizer()
    if cfg.vocab_size == 65:
        return CharTokenizer.from_text(shared_path("tinyshakespeare.txt").read_text())
    chars = sorted(set(TEXT))  # enwik8-sized character vocabulary: the text's, then CJK
    return CharTokenizer(chars + [chr(0x4E00 + i) for i in range(cfg.vocab_size - len(chars))])


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny models run faster on one thread than on two contended ones."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


FAMILIES: dict[str, list[Path]] = {}
for _path in CONFIG_FILES:
    FAMILIES.setdefault(family(load_model_config(_path)), []).append(_path)


# ----------------------------------------------------------------------------- every config


def test_every_config_in_configs_exports():
    """Every config (paper, char, presets, quickstart) picks an exact target and gets a config."""
    counts: dict[str, int] = {}
    for path in CONFIG_FILES:
        cfg = load_model_config(path)
        target = choose_target(cfg)
        config = hf_config(cfg)
        assert config.model_type == target
        assert config.architectures == [CLASS_NAMES[target]], path
        counts[target] = counts.get(target, 0) + 1
        assert (target != REMOTE) == holds_natively(cfg), path
    # every config exports: 36 native (32 Llama, 3 GPT-NeoX, 1 Qwen3) and 41 remote code, as
    # docs/hf.md says (a new config updates it)
    assert counts == {"llama": 32, "gpt_neox": 3, "qwen3": 1, REMOTE: 41}, counts
    assert len(CONFIG_FILES) == 77


def holds_natively(cfg: ModelConfig) -> bool:
    """Whether a native class holds the model exactly, from the classes' own definitions
    (transformers' modeling files): GPT-NeoX's LayerNorm/GeLU/MHA with RoPE on some dims, or
    Llama's RMSNorm/SwiGLU sequential layers (MLP biases too) with RoPE on the whole head or,
    unscaled, partial RoPE, p-RoPE and NoPE as the proportional rope_type, whose base
    theta^(head_dim/r) transformers computes in fp32; QK-Norm as Qwen3's, which has no MLP
    biases. No class has learned positions, ALiBi or a logit soft cap."""
    if cfg.learned_pos_emb or cfg.alibi or cfg.attn_logit_softcap:
        return False
    r, d = cfg.rope_dims, cfg.head_dim
    neox = (cfg.norm, cfg.mlp, cfg.kv_heads) == ("layernorm", "gelu", cfg.n_heads) and r > 0
    if neox and not cfg.qk_norm:
        return True
    if (cfg.norm, cfg.mlp, cfg.block) != ("rmsnorm", "swiglu", "sequential") or cfg.dropout:
        return False
    if cfg.qk_norm and cfg.mlp_bias:
        return False
    if r in (0, d):
        return True
    scaled = cfg.rope_scaling is not None and cfg.rope_scaling.factor != 1.0
    base_log10 = math.log10(cfg.rope_theta) * (1 if cfg.rope_spectrum == "p_rope" else d / r)
    return not scaled and base_log10 < math.log10(torch.finfo(torch.float32).max)


@pytest.mark.parametrize("path", CONFIG_FILES, ids=lambda p: str(p.relative_to(REPO / "configs")))
def test_every_config_shrunk_round_trips_exactly(path):
    """Each config shrunk: the converted state dict goes back bit for bit."""
    from pretrain.hf.convert import from_hf_state_dict, to_hf_state_dict

    cfg = shrink(load_model_config(path))
    cfg = cfg.replace(vocab_size=100, pad_vocab_to_multiple=64)
    model = random_model(cfg, 0)
    target = choose_target(cfg)
    back = from_hf_state_dict(
        {k: v.clone() for k, v in to_hf_state_dict(model.state_dict(), cfg).items()}, cfg, target
    )
    ours = {
        k: v
        for k, v in model.state_dict().items()
        if not (cfg.tie_embeddings and k == "lm_head.weight")
    }
    assert back.keys() == ours.keys()
    assert all(torch.equal(back[k], ours[k]) for k in ours)


def test_each_target_is_a_module_of_its_own():
    """Every target is one module of pretrain/hf/targets/ (a new class lands as one new module),
    and no module of pretrain/hf/ outgrows a reader (600 lines)."""
    from pretrain.hf.targets import BY_NAME

    modules = {name: type(t).__module__ for name, t in BY_NAME.items()}
    assert len(set(modules.values())) == len(modules), modules
    assert all(m.startswith("pretrain.hf.targets.") for m in modules.values()), modules
    sizes = {
        str(p.relative_to(REPO)): len(p.read_text().splitlines())
        for p in (REPO / "pretrain" / "hf").rglob("*.py")
    }
    assert max(sizes.values()) <= 600, sizes


def test_llama8b_is_written_in_shards():
    """The 8B preset in bf16 is 16.5 GB: four files of at most 5 GB (planned on meta)."""
    from pretrain.hf.convert import to_hf_state_dict

    cfg = load_model_config(REPO / "configs/models/llama8b.yaml")
    with torch.device("meta"):
        state = to_hf_state_dict(Transformer(cfg).state_dict(), cfg)
    sizes = {k: v.numel() * 2 for k, v in state.items()}
    plan = shard_plan(sizes, 5 * 10**9)
    assert len(plan) == 4 and sum(len(s) for s in plan) == len(state)
    assert all(sum(sizes[k] for k in s) <= 5 * 10**9 for s in plan)


# ----------------------------------------------------------------------------- families

CHILD = r"""
import importlib.util, json, sys
assert importlib.util.find_spec("pretrain") is None, "the child can import pretrain: " + repr(sys.path)
import torch, transformers
from transformers import AutoModelForCausalLM, AutoTokenizer

torch.set_num_threads(1)
job = json.load(open(sys.argv[1]))
out = {"transformers": str(transformers.__version__), "torch": str(torch.__version__)}
for name, j in job.items():
    model = AutoModelForCausalLM.from_pretrained(j["folder"], trust_remote_code=True, dtype=torch.float32).eval()
    ids = torch.tensor(j["ids"])
    prompt = ids[:, :j["prompt_len"]]
    with torch.no_grad():
        logits = model(ids).logits
        gen = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=j["gen"],
                             do_sample=False, eos_token_id=None)
    out[name] = {"logits": logits, "generated": gen,
                 "module": type(model).__module__, "class": type(model).__name__}
    if j["text"] is not None:
        tok = AutoTokenizer.from_pretrained(j["folder"])
        out[name].update(encoded=tok(j["text"], add_special_tokens=False).input_ids, eos=tok.eos_token_id)
torch.save(out, sys.argv[2])
"""


def child_pythons() -> tuple[dict[str, list[str]], str]:
    """name -> command of each interpreter the child runs with: this environment's torch and
    transformers without `pretrain` (python -S), then each of PRETRAIN_HF_PYTHONS as it is."""
    site = [p for p in sys.path if p.endswith(("site-packages", "dist-packages"))]
    out = {"this": [sys.executable, "-S"]}
    for python in filter(None, os.environ.get("PRETRAIN_HF_PYTHONS", "").split(":")):
        out[Path(python).parents[1].name] = [python]
    return out, ":".join(site)


PYTHONS, _SITE = child_pythons()


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    """name -> (model, tokenizer, export) for one shrunk config of each family."""
    root = tmp_path_factory.mktemp("hf_families")
    out = {}
    for i, (name, paths) in enumerate(sorted(FAMILIES.items())):
        cfg = shrink(load_model_config(paths[0]))
        model = random_model(cfg, i)
        tok = tokenizer_for(cfg)
        # one family is written in shards, as an 8B model is
        shard = "60KB" if name == "sequential-rmsnorm-swiglu-gqa-partial_rope" else "5GB"
        out[name] = (model, tok, export_hf(model, root / name, tokenizer=tok, max_shard_size=shard))
    return out


def config_id(path: Path) -> str:
    return str(path.relative_to(REPO / "configs"))


@pytest.fixture(scope="module")
def config_exports(tmp_path_factory):
    """config id -> (model, export) for every config in configs/ (shrink_keeping_heads)."""
    root = tmp_path_factory.mktemp("hf_configs")
    out = {}
    for i, path in enumerate(CONFIG_FILES):
        model = random_model(shrink_keeping_heads(load_model_config(path)), 100 + i)
        folder = root / config_id(path).replace("/", "__").removesuffix(".yaml")
        out[config_id(path)] = (model, export_hf(model, folder, card=False))
    return out


# RoPE scaling exports: (name, architecture, scaling) -> the target each must land on.
SCALED = {
    "llama-yarn": ("llama", {"type": "yarn", "factor": 4.0}, "llama"),
    "llama-linear": ("llama", {"type": "linear", "factor": 2.0}, "llama"),
    "llama-ntk": ("llama", {"type": "ntk", "factor": 2.0}, "llama"),
    "llama-dynamic_ntk": ("llama", {"type": "dynamic_ntk", "factor": 2.0}, "llama"),
    "llama-llama3": ("llama", {"type": "llama3", "factor": 8.0, "high_freq_factor": 2.0}, "llama"),
    "neox25-yarn": ("neox", {"type": "yarn", "factor": 2.0, "beta_fast": 16.0}, "gpt_neox"),
    "neox25-dynamic_ntk": ("neox", {"type": "dynamic_ntk", "factor": 4.0}, "gpt_neox"),
    "nope_every_2-yarn": ("smollm3", {"type": "yarn", "factor": 4.0}, "smollm3"),
    "llama10-qknorm-yarn": ("remote", {"type": "yarn", "factor": 4.0}, REMOTE),
    "llama10-qknorm-dynamic_ntk": ("remote", {"type": "dynamic_ntk", "factor": 2.0}, REMOTE),
}
SCALED_TRAIN_LEN = 32  # the models' max_seq_len; the child scores 2x that


def scaled_config(arch: str, scaling: dict) -> ModelConfig:
    from pretrain.config import RopeScalingConfig

    shape = dict(vocab_size=300, pad_vocab_to_multiple=64, n_layers=2, d_model=64, d_ff=96)
    shape |= dict(max_seq_len=SCALED_TRAIN_LEN, rope_scaling=RopeScalingConfig(**scaling))
    if arch == "neox":
        return ModelConfig(
            **shape,
            n_heads=4,
            block="parallel",
            norm="layernorm",
            norm_bias=True,
            mlp="gelu",
            attn_bias=True,
            rope_fraction=0.25,
        )
    heads = dict(n_heads=4, n_kv_heads=2, mlp_bias=False)
    if arch == "remote":
        return ModelConfig(**shape, **heads, rotary_dims=2 * 2, rope_fraction=None, qk_norm=True)
    if arch == "smollm3":  # NoPE layers: SmolLM3's RoPE layers scale as Llama's
        return ModelConfig(**shape, **heads, nope_every=2)
    return ModelConfig(**shape, **heads)


@pytest.fixture(scope="module")
def scaled_exports(tmp_path_factory):
    """name -> (model, export) for each RoPE scaling case of SCALED."""
    root = tmp_path_factory.mktemp("hf_scaled")
    out = {}
    for i, (name, (arch, scaling, _)) in enumerate(SCALED.items()):
        model = random_model(scaled_config(arch, scaling), 300 + i)
        out[name] = (model, export_hf(model, root / name, card=False))
    return out


# ----------------------------------------------------------------------------- positions by layer

POSITION_SHAPES = {
    "llama": dict(n_kv_heads=2, mlp_bias=False),
    "neox": dict(block="parallel", norm="layernorm", norm_bias=True, mlp="gelu", attn_bias=True),
}


def position_config(arch: str, keys: dict) -> ModelConfig:
    """4 layers (so every 2nd and a pattern of 2 bite), head_dim 16, a 300-token vocabulary."""
    shape = dict(vocab_size=300, pad_vocab_to_multiple=64, n_layers=4, d_model=64, n_heads=4)
    return ModelConfig(**shape, d_ff=96, max_seq_len=64, **POSITION_SHAPES[arch], **keys)


# A pair selection of the llama position shape (4 layers, 2 KV heads of 8 pairs).
PAIRS = [[[0, 3, 5], [1, 2]], [[7], list(range(8))], [[], []], [[2, 6], [4]]]

# Exported and run through transformers' child: (architecture, position keys, target). A
# window of 8 is shorter than the 40 scored tokens and the 16 + 32 generated ones.
POSITION_VARIANTS = {
    "nope_every_2": ("llama", dict(nope_every=2), "smollm3"),
    "sliding_pattern_2": ("llama", dict(sliding_window=8, sliding_window_pattern=2), "smollm3"),
    "sliding_every_layer": ("llama", dict(sliding_window=8), "mistral"),
    "sliding_global_nope": (
        "llama",
        dict(sliding_window=8, sliding_window_pattern=2, nope_every=2),
        "smollm3",
    ),
    "sliding_global_theta_qknorm": (
        "llama",
        dict(sliding_window=8, sliding_window_pattern=2, global_rope_theta=1e6, qk_norm=True),
        REMOTE,
    ),
    "p_rope_25": ("llama", dict(rope_fraction=0.25, rope_spectrum="p_rope"), "llama"),
    "partial_25": ("llama", dict(rope_fraction=0.25), "phi3"),
    "qknorm_partial_sliding": (
        "llama",
        dict(qk_norm=True, rope_fraction=0.5, sliding_window=8, sliding_window_pattern=2),
        "qwen3",
    ),
    "p_rope_25_neox": ("neox", dict(rope_fraction=0.25, rope_spectrum="p_rope"), "gpt_neox"),
    # model.head_dim apart from d_model / n_heads (Qwen3-0.6B: 16 x 128 on 1024)
    "wide_heads_qknorm": ("llama", dict(qk_norm=True, head_dim=32), "qwen3"),
    "wide_heads_partial_25": ("llama", dict(rope_fraction=0.25, head_dim=32), "phi3"),
    "narrow_heads_nope_every_2": ("llama", dict(nope_every=2, head_dim=8), "smollm3"),
    "wide_heads_neox": ("neox", dict(head_dim=24), REMOTE),
    "alibi": ("llama", dict(rope_fraction=0.0, alibi=True), REMOTE),
    "alibi_nope_every_2": ("llama", dict(alibi=True, nope_every=2), REMOTE),
    "alibi_partial_sliding": (
        "llama",
        dict(
            alibi=True,
            rope_fraction=0.5,
            sliding_window=8,
            layer_types=["sliding", "full", "sliding", "sliding"],
        ),
        REMOTE,
    ),
    # which pairs rotate (model.rope_pairs): different per layer and KV head, a NoPE layer
    "rope_pairs_per_kv_head": ("llama", dict(rope_pairs={"selected": PAIRS}), REMOTE),
    "rope_pairs_low_sliding_qknorm": (
        "llama",
        dict(
            rope_pairs={"strategy": "low", "pairs": 3},
            qk_norm=True,
            nope_every=4,
            sliding_window=8,
            sliding_window_pattern=2,
        ),
        REMOTE,
    ),
}

# (architecture, position keys, the target --target auto picks, {forced target: what its
# one-line refusal names}).
POSITION_CASES = [
    ("llama", dict(nope_every=2), "smollm3", {"llama": "model.nope_every: 2"}),
    ("llama", dict(nope_layers=[1]), "smollm3", {"llama": "model.nope_layers: [1]"}),
    (
        "llama",
        dict(sliding_window=8, sliding_window_pattern=2),
        "smollm3",
        {"llama": "model.sliding_window: 8"},
    ),
    ("llama", dict(sliding_window=8), "mistral", {"llama": "model.sliding_window: 8"}),
    (
        "llama",
        dict(sliding_window=8, sliding_window_pattern=2, global_rope_theta=1e6),
        REMOTE,
        {"llama": "model.global_rope_theta", "smollm3": "model.global_rope_theta: 1e+06"},
    ),
    (
        "llama",
        dict(rope_fraction=0.25, rope_spectrum="p_rope"),
        "llama",
        {"smollm3": "partial RoPE", "phi3": "NeoX's spectrum"},
    ),
    ("llama", dict(rope_spectrum="p_rope"), "llama", {}),  # full p-RoPE is full RoPE
    ("llama", dict(alibi=True), REMOTE, {"llama": "model.alibi", "smollm3": "model.alibi"}),
    ("llama", dict(alibi=True, rope_fraction=0.0), REMOTE, {"smollm3": "model.alibi"}),
    ("neox", dict(rope_fraction=0.25, rope_spectrum="p_rope"), "gpt_neox", {}),
    ("neox", dict(nope_every=2), REMOTE, {"gpt_neox": "model.nope_every: 2"}),
    ("neox", dict(sliding_window=8), REMOTE, {"gpt_neox": "model.sliding_window: 8"}),
    ("neox", dict(alibi=True), REMOTE, {"gpt_neox": "model.alibi"}),
    (
        "llama",
        dict(rope_pairs={"strategy": "high", "pairs": 4}),
        REMOTE,
        {t: "model.rope_pairs" for t in ("llama", "phi3", "smollm3", "qwen3", "mistral")},
    ),
]


@pytest.mark.parametrize(
    "arch, keys, auto, refused", POSITION_CASES, ids=lambda v: str(v) if isinstance(v, dict) else v
)
def test_position_variants_choose_a_target_that_holds_them(arch, keys, auto, refused):
    """NoPE layers, sliding windows, a global theta, p-RoPE and ALiBi: --target auto lands
    on a class that computes them (Llama or GPT-NeoX only when every layer is what those
    compute: RoPE at one theta, full attention, no ALiBi); a forced class that cannot is
    refused in one line naming the field."""
    from pretrain.model.position import layer_positions

    cfg = position_config(arch, keys)
    assert choose_target(cfg) == auto
    assert hf_config(cfg).architectures == [CLASS_NAMES[auto]]
    positions = layer_positions(cfg)
    if auto in ("llama", "gpt_neox"):
        assert all(p.rope and p.window is None and not p.alibi for p in positions)
        assert len({p.theta for p in positions}) == 1
    for target, words in refused.items():
        with pytest.raises(HFConversionError) as e:
            choose_target(cfg, target)
        message = str(e.value)
        assert "\n" not in message and f"cannot export to {CLASS_NAMES[target]}" in message
        assert words in message, message


@pytest.fixture(scope="module")
def variant_exports(tmp_path_factory):
    """name -> (model, export) for each model of POSITION_VARIANTS."""
    root = tmp_path_factory.mktemp("hf_positions")
    out = {}
    for i, (name, (arch, keys, _)) in enumerate(POSITION_VARIANTS.items()):
        model = random_model(position_config(arch, keys), 700 + i)
        out[name] = (model, export_hf(model, root / name, card=i == 0))
    return out


def _probe(tok) -> str:
    return "".join(c for c in TEXT if c in tok.chars) if isinstance(tok, CharTokenizer) else TEXT


def _job(model, export, tok, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "folder": str(export.path),
        "ids": torch.randint(0, model.cfg.vocab_size, (3, 40), generator=g).tolist(),
        "prompt_len": PROMPT_LEN,
        "gen": GEN_TOKENS,
        "text": None if tok is None else _probe(tok),
    }


@pytest.fixture(scope="module")
def loaded(exports, config_exports, scaled_exports, variant_exports, tmp_path_factory):
    """What transformers computes in a process that cannot import the toolkit, for each
    interpreter of PYTHONS: {python: {export name: results}}, and the job."""
    tmp = tmp_path_factory.mktemp("hf_child")
    job = {name: _job(m, e, tok, len(name)) for name, (m, tok, e) in exports.items()}
    job |= {name: _job(m, e, None, i) for i, (name, (m, e)) in enumerate(config_exports.items())}
    for i, (name, (m, e)) in enumerate(scaled_exports.items()):
        job[name] = _job(m, e, None, 500 + i)
        g = torch.Generator().manual_seed(i)
        # scored at twice the training length, where the scaling acts
        job[name]["ids"] = torch.randint(0, 300, (2, 2 * SCALED_TRAIN_LEN), generator=g).tolist()
    job |= {
        name: _job(m, e, None, 700 + i) for i, (name, (m, e)) in enumerate(variant_exports.items())
    }
    (tmp / "job.json").write_text(json.dumps(job))
    (tmp / "child.py").write_text(CHILD)
    # One child per interpreter, all at once: each is one thread, mostly imports and loads.
    children = {}
    for name, command in PYTHONS.items():
        env = {
            "PATH": "/usr/bin:/bin",
            "HOME": str(tmp),
            "HF_HOME": str(tmp / f"hf_{name}"),
            "HF_HUB_OFFLINE": "1",
            "TOKENIZERS_PARALLELISM": "false",
            "OMP_NUM_THREADS": "1",
        }
        if name == "this":
            env["PYTHONPATH"] = _SITE
        out = tmp / f"out_{name}.pt"
        log = (tmp / f"err_{name}.txt").open("w")
        child = subprocess.Popen(
            [*command, str(tmp / "child.py"), str(tmp / "job.json"), str(out)],
            cwd=tmp,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=log,
        )
        children[name] = (command, child, out, log)
    results = {}
    for name, (command, child, out, log) in children.items():
        returncode = child.wait(timeout=600)
        log.close()
        stderr = (tmp / f"err_{name}.txt").read_text()
        assert returncode == 0, f"{command[0]}: " + stderr[-3000:]
        results[name] = torch.load(out)
    return results, job


def check_loaded(got: dict, versions: str, model: Transformer, export, job: dict) -> None:
    """transformers' logits and greedy tokens for one export equal the toolkit's, and
    config.json's `architectures` names the class transformers instantiated (tools such as
    vLLM and llama.cpp's converter pick the class by that list alone)."""
    assert got["class"] == CLASS_NAMES[export.target], versions
    written = json.loads((export.path / "config.json").read_text())
    assert written.get("architectures") == [got["class"]], versions
    # remote code came from the folder, native classes from transformers itself
    assert got["module"].startswith(
        "transformers_modules." if export.remote_code else "transformers.models."
    ), versions
    ids = torch.tensor(job["ids"])
    with torch.no_grad():
        ours = model(ids)
    diff = (ours - got["logits"]).abs().max().item()
    assert diff < 1e-4, f"{versions}: max |logit difference| {diff:.3g}"
    mine = model.generate(ids[:, :PROMPT_LEN], GEN_TOKENS, temperature=0)
    assert torch.equal(mine, got["generated"]), f"{versions}: greedy tokens differ"


@pytest.mark.parametrize("python", sorted(PYTHONS))
@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_family_loads_in_plain_transformers_with_the_same_logits(name, python, exports, loaded):
    results, job = loaded
    model, tok, export = exports[name]
    got, r = results[python][name], results[python]
    check_loaded(
        got, f"transformers {r['transformers']}, torch {r['torch']}", model, export, job[name]
    )
    assert got["encoded"] == tok.encode(job[name]["text"]) and got["eos"] == tok.eod_id


@pytest.mark.parametrize("python", sorted(PYTHONS))
@pytest.mark.parametrize("path", CONFIG_FILES, ids=config_id)
def test_every_config_loads_in_plain_transformers_with_the_same_logits(
    path, python, config_exports, loaded
):
    """Each of the 77 configs (its own head_dim, rotary dims and theta): logits within 1e-4 and
    32 identical greedy tokens through generate() and the exported model's KV cache."""
    results, job = loaded
    model, export = config_exports[config_id(path)]
    r = results[python]
    versions = f"transformers {r['transformers']}, torch {r['torch']}"
    check_loaded(r[config_id(path)], versions, model, export, job[config_id(path)])
    assert export.remote_code == (choose_target(load_model_config(path)) == REMOTE)


@pytest.mark.parametrize("python", sorted(PYTHONS))
@pytest.mark.parametrize("name", sorted(SCALED))
def test_rope_scaling_exports_compute_our_logits_at_twice_the_training_length(
    name, python, scaled_exports, loaded
):
    """linear, ntk, yarn and dynamic NTK, on full RoPE (Llama), 25% (GPT-NeoX), NoPE layers
    (SmolLM3, yarn) and a remote-code model: transformers' logits over 2x max_seq_len within 1e-4, and greedy
    tokens through the KV cache past the training length, equal ours."""
    results, job = loaded
    model, export = scaled_exports[name]
    assert export.target == SCALED[name][2]
    r = results[python]
    check_loaded(r[name], f"transformers {r['transformers']}", model, export, job[name])
    back, _, _ = read_hf_folder(export.path)
    assert back.cfg.rope_scaling is not None or SCALED[name][1]["type"] == "ntk"
    ids = torch.tensor(job[name]["ids"])
    with torch.no_grad():
        assert torch.equal(back(ids), model(ids))  # imported back: the same model


@pytest.mark.parametrize("python", sorted(PYTHONS))
@pytest.mark.parametrize("name", sorted(POSITION_VARIANTS))
def test_position_variant_loads_in_plain_transformers_with_the_same_logits(
    name, python, variant_exports, loaded
):
    """NoPE layers, sliding windows (with NoPE or another theta on the global layers),
    p-RoPE and ALiBi, each exported as the class that holds it (SmolLM3 and GPT-NeoX native,
    RopeLM remote code): transformers' logits within 1e-4 and 32 greedy tokens through
    generate() and its cache (which keeps a sliding layer's last W - 1 keys) equal ours."""
    results, job = loaded
    model, export = variant_exports[name]
    assert export.target == POSITION_VARIANTS[name][2]
    r = results[python]
    versions = f"transformers {r['transformers']}, torch {r['torch']}"
    check_loaded(r[name], versions, model, export, job[name])


@pytest.mark.parametrize("name", sorted(POSITION_VARIANTS))
def test_position_variants_import_back_exactly(name, variant_exports):
    """Imported back: the same config (its spelling too: nope_every, sliding_window_pattern),
    the same positions by layer and logits; and config.json's own fields, without the
    toolkit's record, describe the same network (p-RoPE read back as GPT-NeoX's partial RoPE
    at theta^(r/head_dim), NoPE and window lists instead of their patterns)."""
    from pretrain.hf.convert import RECORD_KEY
    from pretrain.hf.targets import get_target

    model, export = variant_exports[name]
    back, _, _ = read_hf_folder(export.path)
    assert back.cfg == model.cfg and back.layer_positions() == model.layer_positions()
    ids = torch.randint(0, 300, (2, 24), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = model(ids)
        assert torch.equal(back(ids), want)
    target = get_target(export.target)
    hf_cfg = target.config_class().from_pretrained(export.path)
    delattr(hf_cfg, RECORD_KEY)
    derived = Transformer(target.model_config(hf_cfg)).eval()
    derived.load_state_dict(model.state_dict())
    with torch.no_grad():
        assert (derived(ids) - want).abs().max().item() < 1e-5


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_family_imports_back_bit_exact(name, exports):
    model, tok, export = exports[name]
    back, back_tok, record = read_hf_folder(export.path)
    assert back.cfg == model.cfg
    ours = model.state_dict()
    assert back.state_dict().keys() == ours.keys()
    assert all(torch.equal(v, ours[k]) for k, v in back.state_dict().items())
    assert (
        back_tok.identifier == tok.identifier
        and record["model"]["vocab_size"] == model.cfg.vocab_size
    )


def test_sharded_family_has_an_index(exports):
    folder = exports["sequential-rmsnorm-swiglu-gqa-partial_rope"][2].path
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    files = sorted(folder.glob("model-*.safetensors"))
    assert len(files) > 1 and set(index["weight_map"].values()) == {f.name for f in files}
    assert not (folder / "model.safetensors").exists()


def test_remote_code_is_self_contained_and_copied(exports):
    allowed = {"torch", "transformers", "math", "typing"}
    for fname in REMOTE_FILES:
        tree = ast.parse((REMOTE_CODE_DIR / fname).read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                assert {a.name.split(".")[0] for a in node.names} <= allowed, fname
            elif isinstance(node, ast.ImportFrom):
                assert node.level == 1 or node.module.split(".")[0] in allowed, (fname, node.module)
    for model, _, export in exports.values():
        for fname in REMOTE_FILES:
            assert (export.path / fname).is_file() == export.remote_code
            if export.remote_code:
                assert (export.path / fname).read_bytes() == (REMOTE_CODE_DIR / fname).read_bytes()
        config = json.loads((export.path / "config.json").read_text())
        assert ("auto_map" in config) == export.remote_code
        gen = json.loads((export.path / "generation_config.json").read_text())
        assert gen.get("suppress_tokens") == (
            list(range(model.cfg.vocab_size, model.cfg.padded_vocab_size)) or None
        )


def test_model_card_describes_the_architecture(exports):
    model, tok, export = exports["parallel-rmsnorm-swiglu-mha-partial_rope"]
    card = unpadded((export.path / "README.md").read_text())
    cfg = model.cfg
    for text in (
        "RopeLMForCausalLM",
        "trust_remote_code=True",
        "parallel",
        "RMSNorm",
        "SwiGLU",
        f"RoPE | {cfg.rope_dims} of 16 dims per head",
        f"{model.num_params():,}",
        "QK-Norm | no",
        tok.identifier,
    ):
        assert text in card, text


# ----------------------------------------------------------------------------- lm-eval


@pytest.mark.parametrize(
    "name",
    [
        "parallel-rmsnorm-swiglu-mha-partial_rope",
        "sequential-rmsnorm-swiglu-mha-partial_rope-qknorm",
    ],
)
def test_lm_eval_hf_backend_matches_our_harness(name, exports):
    """lm-eval's `hf` model on the remote-code export == the toolkit's own adapter."""
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM

    from pretrain.eval.harness import PretrainLM

    model, tok, export = exports[name]
    ours = PretrainLM(model=model, tokenizer=tok, batch_size=4)
    theirs = HFLM(
        pretrained=str(export.path),
        trust_remote_code=True,
        device="cpu",
        dtype="float32",
        batch_size=4,
    )
    requests = [
        ("The capital of France is", " Paris"),
        ("Water boils at", " 100 degrees Celsius."),
        ("", "A document with no context."),
        ("word " * 40, " end"),
        ("Question: 2+2=?\nAnswer:", " 4"),
        ("Question: 2+2=?\nAnswer:", " 5"),
    ]
    reqs = [Instance("loglikelihood", {}, r, i) for i, r in enumerate(requests)]
    a, b = (
        ours.loglikelihood(reqs, disable_tqdm=True),
        theirs.loglikelihood(reqs, disable_tqdm=True),
    )
    for (la, ga), (lb, gb) in zip(a, b, strict=True):
        assert la == pytest.approx(lb, abs=1e-4) and ga == gb
    rolling = [Instance("loglikelihood_rolling", {}, (" ".join(f"w{i}" for i in range(60)),), 0)]
    assert ours.loglikelihood_rolling(rolling, disable_tqdm=True) == pytest.approx(
        theirs.loglikelihood_rolling(rolling, disable_tqdm=True), abs=1e-3
    )


# ----------------------------------------------------------------------------- command line


@pytest.fixture
def qknorm_run(tmp_path):
    """A run folder with a QK-Norm NoPE checkpoint (bytes tokenizer), its trainer state and
    evaluation results, as training and tools/evaluate.py leave them."""
    cfg = shrink(load_model_config(REPO / "configs/paper/llama1b_seq8192_rope0_qknorm.yaml"))
    model = random_model(cfg.replace(vocab_size=257, pad_vocab_to_multiple=64), 7)
    wdir = tmp_path / "run" / "checkpoints" / "step_0000020"
    save_weights(
        model,
        wdir,
        {"train": {"global_batch_size": 8, "seq_len": 64}, "data": {"train": ["data/x"]}},
    )
    ByteTokenizer().save(wdir / "tokenizer")
    (wdir / "trainer_state.json").write_text(json.dumps({"step": 20, "consumed_tokens": 10240}))
    (tmp_path / "run" / "checkpoints" / "latest").write_text("step_0000020")
    ev = tmp_path / "run" / "eval" / "step_0000020"
    ev.mkdir(parents=True)
    (ev / "lm_eval_results.json").write_text(
        json.dumps(
            {
                "results": {
                    "piqa": {"acc,none": 0.61, "acc_stderr,none": 0.011, "acc_norm,none": 0.625}
                }
            }
        )
    )
    (ev / "valid_metrics.json").write_text(json.dumps({"loss": 2.5, "bits_per_byte": 1.25}))
    return tmp_path / "run", model


def test_cli_export_check_and_import_round_trip(qknorm_run, tmp_path, capsys):
    from pretrain.cli.export_hf import main as export_main
    from pretrain.cli.import_hf import main as import_main

    run, model = qknorm_run
    out = tmp_path / "hf"
    assert (
        export_main(["--run", str(run), "--out", str(out), "--check", "--dtype", "bfloat16"]) == 0
    )
    printed = capsys.readouterr().out
    assert "RopeLMForCausalLM (remote code" in printed and "check: max |logit diff|" in printed
    card = unpadded((out / "README.md").read_text())
    for text in (
        "10,240",
        "step 20",
        "| piqa | acc | 0.6100 ± 0.0110 |",
        "bits_per_byte | 1.2500",
        "QK-Norm | yes",
        "RoPE | none (NoPE)",
        "Parity with the toolkit's model",
        "data/x",
    ):
        assert text in card, text
    assert import_main(["--hf", str(out), "--out", str(tmp_path / "back")]) == 0
    back, _ = load_weights(tmp_path / "back")
    for k, v in model.state_dict().items():  # bf16 export: exactly the rounded weights
        assert torch.equal(back.state_dict()[k], v.to(torch.bfloat16).float())
    assert load_tokenizer(tmp_path / "back" / "tokenizer").identifier == ByteTokenizer().identifier


def test_cli_export_check_fails_when_generation_differs(qknorm_run, tmp_path, monkeypatch, capsys):
    """A fault in the exported remote code that drops the KV cache (what transformers 5.24's
    rename of `past_key_values` to `cache` did to the code of 5.23): the single forward still
    matches, greedy decoding does not, and `--check` exits 1 naming both failures."""
    import pretrain.cli.export_hf as program
    from pretrain.cli.export_hf import main as export_main

    real, line = program.export_hf, "return cache if cache is not None else past_key_values"

    def export_without_cache(*args, **kwargs):
        export = real(*args, **kwargs)
        code = export.path / "modeling_rope_lm.py"
        assert line in code.read_text()
        code.write_text(code.read_text().replace(line, "return None"))
        return export

    monkeypatch.setattr(program, "export_hf", export_without_cache)
    run, _ = qknorm_run
    # a folder name of its own: transformers keeps remote code imported by folder name
    out_dir = tmp_path / "hf_without_cache"
    assert export_main(["--run", str(run), "--out", str(out_dir), "--check"]) == 1
    out, err = capsys.readouterr()
    assert "greedy 16 tokens DIFFERENT" in out
    err = err.strip().splitlines()[-1]  # after transformers' "Loading weights" bar
    assert err.startswith("error: the export differs"), err
    assert "greedy generation of 16 tokens" in err and "with the KV cache" in err
    assert "in a full forward" not in err  # the full forward is still right


@pytest.mark.parametrize(
    "args, words",
    [
        (["--target", "llama"], ["QK-Norm", "--target auto"]),
        (["--target", "gpt_neox"], ["LayerNorm only", "grouped-query", "NoPE"]),
    ],
)
def test_cli_forced_native_target_is_refused_in_one_line(qknorm_run, tmp_path, capsys, args, words):
    from pretrain.cli.export_hf import main as export_main

    assert export_main(["--run", str(qknorm_run[0]), "--out", str(tmp_path / "hf"), *args]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and all(w in err for w in words), err


def test_cli_bad_input_gives_one_line(qknorm_run, tmp_path, capsys):
    from pretrain.cli.export_hf import main as export_main
    from pretrain.cli.import_hf import main as import_main

    cases = [
        (
            export_main,
            ["--run", str(tmp_path / "nope"), "--out", str(tmp_path / "o")],
            "does not exist",
        ),
        (import_main, ["--hf", str(tmp_path), "--out", str(tmp_path / "o2")], "no config.json"),
    ]
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "notes.txt").write_text("mine")
    cases.append(
        (export_main, ["--run", str(qknorm_run[0]), "--out", str(busy)], "holds no earlier export")
    )
    other = tmp_path / "other"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({"model_type": "bert"}))
    cases.append(
        (import_main, ["--hf", str(other), "--out", str(tmp_path / "o3")], "model_type 'bert'")
    )
    for main, argv, words in cases:
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and err.count("\n") == 1 and words in err, err


def test_import_refuses_weights_that_do_not_fit(exports, tmp_path):
    """A non-zero bias where the config says there is none is not dropped silently."""
    import shutil

    from safetensors.torch import load_file, save_file

    src = exports["parallel-rmsnorm-swiglu-mha-full_rope"][2].path
    dst = tmp_path / "edited"
    shutil.copytree(src, dst)
    state = load_file(dst / "model.safetensors")
    state["model.layers.0.self_attn.q_proj.bias"] = torch.ones(64)
    save_file(state, dst / "model.safetensors")
    with pytest.raises(HFConversionError, match="q_proj.bias has no place"):
        read_hf_folder(dst)
