"""Train a model: `python pretrain/main.py --config configs/quickstart.yaml`.

Every launcher works with the same command line:
    python pretrain/main.py --config X.yaml                    # one process (CPU or one GPU)
    deepspeed pretrain/main.py --config X.yaml                 # all GPUs of this node
    torchrun --nproc_per_node 8 pretrain/main.py --config X.yaml
    srun python pretrain/main.py --config X.yaml               # Slurm: one task per GPU

Re-running the same command resumes from the newest complete checkpoint. Exit codes:
0 when train_iters are done, 99 after SIGTERM/SIGUSR1 (a checkpoint was written; requeue),
124 when no step completed within train.hang_timeout (stacks in RUN/hang/; requeue),
2 for a user error (config, data, path, flag: one line; PRETRAIN_DEBUG=1 for a traceback).
"""

from __future__ import annotations

import argparse
import sys

from pretrain.cli.errors import ArgumentParser, user_errors
from pretrain.config import add_set_option, load_config, to_dict
from pretrain.run_layout import CheckpointSaveError
from pretrain.study.records import keep_run_lock_from_children
from pretrain.train.distributed import shutdown
from pretrain.train.trainer import train


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--config",
        required=True,
        help="run config YAML (may `inherit:` a model preset); see docs/configuration.md",
    )
    add_set_option(parser, "optim.lr=3e-4 --set train.micro_batch_size=8")
    parser.add_argument(
        "--print-config",
        action="store_true",
        help="print the resolved config (after inherit and --set) and exit",
    )
    # The deepspeed launcher appends --local_rank=N; the rank comes from the environment.
    parser.add_argument(
        "--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS
    )
    return parser.parse_args(argv)


class LazyPlanner:
    """The planner's answers to the config's "auto" fields (pretrain/train/engine.py
    RunPlanner). Imported when a run asks: the planner loads torch's fake-tensor machinery,
    which every other start (and every rank) would pay for."""

    def recompute(self, cfg, world_size: int, device) -> int:
        from pretrain.planner import resolve_activation_checkpointing

        return resolve_activation_checkpointing(cfg, world_size, device)

    def compiled_fits(self, cfg, world_size: int, device, layers: int) -> bool:
        from pretrain.planner import compiled_step_fits

        return compiled_step_fits(cfg, world_size, device, layers)


@user_errors
def main(argv: list[str] | None = None) -> int:
    keep_run_lock_from_children()  # before the DataLoader forks its workers
    args = parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
        if args.print_config:
            import yaml

            print(yaml.safe_dump(to_dict(cfg), sort_keys=False), end="")
            return 0

        code = train(cfg, planner=LazyPlanner())
        shutdown()  # after the run's last barrier: every rank is here
        return code
    except CheckpointSaveError as e:  # the run is resumable: say how, without a traceback
        print(f"error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
