"""Hugging Face model folders: write one from our model, read our model back from one.

An export folder holds
    config.json                 the transformers config (LlamaConfig, GPTNeoXConfig or RopeLMConfig),
                                with the toolkit's record of the model under "pretrain"
    generation_config.json      eos/bos and the padded vocabulary ids to never generate
    model.safetensors           the weights, or model-0000i-of-0000n.safetensors shards and
                                model.safetensors.index.json above `max_shard_size`
    configuration_rope_lm.py    remote code (RopeLM only), named in config.json's auto_map
    modeling_rope_lm.py
    tokenizer.json, tokenizer_config.json   when the model has a tokenizer with an exact HF form
    README.md                   the model card

Reading a folder runs none of its code: the config is read with our own copy of the
RopeLM config class (or transformers' native ones), the weights straight from safetensors.
A damaged folder (a config.json, index or tokenizer file that is not a JSON object, a
tokenizer.json the `tokenizers` library refuses, a weights file or shard that is missing, cut
short or not safetensors) is refused in one line naming the file (files.py, tokenizer.py).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from pretrain.config import ModelConfig, to_dict
from pretrain.data.tokenizer import Tokenizer
from pretrain.hf.card import RunInfo, write_card
from pretrain.hf.convert import (
    CLASS_NAMES,
    RECORD_KEY,
    TARGETS,
    HFConversionError,
    choose_target,
    config_from_hf,
    from_hf_state_dict,
    hf_config,
    to_hf_state_dict,
)
from pretrain.hf.files import REFETCH, read_json_object
from pretrain.hf.targets import get_target
from pretrain.hf.targets.remote import REMOTE_CODE_DIR
from pretrain.hf.tokenizer import TokenizerExportError, read_hf_tokenizer, write_hf_tokenizer
from pretrain.model.transformer import Transformer
from pretrain.weights import open_safetensors

log = logging.getLogger(__name__)

WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
CONFIG_NAME = "config.json"
README = "README.md"
DEFAULT_MAX_SHARD = 5 * 10**9  # bytes, as transformers' save_pretrained used to default to


@dataclass
class Export:
    """What `export_hf` wrote."""

    path: Path
    target: str
    files: list[str] = field(default_factory=list)
    tokenizer_note: str | None = None  # why no tokenizer was written, if none was

    @property
    def class_name(self) -> str:
        return CLASS_NAMES[self.target]

    @property
    def remote_code(self) -> bool:
        return not get_target(self.target).native


def parse_size(text: str | int) -> int:
    """'5GB', '500MB', '2GiB', 1000 -> bytes."""
    if isinstance(text, int):
        return text
    s = str(text).strip().upper()
    units = {
        "KIB": 2**10,
        "MIB": 2**20,
        "GIB": 2**30,
        "KB": 10**3,
        "MB": 10**6,
        "GB": 10**9,
        "B": 1,
    }
    for unit, mult in units.items():
        if s.endswith(unit):
            try:
                return int(float(s[: -len(unit)]) * mult)
            except ValueError:
                break
    try:
        return int(s)
    except ValueError:
        raise HFConversionError(
            f"size {text!r} is not understood; write e.g. 5GB, 500MB or 2GiB"
        ) from None


# ----------------------------------------------------------------------------- export


def _prepare_out(out: Path) -> None:
    """`out` must be new, empty, or an earlier export (its weight files are replaced)."""
    if out.exists() and not out.is_dir():
        raise HFConversionError(f"{out} is a file; --out must be a folder")
    if out.is_dir() and any(out.iterdir()) and not (out / CONFIG_NAME).is_file():
        raise HFConversionError(
            f"{out} is a non-empty folder that holds no earlier export (no {CONFIG_NAME}); "
            f"choose a new or empty folder"
        )
    out.mkdir(parents=True, exist_ok=True)
    for old in [*out.glob("model*.safetensors"), out / INDEX_NAME, *out.glob("pytorch_model*.bin")]:
        if old.is_file():
            old.unlink()


def shard_plan(sizes: dict[str, int], max_shard: int) -> list[list[str]]:
    """Tensor names grouped in order into files of at most `max_shard` bytes (a tensor larger
    than that gets a file of its own)."""
    shards: list[list[str]] = [[]]
    total = 0
    for name, n in sizes.items():
        if shards[-1] and total + n > max_shard:
            shards.append([])
            total = 0
        shards[-1].append(name)
        total += n
    return shards


def shard_names(n: int) -> list[str]:
    return (
        [WEIGHTS_NAME]
        if n == 1
        else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    )


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _write_weights(
    state: dict[str, torch.Tensor], out: Path, dtype: torch.dtype, max_shard: int
) -> list[str]:
    """model.safetensors, or shards plus model.safetensors.index.json (transformers' layout)."""
    from safetensors.torch import save_file

    sizes = {k: v.numel() * dtype.itemsize for k, v in state.items()}
    shards = shard_plan(sizes, max_shard)
    files = shard_names(len(shards))
    for fname, names in zip(files, shards, strict=True):
        # clone: split views share storage, which safetensors refuses; one shard at a time
        tensors = {k: state[k].detach().to("cpu", dtype).clone() for k in names}
        tmp = out / (fname + ".tmp")
        save_file(tensors, str(tmp), metadata={"format": "pt"})
        tmp.chmod(0o666 & ~_umask())  # safetensors creates 0600 files; others may share the export
        tmp.replace(out / fname)
        del tensors
    if len(files) > 1:
        weight_map = {k: f for f, names in zip(files, shards, strict=True) for k in names}
        index = {"metadata": {"total_size": sum(sizes.values())}, "weight_map": weight_map}
        (out / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
        files = [*files, INDEX_NAME]
    return files


def export_hf(
    model: Transformer,
    out_dir: str | Path,
    target: str | None = None,
    dtype: torch.dtype = torch.float32,
    *,
    tokenizer: Tokenizer | None = None,
    max_shard_size: int | str = DEFAULT_MAX_SHARD,
    provenance: dict[str, Any] | None = None,
    card: bool = True,
    run: RunInfo | None = None,
) -> Export:
    """Write `model` as a Hugging Face folder.

    target: llama, gpt_neox, rope_lm, or None/"auto" (the native class when it holds the
    model exactly, else rope_lm). tokenizer: written when it has an exact Hugging Face form
    (else the export goes on without it and says why in `Export.tokenizer_note`).
    provenance: small JSON-able facts kept in config.json's record (source, step).
    run: a `card.RunInfo` for the model card (training tokens, evaluation results).
    """
    cfg: ModelConfig = model.cfg
    target = choose_target(cfg, target)
    if tokenizer is not None and tokenizer.vocab_size > cfg.vocab_size:
        raise HFConversionError(
            f"tokenizer {tokenizer.identifier} has {tokenizer.vocab_size} ids but the model "
            f"{cfg.vocab_size} (model.vocab_size); pass the tokenizer it was trained with"
        )
    max_shard = parse_size(max_shard_size)
    out = Path(out_dir)
    _prepare_out(out)
    result = Export(out, target)

    record: dict[str, Any] = {"model": to_dict(cfg), **(provenance or {})}
    if tokenizer is not None:
        record["tokenizer"] = tokenizer.describe()
    eod = tokenizer.eod_id if tokenizer is not None else None
    config = hf_config(cfg, target, eos_token_id=eod, record=record)
    config.dtype = dtype
    t = get_target(target)
    if t.remote_files:  # the code transformers runs for this class, named in auto_map
        config.auto_map = dict(t.auto_map)
        for name in t.remote_files:
            shutil.copyfile(REMOTE_CODE_DIR / name, out / name)
        result.files += t.remote_files

    state = to_hf_state_dict(model.state_dict(), cfg, target)
    result.files += _write_weights(state, out, dtype, max_shard)
    del state
    config.save_pretrained(out)
    result.files.append(CONFIG_NAME)
    result.files.append(_write_generation_config(out, cfg, eod))

    if tokenizer is not None:
        try:
            result.files += write_hf_tokenizer(tokenizer, out, cfg.max_seq_len)
        except TokenizerExportError as e:
            result.tokenizer_note = str(e)
            log.warning("exporting without a tokenizer: %s", e)
    else:
        result.tokenizer_note = "the checkpoint has no tokenizer"
    if card:
        write_card(result, model, tokenizer, run)
        result.files.append(README)
    return result


def _write_generation_config(out: Path, cfg: ModelConfig, eod: int | None) -> str:
    from transformers import GenerationConfig

    padded = list(range(cfg.vocab_size, cfg.padded_vocab_size))
    gen = GenerationConfig(
        bos_token_id=eod, eos_token_id=eod, pad_token_id=eod, suppress_tokens=padded or None
    )
    gen.save_pretrained(out)
    return "generation_config.json"


# ----------------------------------------------------------------------------- import


def read_hf_config(path: str | Path):
    """The transformers config of a folder, without running any code from it."""
    path = Path(path)
    file = path / CONFIG_NAME
    if not file.is_file():
        raise HFConversionError(f"{path} has no {CONFIG_NAME}; not a Hugging Face model folder")
    data = read_json_object(file)
    if not isinstance(data.get(RECORD_KEY, {}), dict):
        raise HFConversionError(
            f"{file} holds a {RECORD_KEY!r} record that is not an object ({{...}}); {REFETCH}"
        )
    kind = data.get("model_type")
    if kind not in TARGETS:
        raise HFConversionError(
            f"{path}: model_type {kind!r} is not supported; use one of {', '.join(TARGETS)}"
        )
    return get_target(kind).config_class().from_pretrained(path)


class SafetensorsWeights(Mapping):
    """The tensors of safetensors files by name, each read from disk when asked for, so a
    conversion never holds the model twice."""

    def __init__(self, files: list[Path]):
        self._where: dict[str, Any] = {}
        for f in files:  # each checked whole first: a cut shard fails here, in one line
            handle = open_safetensors(f, REFETCH)
            self._where.update(dict.fromkeys(handle.keys(), handle))

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._where[name].get_tensor(name)

    def __iter__(self):
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)


def read_hf_weights(path: str | Path) -> SafetensorsWeights:
    """A folder's safetensors weights (one file, or the shards its index names)."""
    path = Path(path)
    if (path / INDEX_NAME).is_file():
        weight_map = read_json_object(path / INDEX_NAME).get("weight_map")
        if not weight_map or not isinstance(weight_map, dict):
            raise HFConversionError(
                f"{path / INDEX_NAME} has no weight_map (tensor name -> shard file); {REFETCH}"
            )
        files = sorted({str(f) for f in weight_map.values()})
    elif (path / WEIGHTS_NAME).is_file():
        files = [WEIGHTS_NAME]
    else:
        hint = (
            " (pytorch_model.bin: convert it to safetensors first)"
            if any(path.glob("pytorch_model*.bin"))
            else ""
        )
        raise HFConversionError(f"{path} has no {WEIGHTS_NAME} or {INDEX_NAME}{hint}")
    missing = [f for f in files if not (path / f).is_file()]
    if missing:
        raise HFConversionError(
            f"{path / missing[0]} is missing (named in {INDEX_NAME}); {REFETCH}"
        )
    return SafetensorsWeights([path / f for f in files])


def model_from_state_dict(cfg: ModelConfig, state: dict[str, torch.Tensor]) -> Transformer:
    """Our model (fp32, CPU, eval mode) holding `state`'s tensors; no second copy is made."""
    state = {k: v.float() for k, v in state.items()}  # exact from bf16/fp16
    with torch.device("meta"):
        model = Transformer(cfg)
    if cfg.tie_embeddings:
        state["lm_head.weight"] = state["wte.weight"]
    model.load_state_dict(state, strict=True, assign=True)
    if cfg.tie_embeddings:
        model.lm_head.weight = model.wte.weight
    model.rope = type(model.rope).from_config(cfg)  # built on meta above
    for block in model.blocks:  # ALiBi's slopes too (a plain tensor, made on meta above)
        if block.attn.alibi is not None:
            block.attn.alibi = type(block.attn.alibi)(cfg.n_heads)
    return model.eval()


def read_hf_folder(path: str | Path) -> tuple[Transformer, Tokenizer | None, dict[str, Any]]:
    """(model, tokenizer or None, the toolkit's record from config.json or {})."""
    hf_cfg = read_hf_config(path)
    cfg = config_from_hf(hf_cfg)
    state = from_hf_state_dict(read_hf_weights(path), cfg, hf_cfg.model_type)
    record = getattr(hf_cfg, RECORD_KEY, None) or {}
    return (
        model_from_state_dict(cfg, state),
        read_hf_tokenizer(path, record.get("tokenizer")),
        record,
    )


# ----------------------------------------------------------------------------- in memory


def _module_names(hf_model, state: dict[str, torch.Tensor], target: str) -> dict[str, torch.Tensor]:
    """Checkpoint names -> the module tree's, where they differ (GPT-NeoX's embed_out is
    lm_head in transformers 5): a name the model lacks is given the alias it has."""
    names = hf_model.state_dict().keys()
    state = dict(state)
    for name, aliases in get_target(target).aliases.items():
        there = [a for a in aliases if a in names]
        if name in state and name not in names and there:
            state[there[0]] = state.pop(name)
    return state


def to_hf(model: Transformer, target: str | None = None):
    """A transformers model (CPU, fp32, eval mode) holding our weights."""
    config = hf_config(model.cfg, target)
    hf = get_target(config.model_type).empty_model(config)
    state = _module_names(
        hf, to_hf_state_dict(model.state_dict(), model.cfg, config.model_type), config.model_type
    )
    missing, unexpected = hf.load_state_dict(state, strict=False)
    missing = [k for k in missing if not (config.tie_word_embeddings and k == "lm_head.weight")]
    if missing or unexpected:
        raise HFConversionError(
            f"conversion left weights unmatched: missing {missing}, unexpected {unexpected}"
        )
    return hf.eval()


def from_hf(hf_model) -> Transformer:
    """Our model holding a transformers model's weights (Llama, GPT-NeoX or RopeLM), exactly."""
    cfg = config_from_hf(hf_model.config)
    state = {k: v.detach().clone() for k, v in hf_model.state_dict().items()}
    return model_from_state_dict(cfg, from_hf_state_dict(state, cfg, hf_model.config.model_type))
