"""Resume on another number of ranks (pretrain/train/reshard.py): the optimizer state
re-partitioned bit for bit, and a 2 -> 1 -> 2 run that trains as if never interrupted."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
import warm_start
from safetensors.torch import load_file
from train_support import (
    REPO,
    baseline_run,
    child_env,
    metrics,
    run_main,
    tiny_config,
    write_config,
)

from pretrain.config import ConfigError, grad_accum_steps, load_config
from pretrain.run_layout import TMP_SUFFIX, UNIVERSAL_DIR
from pretrain.train.reshard import saved_ranks, universal_ready

PROBE = Path(__file__).with_name("reshard_probe.py")
_QUIET = dict(cwd=REPO, env=child_env(), capture_output=True, text=True, timeout=300)
# (name, train section): every ZeRO stage, bf16 and fp32. ZeRO-0 in bf16 accumulates in bf16
# (DeepSpeed cannot accumulate bf16 gradients in fp32 without ZeRO: pretrain/train/config.py).
SETUPS = {
    "z0_fp32": {"zero_stage": 0, "precision": "fp32"},
    "z0_bf16": {"zero_stage": 0, "precision": "bf16", "grad_accum_dtype": "bf16"},
    "z1_fp32": {"zero_stage": 1, "precision": "fp32"},
    "z1_bf16": {"zero_stage": 1, "precision": "bf16"},
    "z2_fp32": {"zero_stage": 2, "precision": "fp32"},
    "z2_bf16": {"zero_stage": 2, "precision": "bf16"},
}


def _probe(mode: str, out: Path, step: int, nproc: int, configs: list[Path]) -> None:
    out.mkdir()
    argv = [str(PROBE), mode, str(out), str(step), *map(str, configs)]
    r = warm_start.run_ranks(argv, child_env(), REPO, 400, nproc)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]


@pytest.fixture(scope="module")
def probes(tmp_path_factory) -> dict[str, Path]:
    """Each setup saved at step 2 by 2 ranks, loaded by 1 (which saves step 3), loaded by 2."""
    root = tmp_path_factory.mktemp("reshard")
    configs = [
        write_config(
            root / f"{name}.yaml",
            tiny_config(root / name, root / "no-data", train=train, checkpoint={"keep_last": 3}),
        )
        for name, train in SETUPS.items()
    ]
    dumps = {"two": root / "two", "one": root / "one", "two_again": root / "two_again"}
    _probe("save", dumps["two"], 2, 2, configs)
    _probe("load", dumps["one"], 2, 1, configs)
    _probe("load", dumps["two_again"], 3, 2, configs)
    return {"root": root, **dumps}


def _assert_equal_states(saved: Path, loaded: Path) -> None:
    a, b = torch.load(saved), torch.load(loaded)
    assert sorted(a) == sorted(b)
    assert len(a) > 3 * 10  # every parameter's fp32 master and both moments, and more
    for key in a:
        assert a[key].dtype == b[key].dtype and torch.equal(a[key], b[key]), key


@pytest.mark.parametrize("name", list(SETUPS))
def test_masters_and_adam_moments_are_bit_identical_on_another_world_size(probes, name):
    """2 ranks save, 1 rank loads; that rank trains on and saves, 2 ranks load: each time the
    full fp32 masters, Adam moments, Adam step and schedule position (gathered by DeepSpeed's
    own API) are the saved ones, bit for bit."""
    _assert_equal_states(probes["two"] / f"{name}.saved.pt", probes["one"] / f"{name}.loaded.pt")
    _assert_equal_states(
        probes["one"] / f"{name}.saved.pt", probes["two_again"] / f"{name}.loaded.pt"
    )
    # Re-partitioned through a universal form only where the state is partitioned (ZeRO-1/2);
    # ZeRO-0 keeps the whole optimizer state in one file that loads on any world size.
    ckpts = probes["root"] / name / "checkpoints"
    partitioned = SETUPS[name]["zero_stage"] > 0
    assert saved_ranks(ckpts / "step_0000002") == (2 if partitioned else None)
    assert saved_ranks(ckpts / "step_0000003") == (1 if partitioned else None)
    for tag in ("step_0000002", "step_0000003"):
        assert (ckpts / tag / UNIVERSAL_DIR).is_dir() == partitioned, tag


def test_two_ranks_then_one_then_two_train_as_the_uninterrupted_run(tmp_path_factory, tmp_path):
    """ZeRO-1 fp32. 2 ranks train and are killed mid-save at step 6 (step 3 is the newest
    checkpoint); 1 rank resumes (its first try killed mid-conversion), trains to 6 and is
    killed after saving; 2 ranks resume and finish. Every step reads the uninterrupted
    1-rank run's data and logs its loss to 1e-6; the final weights agree to 1e-5. Not
    bit-exact: 1 rank sums a step's two micro-batch gradients by accumulation, 2 ranks by an
    all-reduce, which rounds in another order."""
    data, base = baseline_run(tmp_path_factory)  # 1 rank, 8 steps, checkpoints every 3
    run = tmp_path / "run"
    cfg = write_config(tmp_path / "run.yaml", tiny_config(run, data))
    ckpts = run / "checkpoints"

    r = run_main(cfg, 2, PRETRAIN_TEST_KILL_AT="after_engine_save:6")
    assert r.returncode != 0 and (ckpts / "latest").read_text().strip() == "step_0000003"

    r = run_main(cfg, 1, PRETRAIN_TEST_KILL_AT="universal_converted:3")
    assert r.returncode == 137, r.stdout[-2000:] + r.stderr[-2000:]
    step3 = ckpts / "step_0000003"
    assert (step3 / (UNIVERSAL_DIR + TMP_SUFFIX)).is_dir() and not (step3 / UNIVERSAL_DIR).exists()

    r = run_main(cfg, 1, PRETRAIN_TEST_KILL_AT="before_retention:6")
    assert r.returncode == 137, r.stdout[-2000:] + r.stderr[-2000:]
    assert "re-partitioning step_0000003 (written by 2 ranks) for 1" in r.stdout
    assert "random states (dropout) re-seeded" in r.stdout
    assert (ckpts / "latest").read_text().strip() == "step_0000006"

    r = run_main(cfg, 2)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "re-partitioning step_0000006 (written by 1 rank) for 2" in r.stdout
    assert "(step 6, 48 samples)" in r.stdout
    mb, mr = metrics(base), metrics(run)
    assert sorted(mr) == list(range(1, 9))
    for step in range(1, 9):
        assert mr[step]["progress/batch_token_sum"] == mb[step]["progress/batch_token_sum"], step
        assert mr[step]["train/loss"] == pytest.approx(mb[step]["train/loss"], abs=1e-6), step
        assert mr[step]["train/lr"] == pytest.approx(mb[step]["train/lr"], rel=1e-12), step
    wb = load_file(str(base / "checkpoints" / "step_0000008" / "model.safetensors"))
    wr = load_file(str(ckpts / "step_0000008" / "model.safetensors"))
    assert max(float((wb[k] - wr[k]).abs().max()) for k in wb) < 1e-5


def test_a_world_size_that_cannot_hold_the_global_batch_is_one_line(tmp_path):
    """Global batch 8 of micro batches of 4 cannot be split over 3 ranks: the one line names
    the world sizes that can resume the run with its global batch."""
    cfg = load_config(write_config(tmp_path / "run.yaml", tiny_config(tmp_path, tmp_path)))
    assert grad_accum_steps(cfg, 2) == 1 and grad_accum_steps(cfg, 1) == 2
    with pytest.raises(ConfigError) as e:
        grad_accum_steps(cfg, 3)
    assert "\n" not in str(e.value)
    assert "train.global_batch_size=8 is not divisible by" in str(e.value)
    assert str(e.value).endswith("world sizes that can hold it: 1, 2")


def test_the_offline_tool_converts_once_and_again_when_damaged(probes):
    """tools/reshard_checkpoint.py writes the universal form a resume would, reuses it when
    intact, and makes it again when a file of it is damaged."""
    ckpts = probes["root"] / "z2_bf16" / "checkpoints"
    folder = ckpts / "step_0000004"  # saved by 2 ranks; nothing has loaded it yet
    tool = [sys.executable, str(REPO / "tools" / "reshard_checkpoint.py"), "--run"]
    r = subprocess.run([*tool, str(probes["root"] / "z2_bf16"), "--workers", "1"], **_QUIET)
    assert r.returncode == 0, r.stderr[-2000:]
    assert f"{folder / UNIVERSAL_DIR}: written in" in r.stdout
    assert "world sizes that can resume it: 1, 2" in r.stdout
    assert universal_ready(folder)
    victim = next((folder / UNIVERSAL_DIR).rglob("exp_avg.pt"))
    raw = bytearray(victim.read_bytes())
    raw[len(raw) // 2] ^= 0xFF  # one byte flipped
    victim.write_bytes(bytes(raw))
    assert not universal_ready(folder)
    r = subprocess.run([*tool, str(folder), "--workers", "1"], **_QUIET)
    assert r.returncode == 0 and "written in" in r.stdout, r.stderr[-2000:]
    r = subprocess.run([*tool, str(folder)], **_QUIET)
    assert "already there, intact" in r.stdout and universal_ready(folder)
