"""Helpers shared by tests/test_train_*.py: a tiny run config, stdlib byte data, launchers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import warm_start
import yaml
from warm_start import free_port

from pretrain.launch_env import LAUNCH_VARS

REPO = Path(__file__).resolve().parents[1]
MAIN = REPO / "pretrain" / "main.py"


def tiny_config(run_dir: Path, data_dir: Path, **sections: dict[str, Any]) -> dict[str, Any]:
    """A 2-layer d-32 model on byte data; fp32 so runs compare to 1e-6."""
    cfg: dict[str, Any] = {
        "model": {
            "vocab_size": 257,
            "pad_vocab_to_multiple": 1,
            "n_layers": 2,
            "d_model": 32,
            "n_heads": 4,
            "d_ff": 64,
            "max_seq_len": 32,
            "rope_fraction": 0.25,
            "qk_norm": True,
            "mlp_bias": False,
        },
        "data": {"train": [str(data_dir)], "valid": [str(data_dir)], "num_workers": 0},
        "optim": {"lr": 3e-3},
        "schedule": {"warmup_steps": 2},
        "train": {
            "train_iters": 8,
            "global_batch_size": 8,
            "micro_batch_size": 4,
            "seq_len": 32,
            "precision": "fp32",
            "zero_stage": 1,
            "eval_interval": 4,
            "eval_iters": 1,
        },
        "checkpoint": {"interval": 3, "keep_last": 2},
        "logging": {"run_dir": str(run_dir), "log_interval": 2, "max_logit_interval": 2},
    }
    for name, values in sections.items():
        cfg[name] = {**cfg.get(name, {}), **values}
    return cfg


def write_config(path: Path, cfg: dict[str, Any]) -> Path:
    path.write_text(yaml.safe_dump(cfg))
    return path


def child_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **extra)
    return env


def main_argv(config: Path, overrides: list[str] | None = None) -> list[str]:
    """`pretrain/main.py --config CONFIG --set ...` (no interpreter)."""
    args = [str(MAIN), "--config", str(config)]
    for o in overrides or []:
        args += ["--set", o]
    return args


def launch_cmd(config: Path, nproc: int = 1, overrides: list[str] | None = None) -> list[str]:
    args = main_argv(config, overrides)
    if nproc == 1:
        return [sys.executable, *args]
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        str(nproc),
        "--master_addr",
        "127.0.0.1",
        "--master_port",
        str(free_port()),
        *args,
    ]


def run_main(
    config: Path,
    nproc: int = 1,
    overrides: list[str] | None = None,
    timeout: float = 240,
    torchrun: bool = False,
    **env: str,
) -> subprocess.CompletedProcess:
    """pretrain/main.py on `nproc` ranks, forked from the warm interpreter (warm_start.py:
    the same program without ~9 s of imports per process); `torchrun`: started cold by
    python or torchrun itself, where the launch is what a test checks."""
    if torchrun:
        return subprocess.run(
            launch_cmd(config, nproc, overrides),
            cwd=REPO,
            env=child_env(**env),
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    return warm_start.run_ranks(
        main_argv(config, overrides), child_env(**env), REPO, timeout, nproc
    )


def start_ranks(config: Path, nproc: int, logs: Path, **env: str) -> list[warm_start.WarmProcess]:
    """One process per rank with the launcher variables set, as srun starts them, so that
    each rank's own exit code is seen (torchrun reports 1 for any failure). Each rank's
    output goes to LOGS/rank_K.log."""
    port = str(free_port())
    procs = []
    for rank in range(nproc):
        procs.append(
            warm_start.WarmProcess(
                main_argv(config),
                child_env(**warm_start.rank_vars(rank, nproc, port), **env),
                REPO,
                logs / f"rank_{rank}.log",
                None,
            )
        )
    return procs


def metrics(run_dir: Path) -> dict[int, dict[str, float]]:
    """step -> merged scalars from RUN/metrics.jsonl."""
    out: dict[int, dict[str, float]] = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        out.setdefault(row.pop("step"), {}).update(row)
    return out


def prepare_stdlib(out_dir: Path, max_bytes: int = 200_000) -> Path:
    """Byte-level stdlib text as megatron-core indexed data (train/ and valid/ splits)."""
    from pretrain.data.recipes import prepare_stdlib_corpus

    if not out_dir.exists():
        # A third of the documents for validation, so that a small corpus has some.
        prepare_stdlib_corpus(out_dir, max_bytes=max_bytes, valid_fraction=0.3, progress=False)
    return out_dir


def saved_byte_run(root: Path, seq_len: int, max_bytes: int = 200_000, seed: int = 1234, **model):
    """(run folder, model): a 1-layer byte-level model saved as the step-1 checkpoint of a run
    whose data is the stdlib corpus (prepared under `root`), as tools/evaluate.py reads it."""
    import torch

    from pretrain.config import ModelConfig
    from pretrain.data.tokenizer import load_tokenizer
    from pretrain.model.transformer import Transformer
    from pretrain.weights import save_weights

    data = prepare_stdlib(root / "data", max_bytes)
    torch.manual_seed(0)
    shape = dict(vocab_size=257, pad_vocab_to_multiple=1, n_layers=1, d_model=32, n_heads=2)
    net = Transformer(ModelConfig(**{**shape, "d_ff": 64, "max_seq_len": seq_len, **model}))
    run_cfg = {
        "data": {"train": [str(data)], "valid": [str(data)]},
        "train": {"seed": seed, "seq_len": seq_len},
    }
    wdir = root / "run" / "checkpoints" / "step_0000001"
    save_weights(net, wdir, run_cfg)
    load_tokenizer("bytes").save(wdir / "tokenizer")
    (wdir.parent / "latest").write_text(wdir.name)
    return root / "run", net


_stdlib: dict[str, Path] = {}


def stdlib_data(tmp_path_factory) -> Path:
    """The stdlib byte corpus, prepared once per pytest session (tests only read it)."""
    if "data" not in _stdlib:
        _stdlib["data"] = prepare_stdlib(tmp_path_factory.mktemp("stdlib") / "data")
    return _stdlib["data"]


_baseline: dict[str, Path] = {}


def baseline_run(tmp_path_factory) -> tuple[Path, Path]:
    """(data dir, run dir) of the tiny config trained once, uninterrupted, on one process.

    Shared by the test modules of one pytest session (it is the reference of several tests).
    """
    if not _baseline:
        root = tmp_path_factory.mktemp("train_baseline")
        data = stdlib_data(tmp_path_factory)
        run = root / "run"
        cfg = write_config(root / "run.yaml", tiny_config(run, data))
        r = run_main(cfg)
        assert r.returncode == 0, r.stdout + r.stderr
        _baseline.update(data=data, run=run)
    return _baseline["data"], _baseline["run"]


def wandb_history(path: Path) -> list[dict]:
    """History rows of an offline W&B run file: wandb's protobuf Records in the LevelDB log
    format (32 KiB blocks; a record is split into FIRST/MIDDLE/LAST pieces at block ends)."""
    import struct

    from wandb.proto import wandb_internal_pb2

    data, pos, block, raws, buf = path.read_bytes(), 7, 32768, [], b""
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        left = block - pos % block
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if left < 7 or (length == 0 and kind == 0):  # block trailer / padding
            pos += left
            continue
        chunk, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        if kind in (1, 4):  # FULL, LAST
            raws.append(buf + chunk if kind == 4 else chunk)
        buf = chunk if kind == 2 else buf + chunk if kind == 3 else b""
    rows = []
    for raw in raws:
        rec = wandb_internal_pb2.Record()
        rec.ParseFromString(raw)
        if rec.WhichOneof("record_type") == "history":
            rows.append(
                {
                    i.key or "/".join(i.nested_key): json.loads(i.value_json)
                    for i in rec.history.item
                }
            )
    return rows


def wandb_rows(run: Path) -> list[dict]:
    (run_dir,) = (run / "wandb").glob("offline-run-*")
    (history,) = run_dir.glob("*.wandb")
    return wandb_history(history)
