"""Where each rank's step time goes (pretrain/train/step_parts.py) and the straggler line:
the parts timed and gathered at logging steps, a rank slowed by the `slow` fault named in one
line within train.straggler_steps logged steps on 2 real CPU ranks, none in an unfaulted run."""

from __future__ import annotations

import time

import pytest
import torch
from train_support import metrics, run_main, stdlib_data, tiny_config, write_config

from pretrain.train.step_parts import OWN, PARTS, PartTimer, StragglerWatch


def test_the_timer_sums_each_part_and_starts_over():
    timer = PartTimer(torch.device("cpu"))
    for _ in range(3):
        with timer.part("forward"):
            time.sleep(0.01)
    with timer.part("collective"):
        pass
    got = timer.take()
    assert set(got) == set(PARTS)
    assert 0.03 <= got["forward"] < 1.0 and got["collective"] < got["forward"]
    assert got["data"] == got["backward"] == got["optimizer"] == 0.0
    assert timer.take() == dict.fromkeys(PARTS, 0.0)


def _parts(data: float, forward: float, backward: float = 0.1) -> dict[str, float]:
    return {"data": data, "forward": forward, "backward": backward, "optimizer": 0.0,
            "collective": 0.0}  # fmt: skip


def test_a_rank_slow_for_the_stated_steps_is_named_once():
    watch = StragglerWatch(0.5, 3, ["a", "b", "c"])
    healthy = [_parts(0.01, 0.05), _parts(0.012, 0.05), _parts(0.01, 0.052)]
    slow = [_parts(0.01, 0.05), _parts(0.01, 0.30, backward=0.0), _parts(0.01, 0.05)]
    assert watch.update(healthy) == []
    assert watch.update(slow) == [] and watch.update(slow) == []
    (named,) = watch.update(slow)  # the third logged step in a row
    assert (named.rank, named.host, named.part, named.steps) == (1, "b", "forward", 3)
    line = named.line()
    assert line.startswith("straggler: rank 1 on b has taken 5.2x the median")
    assert "its slow part: forward (0.3 s against 0.05 s)" in line and "\n" not in line
    assert watch.update(slow) == []  # named once ...
    watch.update(healthy)
    for _ in range(2):
        assert watch.update(slow) == []
    assert [s.rank for s in watch.update(slow)] == [1]  # ... and again after it recovered
    # waiting is not slowness: a rank that waits in backward is not named
    waiting = [_parts(0.01, 0.05, backward=2.0), _parts(0.01, 0.05), _parts(0.01, 0.05)]
    assert not any(watch.update(waiting) for _ in range(5))
    # microseconds of noise on a tiny model are not a straggler (the floor)
    tiny = [_parts(1e-5, 1e-4), _parts(1e-5, 5e-4), _parts(1e-5, 1e-4)]
    assert not any(StragglerWatch(0.5, 1, ["a", "b", "c"]).update(tiny) for _ in range(3))


def _two_ranks(tmp_path, data, name: str, faults: list[dict]):
    cfg = tiny_config(
        tmp_path / name,
        data,
        train={"train_iters": 8, "eval_interval": 1000, "straggler_steps": 3},
        checkpoint={"interval": 1000},
        logging={"log_interval": 1, "max_logit_interval": 0},
        spikes={"faults": faults},
    )
    r = run_main(write_config(tmp_path / f"{name}.yaml", cfg), nproc=2)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return r, metrics(tmp_path / name)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return stdlib_data(tmp_path_factory)


def test_a_slowed_rank_is_named_within_three_logged_steps(tmp_path, data):
    slow = {"kind": "slow", "step": 2, "last": 8, "rank": 1, "seconds": 0.3}
    r, rows = _two_ranks(tmp_path, data, "slow", [slow])
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("straggler:")]
    assert len(lines) == 1, r.stdout[-3000:]  # once, from rank 0
    assert lines[0].startswith("straggler: rank 1 on ") and "its slow part: forward" in lines[0]
    # named at logged step 4 (slow from step 2: steps 2, 3, 4) as that step ends, before its
    # values are published (and long before the hang watchdog)
    out = r.stdout.splitlines()
    at = out.index(lines[0])
    assert any(ln.startswith("step 3/8") for ln in out[:at]), out[: at + 1]
    assert not any(ln.startswith("step 4/8") for ln in out[:at])
    # the parts: the slow rank's forward is the maximum, the other rank waits for it
    assert rows[3]["perf/part/forward_max_s"] > 0.25 and rows[3]["perf/step_time_max_rank_id"] == 1
    waited = max(rows[3][f"perf/part/{k}_max_s"] for k in ("backward", "optimizer", "collective"))
    assert waited > 0.2  # rank 0 waits for it in the first collective after the slow forward
    assert set(OWN) < set(PARTS)


def test_no_straggler_line_in_an_unfaulted_run(tmp_path, data):
    r, rows = _two_ranks(tmp_path, data, "healthy", [])
    assert "straggler:" not in r.stdout
    for k in PARTS:
        assert rows[8][f"perf/part/{k}_max_s"] >= rows[8][f"perf/part/{k}_s"] >= 0.0
