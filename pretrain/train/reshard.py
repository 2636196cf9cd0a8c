"""Resume on another number of ranks: ZeRO's partitioned optimizer state, re-partitioned.

A ZeRO-1/2 checkpoint holds each rank's slice of the flat fp32 master weights and Adam
moments (zero_pp_rank_K_..._optim_states.pt, one per data-parallel rank), and DeepSpeed
refuses to load it on another data-parallel size. Its universal checkpoint is the way
through: `ds_to_universal` cuts the slices back into one file per parameter and state
(fp32, exp_avg, exp_avg_sq, step), and a load with `load_universal` lets every rank take
its new slice of them. Both halves are DeepSpeed's own code; the conversion only re-slices
the saved fp32 values, so the masters and moments a run resumes with are bit-identical to
the ones it saved (tests/test_train_reshard.py checks that for ZeRO 0, 1 and 2, bf16 and
fp32, 2 -> 1 and 1 -> 2 ranks). We chose it over our own re-slicing of DeepSpeed's flat
buffers because the buffers' layout (alignment padding, group order, bf16 vs ZeRO
optimizers) is DeepSpeed's private business and changes between its versions; the
universal format is what it maintains for exactly this.

Where it lives: inside the checkpoint it was made from, CKPT/step_X/universal/, so that
retention and rollbacks treat the two as one. It is written into universal.tmp/, gets its
own marker (the size and CRC-32 of every file, as a checkpoint's), is fsynced, and only
then renamed: a kill during a conversion leaves the checkpoint as it was, and the next
start converts again. It is made once; a resume on yet another world size reuses it
(verified first, and made again when found damaged).

When: a resume or a rollback to a checkpoint that another number of ranks wrote, when it
holds partitioned state. ZeRO-0 keeps the whole optimizer state in one file, which loads
on any world size as it is. Rank 0 converts, in a child process (DeepSpeed's converter
runs process pools, which must not fork a training process and its communication
threads); the other ranks wait. `tools/reshard_checkpoint.py` does the same ahead of time,
e.g. on a CPU node before a large run is resubmitted on fewer GPUs (an 8B model's ZeRO
state is ~100 GB; the conversion reads and writes it once).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
import warnings
from collections.abc import Iterator
from pathlib import Path

from pretrain.errors import UserError
from pretrain.faults import fault_point
from pretrain.integrity import checkpoint_files, file_record, verify_checkpoint
from pretrain.run_layout import (
    STATE_FILE,
    TMP_SUFFIX,
    UNIVERSAL_DIR,
    fsync_dir,
    fsync_tree,
    tag_step,
)
from pretrain.train.deepspeed_adapter import load_universal

# One file per data-parallel rank in a ZeRO-1/2 checkpoint (bf16_ prefix under bf16).
_PARTITION = re.compile(r"^(bf16_)?zero_pp_rank_(\d+)_mp_rank_00_optim_states\.pt$")


class ReshardError(UserError, RuntimeError):
    """A checkpoint could not be re-partitioned; the message says why and what to do."""

    label = "checkpoint error"


def saved_ranks(folder: Path) -> int | None:
    """How many data-parallel ranks hold a slice of the checkpoint's optimizer state (its
    partition files), or None when nothing is partitioned (ZeRO-0: any world size loads it)."""
    ranks = {int(m.group(2)) for p in Path(folder).iterdir() if (m := _PARTITION.match(p.name))}
    return len(ranks) or None


def needs_universal(folder: Path, world_size: int) -> bool:
    """True when `folder` must be re-partitioned before `world_size` ranks can load it."""
    saved = saved_ranks(folder)
    return saved is not None and saved != world_size


def universal_ready(folder: Path, checksum: bool = True) -> bool:
    """True when folder/universal is complete and intact (its marker's sizes, and CRC-32s with
    `checksum`)."""
    out = Path(folder) / UNIVERSAL_DIR
    return (out / STATE_FILE).is_file() and not verify_checkpoint(out, checksum)


def convert_to_universal(folder: Path, workers: int = 4, verify: str = "checksum") -> float:
    """Make folder/universal (see the module docstring) unless an intact one exists.

    Returns the seconds the conversion took (0.0 when an intact one was reused). A damaged
    one is removed and made again. Raises ReshardError when DeepSpeed's converter fails; the
    checkpoint itself is never touched.
    """
    folder = Path(folder)
    out, tmp = folder / UNIVERSAL_DIR, folder / (UNIVERSAL_DIR + TMP_SUFFIX)
    if out.is_dir():
        if verify == "none" or universal_ready(folder, verify == "checksum"):
            return 0.0
        shutil.rmtree(out)  # damaged: made again from the checkpoint, which was verified
    shutil.rmtree(tmp, ignore_errors=True)  # a conversion cut short
    t0 = time.perf_counter()
    cmd = [
        sys.executable,
        "-m",
        "deepspeed.checkpoint.ds_to_universal",
        "--input_folder",
        str(folder),
        "--output_folder",
        str(tmp / folder.name),
        "--num_extract_workers",
        str(workers),
        "--num_merge_workers",
        str(max(1, workers // 2)),
        # Our checkpoints carry no Megatron-style parallelism info; the converter adds the
        # default (data parallelism only) in memory. The checkpoint's files are not modified.
        "--inject_missing_state",
    ]
    r = subprocess.run(
        cmd, capture_output=True, text=True, env={**os.environ, "PYTHONWARNINGS": "ignore"}
    )
    if r.returncode != 0:
        shutil.rmtree(tmp, ignore_errors=True)
        lines = [ln for ln in (r.stderr + r.stdout).splitlines() if ln.strip()]
        raise ReshardError(
            f"re-partitioning {folder} for another number of ranks failed (DeepSpeed's "
            f"ds_to_universal exited with {r.returncode}: {lines[-1] if lines else 'no output'}); "
            f"the checkpoint is unchanged: resume with the number of ranks that wrote it "
            f"({saved_ranks(folder)})"
        )
    fault_point("universal_converted", tag_step(folder.name) or 0)
    records = {rel: file_record(tmp / rel) for rel in checkpoint_files(tmp)}
    (tmp / STATE_FILE).write_text(
        json.dumps({"source": folder.name, "saved_ranks": saved_ranks(folder), "files": records})
    )
    fsync_tree(tmp)
    os.rename(tmp, out)
    fsync_dir(folder)
    return time.perf_counter() - t0


def load_location(folder: Path) -> tuple[str, str]:
    """(load_dir, tag) to hand DeepSpeed's load_checkpoint for the universal form of `folder`."""
    return str(Path(folder) / UNIVERSAL_DIR), Path(folder).name


@contextlib.contextmanager
def universal_loading(engine, on: bool = True) -> Iterator[None]:
    """Make `engine.load_checkpoint` read the universal format inside the block.

    DeepSpeed reads the switch (`checkpoint.load_universal` of its config) at each load, not
    at initialisation, and one run can need both kinds: after a 2 -> 1 resume, a rollback
    may go back to a checkpoint written by 2 ranks, or by 1. So it is set per load.
    """
    with load_universal(engine, on), warnings.catch_warnings():
        # DeepSpeed's universal load calls a torch collective that torch deprecates.
        warnings.filterwarnings("ignore", ".*all_gather_into_tensor", FutureWarning)
        yield
