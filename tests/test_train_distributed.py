"""Rank variables from every launcher: torchrun/deepspeed, srun (SLURM_*), plain python."""

from __future__ import annotations

from pathlib import Path

import pytest

from pretrain.config import ConfigError
from pretrain.train import distributed
from pretrain.train.distributed import first_host, setup_env, slurm_master_port


def test_slurm_variables_become_torch_variables():
    env = {
        "SLURM_PROCID": "5",
        "SLURM_LOCALID": "1",
        "SLURM_NTASKS": "8",
        "SLURM_JOB_ID": "4242",
        "MASTER_ADDR": "node001",
    }
    d = setup_env(env)
    assert (d.rank, d.local_rank, d.world_size, d.launcher) == (5, 1, 8, "slurm")
    assert (env["RANK"], env["LOCAL_RANK"], env["WORLD_SIZE"]) == ("5", "1", "8")
    assert env["MASTER_ADDR"] == "node001" and env["MASTER_PORT"] == str(10000 + 4242 % 20000)
    # Every job's port lies below the ephemeral ports another connection could hold.
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    assert all(slurm_master_port(job) < low for job in (0, 19999, 20000, 4242, 16518167))


def test_launcher_variables_win_over_slurm():
    env = {
        "RANK": "2",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "4",
        "MASTER_ADDR": "h",
        "MASTER_PORT": "1234",
        "SLURM_PROCID": "0",
        "SLURM_NTASKS": "1",
    }
    d = setup_env(env)
    assert (d.rank, d.world_size, d.launcher) == (2, 4, "torch") and env["MASTER_PORT"] == "1234"


def test_plain_python_is_a_world_of_one_with_a_free_port():
    env: dict[str, str] = {}
    d = setup_env(env)
    assert (d.rank, d.local_rank, d.world_size, d.launcher) == (0, 0, 1, "single")
    assert env["MASTER_ADDR"] == "127.0.0.1" and int(env["MASTER_PORT"]) > 0


def test_multi_node_slurm_without_a_node_list_says_what_to_set():
    env = {"SLURM_PROCID": "0", "SLURM_NTASKS": "16"}
    with pytest.raises(ConfigError, match="MASTER_ADDR"):
        setup_env(env)


def test_master_address_is_the_first_node_of_the_job(monkeypatch):
    def no_scontrol(*args, **kwargs):  # as outside a job: fall back to parsing the list
        raise FileNotFoundError("scontrol")

    monkeypatch.setattr(distributed.subprocess, "run", no_scontrol)
    env = {"SLURM_PROCID": "0", "SLURM_NTASKS": "16", "SLURM_JOB_NODELIST": "gpu[007-008,012],cpu1"}
    setup_env(env)
    assert env["MASTER_ADDR"] == "gpu007"
    assert first_host("node17") == "node17" and first_host("a1,b2") == "a1"
