"""A damaged checkpoint never stops a run: resume verifies the newest one against the sizes
and CRC-32s its marker recorded and falls back to the previous one; a save killed at any point
or failing for a full disk leaves the previous checkpoint loadable and the run resumable."""

from __future__ import annotations

import json
import resource
import shutil
import subprocess
import sys

import pytest
from train_support import REPO, baseline_run, metrics, run_main, tiny_config, write_config

from pretrain.faults import SAVE_POINTS
from pretrain.integrity import crc32_file, is_unverified
from pretrain.run_layout import STATE_FILE
from pretrain.train.checkpoint import (
    complete_tags,
    find_resume_tag,
    verify_checkpoint,
)


def _copy_run(base, dest):
    shutil.copytree(base, dest)
    cfg = json.loads((dest / "checkpoints" / "step_0000008" / STATE_FILE).read_text())["config"]
    cfg["logging"]["run_dir"] = str(dest)
    return write_config(dest.parent / "run.yaml", cfg)


def _largest_file(folder):
    return max(
        (p for p in folder.rglob("*") if p.is_file() and p.name != STATE_FILE),
        key=lambda p: p.stat().st_size,
    )


def _truncate(folder):
    path = _largest_file(folder)  # the optimizer states
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    return path.relative_to(folder).as_posix()


def _flip_byte(folder):
    path = folder / "model.safetensors"
    data = bytearray(path.read_bytes())
    data[-7] ^= 0xFF  # inside the last tensor: same size, different bytes
    path.write_bytes(bytes(data))
    return "model.safetensors"


def _cut_marker(folder):
    path = folder / STATE_FILE
    path.write_text(path.read_text()[:100])
    return STATE_FILE


def test_marker_records_every_file(tmp_path_factory):
    _, base = baseline_run(tmp_path_factory)
    folder = base / "checkpoints" / "step_0000008"
    files = json.loads((folder / STATE_FILE).read_text())["files"]
    on_disk = sorted(
        p.relative_to(folder).as_posix()
        for p in folder.rglob("*")
        if p.is_file() and p.name != STATE_FILE
    )
    assert sorted(files) == on_disk and "model.safetensors" in files
    for rel, rec in files.items():  # the recorded CRC-32 is zlib's of the bytes on disk
        assert rec == {"size": (folder / rel).stat().st_size, "crc32": crc32_file(folder / rel)}
    assert verify_checkpoint(folder) == []


@pytest.mark.parametrize(
    "damage", [_truncate, _flip_byte, _cut_marker], ids=["truncated", "corrupted", "marker_cut"]
)
def test_damage_is_found_and_the_previous_checkpoint_chosen(
    tmp_path_factory, tmp_path, damage, capsys
):
    """Each kind of damage to step 8 is named, and a resume would take step 6."""
    _, base = baseline_run(tmp_path_factory)
    ckpts = tmp_path / "run" / "checkpoints"
    _copy_run(base, tmp_path / "run")
    what = damage(ckpts / "step_0000008")
    problems = verify_checkpoint(ckpts / "step_0000008")
    assert problems and what in problems[0]
    assert verify_checkpoint(ckpts / "step_0000006") == []
    assert find_resume_tag(ckpts) == "step_0000006"
    (warning,) = capsys.readouterr().out.splitlines()[:1]
    assert "step_0000008 is damaged" in warning and what in warning


def test_damaged_newest_checkpoint_falls_back_and_matches(tmp_path_factory, tmp_path):
    """Truncate a file of step 8 of a finished run; the same command warns, resumes from step 6
    and trains steps 7 and 8 to the uninterrupted run's losses."""
    _, base = baseline_run(tmp_path_factory)
    run = tmp_path / "run"
    cfg = _copy_run(base, run)
    what = _truncate(run / "checkpoints" / "step_0000008")
    r = run_main(cfg)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    warning = [line for line in r.stdout.splitlines() if line.startswith("warning: checkpoint")]
    assert len(warning) == 1 and "step_0000008 is damaged" in warning[0] and what in warning[0]
    assert "(step 6," in r.stdout
    mb, mr = metrics(base), metrics(run)
    for step in (7, 8):
        assert mr[step]["train/loss"] == mb[step]["train/loss"], step
    # The offline check agrees, after the resume wrote a new step 8.
    out = subprocess.run(
        [sys.executable, str(REPO / "tools" / "check_checkpoint.py"), str(run)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0 and "a resume takes: step_0000008" in out.stdout, out.stdout


def test_no_intact_checkpoint_is_one_clear_line(tmp_path_factory, tmp_path):
    _, base = baseline_run(tmp_path_factory)
    run = tmp_path / "run"
    cfg = _copy_run(base, run)
    for tag in complete_tags(run / "checkpoints"):
        _truncate(run / "checkpoints" / tag)
    out = subprocess.run(
        [sys.executable, str(REPO / "tools" / "check_checkpoint.py"), str(run)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 1 and out.stdout.count("DAMAGED") == 2
    assert "a resume takes: none" in out.stdout
    r = run_main(cfg)
    assert r.returncode == 2
    err = r.stderr.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("checkpoint error: no intact checkpoint in"), (
        r.stderr
    )
    assert "checkpoint.resume=false" in err[0]


def test_evaluation_refuses_damaged_weights_with_one_line(tmp_path_factory, tmp_path):
    _, base = baseline_run(tmp_path_factory)
    run = tmp_path / "run"
    _copy_run(base, run)
    _flip_byte(run / "checkpoints" / "step_0000008")
    out = subprocess.run(
        [
            sys.executable,
            str(REPO / "tools" / "evaluate.py"),
            "--run",
            str(run),
            "--tasks",
            "none",
            "--val",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode != 0
    err = out.stderr.strip().splitlines()
    assert len(err) == 1 and "model.safetensors does not match its checksum" in err[0], out.stderr


def _drop_file_list(folder):
    """The marker as code from before markers recorded files wrote it: no "files" key."""
    path = folder / STATE_FILE
    state = json.loads(path.read_text())
    del state["files"]
    path.write_text(json.dumps(state))


UNVERIFIED_WORDS = "its files cannot be verified (written before markers recorded files)"


def test_marker_without_file_list_is_unverified_and_still_resumed(
    tmp_path_factory, tmp_path, capsys
):
    """Step 8's marker lost its file list: not intact, not damaged, but unverified. A resume
    takes it (the newest not damaged) with one warning naming it; the offline check says
    "unverified" and exits 0, as nothing is known to be wrong with it."""
    _, base = baseline_run(tmp_path_factory)
    run = tmp_path / "run"
    cfg = _copy_run(base, run)
    ckpts = run / "checkpoints"
    _drop_file_list(ckpts / "step_0000008")
    assert is_unverified(ckpts / "step_0000008") and not is_unverified(ckpts / "step_0000006")
    assert verify_checkpoint(ckpts / "step_0000008") == []  # nothing found wrong...
    assert find_resume_tag(ckpts) == "step_0000008"  # ...so it is used, with one warning
    out = capsys.readouterr().out.splitlines()
    assert out == [f"warning: using checkpoint {ckpts / 'step_0000008'}; {UNVERIFIED_WORDS}"]
    assert find_resume_tag(ckpts, "none") == "step_0000008"  # verify: none asks for no warning
    assert capsys.readouterr().out == ""

    check = subprocess.run(
        [sys.executable, str(REPO / "tools" / "check_checkpoint.py"), str(run)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert check.returncode == 0, check.stdout + check.stderr
    # Beside the integrity lines: each checkpoint's pickles, and that integrity is not trust
    # (tests/test_checkpoint_trust.py).
    lines = check.stdout.splitlines()
    trust = [line for line in lines if line.startswith(("  pickles", "note: "))]
    assert [line for line in lines if line not in trust] == [
        "step_0000006  intact",
        f"step_0000008  unverified: {UNVERIFIED_WORDS}",
        "a resume takes: step_0000008 (unverified)",
    ]
    assert len(trust) == 3 and trust[-1].startswith("note: CRC-32 verifies integrity")

    r = run_main(cfg)  # the trainer's own resume: the same one line, then step 8's state
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    warned = [line for line in r.stdout.splitlines() if "cannot be verified" in line]
    assert len(warned) == 1 and "step_0000008" in warned[0], r.stdout[-3000:]
    assert "(step 8," in r.stdout


def test_unverified_checkpoint_behind_a_damaged_one(tmp_path_factory, tmp_path, capsys):
    """Step 8 damaged, step 6 unverified: the fallback takes step 6 and says both; an
    unverified checkpoint never hides damage in a newer one."""
    _, base = baseline_run(tmp_path_factory)
    ckpts = tmp_path / "run" / "checkpoints"
    _copy_run(base, tmp_path / "run")
    what = _truncate(ckpts / "step_0000008")
    _drop_file_list(ckpts / "step_0000006")
    assert find_resume_tag(ckpts) == "step_0000006"
    damaged, using = capsys.readouterr().out.splitlines()
    assert "step_0000008 is damaged" in damaged and what in damaged
    assert using == (
        f"warning: using checkpoint {ckpts / 'step_0000006'}, the newest not damaged; "
        f"{UNVERIFIED_WORDS}"
    )
    check = subprocess.run(
        [sys.executable, str(REPO / "tools" / "check_checkpoint.py"), str(ckpts)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert check.returncode == 1, check.stdout + check.stderr  # the damage decides the code
    assert "step_0000006  unverified" in check.stdout and "step_0000008  DAMAGED" in check.stdout
    assert "a resume takes: step_0000006 (unverified)" in check.stdout


def test_evaluation_and_export_warn_on_unverified_weights(tmp_path_factory, tmp_path, caplog):
    """load_weights, which evaluation and export read checkpoints through, loads an
    unverified checkpoint's weights with one warning naming it, and a verified one silently."""
    import logging

    from pretrain.weights import load_weights

    _, base = baseline_run(tmp_path_factory)
    ckpts = tmp_path / "run" / "checkpoints"
    _copy_run(base, tmp_path / "run")
    _drop_file_list(ckpts / "step_0000008")
    with caplog.at_level(logging.WARNING):
        load_weights(ckpts / "step_0000006")
        assert caplog.records == []
        load_weights(ckpts / "step_0000008")
    (record,) = caplog.records
    assert record.getMessage() == (f"using checkpoint {ckpts / 'step_0000008'}; {UNVERIFIED_WORDS}")


def _short_config(tmp_path, data, name):
    cfg = tiny_config(
        tmp_path / name,
        data,
        train={"train_iters": 4, "eval_interval": 0},
        checkpoint={"interval": 2, "keep_last": 2},
        logging={"max_logit_interval": 0},
    )
    return write_config(tmp_path / f"{name}.yaml", cfg)


@pytest.fixture(scope="module")
def short_baseline(tmp_path_factory):
    data, _ = baseline_run(tmp_path_factory)
    root = tmp_path_factory.mktemp("short_baseline")
    r = run_main(_short_config(root, data, "base"))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return data, root / "base"


# With half the marker on disk (the folder not yet complete), and after the rename but before
# `latest` moves: the two phases of a save (every point is in FAULT_POINTS; each costs two runs).
KILL_POINTS = ("mid_marker", "before_latest")


@pytest.mark.parametrize("point", KILL_POINTS)
def test_kill_during_a_save_leaves_a_resumable_run(short_baseline, tmp_path, point):
    """The process dies (as under kill -9) at `point` of saving step 4; the same command then
    finishes with the uninterrupted run's losses."""
    assert point in SAVE_POINTS
    data, base = short_baseline
    cfg = _short_config(tmp_path, data, point)
    r = run_main(cfg, PRETRAIN_TEST_KILL_AT=f"{point}:4")
    assert r.returncode == 137, (point, r.stdout[-2000:] + r.stderr[-2000:])
    r = run_main(cfg)
    assert r.returncode == 0, (point, r.stdout[-3000:] + r.stderr[-3000:])
    assert "(step 2," in r.stdout, point  # `latest` still names step 2 in every case
    mb, mr = metrics(base), metrics(tmp_path / point)
    assert [mr[s]["train/loss"] for s in (1, 2, 3, 4)] == [
        mb[s]["train/loss"] for s in (1, 2, 3, 4)
    ]
    assert complete_tags(tmp_path / point / "checkpoints") == ["step_0000002", "step_0000004"]


def test_disk_full_during_a_save_keeps_the_previous_checkpoint(short_baseline, tmp_path):
    """A file size limit (RLIMIT_FSIZE, as a full disk would) makes the save of step 4 fail:
    one line that names the intact checkpoint, and the run resumes from it afterwards."""
    data, base = short_baseline
    cfg = _short_config(tmp_path, data, "run")
    r = run_main(cfg, PRETRAIN_TEST_KILL_AT="after_engine_save:4")
    assert r.returncode == 137
    limit = _largest_file(tmp_path / "run" / "checkpoints" / "step_0000002").stat().st_size // 2

    def small_disk():
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    from train_support import child_env, launch_cmd

    r = subprocess.run(
        launch_cmd(cfg),
        cwd=REPO,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=240,
        preexec_fn=small_disk,
    )
    assert r.returncode == 1, r.stdout[-2000:] + r.stderr[-2000:]
    err = r.stderr.strip().splitlines()
    assert err[-1].startswith("error: saving checkpoint step_0000004 failed (")
    assert "step_0000002 is intact" in err[-1], r.stderr
    assert complete_tags(tmp_path / "run" / "checkpoints") == ["step_0000002"]
    r = run_main(cfg)
    assert r.returncode == 0 and "(step 2," in r.stdout, r.stdout[-2000:] + r.stderr[-2000:]
    mb, mr = metrics(base), metrics(tmp_path / "run")
    assert [mr[s]["train/loss"] for s in (3, 4)] == [mb[s]["train/loss"] for s in (3, 4)]
