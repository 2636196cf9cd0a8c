"""A study's runtime half on this machine (pretrain/study/status.py, selection.py,
local_executor.py, report.py, pretrain/cli/study.py):

- every state `status` names, from the run folder, the Slurm job and the local process;
- what a run folder says: progress, the last losses, a hang that is over or not, a spike
  guard that gave up, a loss that is not finite on a step that was or was not skipped;
- `--only` and the CLI's one-line errors;
- the local executor end to end on a tiny study: killed (kill -9) half-way, its run saves
  and stops by itself, a second executor is refused while the first runs, the next call
  resumes the run from its checkpoint and trains the other, a later one evaluates;
- the report's numbers are compare_runs' on the same runs (and a partial report says so).
"""

from __future__ import annotations

import contextlib
import csv
import fcntl
import io
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from tables_support import unpadded
from train_support import child_env, stdlib_data, tiny_config

REPO = Path(__file__).resolve().parents[1]

from pretrain.cli.compare_runs import main as compare_main  # noqa: E402
from pretrain.cli.study import main as study_main  # noqa: E402
from pretrain.slurm_jobs import SlurmJob  # noqa: E402
from pretrain.study.records import (  # noqa: E402
    RUN_LOCK_FD_VAR,
    LocalRecord,
    run_lock_held,
    take_run_lock,
    write_local_record,
)
from pretrain.study.report import write_study_report  # noqa: E402
from pretrain.study.runs import Study, StudyRun  # noqa: E402
from pretrain.study.selection import select_runs  # noqa: E402
from pretrain.study.spec import load_study  # noqa: E402
from pretrain.study.status import (  # noqa: E402
    RunProgress,
    State,
    decide_state,
    read_progress,
    study_status,
)

# ----------------------------------------------------------------------------- the states


def progress(**kw) -> RunProgress:
    return RunProgress(**{"step": 0, "total": 10, **kw})


def job(state: str, restarts: int = 0, reason: str = "None") -> SlurmJob:
    return SlurmJob("7", "x", state, reason, restarts, "1:0" if state == "FAILED" else "0:0")


@pytest.mark.parametrize(
    "prog, slurm, local_running, local, want",
    [
        (progress(), None, False, None, State.NOT_STARTED),
        (progress(), job("PENDING", reason="Dependency"), False, None, State.QUEUED),
        (progress(step=3), job("RUNNING"), False, None, State.RUNNING),
        (progress(step=3), job("PENDING", restarts=1), False, None, State.REQUEUED),
        (progress(step=3), job("REQUEUE_HOLD", restarts=1), False, None, State.REQUEUED),
        (progress(step=10, checkpoint_step=10), job("COMPLETED"), False, None, State.COMPLETED),
        (progress(step=3), job("CANCELLED"), False, None, State.CANCELLED),
        (progress(step=3), job("FAILED"), False, None, State.FAILED),
        (progress(step=3), job("TIMEOUT"), False, None, State.FAILED),
        (progress(step=3, hung=True), job("FAILED"), False, None, State.HUNG),
        # a job that ended 0 without the last checkpoint did not finish its run
        (progress(step=3), job("COMPLETED"), False, None, State.FAILED),
        (progress(step=3, non_finite=True), job("RUNNING"), False, None, State.DIVERGED),
        (progress(step=10, checkpoint_step=10, gave_up=True), None, False, None, State.DIVERGED),
        (progress(step=3), None, True, None, State.RUNNING),
        (progress(step=3), None, False, LocalRecord(1, "t", "t", 99), State.STOPPED),
        (progress(step=3), None, False, LocalRecord(1, "t", "t", -9), State.STOPPED),
        (progress(step=3), None, False, LocalRecord(1, "t", "t", 1), State.FAILED),
        (progress(step=3), None, False, LocalRecord(1, "t", "t", 124), State.HUNG),
        (progress(step=3), None, False, LocalRecord(1, "t"), State.STOPPED),  # executor died
        (
            progress(step=10, checkpoint_step=10),
            None,
            False,
            LocalRecord(1, "t", "t", 0),
            State.COMPLETED,
        ),
        (progress(step=3, hung=True), None, False, None, State.HUNG),
    ],
)
def test_each_state_from_folder_job_and_process(prog, slurm, local_running, local, want):
    assert decide_state(prog, slurm, local_running, local)[0] == want


def _run(name: str, run_dir: Path, config: dict | None = None, **labels: str) -> StudyRun:
    config = config or {"train": {"train_iters": 10}, "logging": {"run_dir": str(run_dir)}}
    return StudyRun(
        name=name,
        labels=labels,
        seed=config.get("train", {}).get("seed"),
        group=",".join(f"{k}={v}" for k, v in labels.items()),
        config=config,
        config_path=str(run_dir) + ".yaml",
        script_path=None,
        run_dir=str(run_dir),
        job_name=name,
    )


def _metrics(run_dir: Path, rows: list[dict]) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def _checkpoint(run_dir: Path, step: int) -> None:
    (run_dir / "checkpoints").mkdir(parents=True, exist_ok=True)
    (run_dir / "checkpoints" / "latest").write_text(f"step_{step:07d}")


def test_run_folder_progress_and_trouble(tmp_path):
    run_dir = tmp_path / "r"
    rows = [{"step": s, "train/loss": 3.0 - 0.1 * s} for s in range(1, 5)]
    rows[-1].update(
        {"valid/loss": 2.9, "perf/tokens_per_s": 5e3, "perf/mfu": 0.4, "perf/step_time_s": 2.0}
    )
    _metrics(run_dir, rows)
    _checkpoint(run_dir, 3)
    p = read_progress(_run("r", run_dir), Path("/"))
    assert (p.step, p.total, p.checkpoint_step, p.valid_loss, p.tokens_per_s) == (
        4,
        10,
        3,
        2.9,
        5e3,
    )
    assert p.train_loss == pytest.approx(2.6) and p.started and not p.done and not p.diverged

    # A hang report older than the metrics is a hang the run got over (requeued, resumed).
    (run_dir / "hang").mkdir()
    (run_dir / "hang" / "rank_1.txt").write_text("stacks")
    old = time.time() - 100
    os.utime(run_dir / "hang" / "rank_1.txt", (old, old))
    assert not read_progress(_run("r", run_dir), Path("/")).hung
    os.utime(run_dir / "hang" / "rank_1.txt")  # newer than the metrics: it is where it stopped
    assert read_progress(_run("r", run_dir), Path("/")).hung

    # NaN on a step the guard skipped harms nothing; on a step that updated, the run diverged.
    _metrics(run_dir, rows + [{"step": 5, "train/loss": float("nan"), "spikes/skipped": 1.0}])
    assert not read_progress(_run("r", run_dir), Path("/")).non_finite
    _metrics(run_dir, rows + [{"step": 5, "train/loss": float("nan")}])
    assert read_progress(_run("r", run_dir), Path("/")).non_finite

    # The spike guard gave up: every rollback spikes.max_rollbacks allows was used.
    _metrics(run_dir, rows)
    (run_dir / "rollbacks.json").write_text(json.dumps([{}, {}]))
    spikes = {"spikes": {"rollback_after": 3, "max_rollbacks": 2}}
    cfg = {"train": {"train_iters": 10}, **spikes}
    assert read_progress(_run("r", run_dir, cfg), Path("/")).gave_up
    cfg["spikes"]["max_rollbacks"] = 3
    assert not read_progress(_run("r", run_dir, cfg), Path("/")).gave_up


# ----------------------------------------------------------------------------- a study file


def study_file(root: Path, data: Path, name: str = "tiny", **train) -> Path:
    """A study of two runs (RoPE on 0% and 25% of the dims, seed 1) of the tests' tiny model,
    in a folder that stands for a repository (its runs go to ROOT/runs/NAME/)."""
    cfg = tiny_config(Path("runs/NAME"), data)
    cfg["train"].update(train)
    cfg["logging"].update(log_interval=1, max_logit_interval=0, tensorboard=False)
    study = {
        "description": "the tests' tiny study",
        "config": cfg,
        "axes": {"rope": {"key": "model.rope_fraction", "values": {0: 0.0, 25: 0.25}}},
        "run_name": "rope{rope}",
        "seeds": [1],
        "baseline": {"rope": 0},
    }
    path = root / "studies" / f"{name}.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(study, sort_keys=False))
    return path


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    return stdlib_data(tmp_path_factory)


def test_only_picks_runs_by_label(tmp_path, data):
    study = load_study(study_file(tmp_path, data))
    assert [r.name for r in select_runs(study, ["rope=25"])] == ["rope25_s1"]
    assert [r.name for r in select_runs(study, ["rope=0,25", "seed=1"])] == [
        "rope0_s1",
        "rope25_s1",
    ]
    assert [r.name for r in select_runs(study, ["run=rope0_s1"])] == ["rope0_s1"]
    for bad, says in (
        ("theta=1", "no axis 'theta'"),
        ("rope=50", "rope is one of 0, 25"),
        ("rope", "give AXIS=LABEL"),
    ):
        with pytest.raises(ValueError, match=says):
            select_runs(study, [bad])


def test_cli_errors_are_one_line(tmp_path, data, capsys):
    path = str(study_file(tmp_path, data))
    for argv, says in (
        (["submit", path, "--executor", "local", "--parallel", "0"], "--parallel 0"),
        (["submit", path, "--executor", "local", "--max-running", "2"], "for Slurm"),
        (["submit", path, "--only", "nope=1"], "no axis 'nope'"),
        (["report", path, "--baseline", "rope"], "give AXIS=LABEL"),
        (["status", path, "--watch", "0"], "--watch 0"),
    ):
        assert study_main(argv) == 2, argv
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and says in err, (argv, err)


def test_submit_refuses_files_not_written_or_stale(tmp_path, data, capsys):
    path = study_file(tmp_path, data)
    local = ["submit", str(path), "--executor", "local"]
    assert study_main(local) == 2
    assert "2 file(s) of the study are not written" in capsys.readouterr().err
    assert study_main(["write", str(path)]) == 0
    # The study changed since `write`: its runs would train the old configs.
    path.write_text(path.read_text().replace("lr: 0.003", "lr: 0.001"))
    assert study_main(local) == 2
    err = capsys.readouterr().err
    assert "differ from what the study writes (studies/tiny/configs/rope0_s1.yaml" in err, err
    assert "run: python tools/study.py write studies/tiny.yaml" in err


def test_status_exit_code_says_a_run_failed(tmp_path, data, capsys):
    path = study_file(tmp_path, data)
    study = load_study(path)
    assert study_main(["status", str(path), "--no-slurm"]) == 0
    assert "2 runs: 2 not started" in capsys.readouterr().out
    run = study.runs[0]
    _metrics(tmp_path / run.run_dir, [{"step": 1, "train/loss": 5.0}])
    write_local_record(study.out_dir, run.name, LocalRecord(1, "t", "t", 1))
    assert study_main(["status", str(path), "--no-slurm"]) == 1
    out = capsys.readouterr().out
    assert "failed: exit code 1" in out and "1 not started, 1 failed" in out


# ----------------------------------------------------------------------------- local executor


def _cli(*args: str) -> list[str]:
    return [sys.executable, str(REPO / "tools" / "study.py"), *args]


def _study(*args: str) -> subprocess.CompletedProcess:
    """tools/study.py's main() in this process: the same program after its imports, without
    a cold interpreter per call (the executor the test kills is launched as a process)."""
    from pretrain.cli.study import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(list(args))
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 1
    return subprocess.CompletedProcess(list(args), code, out.getvalue(), err.getvalue())


def _wait(what, cond, timeout: float = 240.0, proc=None) -> None:
    end = time.monotonic() + timeout
    while not cond():
        if proc is not None and proc.poll() is not None:
            out = proc.stdout.read() if proc.stdout else ""
            raise AssertionError(f"{what}: the executor ended first ({proc.returncode}):\n{out}")
        assert time.monotonic() < end, f"{what}: not within {timeout} s"
        time.sleep(0.2)


def _task_states(pid: int) -> list[str]:
    """The state of each thread of process `pid`, the main thread's first ([] once it is gone)."""
    try:
        tasks = sorted(Path(f"/proc/{pid}/task").iterdir(), key=lambda t: int(t.name))
    except OSError:
        return []
    states = []
    for task in tasks:
        try:  # the state follows the command's name, which may hold spaces: after ")"
            states.append((task / "stat").read_text().rpartition(")")[2].split()[0])
        except (OSError, IndexError):
            continue  # that thread has just ended
    return states


def _alive(pid: int) -> bool:
    """Whether any thread of process `pid` still runs. A zombie is dead for our purpose (its
    parent, the killed executor, is gone; init reaps it), but the main thread turns zombie
    before the others end: until the last one has, the process keeps its files open, the
    run's lock among them (a busy machine made that window long enough to see)."""
    return any(state not in ("Z", "X") for state in _task_states(pid))


_FORKS_A_WORKER = """
import os, sys, time
from pretrain.study.records import keep_run_lock_from_children
keep_run_lock_from_children()
child = os.fork()
if child == 0:  # a DataLoader worker that outlives the run by a few seconds
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 1), os.dup2(null, 2)  # not the test's pipe: it waits for their end
    time.sleep(60)
    os._exit(0)
print(child, flush=True)
"""


_MAIN_THREAD_ENDS_FIRST = """
import ctypes, fcntl, os, sys, threading
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT)
fcntl.flock(fd, fcntl.LOCK_EX)
threading.Thread(target=lambda: (sys.stdin.read(), os._exit(0))).start()  # until the test says
print(os.getpid(), flush=True)
ctypes.CDLL(None).pthread_exit(None)
"""


def test_a_process_whose_main_thread_ended_is_alive_while_a_thread_holds_its_files(tmp_path):
    """`_alive`, which the killed-executor test waits on: a zombie main thread is not the end
    of a process whose other threads still run, and still hold the run's lock."""
    lock = tmp_path / "run.lock"
    proc = subprocess.Popen(
        [sys.executable, "-c", _MAIN_THREAD_ENDS_FIRST, str(lock)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )
    pid = int(proc.stdout.readline())
    _wait("the main thread to end", lambda: _task_states(pid)[:1] == ["Z"], timeout=60)
    assert _alive(pid)
    fd = os.open(lock, os.O_RDONLY)
    try:
        with pytest.raises(BlockingIOError):
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    finally:
        os.close(fd)
    proc.stdin.close()  # the other thread ends the process
    proc.wait(timeout=30)
    assert not _alive(pid)


@pytest.mark.parametrize("kept", [True, False], ids=["kept_from_children", "shared"])
def test_a_run_lock_ends_with_the_training_process(tmp_path, kept):
    # Without keep_run_lock_from_children the forked child holds the lock after its parent
    # ended: status said "running" for a run that had stopped (CI, stop 40).
    fd = take_run_lock(tmp_path, "run")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    if kept:
        env[RUN_LOCK_FD_VAR] = str(fd)
    out = subprocess.run(
        [sys.executable, "-c", _FORKS_A_WORKER],
        pass_fds=(fd,),
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    os.close(fd)  # the executor's copy: the run's process is gone
    worker = int(out.stdout)
    try:
        assert _alive(worker)
        assert run_lock_held(tmp_path, "run") is not kept
    finally:
        os.kill(worker, 9)


@pytest.mark.slow(
    reason="three executor calls, three tiny trainings and an evaluation: 35-60 s on 2 cores"
)
def test_local_executor_killed_halfway_and_continued(tmp_path, data, monkeypatch):
    # 0.4 s per step: the first run is still training when the test kills the executor.
    path = study_file(tmp_path, data, train_iters=12, eval_interval=6)
    cfg_slow = yaml.safe_load(path.read_text())
    cfg_slow["config"]["spikes"] = {
        "faults": [{"kind": "slow", "step": 1, "last": 12, "rank": 0, "seconds": 0.4}]
    }
    cfg_slow["config"]["checkpoint"] = {"interval": 4, "keep_last": 2}
    path.write_text(yaml.safe_dump(cfg_slow, sort_keys=False))
    study = load_study(path)
    first, second = (tmp_path / r.run_dir for r in study.runs)
    env = child_env()
    for name, value in env.items():  # the in-process calls' runs inherit it, as a launch's
        monkeypatch.setenv(name, value)
    out = _study("write", str(path))
    assert out.returncode == 0, out.stderr

    executor = subprocess.Popen(
        _cli(
            "submit", str(path), "--executor", "local", "--parallel", "1", "--progress-every", "2"
        ),
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        _wait("two steps", lambda: read_progress(study.runs[0], tmp_path).step >= 2, proc=executor)
        # Running: a second executor is refused, and status shows the run's progress.
        again = _study("submit", str(path), "--executor", "local")
        assert again.returncode == 2 and "holds" in again.stderr, again.stderr
        rows = {r.run.name: r for r in study_status(study, tmp_path, ask_slurm=False).rows}
        assert rows["rope0_s1"].state == State.RUNNING and rows["rope0_s1"].job.startswith(
            "local pid"
        )
        assert rows["rope25_s1"].state == State.NOT_STARTED
        pid = json.loads((study.out_dir / "state" / "rope0_s1.json").read_text())["pid"]
        executor.kill()  # kill -9: no clean-up of its own
        executor.wait(timeout=30)
    finally:
        if executor.poll() is None:
            executor.kill()
    # The kernel's parent-death signal told the run: it saved a checkpoint and exited.
    _wait("the orphaned run to stop", lambda: not _alive(pid), timeout=120)
    stopped = read_progress(study.runs[0], tmp_path)
    assert stopped.checkpoint_step is not None and 2 <= stopped.checkpoint_step < 12, stopped
    rows = {r.run.name: r for r in study_status(study, tmp_path, ask_slurm=False).rows}
    assert rows["rope0_s1"].state == State.STOPPED and rows["rope25_s1"].state == State.NOT_STARTED

    # The same command continues: the stopped run resumes, the other one starts.
    cont = _study("submit", str(path), "--executor", "local", "--parallel", "1")
    assert cont.returncode == 0, cont.stdout + cont.stderr
    assert f"rope0_s1: started from step {stopped.checkpoint_step}" in cont.stdout, cont.stdout
    assert (
        "rope25_s1: started from scratch" in cont.stdout and "2 finished, 0 failed" in cont.stdout
    )
    log = (study.out_dir / "state" / "rope0_s1.log").read_text()
    assert "resumed from" in log and f"(step {stopped.checkpoint_step}," in log
    for run_dir in (first, second):
        steps = [
            json.loads(line)["step"]
            for line in (run_dir / "metrics.jsonl").read_text().splitlines()
        ]
        assert sorted(set(steps)) == list(range(1, 13)), run_dir
    status = _study("status", str(path), "--no-slurm")
    assert status.returncode == 0 and "2 runs: 2 completed" in status.stdout, status.stdout

    # Nothing left to train; --eval evaluates what completed and has no evaluation yet.
    last = _study(
        "submit",
        str(path),
        "--executor",
        "local",
        "--only",
        "rope=0",
        "--eval",
        "--eval-args",
        "--tasks none --val --val-samples 4",
    )
    assert last.returncode == 0, last.stdout + last.stderr
    assert "rope0_s1: evaluated" in last.stdout and "started" not in last.stdout, last.stdout
    assert (first / "eval" / "step_0000012" / "valid_metrics.json").is_file()


# ----------------------------------------------------------------------------- the report


def _finished_run(run_dir: Path, seed: int, rope: float, losses: list[float], arc: float) -> dict:
    """A finished run folder as training and tools/evaluate.py leave it (the parts compare
    reads): its config, metrics with validation losses, the last checkpoint, an lm-eval result."""
    config = {
        "model": {"rope_fraction": rope},
        "train": {"seed": seed, "train_iters": 30},
        "logging": {"run_dir": str(run_dir)},
    }
    run_dir.mkdir(parents=True)
    (run_dir / "config.yaml").write_text(yaml.safe_dump(config))
    rows = [{"step": s, "train/loss": 4.0 - 0.05 * s + 0.01 * seed} for s in range(1, 31)]
    for i, loss in enumerate(losses):
        rows[10 * (i + 1) - 1]["valid/loss"] = loss
    _metrics(run_dir, rows)
    _checkpoint(run_dir, 30)
    ev = run_dir / "eval" / "step_0000030"
    ev.mkdir(parents=True)
    (ev / "lm_eval_results.json").write_text(
        json.dumps({"results": {"arc_easy": {"acc_norm,none": arc}}})
    )
    return config


def _csv_rows(text: str) -> list[dict[str, str]]:
    return list(csv.DictReader(io.StringIO(text)))


def test_report_numbers_are_compare_runs(tmp_path, capsys):
    runs_dir = tmp_path / "runs"
    spec = {  # (rope label, fraction) -> per seed: (valid losses, ARC-E)
        ("0", 0.0): {
            1: ([3.1, 2.68, 2.71], 0.31),  # the final loss is not always the best
            2: ([3.0, 2.7, 2.65], 0.33),
            3: ([3.2, 2.9, 2.69], 0.30),
        },
        ("100", 1.0): {
            1: ([3.0, 2.6, 2.52], 0.35),
            2: ([2.9, 2.53, 2.55], 0.36),
            3: ([3.0, 2.7, 2.49], 0.34),
        },
    }
    runs = []
    for (label, rope), seeds in spec.items():
        for seed, (losses, arc) in seeds.items():
            run_dir = runs_dir / f"rope{label}_s{seed}"
            config = _finished_run(run_dir, seed, rope, losses, arc)
            runs.append(_run(run_dir.name, run_dir, config, rope=label))
    unfinished = runs_dir / "rope100_s4"
    _metrics(unfinished, [{"step": 1, "train/loss": 4.0}])
    runs.append(
        _run("rope100_s4", unfinished, {"train": {"seed": 4, "train_iters": 30}}, rope="100")
    )
    study = Study(
        "t",
        tmp_path / "t.yaml",
        tuple(runs),
        {"rope": "100"},
        tmp_path / "study",
        None,
        repo=tmp_path,
    )

    report = write_study_report(study, tmp_path)
    assert (
        report.partial
        and "**Partial report**" in report.markdown
        and "rope100_s4 (step 1/30)" in report.markdown
    )
    assert {p.name for p in report.files} == {
        "report.md",
        "report.csv",
        "welch.csv",
        "loss_curves.png",
    }
    assert (tmp_path / "study" / "report" / "loss_curves.png").stat().st_size > 10_000

    finished = [str(runs_dir / r.name) for r in runs[:-1]]
    assert compare_main([*finished, "--baseline", "rope100", "--csv", str(tmp_path / "c.csv")]) == 0
    ours = _csv_rows((tmp_path / "study" / "report" / "report.csv").read_text())
    theirs = _csv_rows((tmp_path / "c.csv").read_text())
    numbers = (
        "valid_loss_final",
        "valid_loss_final_std",
        "valid_loss_best",
        "arc_easy/acc_norm",
        "arc_easy/acc_norm_std",
    )
    # Runs by name; groups by their members (compare_runs names a group after its folders).
    assert {r["name"]: [r[k] for k in numbers] for r in ours if r["kind"] == "run"} == {
        r["name"]: [r[k] for k in numbers] for r in theirs if r["kind"] == "run"
    }
    members = {
        r["group"]: frozenset(
            x["name"] for x in ours if x["kind"] == "run" and x["group"] == r["group"]
        )
        for r in ours
        if r["kind"] == "group"
    }
    them = {
        r["group"]: frozenset(
            x["name"] for x in theirs if x["kind"] == "run" and x["group"] == r["group"]
        )
        for r in theirs
        if r["kind"] == "group"
    }
    ours_g = {members[r["name"]]: [r[k] for k in numbers] for r in ours if r["kind"] == "group"}
    theirs_g = {them[r["name"]]: [r[k] for k in numbers] for r in theirs if r["kind"] == "group"}
    assert ours_g == theirs_g and len(ours_g) == 2
    # Welch: the same t-test as compare_runs' on the validation loss, plus every evaluated metric.
    printed = capsys.readouterr().out
    welch = {
        (r["group"], r["metric"]): float(r["p"])
        for r in _csv_rows((tmp_path / "study" / "report" / "welch.csv").read_text())
    }
    assert set(welch) == {
        ("rope=0", "valid_loss_final"),
        ("rope=0", "valid_loss_best"),
        ("rope=0", "arc_easy/acc_norm"),
    }
    line = next(
        x for x in unpadded(printed).splitlines() if x.startswith("| rope0 | valid_loss_final")
    )
    assert f"{welch[('rope=0', 'valid_loss_final')]:.4f}" == line.split("|")[-2].strip()
    assert 0 < welch[("rope=0", "valid_loss_final")] < 0.05  # NoPE's loss is higher here
    assert "| rope=0 | 3 |" in unpadded(report.markdown) and not math.isnan(
        float(next(r for r in ours if r["name"] == "rope=0")["valid_loss_final_std"])
    )
