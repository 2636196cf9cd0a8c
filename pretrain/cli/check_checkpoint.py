"""Verify a run's checkpoints offline: every file against the size and CRC-32 that its
checkpoint's marker recorded, as a resume does before it loads one.

    python tools/check_checkpoint.py runs/llama1b_rope10            # every checkpoint
    python tools/check_checkpoint.py runs/llama1b_rope10 --size-only

Prints one line per checkpoint (intact, unverified, or what is damaged) and which one a
resume would take. Unverified: its marker records no file list (written before markers
recorded files), so there is nothing to check its files against; a resume still takes it,
with a warning. Exit code 0 when no checkpoint is damaged (intact or unverified), 1 when one
is damaged or holds an RNG file a resume refuses, 2 for a bad path. Unverified is not a
failure: nothing is known to be wrong with it and a resume uses it, while exit 1 would fail
every script checking a run saved by older code, with nothing to repair.

Integrity is not trust: under each checkpoint it names the files that are pickles
(DeepSpeed's model and optimizer states, which DeepSpeed loads with weights_only=False, so
loading them can execute code) and any RNG file not in the current format (the old one,
read through a compatibility path, or one a resume refuses). Anyone who can write the folder
can also rewrite the CRC-32s in its marker (docs/checkpoints.md, "Trust").
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from pretrain.cli.errors import ArgumentParser, user_errors
from pretrain.integrity import UNVERIFIED, is_unverified
from pretrain.run_layout import CHECKPOINTS_DIR, DELETING_SUFFIX, RNG_DIR, TMP_SUFFIX
from pretrain.train.checkpoint import (
    CheckpointError,
    complete_tags,
    find_resume_tag,
    verify_checkpoint,
)
from pretrain.train.state_files import pickle_files, rng_file_problem


@user_errors
def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("run", help="a run folder (runs/NAME) or its checkpoints folder")
    parser.add_argument(
        "--size-only", action="store_true", help="compare sizes only (fast); by default CRC-32s too"
    )
    args = parser.parse_args(argv)

    path = Path(args.run)
    ckpts = path / CHECKPOINTS_DIR if (path / CHECKPOINTS_DIR).is_dir() else path
    if not ckpts.is_dir():
        print(
            f"error: {path} is neither a run folder nor a checkpoints folder; give runs/NAME",
            file=sys.stderr,
        )
        return 2
    tags = complete_tags(ckpts)
    if not tags:
        print(f"no complete checkpoint in {ckpts}")
    damaged = 0
    unverified = set()
    for tag in tags:
        problems = verify_checkpoint(ckpts / tag, checksum=not args.size_only)
        damaged += bool(problems)
        if problems:
            print(f"{tag}  DAMAGED: " + "; ".join(problems))
        elif is_unverified(ckpts / tag):
            unverified.add(tag)
            print(f"{tag}  unverified: {UNVERIFIED}")
        else:
            print(f"{tag}  intact")
        damaged += _print_trust(ckpts / tag)
    for p in sorted(ckpts.iterdir()):
        if p.is_dir() and p.name.endswith((TMP_SUFFIX, DELETING_SUFFIX)):
            print(
                f"{p.name}  incomplete (a save or a removal was cut short; the next start "
                f"removes it)"
            )
    if tags:
        import contextlib
        import io

        with contextlib.redirect_stdout(io.StringIO()):
            try:
                tag = find_resume_tag(ckpts, "size" if args.size_only else "checksum")
            except CheckpointError:
                tag = None
        note = " (unverified)" if tag in unverified else ""
        print(f"a resume takes: {tag or 'none (no intact checkpoint)'}{note}")
        print(
            "note: CRC-32 verifies integrity (the files are as written), not trust (who wrote "
            "them): resume or load pickles only from runs you trust; share a model as its "
            "weights folder (model.safetensors + config.yaml) or an export "
            '(docs/checkpoints.md, "Trust")'
        )
    return 1 if damaged else 0


def _print_trust(folder: Path, shown: int = 4) -> int:
    """Print the checkpoint's pickles (at most `shown` names) and its RNG files that are not
    of the current format; 1 when a resume would refuse one of them, else 0."""
    pickles = pickle_files(folder)
    if pickles:
        more = f" and {len(pickles) - shown} more" if len(pickles) > shown else ""
        print(
            f"  pickles (DeepSpeed loads them with weights_only=False: loading one can run "
            f"code): {', '.join(pickles[:shown])}{more}"
        )
    refused = 0
    for rng in sorted((folder / RNG_DIR).glob("*.pt")):
        problem = rng_file_problem(rng)
        if problem:
            refused |= problem.startswith("REFUSED")
            print(f"  {rng.relative_to(folder).as_posix()}: {problem}")
    return refused
