"""Checkpoints as untrusted input (issue 39): our state files load without running code, an
RNG file that would run code is refused in one line, the old RNG format still resumes (one
warning), two identical runs write byte-identical checkpoints, and `checkpoint.init_from`
takes a weights folder as well as a run's checkpoint.

Two short runs (2 steps, one checkpoint) in the same run folder are shared by the tests.
"""

from __future__ import annotations

import hashlib
import io
import json
import pickle
import random
import shutil
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
from train_support import run_main, stdlib_data, tiny_config, write_config

from pretrain.cli.check_checkpoint import main as check_checkpoint
from pretrain.config import Config, from_dict
from pretrain.integrity import file_record
from pretrain.model.transformer import Transformer
from pretrain.run_layout import STATE_FILE
from pretrain.train.checkpoint import check_init_from
from pretrain.train.state_files import (
    RngStateError,
    pickle_files,
    read_rng_state,
    rng_state,
    set_rng_state,
)
from pretrain.weights import CONFIG_FILE, WEIGHTS_FILE, WeightsError, load_initial_weights

TAG = "step_0000002"
RNG = f"rng/rank_{0:05d}.pt"
# The one field of a checkpoint that records a wall time: the marker's `saved_at` (when the
# save committed). Every other byte of every file depends on the config alone.
WALL_TIME_FIELDS = {STATE_FILE: ("saved_at",)}


def _config(run: Path, data: Path, **train) -> dict:
    return tiny_config(
        run,
        data,
        train={"train_iters": 2, "eval_interval": 0, **train},
        checkpoint={"interval": 2},
        logging={"log_interval": 1, "max_logit_interval": 0, "tensorboard": False},
    )


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory) -> tuple[Path, Path, Path]:
    """(data, first run, second run): the same command twice in the same run folder (the
    resolved config holds its path), the first moved away before the second starts."""
    data = stdlib_data(tmp_path_factory)
    root = tmp_path_factory.mktemp("trust")
    run = root / "run"
    cfg = write_config(root / "run.yaml", _config(run, data))
    for _ in range(2):
        if run.exists():
            run.rename(root / "first")
        r = run_main(cfg)
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return data, root / "first", run


def _hashes(folder: Path) -> dict[str, str]:
    out = {}
    for p in sorted(folder.rglob("*")):
        if p.is_file():
            rel = p.relative_to(folder).as_posix()
            data = p.read_bytes()
            for field in WALL_TIME_FIELDS.get(p.name, ()):
                state = json.loads(data)
                state.pop(field)
                data = json.dumps(state).encode()
            out[rel] = hashlib.sha256(data).hexdigest()
    return out


def test_two_identical_runs_write_identical_checkpoints(two_runs):
    _, first, second = two_runs
    a, b = _hashes(first / "checkpoints"), _hashes(second / "checkpoints")
    assert a == b
    assert f"{TAG}/{RNG}" in a and f"{TAG}/{STATE_FILE}" in a and len(a) >= 8
    # Only the marker's saved_at differs; it is the only wall time recorded.
    raw = [(r / "checkpoints" / TAG / STATE_FILE).read_bytes() for r in (first, second)]
    sa, sb = (json.loads(x) for x in raw)
    assert {k for k in sa if sa[k] != sb[k]} <= {"saved_at"}
    # Our files load as data: the RNG file with weights_only=True, tensors and plain values.
    rng = torch.load(second / "checkpoints" / TAG / RNG, weights_only=True)
    assert rng["torch"].dtype == torch.uint8 and isinstance(rng["numpy"]["key"], list)
    assert isinstance(rng["python"]["state"], list)


def _tampered_copy(run: Path, dest: Path, rng: bytes) -> Path:
    """A copy of `run` whose checkpoint's RNG file is `rng`, the marker recording its size
    and CRC-32, as anyone who can write the folder can do: the integrity check passes; it
    says nothing of who wrote the files."""
    shutil.copytree(run, dest)
    folder = dest / "checkpoints" / TAG
    (folder / RNG).write_bytes(rng)
    state = json.loads((folder / STATE_FILE).read_text())
    state["files"][RNG] = file_record(folder / RNG)
    (folder / STATE_FILE).write_text(json.dumps(state, indent=1))
    return dest


def _saved(obj: object) -> bytes:
    """What torch.save writes for `obj`."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


class _Payload:
    """Unpickling it creates a file: proof that code ran."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


def _as_numpy1(blob: bytes) -> bytes:
    """A torch.save zip as NumPy 1 wrote it: its array-rebuilding function under the module
    name numpy.core.multiarray (protocol 2 names globals as text lines)."""
    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(blob)) as zin, zipfile.ZipFile(out, "w") as zout:
        for info in zin.infolist():
            data = zin.read(info)
            if info.filename.endswith("data.pkl"):
                assert b"numpy._core.multiarray\n" in data
                data = data.replace(b"numpy._core.multiarray\n", b"numpy.core.multiarray\n")
            zout.writestr(info.filename, data)
    return out.getvalue()


def _resume(data: Path, run: Path):
    """`run` resumed for one more step."""
    return run_main(write_config(run.parent / "resume.yaml", _config(run, data, train_iters=3)))


def test_an_rng_file_that_would_run_code_is_refused_in_one_line(two_runs, tmp_path):
    data, _, run = two_runs
    marker = tmp_path / "code_ran"
    # As torch.save writes it (a zip), and as a bare pickle: neither runs.
    for blob, why in (
        (_saved(_Payload(marker)), "it would call io.open"),
        (pickle.dumps({"torch": _Payload(marker)}), "Unsupported"),
    ):
        path = tmp_path / "rng.pt"
        path.write_bytes(blob)
        with pytest.raises(RngStateError) as e:
            read_rng_state(path)
        assert "\n" not in str(e.value) and str(path) in str(e.value) and why in str(e.value)
        assert not marker.exists()

    # A resume of a checkpoint whose RNG file (and marker) were replaced stops, exit code 2.
    r = _resume(data, _tampered_copy(run, tmp_path / "crafted", _saved(_Payload(marker))))
    assert r.returncode == 2, r.stdout[-2000:] + r.stderr[-2000:]
    assert not marker.exists()
    errors = [line for line in r.stderr.splitlines() if "error" in line]
    assert len(errors) == 1 and errors[0].startswith("checkpoint error: "), r.stderr
    assert f"{RNG} is not an RNG state file" in errors[0] and "io.open" in errors[0]
    assert "Traceback" not in r.stderr


def test_the_old_rng_format_resumes_with_one_warning(two_runs, tmp_path):
    data, _, run = two_runs
    new = read_rng_state(run / "checkpoints" / TAG / RNG)
    # What the writer before issue 39 saved: getstate()'s tuples and NumPy arrays, pickled.
    old = {
        "python": (new["python"]["version"], tuple(new["python"]["state"]), None),
        "numpy": ("MT19937", np.array(new["numpy"]["key"], np.uint32), new["numpy"]["pos"], 0, 0.0),
        "torch": new["torch"],
    }
    (tmp_path / "old.pt").write_bytes(_saved(old))
    with pytest.raises(pickle.UnpicklingError):
        torch.load(tmp_path / "old.pt", weights_only=True)  # it needs NumPy's globals
    # Written under NumPy 2 and under NumPy 1 (another module name for the same function).
    (tmp_path / "numpy1.pt").write_bytes(_as_numpy1(_saved(old)))
    for name in ("old.pt", "numpy1.pt"):
        again = read_rng_state(tmp_path / name, warn=False)
        assert torch.equal(again.pop("torch"), new["torch"]), name
        assert again == {k: v for k, v in new.items() if k != "torch"}, name  # exactly

    resumed = _tampered_copy(run, tmp_path / "old_run", _saved(old))
    r = _resume(data, resumed)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    out = r.stdout + r.stderr
    assert out.count("in the old RNG format") == 1 and "compatibility path" in out
    assert "resumed from" in out and TAG in out
    # The next checkpoint is written in the new format.
    step3 = resumed / "checkpoints" / "step_0000003"
    assert torch.load(step3 / RNG, weights_only=True)["format"] == 2


def test_rng_states_round_trip_as_data():
    state = rng_state()
    a = (random.random(), float(np.random.rand()), float(torch.rand(1)))
    set_rng_state(state)
    assert (random.random(), float(np.random.rand()), float(torch.rand(1))) == a


def test_init_from_a_weights_folder_equals_init_from_the_run(two_runs, tmp_path):
    data, _, run = two_runs
    # A weights folder: the safetensors file and the config, as a checkpoint holds them and
    # tools/import_hf.py writes them; nothing else (no marker, no pickles).
    weights = tmp_path / "weights"
    weights.mkdir()
    for name in (WEIGHTS_FILE, CONFIG_FILE):
        shutil.copy(run / "checkpoints" / TAG / name, weights / name)
    model_cfg = from_dict(Config, _config(tmp_path / "new", data)).model
    models = []
    for spec in (str(weights), f"{run}@2", str(run)):
        check_init_from(spec)
        torch.manual_seed(1)
        model = Transformer(model_cfg)
        load_initial_weights(model, spec)
        models.append(model.state_dict())
    for other in models[1:]:
        assert all(torch.equal(models[0][k], other[k]) for k in models[0])
    assert pickle_files(weights) == []

    # A Hugging Face folder and a folder of neither kind: one line saying what to give.
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    shutil.copy(weights / WEIGHTS_FILE, hf / WEIGHTS_FILE)
    with pytest.raises(WeightsError, match="tools/import_hf.py --hf") as e:
        check_init_from(str(hf))
    assert "\n" not in str(e.value)
    with pytest.raises(WeightsError, match="is neither a run's checkpoint") as e:
        check_init_from(str(tmp_path))
    assert "\n" not in str(e.value)


def test_check_checkpoint_names_the_pickles(two_runs, tmp_path, capsys):
    _, _, run = two_runs
    folder = run / "checkpoints" / TAG
    assert pickle_files(folder) == [
        "mp_rank_00_model_states.pt",
        "zero_pp_rank_0_mp_rank_00_optim_states.pt",
    ]
    assert check_checkpoint([str(run)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[:2] == [
        f"{TAG}  intact",
        "  pickles (DeepSpeed loads them with weights_only=False: loading one can run code): "
        "mp_rank_00_model_states.pt, zero_pp_rank_0_mp_rank_00_optim_states.pt",
    ]
    assert lines[-1].startswith("note: CRC-32 verifies integrity (the files are as written), not")
    # An RNG file a resume refuses fails the check (its CRC-32 matches: it was re-recorded).
    marker = tmp_path / "code_ran"
    crafted = _tampered_copy(run, tmp_path / "crafted", _saved(_Payload(marker)))
    assert check_checkpoint([str(crafted)]) == 1
    out = capsys.readouterr().out
    assert f"{TAG}  intact" in out and f"  {RNG}: REFUSED: " in out and not marker.exists()
