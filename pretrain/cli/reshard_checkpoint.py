"""Prepare a checkpoint for a resume on another number of GPUs, ahead of time.

    python tools/reshard_checkpoint.py --run runs/llama1b_rope10            # the newest
    python tools/reshard_checkpoint.py --run runs/llama1b_rope10 --step 6000 --workers 16

A ZeRO-1/2 checkpoint holds each rank's slice of the fp32 master weights and Adam moments.
A run resumed on another number of ranks re-partitions it by itself (rank 0 converts it to
DeepSpeed's universal checkpoint while the others wait: see pretrain/train/reshard.py and
docs/checkpoints.md, "Resuming on another number of GPUs"). For a large model, run this
program first, on a CPU node, so that the GPUs do not wait: it verifies the checkpoint
against its marker, writes CKPT/step_N/universal/ (atomically: a kill leaves the checkpoint
as it was), and prints the world sizes that can hold the run's global batch. The resume
then finds the universal form and loads it on any number of ranks. A ZeRO-0 checkpoint
needs nothing: it loads on any number of ranks as it is.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from pretrain.cli.errors import ArgumentParser, user_errors
from pretrain.config import world_sizes_for
from pretrain.integrity import verify_checkpoint
from pretrain.run_layout import CHECKPOINTS_DIR, LATEST_FILE, UNIVERSAL_DIR, step_tag
from pretrain.train.checkpoint import CheckpointError, complete_tags, is_complete, read_state
from pretrain.train.reshard import convert_to_universal, saved_ranks


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_checkpoint_arguments("convert")
    p.add_argument(
        "--workers",
        type=int,
        default=min(8, os.cpu_count() or 1),
        help="processes that read the ranks' slices in parallel (default: up to 8 cores)",
    )
    p.add_argument(
        "--size-only",
        action="store_true",
        help="verify the checkpoint's file sizes only (fast); by default their CRC-32s too",
    )
    return p.parse_args(argv)


def checkpoint_folder(path: Path, step: int | None) -> Path:
    """The complete checkpoint that --run/--step name: the folder itself, that step's, or
    the one `latest` names (else the newest)."""
    if is_complete(path) and step is None:
        return path
    ckpts = path / CHECKPOINTS_DIR if (path / CHECKPOINTS_DIR).is_dir() else path
    tags = complete_tags(ckpts)
    if not tags:
        raise CheckpointError(
            f"no complete checkpoint under {ckpts}; give a run folder (runs/NAME) or a "
            f"checkpoint folder RUN/checkpoints/step_N"
        )
    if step is not None:
        if step_tag(step) not in tags:
            raise CheckpointError(
                f"--step {step}: no complete checkpoint of it in {ckpts}; there are "
                f"{', '.join(tags)}"
            )
        return ckpts / step_tag(step)
    latest = ckpts / LATEST_FILE
    named = latest.read_text().strip() if latest.is_file() else ""
    return ckpts / (named if named in tags else tags[-1])


@user_errors
def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.workers < 1:
        raise CheckpointError(f"--workers {args.workers}: give at least 1")
    folder = checkpoint_folder(Path(args.run), args.step)
    if not any(folder.glob("mp_rank_*_model_states.pt")):
        raise CheckpointError(
            f"{folder} is not a training checkpoint (no DeepSpeed files); give a run folder "
            f"or a checkpoint folder RUN/checkpoints/step_N"
        )
    problems = verify_checkpoint(folder, checksum=not args.size_only)
    if problems:
        raise CheckpointError(
            f"{folder} is damaged: {problems[0]}; python tools/check_checkpoint.py shows all"
        )
    ranks = saved_ranks(folder)
    train = read_state(folder).get("config", {}).get("train", {})
    if ranks is None:
        print(
            f"{folder}: the optimizer state is not partitioned (ZeRO-0); it loads on any "
            f"number of ranks as it is"
        )
    else:
        seconds = convert_to_universal(
            folder, args.workers, "size" if args.size_only else "checksum"
        )
        done = f"written in {seconds:.1f} s" if seconds else "already there, intact"
        print(f"{folder / UNIVERSAL_DIR}: {done} (from {ranks} ranks' slices)")
    gbs, micro = train.get("global_batch_size"), train.get("micro_batch_size")
    if gbs and micro and (fits := world_sizes_for(gbs, micro)):
        print(
            f"global batch {gbs} of micro batches of {micro}: world sizes that can resume it: "
            f"{', '.join(map(str, fits))} (or change train.micro_batch_size)"
        )
    return 0
