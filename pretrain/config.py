"""The run config: the sections (pretrain/*/config.py) put together with their rules across
sections, YAML loading with `inherit:` and `--set`, dotted keys. What the file alone decides
is checked wherever a config is read; what needs this machine (a GPU for fp8, a compiler,
paths) is pretrain/preflight.py's, called at start, never when a study is planned."""

from __future__ import annotations

import argparse
import copy
from pathlib import Path
from typing import Any, get_origin

import yaml
from pydantic import Field, model_validator

from pretrain.data.config import DataConfig
from pretrain.eval.config import DownstreamConfig
from pretrain.model.config import ModelConfig, RopeScalingConfig, rotary_dims_from_fraction
from pretrain.model.recompute import recompute_layers
from pretrain.schema import (
    ConfigError,
    Section,
    did_you_mean,
    from_dict,
    sections,
    to_dict,
    yaml_keys,
)
from pretrain.train.config import (
    RANK_FAULTS,
    CheckpointConfig,
    FaultConfig,
    LoggingConfig,
    OptimConfig,
    ScheduleConfig,
    SpikesConfig,
    TrainConfig,
    WandbConfig,
)


class Config(Section):
    """One training run: YAML sections map to these fields (docs/configuration.md)."""

    model: ModelConfig = Field(default_factory=ModelConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    optim: OptimConfig = Field(default_factory=OptimConfig)
    schedule: ScheduleConfig = Field(default_factory=ScheduleConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    logging: LoggingConfig = Field(default_factory=LoggingConfig)
    spikes: SpikesConfig = Field(default_factory=SpikesConfig)
    wandb: WandbConfig = Field(default_factory=WandbConfig)
    downstream: DownstreamConfig = Field(default_factory=DownstreamConfig)
    callbacks: list[dict[str, Any]] = Field(default_factory=list)
    """Your own callbacks (docs/training.md, "Callbacks"): each entry names a class by its dotted path under `class:`; the other keys go to its constructor."""

    @property
    def seq_len(self) -> int:
        return self.train.seq_len or self.model.max_seq_len

    @model_validator(mode="after")
    def _across_sections(self) -> Config:
        """The rules that read two sections (each section checks its own fields)."""
        t = self.train
        if self.seq_len > self.model.max_seq_len:
            raise ConfigError(
                f"train.seq_len={t.seq_len} exceeds model.max_seq_len={self.model.max_seq_len}; "
                f"lower train.seq_len or raise model.max_seq_len"
            )
        recompute_layers(t.activation_checkpointing, self.model.n_layers)
        s = self.schedule
        if s.warmup_steps is not None and s.warmup_steps > t.train_iters:
            raise ConfigError(
                f"schedule.warmup_steps={s.warmup_steps} must be in [0, train.train_iters="
                f"{t.train_iters}]"
            )
        for i, f in enumerate(self.spikes.faults):
            if f.kind == "hang" and not t.hang_timeout:
                raise ConfigError(
                    f"spikes.faults[{i}]: a hang fault with the watchdog off (train.hang_timeout="
                    f"{t.hang_timeout}) would hold the job until its time limit; set "
                    f"train.hang_timeout (seconds)"
                )
        ds = t.deepspeed
        writer = (ds.get("checkpoint") or {}).get("writer")
        if self.checkpoint.async_ and (writer or (ds.get("datastates") or {}).get("enabled")):
            raise ConfigError(
                "checkpoint.async=true needs DeepSpeed's default checkpoint engine; remove "
                "train.deepspeed's checkpoint.writer (or datastates), or set checkpoint.async=false"
            )
        return self


# ----------------------------------------------------------------------------- world size


def world_sizes_for(global_batch_size: int, micro_batch_size: int) -> list[int]:
    """The numbers of ranks that can train a global batch in micro batches of this size
    (every divisor of the micro batches per step; none when the sizes do not divide)."""
    micro, rest = divmod(global_batch_size, micro_batch_size)
    return [] if rest else [w for w in range(1, micro + 1) if micro % w == 0]


def grad_accum_steps(cfg: Config, world_size: int) -> int:
    """global batch = micro batch x accumulation x world size; refuse what does not divide."""
    t = cfg.train
    per_step = t.micro_batch_size * world_size
    if t.global_batch_size % per_step:
        lo = max(per_step, t.global_batch_size // per_step * per_step)
        # A resumed run must keep its global batch: say which world sizes can hold it.
        fits = ", ".join(map(str, world_sizes_for(t.global_batch_size, t.micro_batch_size)[:12]))
        holds = f"; with this micro batch, world sizes that can hold it: {fits}" if fits else ""
        raise ConfigError(
            f"train.global_batch_size={t.global_batch_size} is not divisible by "
            f"train.micro_batch_size={t.micro_batch_size} x world size {world_size} = {per_step}; "
            f"set train.global_batch_size to a multiple of {per_step} (e.g. {lo} or {lo + per_step}) "
            f"or change train.micro_batch_size{holds}"
        )
    return t.global_batch_size // per_step


def check_world_size(cfg: Config, world_size: int) -> None:
    """What the file decides for a number of ranks (a study's Slurm layout, or the launch):
    the batch divides over them, and a rank fault names one of them."""
    grad_accum_steps(cfg, world_size)
    for i, f in enumerate(cfg.spikes.faults):
        if f.kind not in RANK_FAULTS and f.rank is not None and not 0 <= f.rank < world_size:
            raise ConfigError(
                f"spikes.faults[{i}].rank={f.rank}: a {f.kind} fault on one rank names one of "
                f"0 to {world_size - 1} for this world size of {world_size} (null: every rank)"
            )
        if f.kind in RANK_FAULTS and (f.rank is None or not 0 <= f.rank < world_size):
            raise ConfigError(
                f"spikes.faults[{i}].rank={f.rank}: a {f.kind} fault needs the rank it stalls, "
                f"0 to {world_size - 1} for this world size of {world_size}"
            )


# ----------------------------------------------------------------------------- dotted keys


def check_key(key: str) -> None:
    """Refuse a dotted key the config does not have (ConfigError naming the closest one).
    `inherit` and `inherit.SECTION` are the config file's own keys."""
    parts = key.split(".")
    if not all(parts):
        raise ConfigError(f"{key!r} is not a dotted config key (e.g. train.seq_len)")
    top = list(yaml_keys(Config))
    if parts[0] == "inherit":
        if len(parts) > 2 or (len(parts) == 2 and parts[1] not in top):
            raise ConfigError(f"{key}: inherit takes a file per section ({', '.join(top)})")
        return
    known = {"": Config, **sections(Config)}  # a list's items ("spikes.faults[]") are values
    for i, part in enumerate(parts):
        where = ".".join(parts[:i])
        if where not in known:  # the key goes on below a plain value
            raise ConfigError(f"{key}: {where} is a value, not a section")
        fields = yaml_keys(known[where])
        if part not in fields:
            hint = did_you_mean(part, fields, f"{where}." if where else "")
            raise ConfigError(
                f"unknown config key {key}{hint}; known keys of {where or 'the config'}: "
                f"{', '.join(fields)}"
            )
        if get_origin(known[where].model_fields[fields[part]].annotation) is dict:
            return  # a free mapping (train.deepspeed): any key below it


def get_key(data: dict[str, Any], key: str) -> tuple[bool, Any]:
    """(found, value) of a dotted key in nested mappings."""
    node: Any = data
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return False, None
        node = node[part]
    return True, node


def set_key(data: dict[str, Any], key: str, value: Any) -> None:
    """Set a dotted key in place: an existing key keeps its position, a new one goes last."""
    *path, last = key.split(".")
    node = data
    for part in path:
        if not isinstance(node.get(part), dict):
            node[part] = {}
        node = node[part]
    node[last] = value


# ----------------------------------------------------------------------------- loading


def deep_merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """`over` on `base`, mappings merged key by key; anything else (a list) replaced whole."""
    out = dict(base)
    for k, v in over.items():
        out[k] = (
            deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
        )
    return out


def yaml_error_message(e: BaseException, path: Any = None) -> str:
    """`FILE:LINE:COLUMN: not valid YAML: PROBLEM` for a yaml.MarkedYAMLError (1-based)."""
    mark = getattr(e, "problem_mark", None) or getattr(e, "context_mark", None)
    problem = getattr(e, "problem", None) or getattr(e, "context", None) or str(e)
    name = path if path is not None else getattr(mark, "name", None) or "<yaml>"
    where = f"{name}:{mark.line + 1}:{mark.column + 1}" if mark is not None else f"{name}"
    return f"{where}: not valid YAML: {problem}; fix the file's syntax"


def read_yaml(path: Path) -> dict[str, Any]:
    """One YAML file's top-level mapping, or a ConfigError naming the file (and line)."""
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(yaml_error_message(e, path)) from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of keys")
    return data


def resolve_inherit(
    data: dict[str, Any], base: Path, _seen: tuple[Path, ...] = ()
) -> dict[str, Any]:
    """`data` with its `inherit:` read: a path or list of paths (relative to `base`) merged
    first, in order, or `{section: path}` putting a file's content under that section (a model
    preset: `inherit: {model: ../models/llama1b.yaml}`); `data`'s own keys win."""
    data = dict(data)
    parents = data.pop("inherit", None)
    if parents is None:
        return data
    merged: dict[str, Any] = {}
    if isinstance(parents, (str, list)):
        for p in [parents] if isinstance(parents, str) else parents:
            merged = deep_merge(merged, load_yaml(base / str(p), _seen))
    elif isinstance(parents, dict):
        for section, p in parents.items():
            merged = deep_merge(merged, {section: load_yaml(base / str(p), _seen)})
    else:
        raise ConfigError(f"{base}: inherit must be a path, a list of paths or a mapping")
    return deep_merge(merged, data)


def load_yaml(path: str | Path, _seen: tuple[Path, ...] = ()) -> dict[str, Any]:
    """Read a YAML config, resolving `inherit:` (paths relative to the file)."""
    path = Path(path).resolve()
    if path in _seen:
        raise ConfigError(f"config inherit cycle: {' -> '.join(map(str, _seen + (path,)))}")
    return resolve_inherit(read_yaml(path), path.parent, _seen + (path,))


def parse_override(text: str) -> tuple[str, Any]:
    """'optim.lr=3e-4' -> ('optim.lr', 0.0003). The value is read as YAML."""
    if "=" not in text:
        raise ConfigError(f"--set {text!r} must look like section.key=value (e.g. optim.lr=3e-4)")
    key, raw = text.split("=", 1)
    key = key.strip()
    if not all(key.split(".")):
        raise ConfigError(f"--set {text!r}: bad key {key!r}")
    try:
        value = yaml.safe_load(raw)
    except yaml.YAMLError:
        value = raw
    return key, value


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """`--set KEY=VALUE` overrides on a config's mapping (a copy; `data` is left as it is)."""
    data = copy.deepcopy(data)
    for text in overrides:
        set_key(data, *parse_override(text))
    return data


def load_config(path: str | Path, overrides: list[str] | None = None) -> Config:
    """Load a run config (YAML with inherit) and apply `--set a.b=c` overrides."""
    return from_dict(Config, apply_overrides(load_yaml(path), overrides or []), "")


def load_model_config(path: str | Path, overrides: list[str] | None = None) -> ModelConfig:
    """Load a model preset (a YAML of model fields only), e.g. configs/models/llama1b.yaml."""
    data = load_yaml(path)
    data = data["model"] if isinstance(data.get("model"), dict) else data
    return from_dict(ModelConfig, apply_overrides(data, overrides or []), "model")


def add_set_option(parser: argparse.ArgumentParser, example: str = "optim.lr=3e-4") -> None:
    """`--set KEY=VALUE` (repeatable) into `args.overrides`: the one config override flag of
    every program, read as YAML like the config file (apply_overrides)."""
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help=f"override one config value, e.g. --set {example} (repeatable; values are read "
        f"as YAML)",
    )


__all__ = [
    "CheckpointConfig",
    "Config",
    "ConfigError",
    "DataConfig",
    "DownstreamConfig",
    "FaultConfig",
    "LoggingConfig",
    "ModelConfig",
    "OptimConfig",
    "RopeScalingConfig",
    "ScheduleConfig",
    "SpikesConfig",
    "TrainConfig",
    "WandbConfig",
    "add_set_option",
    "apply_overrides",
    "check_key",
    "check_world_size",
    "deep_merge",
    "from_dict",
    "get_key",
    "grad_accum_steps",
    "load_config",
    "load_model_config",
    "load_yaml",
    "resolve_inherit",
    "rotary_dims_from_fraction",
    "set_key",
    "to_dict",
    "world_sizes_for",
    "yaml_error_message",
]
