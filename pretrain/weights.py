"""Consolidated model weights: one safetensors file plus the config, no DeepSpeed needed.

A weights folder holds:
    model.safetensors   fp32 (or the saved dtype) state dict of `Transformer`
    the run config      resolved (its `model:` section rebuilds the model); run_layout.CONFIG_FILE
    tokenizer/          the tokenizer, when the writer had one (pretrain.data.tokenizer)

Training writes one beside every checkpoint; evaluation and export read only this.
Files are written to a temporary name and renamed, so a crash never leaves half a file.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch
import yaml

from pretrain.config import ConfigError, ModelConfig, from_dict, to_dict, yaml_error_message
from pretrain.errors import UserError
from pretrain.integrity import UNVERIFIED, is_unverified, verify_checkpoint
from pretrain.model.pairs import describe
from pretrain.model.transformer import Transformer
from pretrain.run_layout import (
    CHECKPOINTS_DIR,
    CONFIG_FILE,
    LATEST_FILE,
    STATE_FILE,
    atomic_write,
    step_tag,
    tag_step,
)

log = logging.getLogger(__name__)

WEIGHTS_FILE = "model.safetensors"


def weights_state(
    model: Transformer, dtype: torch.dtype | None = torch.float32
) -> dict[str, torch.Tensor]:
    """The tensors `save_weights` writes, on the model's device: its state dict in `dtype`
    (None: as trained), contiguous, without the tied output matrix."""
    state = {}
    for name, t in model.state_dict().items():
        if name == "lm_head.weight" and model.cfg.tie_embeddings:
            continue  # tied to wte.weight; safetensors refuses shared storage
        t = t.detach()
        state[name] = (
            t.to(dtype) if dtype is not None and t.is_floating_point() else t
        ).contiguous()
    return state


def save_weights(
    model: Transformer,
    directory: str | Path,
    config: dict[str, Any] | None = None,
    dtype: torch.dtype | None = torch.float32,
    state: dict[str, torch.Tensor] | None = None,
) -> Path:
    """Write the weights and the run config into `directory` (created). `state`: the tensors
    to write instead of the model's (a host copy that a background checkpoint took earlier,
    as `weights_state` gave them)."""
    from safetensors.torch import save

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    state = weights_state(model, dtype) if state is None else state
    full = dict(config or {})
    full["model"] = to_dict(model.cfg)
    atomic_write(directory / CONFIG_FILE, yaml.safe_dump(full, sort_keys=False))
    atomic_write(directory / WEIGHTS_FILE, save({k: t.cpu() for k, t in state.items()}))
    return directory


class WeightsError(UserError, ValueError):
    """A weights folder (or the run folder around it) is missing, incomplete or damaged;
    the message names it and what to give instead."""


# safetensors' own limit on the JSON header; the first 8 bytes of any other file, read as
# a length, are almost never below it.
_MAX_HEADER = 100_000_000


def safetensors_problem(path: str | Path) -> str | None:
    """What makes `path` no whole safetensors file, in words, from its 8-byte length and JSON
    header alone (None: the header reads and the tensors' bytes are all there). safetensors
    refuses such a file too, but in its own words ("incomplete metadata, file not fully
    covered"), which name neither the file nor the fix."""
    path = Path(path)
    size = path.stat().st_size
    with path.open("rb") as f:
        head = f.read(8)
        n = int.from_bytes(head, "little") if len(head) == 8 else 0
        if not head:
            return "is empty"
        if len(head) < 8 or n > _MAX_HEADER:
            return "is not a safetensors file (its first 8 bytes are no header length)"
        if 8 + n > size:
            return f"is cut short ({size} bytes; its header alone takes {8 + n})"
        try:
            header = json.loads(f.read(n))
        except ValueError:
            return "is not a safetensors file (its header is not JSON)"
    if not isinstance(header, dict):
        return "is not a safetensors file (its header is not a JSON object)"
    try:
        end = max(
            (int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"),
            default=0,
        )
    except (TypeError, KeyError, IndexError, ValueError):
        return "is not a safetensors file (its header gives no tensors' data offsets)"
    if 8 + n + end > size:
        return f"is cut short ({size} bytes; its header describes {8 + n + end})"
    return None


def open_safetensors(path: str | Path, fix: str, device: str | torch.device = "cpu"):
    """`safetensors.safe_open(path)` for PyTorch tensors on `device`; a file that is not whole
    safetensors raises WeightsError in one line: the file, what is wrong, then `fix`."""
    from safetensors import safe_open

    problem = safetensors_problem(path)
    if problem is None:
        try:
            return safe_open(str(path), framework="pt", device=str(device))
        except OSError:
            raise
        except Exception as e:  # safetensors' SafetensorError: a header it refuses
            problem = f"is not a valid safetensors file ({e})"
    raise WeightsError(f"{path} {problem}; {fix}")


def load_safetensors(
    path: str | Path, fix: str, device: str | torch.device = "cpu"
) -> dict[str, torch.Tensor]:
    """Every tensor of a safetensors file (as safetensors.torch.load_file), checked as
    `open_safetensors` checks it."""
    with open_safetensors(path, fix, device) as f:
        return {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118 (no dict)


def read_config(directory: str | Path) -> dict[str, Any]:
    path = Path(directory) / CONFIG_FILE
    if not path.is_file():
        raise WeightsError(
            f"{path} not found: {directory} is not a weights folder "
            f"(expected {WEIGHTS_FILE} and {CONFIG_FILE})"
        )
    try:
        return yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(yaml_error_message(e, path)) from None  # the run config's syntax


def load_weights(
    directory: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype | None = None
) -> tuple[Transformer, dict[str, Any]]:
    """Rebuild the model from a weights folder. Returns (model in eval mode, full config)."""
    directory = Path(directory)
    # In a checkpoint folder: the weights and config against the sizes and CRC-32s its marker
    # recorded.
    marker = (directory / STATE_FILE).is_file()
    problems = verify_checkpoint(directory, files=[WEIGHTS_FILE, CONFIG_FILE]) if marker else []
    if problems:
        problem = problems[0]
        raise WeightsError(
            f"{directory} is damaged: {problem}; use an earlier checkpoint "
            f"(python tools/check_checkpoint.py RUN lists the intact ones)"
        )
    if marker and is_unverified(directory):
        log.warning("using checkpoint %s; %s", directory, UNVERIFIED)
    config = read_config(directory)
    weights = directory / WEIGHTS_FILE
    if not weights.is_file():
        raise WeightsError(f"{weights} not found; the folder has a config but no weights")
    cfg = from_dict(ModelConfig, config.get("model"), "model")
    with torch.device("meta"):
        model = Transformer(cfg)
    state = load_safetensors(weights, "write it again or use an earlier checkpoint", device)
    if cfg.tie_embeddings:
        state["lm_head.weight"] = state["wte.weight"]
    model.load_state_dict(state, strict=True, assign=True)
    if cfg.tie_embeddings:
        model.lm_head.weight = model.wte.weight
    # Buffers (the RoPE cache) were built on meta; rebuild them where the weights are.
    model.rope = type(model.rope).from_config(cfg).to(device)
    if dtype is not None:
        model.to(dtype)
    return model.eval(), config


def find_weights_dir(path: str | Path, step: int | None = None) -> Path:
    """A weights folder from a run folder (newest, or `step`), a checkpoints folder, or itself."""
    path = Path(path)
    if not path.exists():
        raise WeightsError(
            f"{path} does not exist; give a run folder (runs/NAME) or a weights folder"
        )
    if (path / WEIGHTS_FILE).is_file() and step is None:
        return path
    ckpts = path / CHECKPOINTS_DIR if (path / CHECKPOINTS_DIR).is_dir() else path
    if step is not None:
        found = ckpts / step_tag(step)
        if not (found / WEIGHTS_FILE).is_file():
            have = sorted(p.name for p in ckpts.glob("step_*") if (p / WEIGHTS_FILE).is_file())
            raise WeightsError(
                f"no weights for step {step} in {ckpts}; available: {', '.join(have) or 'none'}"
            )
        return found
    latest = ckpts / LATEST_FILE
    if latest.is_file():
        found = ckpts / latest.read_text().strip()
        if (found / WEIGHTS_FILE).is_file():
            return found
    have = sorted(p for p in ckpts.glob("step_*") if (p / WEIGHTS_FILE).is_file())
    if not have:
        raise WeightsError(
            f"no checkpoint with weights under {ckpts}; train first, or pass a "
            f"folder holding {WEIGHTS_FILE}"
        )
    return have[-1]


# Model fields a run started from another run's weights may change: they set positions and
# regularisation, not the parameters' shapes or the network's layers.
INIT_FROM_FREE = (
    "max_seq_len",
    "rope_fraction",
    "rotary_dims",
    "rope_theta",
    "rope_scaling",
    "rope_spectrum",
    "rope_pairs",
    "nope_layers",
    "nope_every",
    "sliding_window",
    "sliding_window_pattern",
    "layer_types",
    "global_rope_theta",
    "alibi",
    "dropout",
    "init",
    "init_std",
)


def parse_init_from(spec: str) -> tuple[str, int | None]:
    """'runs/x@600' -> ('runs/x', 600); 'runs/x' -> ('runs/x', None)."""
    path, sep, step = spec.rpartition("@")
    if sep and step.isdigit():
        return path, int(step)
    return spec, None


def init_from_source(spec: str, target: ModelConfig) -> tuple[Path, ModelConfig]:
    """(weights folder, its model config) of `checkpoint.init_from`, after checking that
    `target` has the same shape; one line naming the fields otherwise."""
    path, step = parse_init_from(spec)
    try:
        folder = find_weights_dir(path, step)
    except WeightsError as e:
        raise WeightsError(f"checkpoint.init_from={spec!r}: {e}") from None
    source = from_dict(ModelConfig, read_config(folder).get("model"), "model")
    # head_dim_ read as head_dim: null and d_model / n_heads written out are one shape
    changed = [
        f"model.{key} {getattr(source, key)!r} -> {getattr(target, key)!r}"
        for key in (name.rstrip("_") for name in ModelConfig.model_fields)
        if key not in INIT_FROM_FREE and getattr(source, key) != getattr(target, key)
    ]
    if source.learned_pos_emb and source.max_seq_len != target.max_seq_len:
        changed.append(
            f"model.max_seq_len {source.max_seq_len} -> {target.max_seq_len} (the learned "
            f"position table)"
        )
    if changed:
        raise WeightsError(
            f"checkpoint.init_from={spec!r}: {folder} holds a model of another shape "
            f"({'; '.join(changed)}); only {', '.join(INIT_FROM_FREE)} may change"
        )
    return folder, source


@torch.no_grad()
def load_initial_weights(model: Transformer, spec: str) -> Path:
    """Copy the weights of `checkpoint.init_from` into `model` (in place, its device and
    dtype); returns the folder they came from."""
    folder, source = init_from_source(spec, model.cfg)
    if (folder / STATE_FILE).is_file():
        problems = verify_checkpoint(folder, files=[WEIGHTS_FILE, CONFIG_FILE])
        if problems:
            raise WeightsError(
                f"checkpoint.init_from={spec!r}: {folder} is damaged: {problems[0]}; use an "
                f"earlier step (RUN@STEP)"
            )
    try:
        state = load_safetensors(folder / WEIGHTS_FILE, "write it again or use an earlier step")
    except WeightsError as e:
        raise WeightsError(f"checkpoint.init_from={spec!r}: {e} (RUN@STEP)") from None
    if source.tie_embeddings:
        state["lm_head.weight"] = state["wte.weight"]
    model.load_state_dict(state, strict=True)
    return folder


def _pairs_text(cfg: ModelConfig) -> str:
    """What rotates, for the surgery line: 'full 32 pairs', 'the first 16 of 64 dims (neox)',
    '8 of 32 pairs per KV head (usage top-8 of FILE, layer 0 kv 0: 0,1,3,...)'. The pairs of a
    selection keep their dims (j, j + head_dim/2) and frequency: no weight is re-paired."""
    if cfg.rope_pairs is not None:
        return describe(cfg.rope_pairs, cfg.head_dim)
    r, d = cfg.rope_dims, cfg.head_dim
    if r == d:
        return f"full {d // 2} pairs"
    return f"the first {r} of {d} dims ({cfg.rope_spectrum})" if r else "NoPE"


def init_from_summary(spec: str, target: ModelConfig) -> str:
    """The log line of a run started from `checkpoint.init_from`: where the weights came
    from (and its step: this run counts from 0), that every weight was kept, and what the
    position surgery changed (INIT_FROM_FREE fields), or that nothing did."""
    folder, source = init_from_source(spec, target)
    step = tag_step(folder.name)
    changed = [
        f"model.{name} {getattr(source, name)!r} -> {getattr(target, name)!r}"
        for name in INIT_FROM_FREE
        if name != "rope_pairs" and getattr(source, name) != getattr(target, name)
    ]
    if source.rope_pairs != target.rope_pairs:
        changed.append(f"RoPE: {_pairs_text(source)} -> {_pairs_text(target)}")
    origin = f"{folder}" + (f" (its step {step})" if step is not None else "")
    what = "; changed: " + ", ".join(changed) if changed else "; the same model"
    return f"initialised from {origin}, every weight kept, this run counting from step 0{what}"
