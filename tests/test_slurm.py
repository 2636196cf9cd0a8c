"""The Slurm path on a real local cluster: Debian's slurmctld + slurmd (4 simulated nodes on
this host, tools/slurm_local.sh), jobs submitted with sbatch through slurm/launch.sh.

- a tiny CPU model trains on 2 nodes (gloo, one rank per task); its losses equal a torchrun
  run of the same config and global batch;
- a job sent its pre-emption signal mid-run (`scancel --signal=USR1 --batch`, what
  `--signal=B:USR1@600` does before a time limit) checkpoints, requeues itself, resumes, and
  ends with the same weights as the uninterrupted job;
- the same job through DeepSpeed's launcher (PRETRAIN_LAUNCHER=deepspeed) trains alike;
- an evaluation job chained with --dependency=afterok (slurm/submit.sh) starts only after
  the pre-empted job completed;
- USR1 sent to the steps also requeues; `scancel` (TERM) checkpoints but does not requeue;
- a job one of whose ranks hangs (an injected fault, once) ends with the hang watchdog's
  124 on both tasks, is requeued, resumes and finishes;
- every generated paper job script is accepted by Slurm as written (`sbatch --test-only` on
  4 nodes of 8 GPUs).

Needs root (slurmd runs jobs as their owner). Slurm is installed with apt-get when missing;
when that is impossible the tests fail under CI=true and skip elsewhere.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import missing
from train_support import LAUNCH_VARS, prepare_stdlib, run_main, tiny_config, write_config

REPO = Path(__file__).resolve().parents[1]

from pretrain.study import load_study  # noqa: E402
from pretrain.study.runs import Study, StudyRun  # noqa: E402
from pretrain.study.slurm import Slurm  # noqa: E402
from pretrain.study.write import render_run_script  # noqa: E402
from pretrain.train.distributed import slurm_master_port  # noqa: E402

pytestmark = pytest.mark.slurm
HARNESS = REPO / "tools" / "slurm_local.sh"
ITERS = 40  # long enough to signal mid-run, short enough for CI
HANG_STEP = 30  # well after the pre-emption (signalled once 4 steps are logged)
HANG_TIMEOUT = 5  # seconds; a step of the tiny model takes well under 1 s on a loaded CPU


def paper_runs() -> tuple[StudyRun, ...]:
    return load_study(REPO / "studies" / "partial_rope.yaml").runs


def job_script(name: str, description: str, slurm: Slurm, config: Path) -> str:
    """The job script a study writes for one run (pretrain/study/write.py, as the paper's
    scripts are made), here of a config outside any study, with a test cluster's header."""
    run = StudyRun(
        name=name,
        labels={},
        seed=None,
        group=name,
        config={},
        config_path=str(config),
        script_path=f"{name}.sh",
        run_dir="",
        job_name=name,
        description=description,
        slurm=slurm,
    )
    study = Study(
        name=name,
        path=config.with_suffix(".study.yaml"),
        runs=(run,),
        baseline=None,
        out_dir=config.parent,
        slurm=slurm,
        repo=config.parent,
    )
    return render_run_script(study, run)


def unavailable(reason: str):
    missing(reason)


def free_port_block(width: int = 20) -> int:
    """A port p with p..p+width free (slurmctld, slurmd, one per node)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base + width > 65000:
            continue
        try:
            for p in range(base, base + width):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", p))
            return base
        except OSError:
            continue
    raise RuntimeError("no free block of ports")


class Cluster:
    def __init__(self, directory: Path, env: dict[str, str]) -> None:
        self.dir = directory
        self.env = env

    def run(
        self, *cmd: str, timeout: float = 30, check: bool = True, **kw
    ) -> subprocess.CompletedProcess:
        out = subprocess.run(
            cmd,
            cwd=kw.pop("cwd", REPO),
            env=kw.pop("env", self.env),
            capture_output=True,
            text=True,
            timeout=timeout,
            **kw,
        )
        if check and out.returncode != 0:
            raise AssertionError(
                f"{' '.join(cmd)} failed ({out.returncode}):\n{out.stdout}\n{out.stderr}"
            )
        return out

    def sbatch(
        self, script: Path | str, *args: str, options: tuple[str, ...] = (), **env: str
    ) -> str:
        # sbatch hands its environment to the job (--export=ALL).
        out = self.run(
            "sbatch", "--parsable", *options, str(script), *args, env={**self.env, **env}
        )
        return out.stdout.strip().split(";")[0]

    def job(self, job_id: str) -> dict[str, str]:
        text = self.run("scontrol", "-o", "show", "job", job_id).stdout
        return dict(re.findall(r"(\w+)=(\S*)", text))

    def wait(self, job_id: str, timeout: float = 240) -> dict[str, str]:
        """Until the job has left the queue for good (a requeued job comes back)."""
        end = time.monotonic() + timeout
        while True:
            info = self.job(job_id)
            if info["JobState"] not in {
                "PENDING",
                "RUNNING",
                "CONFIGURING",
                "COMPLETING",
                "REQUEUED",
                "SIGNALING",
            }:
                return info
            if time.monotonic() > end:
                self.run("scancel", job_id, check=False)
                raise AssertionError(f"job {job_id} still {info['JobState']} after {timeout}s")
            time.sleep(0.3)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    if os.geteuid() != 0:
        unavailable("the local Slurm cluster needs root (slurmd starts jobs as their owner)")
    if shutil.which("apt-get") is None and shutil.which("slurmctld") is None:
        unavailable("Slurm is not installed and there is no apt-get to install it")
    inst = subprocess.run([str(HARNESS), "install"], capture_output=True, text=True, timeout=600)
    if inst.returncode != 0:
        unavailable(f"could not install Slurm: {inst.stderr.strip() or inst.stdout.strip()}")

    directory = tmp_path_factory.mktemp("slurm")
    env = {
        k: v for k, v in os.environ.items() if k not in LAUNCH_VARS and not k.startswith("SLURM_")
    }
    env.update(
        SLURM_LOCAL_DIR=str(directory),
        SLURM_LOCAL_PORT=str(free_port_block()),
        # 4 nodes shaped like the paper's (8 GPUs, 64 CPUs each, all on this host), so
        # the real job scripts can be checked against them.
        SLURM_LOCAL_CPUS="64",
        SLURM_LOCAL_GPUS="8",
        SLURM_CONF=str(directory / "slurm.conf"),
        PRETRAIN_PYTHON=sys.executable,
        OMP_NUM_THREADS="1",
    )
    try:
        start = subprocess.run(
            [str(HARNESS), "start", "4"], env=env, capture_output=True, text=True, timeout=90
        )
        if start.returncode != 0:
            raise AssertionError(
                f"the local cluster did not start:\n{start.stdout}\n{start.stderr}"
            )
        yield Cluster(directory, env)
    finally:
        subprocess.run(["scancel", "--user", "root"], env=env, capture_output=True, timeout=30)
        stop = subprocess.run(
            [str(HARNESS), "stop"], env=env, capture_output=True, text=True, timeout=60
        )
        assert stop.returncode == 0, stop.stderr
        left = [p.name for p in directory.glob("*.pid")]
        assert not left, f"daemons not stopped: {left}"


def test_two_node_job_runs_one_task_per_node(cluster):
    script = cluster.dir / "hello.sh"
    script.write_text(
        "#!/bin/bash\n#SBATCH --nodes=2 --ntasks-per-node=1 --output="
        f"{cluster.dir}/hello-%j.out\n"
        "srun bash -c 'echo task=$SLURM_PROCID node=$SLURMD_NODENAME'\n"
    )
    job = cluster.sbatch(script)
    info = cluster.wait(job, 60)
    assert info["JobState"] == "COMPLETED", info
    lines = sorted((cluster.dir / f"hello-{job}.out").read_text().split())
    assert lines == ["node=node1", "node=node2", "task=0", "task=1"]


def test_paper_job_scripts_are_accepted_by_slurm(cluster):
    """Every generated header is valid for Slurm and fits 4 nodes of 8 GPUs (without running)."""
    for run in paper_runs():
        out = cluster.run("sbatch", "--test-only", run.script_path, check=False)
        assert out.returncode == 0 and "to start at" in out.stderr, (
            f"{run.script_path}: {out.stderr}"
        )
        assert "node[1-4]" in out.stderr, f"{run.script_path}: {out.stderr}"
    # The control: the same script asking for more than the cluster has is refused.
    out = cluster.run(
        "sbatch", "--test-only", "--nodes=5", paper_runs()[0].script_path, check=False
    )
    assert out.returncode != 0


# ----------------------------------------------------------------------------- launcher logic
# A stand-in trainer (a few lines of Python honouring the trainer's exit-code contract) keeps
# these checks of launch.sh's signal handling to seconds; the real trainer goes through the
# same path in the training tests below.
STUB = """
import os, signal, sys, time
from pathlib import Path
run = Path(sys.argv[sys.argv.index("--config") + 1]).with_suffix(".run")
got = []
for s in (signal.SIGUSR1, signal.SIGTERM):
    signal.signal(s, lambda n, f: got.append(signal.Signals(n).name))
saved = run / "saved"
if saved.exists():                       # resumed: finish
    print("stub: resumed, finishing", flush=True)
    sys.exit(0)
print("stub: started", flush=True)
(run / f"started{os.environ['RANK']}").touch()
end = time.monotonic() + 60
while not got and time.monotonic() < end:
    time.sleep(0.05)
saved.write_text(",".join(got))
print(f"stub: {got} -> saved, exit 99", flush=True)
sys.exit(99 if got else 0)
"""


@pytest.fixture
def stub_job(cluster, tmp_path):
    def submit(name: str) -> tuple[str, Path]:
        run = tmp_path / f"{name}.run"
        run.mkdir()
        config = tmp_path / f"{name}.yaml"
        config.write_text(f"logging: {{run_dir: {run}}}\n")
        entry = tmp_path / "stub.py"
        entry.write_text(STUB)
        slurm = Slurm(
            nodes=2,
            gpus_per_node=0,
            ntasks_per_node=1,
            cpus_per_task=None,
            exclusive=False,
            mem=None,
            time="00:30:00",
            output=f"{tmp_path}/%x-%j.out",
        )
        script = tmp_path / f"{name}.sh"
        script.write_text(job_script(name, "stub", slurm, config))
        job_id = cluster.sbatch(script, PRETRAIN_ENTRY=str(entry))
        end = time.monotonic() + 60
        while not ((run / "started0").exists() and (run / "started1").exists()):
            assert time.monotonic() < end, "the stub did not start"
            time.sleep(0.1)
        return job_id, run

    return submit


def test_usr1_to_the_steps_checkpoints_and_requeues(cluster, stub_job, tmp_path):
    """`scancel --signal=USR1 JOB` reaches the training processes only; their exit 99 is
    enough for the launcher to requeue."""
    job, run = stub_job("steps")
    cluster.run("scancel", "--signal=USR1", job)
    info = cluster.wait(job, 90)
    log = (tmp_path / f"steps-{job}.out").read_text()
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "1", log
    assert (run / "saved").read_text() == "SIGUSR1"
    assert "stopped for pre-emption (exit 99)" in log and "stub: resumed, finishing" in log


def test_scancel_stops_for_good(cluster, stub_job, tmp_path):
    """scancel sends TERM: the trainer checkpoints, but the job is not requeued."""
    job, run = stub_job("cancel")
    cluster.run("scancel", job)
    info = cluster.wait(job, 90)
    time.sleep(1)  # the batch shell's last lines
    log = (tmp_path / f"cancel-{job}.out").read_text()
    assert info["JobState"] == "CANCELLED" and info["Restarts"] == "0", log
    assert (run / "saved").read_text() == "SIGTERM"
    assert "requeueing" not in log, log


# ----------------------------------------------------------------------------- training


@pytest.fixture(scope="module")
def jobs(cluster, tmp_path_factory):
    """Submit, at once: an uninterrupted job, the same through DeepSpeed's launcher, and a job
    to pre-empt (whose rank 1 later hangs) with its chained evaluation."""
    base = tmp_path_factory.mktemp("runs")
    data = prepare_stdlib(base / "data")
    config = write_config(
        base / "tiny.yaml",
        tiny_config(
            base / "unused",
            data,
            train={
                "train_iters": ITERS,
                "global_batch_size": 8,
                "micro_batch_size": 4,
                "eval_interval": 1000,
            },
            # No periodic checkpoint before the end: the resume must come from the signal's.
            checkpoint={"interval": 1000, "keep_last": 2},
            logging={"log_interval": 1, "max_logit_interval": 0, "tensorboard": False},
        ),
    )
    # The same generator as the paper's scripts, with a CPU test cluster's header.
    slurm = Slurm(
        nodes=2,
        gpus_per_node=0,
        ntasks_per_node=1,
        cpus_per_task=None,
        exclusive=False,
        mem=None,
        time="00:30:00",
        output=f"{base}/%x-%j.out",
    )
    script = base / "tiny.sh"
    script.write_text(job_script("tiny", "tiny CPU model for the Slurm tests", slurm, Path(config)))
    plain, preempted, ds = base / "plain", base / "preempted", base / "deepspeed"
    # The run folder comes in as an argument after the script, as users pass --set.
    ids = {
        "plain": cluster.sbatch(script, "--set", f"logging.run_dir={plain}"),
        "deepspeed": cluster.sbatch(
            script, "--set", f"logging.run_dir={ds}", PRETRAIN_LAUNCHER="deepspeed"
        ),
    }
    # The job to pre-empt goes through slurm/submit.sh, which chains the evaluation to it.
    # After its requeue, rank 1 hangs at step HANG_STEP, once (its marker stays in the run
    # folder): the watchdog ends the job, launch.sh requeues it again, it resumes from the
    # pre-emption's checkpoint and finishes. One job for both paths: each costs a 2-rank run.
    # Steps 4-10 slowed on rank 0 (0.5 s each): the test signals the job once it has logged 4
    # steps, and the unslowed job would reach the hang within a second of that, too short a
    # window for a test process that shares 2 loaded cores (seen under two workers).
    hang = [
        f"train.hang_timeout={HANG_TIMEOUT}",
        f"spikes.faults=[{{kind: hang, step: {HANG_STEP}, rank: 1}}, "
        f"{{kind: slow, step: 4, last: 10, rank: 0, seconds: 0.5}}]",
    ]
    out = cluster.run(
        "slurm/submit.sh",
        str(script),
        *[a for o in hang for a in ("--set", o)],
        "--set",
        f"logging.run_dir={preempted}",
        env={
            **cluster.env,
            "SBATCH_OUTPUT": f"{base}/%x-%j.out",
            "PRETRAIN_EVAL_ARGS": "--tasks none --val --val-samples 8",
        },
    )
    ids["preempted"] = re.search(r"training: +job (\d+)", out.stdout).group(1)
    ids["evaluate"] = re.search(r"evaluation: +job (\d+)", out.stdout).group(1)
    return {
        "base": base,
        "config": config,
        "ids": ids,
        "plain": plain,
        "preempted": preempted,
        "deepspeed": ds,
    }


def losses(run_dir: Path) -> dict[int, float]:
    out = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        if "train/loss" in row:
            out[row["step"]] = row["train/loss"]
    return out


def final_weights(run_dir: Path):
    from safetensors.torch import load_file

    ckpt = run_dir / "checkpoints"
    return load_file(ckpt / (ckpt / "latest").read_text().strip() / "model.safetensors")


def log_of(jobs, job_id: str) -> str:
    return (jobs["base"] / f"tiny-{job_id}.out").read_text()


# The pre-emption test runs first: it must signal its job while that job still runs.
@pytest.mark.slow(
    reason="waits for one real Slurm job through a pre-emption, a requeue, a hang and a "
    "second requeue to its end; the other jobs of the module run meanwhile"
)
def test_preempted_job_requeues_and_ends_like_uninterrupted(cluster, jobs):
    job = jobs["ids"]["preempted"]
    metrics = jobs["preempted"] / "metrics.jsonl"
    # Signal it mid-run: once it has logged a few steps, and well before the last.
    end = time.monotonic() + 180
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 4):
        assert time.monotonic() < end, "the job logged no steps in time"
        assert cluster.job(job)["JobState"] in {"PENDING", "RUNNING", "CONFIGURING"}, log_of(
            jobs, job
        )
        time.sleep(0.2)
    cluster.run("scancel", "--signal=USR1", "--batch", job)
    info = cluster.wait(job)
    log = log_of(jobs, job)
    assert info["JobState"] == "COMPLETED", log
    assert info["Restarts"] == "2", log  # the pre-emption, then the hang (the next test)
    # One log, appended by every run of the job.
    assert "got SIGUSR1" in log and "requeueing job" in log
    assert f"job {job} (restart 0)" in log and f"job {job} (restart 1)" in log
    # It stopped mid-run with a checkpoint and the second run resumed from it.
    # Every rank saved and exited 99 (none killed half-way), and the second run resumed
    # from the checkpoint that the signal wrote.
    assert "stopped for pre-emption (exit 99)" in log, log
    saved = re.search(r"checkpoint written at step (\d+)", log)
    resumed = re.search(r"resumed from \S+ \(step (\d+)", log)
    assert saved and resumed, log
    assert 1 <= int(saved.group(1)) == int(resumed.group(1)) < HANG_STEP
    assert sorted(losses(jobs["preempted"])) == list(range(1, ITERS + 1))

    import torch

    got, want = final_weights(jobs["preempted"]), final_weights(jobs["plain"])
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=1e-6, msg=name)


def test_two_nodes_train_like_torchrun(cluster, jobs):
    job = jobs["ids"]["plain"]
    info = cluster.wait(job)
    log = log_of(jobs, job)
    assert info["JobState"] == "COMPLETED", log
    assert info["NodeList"] == "node[1-2]"
    assert info["Restarts"] == "0"  # a run that finished is not requeued
    assert "nodes 2 (node1 node2) x 1 tasks = world size 2" in log
    # launch.sh's port is the trainer's own rule (a bare srun), below the ephemeral ports.
    assert f"master 127.0.0.1:{slurm_master_port(int(job))}" in log
    assert "2 rank(s)" in log  # the trainer's own view: both tasks joined one process group
    # The Slurm log is linked into the run folder.
    assert (jobs["plain"] / f"slurm-{job}.out").resolve() == (jobs["base"] / f"tiny-{job}.out")

    reference = jobs["base"] / "torchrun"
    out = run_main(jobs["config"], 2, [f"logging.run_dir={reference}"], timeout=240, torchrun=True)
    assert out.returncode == 0, out.stderr[-3000:]
    got, want = losses(jobs["plain"]), losses(reference)
    assert sorted(got) == list(range(1, ITERS + 1))
    assert got.keys() == want.keys()
    for step in want:
        assert got[step] == pytest.approx(want[step], rel=1e-6, abs=1e-6), step


def test_deepspeed_launcher_option_trains_alike(cluster, jobs):
    """PRETRAIN_LAUNCHER=deepspeed: a generated hostfile and DeepSpeed's own multi-node runner."""
    job = jobs["ids"]["deepspeed"]
    info = cluster.wait(job)
    log = log_of(jobs, job)
    assert info["JobState"] == "COMPLETED", log
    assert (jobs["deepspeed"] / f"hostfile-{job}").read_text() == "node1 slots=1\nnode2 slots=1\n"
    assert "runner.py" in log and "2 rank(s)" in log
    got, want = losses(jobs["deepspeed"]), losses(jobs["plain"])
    assert got.keys() == want.keys()
    for step in want:
        assert got[step] == pytest.approx(want[step], rel=1e-6, abs=1e-6), step


def test_evaluation_waits_for_the_training_job(cluster, jobs):
    train, evaluate = jobs["ids"]["preempted"], jobs["ids"]["evaluate"]
    info = cluster.wait(evaluate, 240)
    log = (jobs["base"] / f"eval_tiny-{evaluate}.out").read_text()
    assert info["JobState"] == "COMPLETED", log
    trained = cluster.job(train)
    assert trained["JobState"] == "COMPLETED"
    # afterok held it through the requeue: it started only after the final run ended.
    assert info["StartTime"] >= trained["EndTime"], (info["StartTime"], trained["EndTime"])
    results = list((jobs["preempted"] / "eval").glob("step_*/valid_metrics.json"))
    assert [p.parent.name for p in results] == [f"step_{ITERS:07d}"], log
    assert json.loads(results[0].read_text())["loss"] > 0


def test_hung_job_is_requeued_and_finishes(cluster, jobs):
    """The pre-empted job's second run: rank 1 hangs at HANG_STEP."""
    job, run_dir = jobs["ids"]["preempted"], jobs["preempted"]
    info = cluster.wait(job)
    log = log_of(jobs, job)
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "2", log
    # Both tasks of the second run exited with the watchdog's code, and srun passed it on.
    assert "task 0: Exited with exit code 124" in log and "task 1: Exited with exit code 124" in log
    verdict = [line for line in log.splitlines() if line.startswith("hang:")]
    assert len(verdict) == 1 and verdict[0].startswith(f"hang: step {HANG_STEP} stalled"), log
    assert "rank 1 stopped outside any collective, in block_forever" in verdict[0]
    assert "training hung (exit 124" in log and f"requeueing job {job} (hang requeue 1 of 3" in log
    # The third run resumed from the newest checkpoint, the pre-emption's, as the second did.
    assert f"job {job} (restart 2)" in log
    resumed = re.findall(r"resumed from \S+ \(step (\d+),", log)
    saved = re.search(r"checkpoint written at step (\d+)", log)
    assert len(resumed) == 2 and set(resumed) == {saved.group(1)}, log
    hang = run_dir / "hang"
    assert (hang / f"requeues-{job}").read_text().strip() == "1"
    assert sorted(p.name for p in hang.glob("rank_*.txt")) == ["rank_0.txt", "rank_1.txt"]
