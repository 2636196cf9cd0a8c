"""Asynchronous checkpoints (checkpoint.async): the same files as a synchronous save, training
going on while they are written, and a kill or a failed write mid-way costing nothing.

Three launches of 2 ranks (gloo, ZeRO-1, fp32) for the whole module: an uninterrupted run
beside a synchronous twin of every save, whose writer is paused; one killed in the middle of
an asynchronous write; and its resume, whose last write fails as a full disk would.
"""

from __future__ import annotations

import io
import json
import os
import zipfile
from collections import OrderedDict
from pathlib import Path

import pytest
import torch
from train_support import metrics, run_main, stdlib_data, tiny_config, write_config

from pretrain.integrity import crc32_file
from pretrain.run_layout import STATE_FILE
from pretrain.train.async_save import HostBuffers, HostCopy
from pretrain.train.checkpoint import complete_tags, find_resume_tag

TESTS = Path(__file__).resolve().parent
PAUSE = 3.0  # seconds the writer of step 2 is held at async_write


def _saved_bytes(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


class _Scaler:  # an object a state dict holds and training changes (as DeepSpeed's loss scaler)
    def __init__(self) -> None:
        self.scale = 2.0**16


def _tricky_state(device: str) -> dict:
    flat = torch.arange(24, dtype=torch.float32, device=device)  # one buffer, many views
    param = torch.nn.Parameter(torch.randn(3, 4, device=device))
    moments = torch.randn(6, device=device, dtype=torch.bfloat16)
    names = ["wte.weight", "blocks.0.attn.weight"]
    state = {
        "module": OrderedDict(a=flat[:12].view(3, 4), b=flat[12:].view(4, 3).t(), c=param),
        "optimizer": {"exp_avg": moments, "same": moments, "step": torch.tensor(7)},
        "names": names,
        "again": names,  # one list twice: pickle writes a reference the second time
        "scaler": _Scaler(),
        "shape": torch.Size([3, 4]),
        "master": torch.zeros(5, device=device, requires_grad=True),
    }
    return state


def _host_copy_is_exact(device: str) -> None:
    state = _tricky_state(device)
    before = _saved_bytes(state)
    host = HostCopy(HostBuffers())
    copy = host(state)
    host.seal()
    # Training goes on: every tensor and the scaler change in place.
    with torch.no_grad():
        for t in (state["module"]["a"], state["module"]["c"], state["optimizer"]["exp_avg"]):
            t.add_(1)
        state["master"].add_(1)
    state["scaler"].scale = 1.0
    host.wait()
    assert all(t.device.type == "cpu" for t in copy["module"].values())
    assert copy["module"]["a"].untyped_storage().data_ptr() == (
        copy["module"]["b"].untyped_storage().data_ptr()
    )  # the views still share one storage
    assert _saved_bytes(copy) == before != _saved_bytes(state)


def test_host_copy_saves_the_same_bytes_as_the_state_it_copied():
    """torch.save of the host copy = torch.save of the state at the moment of the copy: views
    of one storage, a Parameter, requires_grad, bf16, a list held twice, an object training
    mutates (each a way for the bytes to differ), and the originals changed afterwards."""
    _host_copy_is_exact("cpu")


def test_a_gpu_storages_tag_is_pickled_as_torch_pickles_the_original():
    """torch's CUDA tagger builds "cuda:0" anew for every tensor it is asked about, so pickle
    writes the string once per tensor, never as a memo reference; the tag of a host copy
    must come out the same way (the first GPU run found one string per storage: a memo
    reference for a second view, and different bytes)."""
    from types import SimpleNamespace

    from pretrain.train import async_save

    on_gpu = SimpleNamespace(device=torch.device("cuda", 0))  # what torch's tagger reads
    tags = [torch.serialization.location_tag(on_gpu) for _ in range(2)]
    assert tags[0] == tags[1] == "cuda:0"
    views = 3
    expected = views if tags[0] is not tags[1] else 1
    host = torch.UntypedStorage(24 * 4)
    async_save._LOCATIONS[host._cdata] = torch.device("cuda", 0)
    try:
        flat = torch.empty(0).set_(host, 0, (24,), (1,))
        buf = io.BytesIO()
        torch.save({"a": flat[:12], "b": flat[12:], "c": flat}, buf)
    finally:
        async_save._LOCATIONS.pop(host._cdata)
    with zipfile.ZipFile(io.BytesIO(buf.getvalue())) as z:
        pickled = z.read(next(n for n in z.namelist() if n.endswith("data.pkl")))
    assert pickled.count(b"cuda:0") == expected


@pytest.mark.gpu
def test_host_copy_of_gpu_tensors_saves_the_same_bytes():
    """On a GPU: non-blocking copies into pinned memory, and torch.save tags the host copies
    "cuda:0" as it tags the originals."""
    _host_copy_is_exact("cuda")


def _config(root: Path, data: Path, name: str, **extra) -> dict:
    cfg = tiny_config(
        root / name,
        data,
        train={"train_iters": 6, "eval_interval": 0},
        checkpoint={"interval": 2, "keep_last": 3, **extra},
        logging={"max_logit_interval": 0, "log_interval": 1},
    )
    return cfg


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """(run folder, twin folder, step end times, stdout) of 6 steps on 2 ranks, saving
    asynchronously at 2, 4 and 6, each save preceded by a synchronous one of the same state
    into the twin folder (callback_probe.SyncTwin); the writer of step 2 pauses PAUSE s."""
    data = stdlib_data(tmp_path_factory)
    root = tmp_path_factory.mktemp("async_ckpt")
    cfg = _config(root, data, "run", **{"async": True})
    cfg["callbacks"] = [
        {
            "class": "callback_probe.SyncTwin",
            "twin_dir": str(root / "twin"),
            "times": str(root / "times.jsonl"),
        }
    ]
    r = run_main(
        write_config(root / "run.yaml", cfg),
        nproc=2,
        PYTHONPATH=os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]),
        PRETRAIN_TEST_PAUSE_AT=f"async_write:2:{PAUSE}",
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    times = dict(json.loads(line) for line in (root / "times.jsonl").read_text().splitlines())
    return root / "run", root / "twin", times, r.stdout


def test_async_files_are_byte_identical_to_a_synchronous_save(uninterrupted):
    """Every file of every checkpoint (2 ranks' ZeRO shards and RNG states, model states,
    weights, tokenizer) has the bytes of the synchronous save of the same step; the markers
    record the same files and are equal but for the time of writing."""
    run, twin, _, _ = uninterrupted
    assert (
        complete_tags(run / "checkpoints")
        == complete_tags(twin)
        == [
            "step_0000002",
            "step_0000004",
            "step_0000006",
        ]
    )
    for tag in complete_tags(twin):
        a, b = run / "checkpoints" / tag, twin / tag
        files = sorted(p.relative_to(a).as_posix() for p in a.rglob("*") if p.is_file())
        assert files == sorted(p.relative_to(b).as_posix() for p in b.rglob("*") if p.is_file())
        assert "zero_pp_rank_1_mp_rank_00_optim_states.pt" in files and "rng/rank_00001.pt" in files
        for rel in files:
            if rel != STATE_FILE:
                assert (a / rel).read_bytes() == (b / rel).read_bytes(), (tag, rel)
        ma, mb = (json.loads((f / STATE_FILE).read_text()) for f in (a, b))
        assert ma.pop("saved_at") >= mb.pop("saved_at")
        assert ma == mb and ma["step"] == int(tag[5:]) and ma["world_size"] == 2
        for rel, rec in ma["files"].items():  # the records are of the bytes on disk
            assert rec == {"size": (a / rel).stat().st_size, "crc32": crc32_file(a / rel)}


def test_steps_go_on_while_a_save_is_written(uninterrupted):
    """The writer of step 2 is held PAUSE s: steps 3 and 4 end meanwhile, step 2's marker is
    written after them, and the save of step 4 waits for it (at most one in flight)."""
    run, _, times, out = uninterrupted
    saved_2 = json.loads((run / "checkpoints" / "step_0000002" / STATE_FILE).read_text())
    assert times[2] < times[3] < times[4] < saved_2["saved_at"]
    assert saved_2["saved_at"] - times[2] >= PAUSE

    def line(text: str) -> int:
        return next(i for i, s in enumerate(out.splitlines()) if s.startswith(text))

    ckpts = run / "checkpoints"
    assert (
        line("step 3/6")
        < line("step 4/6")
        < line(f"saved checkpoint {ckpts / 'step_0000002'} (in the background")
        < line(f"writing checkpoint {ckpts / 'step_0000004'} in the background")
    )


def test_kill_during_an_async_write_then_a_failed_write(uninterrupted, tmp_path_factory):
    """kill -9 (both ranks) in the middle of writing step 4: step 2 is what is complete, and
    the same command resumes from it with the uninterrupted run's losses, step for step. Its
    last write (step 6) then fails as on a full disk: the run ends with the synchronous
    save's error, naming the intact checkpoint, which stays the one to resume from."""
    base, _, _, _ = uninterrupted
    data = stdlib_data(tmp_path_factory)
    root = tmp_path_factory.mktemp("async_kill")
    cfg = write_config(root / "run.yaml", _config(root, data, "run"))
    ckpts = root / "run" / "checkpoints"
    on = ["checkpoint.async=true"]
    killed = run_main(cfg, nproc=2, overrides=on, PRETRAIN_TEST_KILL_AT="async_write:4")
    assert killed.returncode != 0
    assert "writing checkpoint" in killed.stdout and max(metrics(root / "run")) >= 4
    assert (ckpts / "latest").read_text().strip() == "step_0000002"
    assert (ckpts / "step_0000004.tmp").is_dir() and not (ckpts / "step_0000004").exists()
    assert find_resume_tag(ckpts) == "step_0000002"

    r = run_main(cfg, nproc=2, overrides=on, PRETRAIN_TEST_FAIL_AT="async_write:6")
    assert r.returncode == 1, r.stdout[-3000:] + r.stderr[-3000:]
    assert "resumed from" in r.stdout and "(step 2," in r.stdout
    mb, mr = metrics(base), metrics(root / "run")
    assert sorted(mr) == list(range(1, 7))
    for step in range(1, 7):
        assert mr[step]["progress/batch_token_sum"] == mb[step]["progress/batch_token_sum"]
        assert mr[step]["train/loss"] == mb[step]["train/loss"], step
    # The failed write: one error line on each rank, as a synchronous save's.
    errors = [line for line in r.stderr.splitlines() if line.startswith("error: saving")]
    assert len(errors) == 2, r.stderr[-3000:]
    assert errors[0].startswith(
        "error: saving checkpoint step_0000006 failed (OSError: [Errno 28] No space left on device"
    )
    assert "the previous checkpoint step_0000004 is intact" in errors[0]
    assert complete_tags(ckpts) == ["step_0000002", "step_0000004"]
    assert (base / "checkpoints" / "step_0000004" / "model.safetensors").read_bytes() == (
        ckpts / "step_0000004" / "model.safetensors"
    ).read_bytes()
