"""The hang watchdog and the straggler scalar (pretrain/train/watchdog.py, callbacks/hang.py,
callbacks/speed.py).

- Two real ranks (gloo, the tiny model), started as srun starts them: rank 1 is slow at
  steps 2-3 and hangs at step 5; the save at step 3 takes longer than train.hang_timeout.
  Both ranks exit with EXIT_HUNG within the timeout plus the stated margin of the hung
  step's start, their stack files name the blocked calls (the sleep on rank 1, the
  all-reduce on rank 0), one line names the stalled step and the ranks; the long save was
  not taken for a hang; the slow rank is the TensorBoard scalar's rank.
- The agreement itself, in-process on a real TCPStore: a verdict only when every rank is
  overdue, a silent rank named, a rank alone, and the exit code of a rank whose main thread
  reaches the end with an error after the verdict.
- Bad fault and watchdog settings fail with one line naming the field.
"""

from __future__ import annotations

import json
import math
import threading
import time

import pytest
from torch.distributed import TCPStore
from train_support import REPO, start_ranks, stdlib_data, tiny_config, write_config

from pretrain.config import Config, ConfigError, from_dict
from pretrain.exit_codes import EXIT_HUNG
from pretrain.preflight import preflight
from pretrain.run_layout import RunLayout
from pretrain.train.watchdog import Watchdog, ranks_text

TIMEOUT, LONG = 3.0, 8.0  # train.hang_timeout, train.hang_timeout_long
POLL = TIMEOUT / 10  # the watchdog's poll at this timeout (Watchdog.poll)
MARGIN = 3 * POLL + 2.0  # docs/hangs.md, "Detection time": detection + reports + exit
SAVE_PAUSE = 4.5  # the step-3 save: longer than TIMEOUT, shorter than LONG
SLOW = 0.3  # rank 1's delay at steps 2-3


def test_exit_code_is_the_one_slurm_launch_requeues():
    assert EXIT_HUNG == 124
    assert "EXIT_HUNG=124" in (REPO / "slurm" / "launch.sh").read_text()


# ----------------------------------------------------------------------------- two ranks


@pytest.fixture(scope="module")
def hung(tmp_path_factory):
    data = stdlib_data(tmp_path_factory)
    root = tmp_path_factory.mktemp("hang")
    run = root / "run"
    faults = [
        {"kind": "slow", "step": 2, "last": 3, "rank": 1, "seconds": SLOW},
        {"kind": "hang", "step": 5, "rank": 1},
    ]
    config = write_config(
        root / "run.yaml",
        tiny_config(
            run,
            data,
            train={
                "train_iters": 6,
                "eval_interval": 1000,
                "hang_timeout": TIMEOUT,
                "hang_timeout_long": LONG,
            },
            checkpoint={"interval": 3},
            logging={"log_interval": 1, "max_logit_interval": 0},
            spikes={"faults": faults},
        ),
    )
    procs = start_ranks(config, 2, root, PRETRAIN_TEST_PAUSE_AT=f"before_commit:3:{SAVE_PAUSE}")
    metrics, step4, exits = run / "metrics.jsonl", None, {}
    end = time.monotonic() + 180
    try:
        while len(exits) < 2:
            assert time.monotonic() < end, "the ranks did not exit"
            # Rank 0 writes step 4's line right after that step's heartbeat: the hung step
            # starts there.
            if step4 is None and metrics.exists() and '"step": 4,' in metrics.read_text():
                step4 = time.monotonic()
            for rank, p in enumerate(procs):
                if rank not in exits and p.poll() is not None:
                    exits[rank] = time.monotonic()
            time.sleep(0.02)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return {
        "run": RunLayout(run),
        "codes": [p.returncode for p in procs],
        "after_step4": {r: t - step4 for r, t in exits.items()} if step4 else None,
        "logs": [(root / f"rank_{r}.log").read_text() for r in range(2)],
    }


def _main_thread(report: str) -> str:
    """The main thread's stack in a rank's report."""
    return report.split("(main thread), most recent call last:")[1].split("\nThread ")[0]


def test_a_hung_rank_ends_both_ranks_with_the_watchdog_code(hung):
    assert hung["codes"] == [EXIT_HUNG, EXIT_HUNG], hung["logs"]
    after = hung["after_step4"]
    assert after is not None, hung["logs"][0]
    for rank, seconds in after.items():  # from the hung step's start to the rank's exit
        assert TIMEOUT - 0.5 < seconds < TIMEOUT + MARGIN, (rank, after)
    lines = [ln for log in hung["logs"] for ln in log.splitlines() if ln.startswith("hang:")]
    assert len(lines) == 1, lines  # one line, from the rank that judged
    line = lines[0]
    assert line.startswith("hang: step 5 stalled, no step completed for ")
    assert "rank 1 stopped outside any collective, in block_forever (pretrain/faults.py" in line
    assert "rank 0 waits in a collective (all_reduce)" in line
    assert f"exiting with {EXIT_HUNG}" in line


def test_the_verdict_is_published_to_the_judging_ranks_sinks(hung):
    # The verdict is a record (pretrain/train/publish.py Notice): the judging rank's console,
    # and where that is rank 0, its TensorBoard too, flushed before the exit.
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    judged_by = [r for r, log in enumerate(hung["logs"]) if "\nhang: step 5 stalled" in log]
    assert len(judged_by) == 1, hung["logs"]
    acc = EventAccumulator(str(hung["run"].tensorboard), size_guidance={"tensors": 0})
    acc.Reload()
    texts = [
        t.tensor_proto.string_val[0].decode()
        for tag in acc.Tags()["tensors"]
        if tag.startswith("hang")
        for t in acc.Tensors(tag)
    ]
    if judged_by == [0]:
        assert len(texts) == 1 and texts[0].startswith("hang: step 5 stalled"), texts
    else:
        assert texts == []


def test_the_stack_files_name_the_blocked_calls(hung):
    layout = hung["run"]
    reports = [layout.hang_report(r).read_text() for r in range(2)]
    for rank, report in enumerate(reports):
        assert report.startswith(f"hang report of rank {rank} of 2 ")
        assert "verdict: hang: step 5 stalled" in report
        assert "last completed step 4" in report
    hung_main = _main_thread(reports[1]).rstrip().splitlines()
    assert "pretrain/faults.py" in hung_main[-2] and "in block_forever" in hung_main[-2]
    assert hung_main[-1].strip() == "time.sleep(3600)"
    waiting = _main_thread(reports[0]).rstrip().splitlines()
    assert "torch/distributed/distributed_c10d.py" in waiting[-2], waiting[-4:]
    assert "in all_reduce" in waiting[-2] and waiting[-1].strip() == "work.wait()"
    # The injected hang fired once: its marker makes a requeued run train through.
    assert layout.injected_hang(1, 5).exists()


def test_a_save_longer_than_the_timeout_is_not_a_hang(hung):
    assert f"pausing {SAVE_PAUSE}s at before_commit (step 3)" in hung["logs"][0]
    assert (hung["run"].checkpoint(3)).is_dir()
    assert '"step": 4,' in hung["run"].metrics.read_text()  # trained on after the slow save


def test_a_slow_rank_shows_in_the_scalar(hung):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(hung["run"].tensorboard))
    events.Reload()  # flushed at the step-3 save, before the hang

    def scalar(tag: str) -> dict[int, float]:
        return {e.step: e.value for e in events.Scalars(tag)}

    slowest, rank = scalar("perf/step_time_max_rank"), scalar("perf/step_time_max_rank_id")
    median = scalar("perf/step_time_rank_median")
    for step in (2, 3):
        # Rank 1 slept SLOW s before its forward; rank 0 waited for it, in a collective,
        # which its own time leaves out (2 ranks: the median is the mean).
        rank0 = 2 * median[step] - slowest[step]
        assert rank[step] == 1 and slowest[step] >= SLOW, (step, slowest, rank)
        assert slowest[step] - rank0 > 0.8 * SLOW, (step, slowest, median)
    # Step 4, without the fault (metrics.jsonl is written line by line): no such gap.
    row = [r for r in hung["run"].metrics.read_text().splitlines() if '"step": 4,' in r][0]
    row = json.loads(row)
    gap = 2 * (row["perf/step_time_max_rank"] - row["perf/step_time_rank_median"])
    assert gap < 0.5 * SLOW, row


# ----------------------------------------------------------------------------- the agreement


class Ranks:
    """Watchdogs of a job of `world` ranks in this process, on one real TCPStore; their
    exits are recorded (the process must live on)."""

    def __init__(self, tmp_path, world: int, timeout: float = 0.5, started=None) -> None:
        self.master = TCPStore("127.0.0.1", 0, world, is_master=True, wait_for_workers=False)
        self.layout, self.lines, self.exits = RunLayout(tmp_path), [], []
        self.dogs = []
        for rank in range(world):
            store = (
                self.master
                if rank == 0
                else TCPStore("127.0.0.1", self.master.port, world, is_master=False)
            )
            self.dogs.append(
                Watchdog(
                    store,
                    rank,
                    world,
                    timeout,
                    4 * timeout,
                    self.layout.hang_report,
                    log=self.lines.append,
                    step=4,
                    exit_process=lambda code: self.exits.append(
                        (code, threading.current_thread().name)
                    ),
                )
            )
        for dog in self.dogs if started is None else [self.dogs[r] for r in started]:
            dog.beat(4)  # the first step of the start is done: the short allowance
            dog.start()

    def wait_for_exits(self, n: int, seconds: float) -> float:
        t0 = time.monotonic()
        while len(self.exits) < n:
            assert time.monotonic() - t0 < seconds, self.exits
            time.sleep(0.02)
        return time.monotonic() - t0


def test_every_rank_overdue_gives_one_verdict_and_every_rank_exits(tmp_path):
    job = Ranks(tmp_path, 3)
    took = job.wait_for_exits(3, 10)
    assert 0.5 <= took < 0.5 + 3 * job.dogs[0].poll + 2.0
    assert [code for code, _ in job.exits] == [EXIT_HUNG] * 3
    assert len(job.lines) == 1 and job.lines[0].startswith("hang: step 5 stalled")
    assert "rank 0-2 stopped outside any collective" in job.lines[0]
    for rank in range(3):
        assert f"verdict: {job.lines[0]}" in job.layout.hang_report(rank).read_text()
    # A rank whose main thread then fails (its collective broke when a peer exited) ends
    # with the watchdog's code, not the error's.
    job.dogs[1].close()
    assert job.exits[-1] == (EXIT_HUNG, threading.main_thread().name)


def test_a_rank_still_working_holds_the_verdict(tmp_path):
    job = Ranks(tmp_path, 2)
    end = time.monotonic() + 3 * 0.5
    while time.monotonic() < end:  # rank 0 keeps completing steps; rank 1 is overdue
        job.dogs[0].beat(job.dogs[0].step + 1)
        time.sleep(0.05)
    assert job.exits == [] and job.lines == []
    job.wait_for_exits(2, 10)  # rank 0 stops too
    assert job.lines[0].startswith(f"hang: step {4 + 1} stalled")  # the step rank 1 never did


def test_a_silent_rank_is_named(tmp_path):
    job = Ranks(tmp_path, 2, started=[0])  # rank 1's watchdog never beats (a frozen process)
    job.wait_for_exits(1, 10)
    assert "rank 1 stopped answering (process gone or frozen; no stacks)" in job.lines[0]
    assert job.layout.hang_report(0).exists() and not job.layout.hang_report(1).exists()


def test_a_rank_that_failed_is_named(tmp_path):
    job = Ranks(tmp_path, 2)
    job.dogs[1].close(failed=True)  # its loop ended with an error; rank 0 waits on
    job.wait_for_exits(1, 10)
    assert "rank 1 ended with an error (see its log)" in job.lines[0]
    assert "rank 0 stopped outside any collective" in job.lines[0]


def test_a_rank_without_a_store_acts_alone(tmp_path):
    exits, lines = [], []
    dog = Watchdog(
        None, 0, 1, 0.3, 1.2, RunLayout(tmp_path).hang_report, lines.append, 7, exits.append
    )
    dog.beat(7)
    dog.start()
    end = time.monotonic() + 10
    while not exits:
        assert time.monotonic() < end
        time.sleep(0.02)
    assert exits == [EXIT_HUNG] and lines[0].startswith("hang: step 8 stalled on rank 0")


def test_rank_lists_stay_short():
    assert ranks_text([7, 0, 1, 2, 5, 8]) == "0-2, 5, 7-8"
    assert ranks_text(list(range(1024))) == "0-1023"


# ----------------------------------------------------------------------------- bad settings


@pytest.mark.parametrize(
    "sections, message",
    [
        ({"spikes": {"faults": [{"step": 2, "kind": "hang"}]}}, "spikes.faults[0].rank=None"),
        ({"spikes": {"faults": [{"step": 2, "kind": "hang", "rank": 2}]}}, "0 to 1"),
        (
            {"spikes": {"faults": [{"step": 2, "kind": "slow", "rank": 0}]}},
            "spikes.faults[0].seconds=None: a slow fault needs the delay",
        ),
        (
            {"spikes": {"faults": [{"step": 2, "kind": "hang", "rank": 0, "last": 3}]}},
            "blocks for good",
        ),
        (
            {"spikes": {"faults": [{"step": 2, "kind": "nan", "seconds": 1.0}]}},
            "seconds is for kind slow; remove it from a nan fault",
        ),
        (
            {"spikes": {"faults": [{"step": 2, "kind": "nan", "rank": 2}]}},
            "a nan fault on one rank names one of 0 to 1",
        ),
        (
            {
                "train": {"hang_timeout": 0},
                "spikes": {"faults": [{"step": 2, "kind": "hang", "rank": 0}]},
            },
            "with the watchdog off (train.hang_timeout=0.0)",
        ),
        ({"train": {"hang_timeout": -1.0}}, "train.hang_timeout=-1.0 must be >= 0 (seconds;"),
        ({"train": {"hang_timeout": math.inf}}, "train.hang_timeout=inf must be a finite number"),
        (
            {"spikes": {"faults": [{"step": 2, "kind": "slow", "rank": 0, "seconds": -1}]}},
            "spikes.faults[0].seconds=-1 must be > 0",
        ),
        (
            {"train": {"hang_timeout": 60, "hang_timeout_long": 30}},
            "train.hang_timeout_long=30.0 must be >= train.hang_timeout=60.0",
        ),
    ],
)
def test_bad_watchdog_settings_name_the_field(tmp_path, sections, message):
    with pytest.raises(ConfigError) as e:  # as the config is read, or at start (the rank)
        cfg = from_dict(Config, tiny_config(tmp_path / "run", tmp_path, **sections))
        preflight(cfg, 2, check_data=False)
    assert message in str(e.value)


def test_the_watchdog_is_on_by_default_and_off_with_zero_or_null(tmp_path):
    from pretrain.train.callbacks import HangWatchdog, build_callbacks

    def dogs(**train) -> list:
        cfg = from_dict(Config, tiny_config(tmp_path, tmp_path, train=train))
        return [cb for cb in build_callbacks(cfg) if isinstance(cb, HangWatchdog)]

    default = Config().train
    assert (default.hang_timeout, default.hang_timeout_long) == (300.0, None)
    (dog,) = dogs()
    assert (dog.timeout, dog.long_timeout) == (300.0, 1200.0)
    first = build_callbacks(from_dict(Config, tiny_config(tmp_path, tmp_path)))[0]
    assert isinstance(first, HangWatchdog)  # a step's heartbeat comes before its save
    assert dogs(hang_timeout=0) == [] and dogs(hang_timeout=None) == []
