"""A child program of tests/test_train_reshard.py, run on N ranks with torchrun's variables
(warm_start.run_ranks).

    reshard_probe.py save OUT STEP CONFIG...   train STEP updates on fixed random tokens, dump
                                               the full optimizer state, save checkpoint STEP
    reshard_probe.py load OUT STEP CONFIG...   load checkpoint STEP (written by any number of
                                               ranks), dump the full optimizer state, then
                                               train one more update and save, dump as `save`

The dumps (OUT/<config name>.<when>.pt, written by rank 0) are read through DeepSpeed's own
API (deepspeed.utils.safe_get_full_fp32_param / safe_get_full_optimizer_state, which gather
a parameter's slices from every rank), never through our code, so the test compares the
state a run saved with the state another world size loaded on DeepSpeed's word alone.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch


def full_state(engine) -> dict[str, torch.Tensor]:
    """name/kind -> the full tensor: fp32 master, exp_avg, exp_avg_sq of every parameter,
    gathered from every rank (every rank must call it)."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    opt = engine.optimizer
    base = getattr(opt, "optimizer", opt)
    if hasattr(opt, "_lazy_init_hp_params_optimizer_state"):
        # DeepSpeed 0.19's ZeRO-1/2 links each group's moments to the parameters' views after
        # the first group's first update, when later groups have none yet; linked again now,
        # safe_get_full_optimizer_state finds them (loading links them all itself).
        opt._hp_optimizer_states_linked = False
        opt._lazy_init_hp_params_optimizer_state()
    # ZeRO-0: in fp32 the torch optimizer steps the parameters themselves; in bf16 DeepSpeed's
    # unfused wrapper keeps an fp32 copy of each (fp32_groups beside fp16_groups).
    lp_groups, hp_groups = getattr(opt, "fp16_groups", []), getattr(opt, "fp32_groups", [])
    masters = {
        id(lp): hp
        for lps, hps in zip(lp_groups, hp_groups, strict=True)
        for lp, hp in zip(lps, hps, strict=True)
    }
    out: dict[str, torch.Tensor] = {}
    for name, p in engine.module.named_parameters():
        master = safe_get_full_fp32_param(p)
        if master is None:
            master = masters.get(id(p), p)
            m, v = base.state[master]["exp_avg"], base.state[master]["exp_avg_sq"]
        else:
            m = safe_get_full_optimizer_state(p, "exp_avg")
            v = safe_get_full_optimizer_state(p, "exp_avg_sq")
        for kind, t in (("fp32", master), ("exp_avg", m), ("exp_avg_sq", v)):
            out[f"{name}/{kind}"] = t.detach().clone().cpu()
    steps = {float(s["step"]) for s in base.state.values() if "step" in s}
    out["adam_step"] = torch.tensor(sorted(steps), dtype=torch.float64)
    out["lr_epoch"] = torch.tensor(engine.lr_scheduler.state_dict()["last_epoch"])
    return out


def dump(engine, path: Path, main: bool) -> None:
    state = full_state(engine)  # a collective: every rank
    if main:
        torch.save(state, path)


def train(engine, cfg, updates: int, seed: int) -> None:
    from pretrain.config import grad_accum_steps

    world = torch.distributed.get_world_size()
    rank = torch.distributed.get_rank()
    t = cfg.train
    gen = torch.Generator().manual_seed(seed)
    for _ in range(updates):
        # The same global batch on any world size: rank r takes its rows of it.
        batch = torch.randint(
            0, cfg.model.vocab_size, (t.global_batch_size, cfg.seq_len + 1), generator=gen
        )
        mine = batch.view(world, -1, cfg.seq_len + 1)[rank]
        for micro in mine.split(t.micro_batch_size):
            loss, _ = engine(micro[:, :-1], targets=micro[:, 1:], z_loss=0.0)
            engine.backward(loss)
            engine.step()
        assert grad_accum_steps(cfg, world) == len(mine) // t.micro_batch_size


def main() -> None:
    from pretrain.config import load_config, to_dict
    from pretrain.run_layout import RunLayout
    from pretrain.train import distributed as dist_utils
    from pretrain.train.checkpoint import Checkpointer, read_state
    from pretrain.train.engine import build_engine

    mode, out, step, configs = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3]), sys.argv[4:]
    env = dist_utils.setup_env()
    device = dist_utils.device_for(env)
    dist_utils.init_process_group(device)
    for path in configs:
        cfg = load_config(path)
        name = Path(path).stem
        engine = build_engine(cfg, env.world_size, device, 0)
        ckpt = Checkpointer(
            RunLayout(cfg.logging.run_dir).checkpoints, cfg.checkpoint, env.rank, env.world_size
        )

        if mode == "load":
            tag = f"step_{step:07d}"
            ckpt.load(engine, tag, cfg.train.seed)
            dump(engine, out / f"{name}.loaded.pt", env.is_main)
            assert read_state(ckpt.dir / tag)["step"] == step
            step_after = step + 1
            train(engine, cfg, 1, seed=step)
        else:
            step_after = step
            train(engine, cfg, step, seed=0)
        dump(engine, out / f"{name}.saved.pt", env.is_main)
        state = {"consumed_samples": 0, "config": to_dict(cfg)}
        ckpt.save(engine, step_after, state, lambda folder: None)


if __name__ == "__main__":
    main()
