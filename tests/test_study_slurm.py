"""`study submit` and `study status` against a real local Slurm cluster (tests/test_slurm.py's
`cluster`: Debian's slurmctld + slurmd, tools/slurm_local.sh), through the study's real job
scripts and slurm/launch.sh, with a stand-in trainer (PRETRAIN_ENTRY: a few lines honouring
the trainer's run folder and exit codes) so that each job costs seconds:

- four runs submitted at once, two lanes (--max-running 2), each with its evaluation chained
  (afterok); a second submit right after submits nothing;
- one run completes, one fails, one is cancelled (scancel), one is requeued (scontrol
  requeuehold): status tells the four apart and exits 1 (a run failed); a dry run would
  submit only the failed and the cancelled one; the requeued one, released, resumes and
  completes;
- a study written as one job array: its tasks are found by index and reported per run.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from test_slurm import cluster  # noqa: F401 (the module's own local cluster)
from train_support import stdlib_data, tiny_config

REPO = Path(__file__).resolve().parents[1]

from pretrain.study.selection import select_runs  # noqa: E402
from pretrain.study.slurm_submit import submit_to_slurm  # noqa: E402
from pretrain.study.spec import load_study  # noqa: E402
from pretrain.study.status import study_status  # noqa: E402
from pretrain.study.write import write_study  # noqa: E402

pytestmark = pytest.mark.slurm
TOTAL = 10

# The trainer's contract, as far as a study reads it: RUN/metrics.jsonl, RUN/checkpoints/latest,
# exit 0 when train_iters are done, 99 after TERM/USR1 with a checkpoint, resume from it.
STUB = """
import signal, sys, time
from pathlib import Path
import json, yaml
args = sys.argv[1:]
run = Path(yaml.safe_load(open(args[args.index("--config") + 1]))["logging"]["run_dir"])
total, case = %(total)d, run.name.split("_")[0]
go = Path(%(go)r)
ckpt = run / "checkpoints"
def rows(first, last):
    with open(run / "metrics.jsonl", "a") as f:
        for s in range(first, last + 1):
            f.write(json.dumps({"step": s, "train/loss": 3.0 - 0.1 * s, "perf/tokens_per_s": 1e3,
                                "perf/mfu": 0.1, "perf/step_time_s": 0.5}) + "\\n")
def save(step):
    (ckpt / f"step_{step:07d}").mkdir(parents=True, exist_ok=True)
    (ckpt / "latest").write_text(f"step_{step:07d}")
while not go.exists():
    time.sleep(0.1)
latest = int((ckpt / "latest").read_text()[5:]) if (ckpt / "latest").exists() else 0
if case.startswith("ok") or latest:
    rows(latest + 1, total); save(total); print("stub: done", flush=True); sys.exit(0)
if case == "fail":
    rows(1, 2); print("stub: failing", flush=True); sys.exit(1)
got = []
for s in (signal.SIGTERM, signal.SIGUSR1):
    signal.signal(s, lambda n, f: got.append(n))
rows(1, 3); save(3); (run / "started").touch()
end = time.monotonic() + 120
while not got and time.monotonic() < end:
    time.sleep(0.05)
print(f"stub: signal {got}, saved, exit 99", flush=True)
sys.exit(99 if got else 1)
"""


def make_study(root: Path, data: Path, name: str, cases: list[str], array: bool = False) -> Path:
    """A study in ROOT (standing for a repository: its slurm/ and tools/ are this one's), one
    run per case, on a 1-task CPU layout, logs under ROOT/logs."""
    for folder in ("slurm", "tools"):
        if not (root / folder).exists():
            (root / folder).symlink_to(REPO / folder)
    (root / "logs").mkdir(exist_ok=True)
    cfg = tiny_config(Path("runs/NAME"), data, train={"train_iters": TOTAL})
    slurm = {
        "nodes": 1,
        "gpus_per_node": 0,
        "ntasks_per_node": 1,
        "cpus_per_task": None,
        "exclusive": False,
        "mem": None,
        "time": "0:30:00",
        "signal_margin_s": 60,
        "output": f"{root}/logs/%x-%j.out",
        "array": array,
    }
    spec = {
        "config": cfg,
        "axes": {"case": {"values": {c: {} for c in cases}}},
        "run_name": "{case}_" + name,  # job names unique on the cluster across the tests
        "slurm": slurm,
    }
    path = root / "studies" / f"{name}.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("study_repo")


@pytest.fixture(scope="module")
def stub_env(cluster, root) -> dict[str, str]:  # noqa: F811
    stub = root / "stub.py"
    stub.write_text(STUB % {"total": TOTAL, "go": str(root / "go")})
    return {**cluster.env, "PRETRAIN_ENTRY": str(stub)}


def _dependency(cluster, job: str) -> str:  # noqa: F811
    return cluster.job(job).get("Dependency", "")


def _states(study, root, env) -> dict[str, str]:
    return {r.run.name: r.state for r in study_status(study, root, ask_slurm=True, env=env).rows}


def _wait_for(what: str, cond, timeout: float = 120) -> None:
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, f"{what}: not within {timeout} s"
        time.sleep(0.3)


@pytest.mark.slow(reason="a local Slurm cluster and eight jobs through slurm/launch.sh, ~25 s")
def test_submit_status_requeue_on_slurm(cluster, root, stub_env, tmp_path_factory):  # noqa: F811
    data = stdlib_data(tmp_path_factory)
    study = load_study(make_study(root, data, "lanes", ["ok", "fail", "cancel", "hold"]))
    write_study(study, root)
    names = [r.name for r in study.runs]
    assert names == ["ok_lanes", "fail_lanes", "cancel_lanes", "hold_lanes"]
    env = cluster.env

    said: list[str] = []
    first = submit_to_slurm(
        study, root, study.runs, max_running=2, evaluate=True, env=stub_env, echo=said.append
    )
    ids = {name: (job, ev) for name, job, ev in first.jobs}
    assert list(ids) == names and all(job and ev for job, ev in ids.values()), said
    assert re.search(r"submitted 4 run\(s\): jobs( \d+){8}$", said[-1]), said
    # Two lanes: the third and fourth jobs wait for the first and second, whatever their end.
    assert _dependency(cluster, ids["cancel_lanes"][0]).startswith(f"afterany:{ids['ok_lanes'][0]}")
    assert _dependency(cluster, ids["hold_lanes"][0]).startswith(f"afterany:{ids['fail_lanes'][0]}")
    # Each evaluation is chained as slurm/submit.sh chains it; then they go (not the point here).
    for name, (job, ev) in ids.items():
        assert _dependency(cluster, ev).startswith(f"afterok:{job}"), name
        assert cluster.job(ev)["JobName"] == f"eval_{name}"
    cluster.run("scancel", *[ev for _, ev in ids.values()])

    # Right away, again: everything is queued or running, nothing is submitted.
    recorded = (study.out_dir / "state" / "jobs.json").read_text()
    said.clear()
    again = submit_to_slurm(study, root, study.runs, env=stub_env, echo=said.append)
    assert again.jobs == [] and said[-1].startswith("nothing to submit"), said
    assert {s for _, s in again.skipped} <= {"queued", "running"}, again.skipped
    assert (study.out_dir / "state" / "jobs.json").read_text() == recorded

    (root / "go").touch()
    run_dirs = {r.name: root / r.run_dir for r in study.runs}
    _wait_for(
        "cancel and hold started",
        lambda: all((run_dirs[n] / "started").exists() for n in ("cancel_lanes", "hold_lanes")),
    )
    cluster.run("scancel", ids["cancel_lanes"][0])
    cluster.run("scontrol", "requeuehold", ids["hold_lanes"][0])
    for name in ("ok_lanes", "fail_lanes", "cancel_lanes"):
        cluster.wait(ids[name][0], 60)
    _wait_for("hold requeued", lambda: _states(study, root, env)["hold_lanes"] == "requeued")

    status = study_status(study, root, ask_slurm=True, env=env)
    rows = {r.run.name: r for r in status.rows}
    assert {n: r.state for n, r in rows.items()} == {
        "ok_lanes": "completed",
        "fail_lanes": "failed",
        "cancel_lanes": "cancelled",
        "hold_lanes": "requeued",
    }
    assert rows["fail_lanes"].job_state == "FAILED (exit 1)"
    assert rows["cancel_lanes"].progress.checkpoint_step == 3  # it saved on the way out
    held = rows["hold_lanes"].job_state  # COMPLETING while its last step ends, then PENDING
    assert "(job requeued in held state), restart 1" in held, held
    assert rows["ok_lanes"].progress.step == TOTAL and rows["ok_lanes"].job == ids["ok_lanes"][0]
    cli = subprocess.run(
        [sys.executable, str(REPO / "tools" / "study.py"), "status", str(study.path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert cli.returncode == 1, cli.stdout + cli.stderr  # a run failed
    assert "4 runs: 1 requeued, 1 completed, 1 cancelled, 1 failed" in cli.stdout, cli.stdout

    # What a third submit would do: the failed and the cancelled run, nothing else.
    said.clear()
    submit_to_slurm(study, root, study.runs, dry_run=True, env=stub_env, echo=said.append)
    would = [line.split(":")[0] for line in said if "would submit" in line]
    assert would == ["fail_lanes", "cancel_lanes"], said
    assert "hold_lanes: requeued, skipped" in said and "ok_lanes: completed, skipped" in said

    # Released, the requeued job resumes from its checkpoint and completes.
    cluster.run("scontrol", "release", ids["hold_lanes"][0])
    info = cluster.wait(ids["hold_lanes"][0], 90)
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "1", info
    assert _states(study, root, env)["hold_lanes"] == "completed"
    steps = [
        json.loads(x)["step"]
        for x in (run_dirs["hold_lanes"] / "metrics.jsonl").read_text().splitlines()
    ]
    assert steps == list(range(1, TOTAL + 1))


def test_job_array_study(cluster, root, stub_env, tmp_path_factory):  # noqa: F811
    (root / "go").touch()
    data = stdlib_data(tmp_path_factory)
    study = load_study(make_study(root, data, "arr", ["ok", "fail", "ok2"], array=True))
    assert study.array and all(r.script_path is None for r in study.runs)
    write_study(study, root)
    said: list[str] = []
    runs = select_runs(study, ["case=ok,ok2"])  # tasks 0 and 2 only
    done = submit_to_slurm(study, root, runs, max_running=1, env=stub_env, echo=said.append)
    array = re.search(r"job array (\d+): tasks 0,2%1 of", "\n".join(said)).group(1)
    assert [j for _, j, _ in done.jobs] == [f"{array}_0", f"{array}_2"], said
    # Task 1 by hand, held: the study finds it in the queue by its index, not by a record.
    out = cluster.run(
        "sbatch",
        "--parsable",
        "--hold",
        "--array=1",
        str(study.array_script),
        cwd=root,
        env=stub_env,
    )
    by_hand = out.stdout.strip().split(";")[0]
    said.clear()
    assert submit_to_slurm(study, root, study.runs, env=stub_env, echo=said.append).jobs == []
    assert "fail_arr: queued, skipped" in said, said
    for job in (f"{array}_0", f"{array}_2"):
        assert cluster.wait(job, 60)["JobState"] == "COMPLETED"
    rows = {r.run.name: r for r in study_status(study, root, ask_slurm=True, env=cluster.env).rows}
    assert {n: r.state for n, r in rows.items()} == {
        "ok_arr": "completed",
        "fail_arr": "queued",
        "ok2_arr": "completed",
    }
    assert rows["ok2_arr"].job == f"{array}_2" and rows["fail_arr"].job == f"{by_hand}_1"
    cluster.run("scancel", by_hand)
