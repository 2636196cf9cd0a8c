"""What DeepSpeed's engine sends in training steps, as its own communication logger records it.

`measure(configs, world_size, steps)` starts `world_size` CPU ranks (gloo), and in each builds
every config's engine as training does (`pretrain.train.engine.build_engine`: the model, our
AdamW groups, the DeepSpeed config the toolkit generates), runs `steps` optimizer steps of
random tokens (`train.global_batch_size / (micro x world)` micro steps each, the engine's own
forward, backward and step) and returns what DeepSpeed's `comms_logger` recorded from the first
micro step on: per collective and message size, the calls and their seconds. The planner's
inventory of a step (pretrain/planner/comms.py) is checked against it exactly
(tests/test_plan_comms.py), and its time model against the seconds
(`tools/plan.py --check-comms`).

The trainer's own collectives (its step's stop flag and loss, a logging step's metrics:
torch.distributed directly) are not DeepSpeed's and are not logged; the planner lists them
apart, and tests/trainer_comms.py counts them in the real trainer.
"""

from __future__ import annotations

import json
import os
import socket
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

from pretrain.config import Config, from_dict, grad_accum_steps, to_dict
from pretrain.train import deepspeed_adapter
from pretrain.train.engine import build_engine

# DeepSpeed's logger, enabled for every op (prof_all) and quiet (no table printed at the end).
COMMS_LOGGER = {"comms_logger": {"enabled": True, "prof_all": True, "verbose": False}}

# op -> message bytes -> {"calls": n, "latencies": [seconds of each call]}
Logged = dict[str, dict[int, dict[str, Any]]]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _logged(raw: dict[str, Any]) -> Logged:
    """comms_logger.get_raw_data() (op -> size -> [count, latencies ms, algbw, busbw]) as
    op -> bytes -> calls and each call's seconds.

    DeepSpeed 0.19's logger records, for each call, its op's timer's *running total*
    (`timers(log_name).elapsed(reset=False)` sums every call of that op so far, all sizes
    together: deepspeed/comm/comm.py timed_op). Sorted, the totals of an op give each call's
    own time as the difference to the one before. On CPU ranks a call's time includes waiting
    for the other ranks to arrive."""
    out: Logged = {}
    for op, sizes in raw.items():
        totals = sorted((float(ms) / 1e3, int(size)) for size, v in sizes.items() for ms in v[1])
        own: dict[int, list[float]] = {int(size): [] for size in sizes}
        before = 0.0
        for total, size in totals:
            own[size].append(total - before)
            before = total
        out[op] = {
            int(size): {"calls": int(v[0]), "latencies": own[int(size)]}
            for size, v in sizes.items()
        }
    return out


def run_steps(cfg: Config, world_size: int, steps: int) -> Logged:
    """In a rank of an initialised process group: `steps` optimizer steps of `cfg`'s engine,
    what DeepSpeed logged from the first micro step on."""
    data = to_dict(cfg)
    data["train"]["deepspeed"] = {**cfg.train.deepspeed, **COMMS_LOGGER}
    cfg = from_dict(Config, data)
    engine = build_engine(cfg, world_size, torch.device("cpu"), recompute=0)
    t, m = cfg.train, cfg.model
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, m.vocab_size, (t.micro_batch_size, cfg.seq_len + 1), generator=g)
    deepspeed_adapter.reset_comms_log()  # the engine's set-up apart from its steps
    for _ in range(steps * grad_accum_steps(cfg, world_size)):
        loss, _ = engine(x[:, :-1], targets=x[:, 1:])
        engine.backward(loss)
        engine.step()
    logged = _logged(deepspeed_adapter.comms_log())
    deepspeed_adapter.reset_comms_log()
    engine.destroy()
    return logged


def _worker(rank: int, world_size: int, port: int, configs: dict, steps: int, out: str) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
    )
    torch.set_num_threads(1)
    deepspeed_adapter.quiet_logs()
    deepspeed_adapter.init_distributed("cpu")
    results = {}
    for name, data in configs.items():
        logged = run_steps(from_dict(Config, data), world_size, steps)
        results[name] = {op: {str(b): v for b, v in s.items()} for op, s in logged.items()}
    Path(out, f"rank{rank}.json").write_text(json.dumps(results))
    torch.distributed.destroy_process_group()


def measure(configs: dict[str, Config], world_size: int, steps: int = 2) -> dict[str, list[Logged]]:
    """Every config's `steps` steps on `world_size` CPU ranks: per config, each rank's log."""
    with tempfile.TemporaryDirectory() as out:
        data = {name: to_dict(cfg) for name, cfg in configs.items()}
        mp.spawn(_worker, (world_size, free_port(), data, steps, out), nprocs=world_size)
        ranks = [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(world_size)]
    return {
        name: [
            {op: {int(b): v for b, v in s.items()} for op, s in rank[name].items()}
            for rank in ranks
        ]
        for name in configs
    }
