"""megatron-core's index cache (the shuffled sample order it saves beside the data), built on
every rank without megatron's own rank protocol.

megatron-core's builder lets rank 0 build the cache while the others wait at a barrier and then
load it, which kills every other node with a FileNotFoundError where the cache folder is on a
node-local disk. Here megatron always sees one process (`single_process_rank`), and
`build_on_ranks` coordinates the ranks itself: rank 0 builds; a node that cannot see rank 0's
files builds its own copy (its LOCAL_RANK 0); a rank that still cannot stops every rank with the
same one line naming data.cache_dir. The cache lives in data.cache_dir, else in cache/ beside
the first train prefix (`index_cache_dir`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from pretrain.config import DataConfig
from pretrain.data.prefixes import DataError

log = logging.getLogger(__name__)


def index_cache_dir(data: DataConfig, first_prefix: str) -> Path:
    return Path(data.cache_dir) if data.cache_dir else Path(first_prefix).parent / "cache"


def _check_cache_writable(path: Path) -> None:
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".write_test_{os.getpid()}"
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        raise DataError(
            f"data.cache_dir: cannot write megatron's index cache to {path} ({e}); "
            f"set data.cache_dir to a writable folder"
        ) from None


@contextlib.contextmanager
def single_process_rank() -> Iterator[None]:
    """While megatron-core builds, it sees one process: rank 0, no process group.

    Every rank that calls the builder then builds the index files it misses and loads those
    it finds; megatron's own protocol (rank 0 builds, a barrier, the others load and die of a
    FileNotFoundError on a node that cannot see rank 0's folder) never runs.
    `build_on_ranks` coordinates the ranks instead. Without a process group this also lets
    megatron-core 0.16.1's BlendedDataset, which calls get_rank() unchecked, blend at all.
    """
    dist = torch.distributed
    original = dist.is_initialized, dist.get_rank
    dist.is_initialized = lambda: False
    dist.get_rank = lambda group=None: 0
    try:
        yield
    finally:
        dist.is_initialized, dist.get_rank = original


def _process_group() -> tuple[int, int] | None:
    """(rank, world size) of an initialised process group of more than one process, else None."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return dist.get_rank(), dist.get_world_size()
    return None


def _cache_files(datasets, cache: Path) -> list[str]:
    """Names of the index files in `cache` that the built datasets read (megatron names them
    HASH-CLASS-SPLIT-*.npy / description.txt by each dataset's unique_description_hash)."""
    hashes, todo = set(), [d for d in datasets if d is not None]
    while todo:
        ds = todo.pop()
        hashes.add(ds.unique_description_hash)
        todo.extend(getattr(ds, "datasets", None) or [])  # a blend's parts
    return sorted(n for n in os.listdir(cache) if n.split("-", 1)[0] in hashes)


def _missing(cache: Path, names: list[str]) -> list[str]:
    try:
        present = set(os.listdir(cache))
    except OSError:
        present = set()
    return [n for n in names if n not in present]


def _on_every_rank(fn: Callable[[], Any], rank: int, world: int) -> Any:
    """fn() on this rank; when it fails on any rank, every rank raises the same one-line
    DataError (the failing rank keeps its own exception), so that no rank waits forever in a
    collective for a rank that died, nor dies of the closed connection it leaves."""
    try:
        out, error = fn(), None
    except DataError as e:
        out, error, own = None, str(e), e
    except Exception as e:  # anything else: this rank re-raises it with its traceback
        out, error, own = None, f"{type(e).__name__}: {e}", e
    errors: list[str | None] = [None] * world
    torch.distributed.all_gather_object(errors, error)
    failed = [(r, e) for r, e in enumerate(errors) if e is not None]
    if not failed:
        return out
    if error is not None and not isinstance(own, DataError):
        raise own
    first_rank, first = failed[0]
    if all(e == first for _, e in failed) and len(failed) == world:
        raise DataError(first)
    raise DataError(f"rank {first_rank}: {first}")


def build_on_ranks(build: Callable[[], Any], cache: Path) -> Any:
    """Build the datasets and megatron's index cache on every rank, the cache only once where
    the ranks share the folder.

    One process: build (writing the cache). Several: rank 0 builds while the others wait; rank
    0 names the cache files; each rank checks that it sees them. Where a rank does not (the
    folder is on a node-local disk), the first process of each node (LOCAL_RANK 0) that lacks
    them builds its node's copy; if a rank still lacks them, every rank stops with one line
    naming data.cache_dir. Then every rank loads. Each step ends in a collective, so an error
    on one rank stops all of them with the same line.
    """
    group = _process_group()
    if group is None:
        _check_cache_writable(cache)
        return build()
    rank, world = group
    local_rank = int(os.environ.get("LOCAL_RANK", rank))

    def build_first():
        _check_cache_writable(cache)
        return build()

    built = _on_every_rank(build_first if rank == 0 else lambda: None, rank, world)
    names = [_cache_files(built, cache) if rank == 0 else None]
    torch.distributed.broadcast_object_list(names, src=0)
    names = names[0]
    missing = _missing(cache, names)
    if missing:  # a file system that shows new files late: look once more
        time.sleep(1.0)
        missing = _missing(cache, names)
    views: list[tuple[str, int, str] | None] = [None] * world
    torch.distributed.all_gather_object(views, (socket.gethostname(), len(missing), str(cache)))
    if any(n for _, n, _ in views):
        lacking = sorted({host for host, n, _ in views if n})
        if rank == 0:
            log.warning(
                "data.cache_dir: %s is not shared by every node (%s cannot see the %d index "
                "files rank 0 wrote); the first process of each such node builds its own "
                "copy. Set data.cache_dir to a folder all nodes share to build it once",
                cache,
                ", ".join(lacking),
                len(names),
            )
        own_copy = local_rank == 0 and bool(missing)

        def build_copy():
            if own_copy:
                _check_cache_writable(cache)
                return build()
            return None

        copy = _on_every_rank(build_copy, rank, world)
        built = built if rank == 0 else copy
        torch.distributed.barrier()
        missing = _missing(cache, names)
        views = [None] * world
        torch.distributed.all_gather_object(views, (socket.gethostname(), len(missing), str(cache)))
        still = [(r, host, folder) for r, (host, n, folder) in enumerate(views) if n]
        if still:
            r, host, folder = still[0]
            raise DataError(
                f"data.cache_dir: rank {r} on {host} cannot see megatron's index cache in {folder}, "
                f"not even after the first process of its node (LOCAL_RANK=0) built a copy; set "
                f"data.cache_dir to a folder that all nodes share, or to a node-local folder that "
                f"all ranks of a node share (and launch with LOCAL_RANK set)"
            )
    # Every rank now sees every file: the others load (rank 0 and the node copies are built).
    return _on_every_rank(lambda: built if built is not None else build(), rank, world)
