"""megatron's index cache on several ranks (issue 13): two processes on gloo simulate two nodes.

A cache folder on a node-local disk is seen by rank 0's node only; megatron-core's own protocol
(rank 0 builds, the others load) then kills the other nodes with a FileNotFoundError and rank 0
with a closed connection. Here every node's first process builds its own copy, and what cannot
be fixed stops every rank with the same line.
"""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import os
from pathlib import Path

import pytest
from conftest import shared_path
from warm_start import free_port

from pretrain.config import DataConfig
from pretrain.data.prepare import prepare

SEQ = 64


@pytest.fixture(scope="module")
def edu(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("edu")
    prepare(
        out,
        "bytes",
        inputs=[str(shared_path("webtext", "fineweb_edu_10BT_150docs.jsonl"))],
        valid_fraction=0.1,
        workers=1,
        progress=False,
    )
    return out


def _digest(ds) -> str:
    h = hashlib.sha256()
    for i in range(0, len(ds), max(1, len(ds) // 50)):
        h.update(ds[i]["input_ids"].numpy().tobytes())
    return h.hexdigest()


def _rank_main(
    rank: int, port: int, data: str, caches: list[str], local_ranks: list[int], queue
) -> None:
    """One rank: for each scenario, build the datasets and report (digest or error line)."""
    import torch.distributed as dist

    from pretrain.data.dataset import build_datasets
    from pretrain.data.prefixes import DataError

    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2"
    )
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        for scenario, (cache, local_rank) in enumerate(zip(caches, local_ranks, strict=True)):
            os.environ["LOCAL_RANK"] = str(
                local_rank[rank] if isinstance(local_rank, list) else local_rank
            )
            cfg = DataConfig(
                train=[data],
                valid=[data],
                cache_dir=cache[rank] if isinstance(cache, list) else cache,
            )
            try:
                train, valid = build_datasets(cfg, SEQ, seed=5, train_samples=300, valid_samples=20)
                outcome = ("ok", _digest(train), _digest(valid), sorted(os.listdir(cfg.cache_dir)))
            except DataError as e:
                outcome = ("error", str(e))
            queue.put((scenario, rank, outcome))
            dist.barrier()
    finally:
        dist.destroy_process_group()


def _run_two_ranks(data: Path, caches: list, local_ranks: list) -> dict[int, dict[int, tuple]]:
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_rank_main, args=(r, port, str(data), caches, local_ranks, queue))
        for r in range(2)
    ]
    for p in procs:
        p.start()
    out: dict[int, dict[int, tuple]] = {}
    try:
        for _ in range(2 * len(caches)):
            scenario, rank, outcome = queue.get(timeout=90)  # a hang fails here, not forever
            out.setdefault(scenario, {})[rank] = outcome
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    assert [p.exitcode for p in procs] == [0, 0]
    return out


def test_node_local_cache_folders_on_two_nodes(edu, tmp_path):
    """Scenarios in one process group (start-up paid once):
    0. two nodes (LOCAL_RANK 0 on both), each with its own cache folder: each node builds one;
    1. a shared folder: built once by rank 0, read by rank 1;
    2. two ranks that claim one node (LOCAL_RANK 0, 1) but see different folders: one line;
    3. rank 0 cannot write its cache folder: the same line on both ranks, no hang."""
    node = [str(tmp_path / "node0"), str(tmp_path / "node1")]
    shared = str(tmp_path / "shared")
    odd = [str(tmp_path / "odd0"), str(tmp_path / "odd1")]
    (tmp_path / "file").write_text("not a folder")
    unwritable = [str(tmp_path / "file" / "cache"), str(tmp_path / "fine")]
    out = _run_two_ranks(edu, [node, shared, odd, unwritable], [0, 0, [0, 1], 0])

    two_nodes = out[0]
    assert two_nodes[0][0] == "ok" and two_nodes[1][0] == "ok"
    assert two_nodes[0][1:3] == two_nodes[1][1:3]  # the same samples on both nodes
    files = two_nodes[0][3]
    assert files == two_nodes[1][3] and any(f.endswith("shuffle_index.npy") for f in files)
    assert len(files) == 8  # train and valid: description + document, sample, shuffle index each

    shared_run = out[1]
    assert shared_run[0][:3] == shared_run[1][:3] == two_nodes[0][:3]
    assert shared_run[0][3] == files

    odd_run = out[2]
    assert odd_run[0][0] == odd_run[1][0] == "error" and odd_run[0][1] == odd_run[1][1]
    line = odd_run[0][1]
    assert (
        line.startswith("data.cache_dir: rank 1 on ")
        and "set data.cache_dir to a folder that all nodes share" in line
    )
    assert "\n" not in line
    assert not Path(odd[1]).exists()  # rank 1 is not its node's first process: it built nothing

    bad = out[3]
    assert bad[0][0] == bad[1][0] == "error" and bad[0][1] == bad[1][1]
    assert bad[0][1].startswith("rank 0: data.cache_dir: cannot write megatron's index cache to ")
