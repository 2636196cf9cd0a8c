"""Loss spikes with the real DeepSpeed engine: a flagged step's update is withheld bit for bit
(ZeRO 0/1/2, fp32 and bf16), a rollback equals a run whose data omitted the skipped window,
and a kill in the middle of a rollback resumes into the same run (2 ranks)."""

from __future__ import annotations

import json
import os

import pytest
import torch
from train_support import metrics, run_main, stdlib_data, tiny_config, write_config

from pretrain.config import Config, ConfigError, from_dict
from pretrain.faults import PAUSE_ENV
from pretrain.run_layout import step_tag
from pretrain.train.callbacks import Callback
from pretrain.train.schedule import lr_at
from pretrain.train.sinks import build_sinks
from pretrain.train.spikes import DataWindows, SpikeDetector, _inner_optimizer, read_rollbacks
from pretrain.train.trainer import Trainer


@pytest.fixture
def isolated_env(monkeypatch):
    """The trainer maps launcher variables into os.environ; keep that out of the test process."""
    keep = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    monkeypatch.setattr(os, "environ", {k: v for k, v in os.environ.items() if k not in keep})


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return stdlib_data(tmp_path_factory)


class StateProbe(Callback):
    """After every step: the module's parameters, and every tensor the inner optimizer holds
    (the fp32 master weights it steps and their moments and step counts), cloned."""

    def __init__(self) -> None:
        self.after: dict[int, list[torch.Tensor]] = {}
        self.verdicts = {}
        self.lrs: dict[int, float] = {}
        self.scalars: dict[int, dict[str, float]] = {}

    def on_step_end(self, trainer, out) -> None:
        inner = _inner_optimizer(trainer.run.module.engine)
        masters = [p for g in inner.param_groups for p in g["params"]]
        tensors = [p.detach().clone() for p in trainer.run.module.model.parameters()]
        tensors += [m.detach().clone() for m in masters]
        for m in masters:
            for _, v in sorted(inner.state.get(m, {}).items()):
                if isinstance(v, torch.Tensor):
                    tensors.append(v.detach().clone())
        self.after[out.step] = tensors
        self.lrs[out.step] = out.lr

    def on_values(self, trainer, outs) -> None:  # the steps' verdicts and every scalar
        for out in outs:
            self.verdicts[out.step] = out.verdict
            self.scalars[out.step] = dict(out.scalars)


def _cfg(run, data, **sections) -> Config:
    return from_dict(Config, tiny_config(run, data, **sections))


def _bitwise_equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(
        x.dtype == y.dtype
        and torch.equal(x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8))
        for x, y in zip(a, b, strict=True)
    )


@pytest.mark.parametrize(
    "zero_stage,precision",
    # DeepSpeed's three step paths: the bare optimizer (ZeRO 0, fp32), BF16_Optimizer (bf16
    # ZeRO 1), DeepSpeedZeroOptimizer (ZeRO 2; also fp32 ZeRO 1).
    [(0, "fp32"), (1, "bf16"), (2, "bf16")],
)
def test_flagged_step_applies_no_update(tmp_path, data, isolated_env, zero_stage, precision):
    """A NaN loss (step 5) and a grad-norm blow-up with a normal loss (step 14): with
    spikes.skip_step the state after the step is bit-identical to the state before it, the
    Adam step counts included, while the steps around them do update."""
    cfg = _cfg(
        tmp_path / "run",
        data,
        train={
            "train_iters": 15,
            "zero_stage": zero_stage,
            "precision": precision,
        },
        spikes={
            "window": 20,
            "skip_step": True,
            "faults": [
                {"step": 5, "kind": "nan"},
                {"step": 14, "kind": "scale_grads", "factor": 1e4},
            ],
        },
        checkpoint={"interval": 1000},
    )
    probe = StateProbe()
    assert Trainer(cfg, callbacks=[probe], save_checkpoints=False).fit() == 0
    for step in (5, 14):
        assert probe.verdicts[step].skipped, probe.verdicts[step]
        assert _bitwise_equal(probe.after[step], probe.after[step - 1]), step
    assert probe.verdicts[14].grad_spike is not None and probe.verdicts[14].loss_spike is None
    flagged = [s for s, v in probe.verdicts.items() if v.flagged]
    assert flagged == [5, 14]
    for step in (4, 6, 13, 15):  # a normal step changes the state
        assert not _bitwise_equal(probe.after[step], probe.after[step - 1]), step
    # The LR schedule follows the step number over skipped steps (whoever skipped them).
    for step, lr in probe.lrs.items():
        assert lr == pytest.approx(lr_at(step, cfg.optim.lr, cfg.schedule, 15), rel=1e-12)


def test_without_mitigation_a_nan_step_is_applied(tmp_path, data, isolated_env):
    """Mitigation off (the default): the step is flagged and logged, and the update happens,
    as before this feature (ZeRO 0 in fp32 has no overflow check of its own)."""
    cfg = _cfg(
        tmp_path / "run",
        data,
        train={"train_iters": 6, "zero_stage": 0, "z_loss": 1e-3},
        spikes={"faults": [{"step": 5, "kind": "nan"}]},
        checkpoint={"interval": 1000},
    )
    probe = StateProbe()
    assert Trainer(cfg, callbacks=[probe], save_checkpoints=False).fit() == 0
    assert probe.verdicts[5].flagged and not probe.verdicts[5].skipped
    assert not probe.after[5][0].isfinite().all()  # the NaN reached the weights
    # z-loss on: the added term (1e-3 x lse^2, lse about log(257) = 5.5 at initialisation) is
    # logged apart from train/loss.
    z = probe.scalars[1]["train/z_loss"]
    assert 1e-3 * 4.0**2 < z < 1e-3 * 7.0**2


ROLLBACK = {
    "skip_step": True,
    "rollback_after": 3,
    "rollback_within": 5,
    "faults": [{"step": s, "kind": "nan"} for s in (9, 10, 11)],
}
WINDOW = [9, 11]  # the data steps the rollback skips: from the first spike to the rollback


def _rollback_config(run, data, spikes) -> dict:
    return tiny_config(
        run,
        data,
        train={"train_iters": 16, "eval_interval": 1000},
        checkpoint={"interval": 5, "keep_last": 3},
        spikes=spikes,
    )


def _final_weights(run) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(run / "checkpoints" / step_tag(16) / "model.safetensors"))


def test_rollback_equals_a_run_without_the_window(tmp_path, data, isolated_env, capsys):
    """Spikes at steps 9-11 roll back to checkpoint 5 (checkpoint 10, past the first spike, is
    removed) and skip data steps 9-11: every step, and the final weights, equal a run that was
    told to skip those data steps from the start. The rolled run saves asynchronously, the
    write of checkpoint 10 held 2 s: the rollback waits for it, then removes it."""
    rolled, plain = tmp_path / "rolled", tmp_path / "plain"
    cfg = from_dict(Config, _rollback_config(rolled, data, ROLLBACK))
    cfg.checkpoint.async_ = True
    os.environ[PAUSE_ENV] = "async_write:10:2"  # os.environ is isolated_env's dict
    assert Trainer(cfg).fit() == 0
    del os.environ[PAUSE_ENV]
    out = capsys.readouterr().out
    ref = from_dict(Config, _rollback_config(plain, data, {"skip_data": [WINDOW]}))
    assert Trainer(ref).fit() == 0

    (r,) = read_rollbacks(rolled)
    assert (r.at_step, r.to_step, r.first_spike, list(r.skip)) == (11, 5, 9, WINDOW)
    assert "rollback 1:" in out and f"removing checkpoint {step_tag(10)}" in out
    mr, mp = metrics(rolled), metrics(plain)
    assert sorted(mr) == sorted(mp) == list(range(1, 17))
    for step in range(1, 17):
        assert mr[step]["train/loss"] == mp[step]["train/loss"], step
    assert mr[5]["spikes/rollbacks"] == 1 and mr[5]["spikes/rollback_from"] == 11
    final_r, final_p = _final_weights(rolled), _final_weights(plain)
    assert final_r.keys() == final_p.keys()
    assert all(torch.equal(final_r[k], final_p[k]) for k in final_r)
    # TensorBoard holds the rollback, and the loss of each step once (the purged branch gone).
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(rolled / "tensorboard"), size_guidance={"scalars": 0})
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("spikes/rollbacks")] == [(5, 1.0)]
    tb_loss = [e.step for e in acc.Scalars("train/loss")]
    assert tb_loss == list(range(1, 17))


def test_kill_in_a_rollback_resumes_into_the_same_run_on_two_ranks(tmp_path, data):
    """2 ranks: killed (SIGKILL) right after the rollback was recorded, before it removed the
    stale checkpoint and loaded the old one; the re-run finishes the rollback and ends equal,
    step for step, to a 2-rank run whose data omitted the window."""
    rolled, plain = tmp_path / "rolled", tmp_path / "plain"
    cfg = write_config(tmp_path / "rolled.yaml", _rollback_config(rolled, data, ROLLBACK))
    killed = run_main(cfg, nproc=2, PRETRAIN_TEST_KILL_AT="rollback_recorded")
    assert killed.returncode != 0
    assert (rolled / "checkpoints" / step_tag(10)).is_dir()  # not yet removed
    assert len(read_rollbacks(rolled)) == 1
    resumed = run_main(cfg, nproc=2)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert f"removing checkpoint {step_tag(10)}" in resumed.stdout
    assert "resumed from" in resumed.stdout and "(step 5," in resumed.stdout
    ref_cfg = write_config(
        tmp_path / "plain.yaml", _rollback_config(plain, data, {"skip_data": [WINDOW]})
    )
    ref = run_main(ref_cfg, nproc=2)
    assert ref.returncode == 0, ref.stdout + ref.stderr
    mr, mp = metrics(rolled), metrics(plain)
    assert sorted(mr) == sorted(mp) == list(range(1, 17))
    for step in range(1, 17):
        assert mr[step]["train/loss"] == mp[step]["train/loss"], step
    final_r, final_p = _final_weights(rolled), _final_weights(plain)
    assert all(torch.equal(final_r[k], final_p[k]) for k in final_r)
    assert len(read_rollbacks(rolled)) == 1  # the re-run did not roll back a second time
    assert json.loads((rolled / "rollbacks.json").read_text())[0]["skip"] == WINDOW


def test_detector_scores_grad_norm_and_nan():
    det = SpikeDetector(window=20, threshold=6.0)
    rng = torch.Generator().manual_seed(0)
    norms = (1.0 + 0.05 * torch.randn(30, generator=rng)).abs().tolist()
    assert [s for s, v in enumerate(norms) if det.update(s, v)] == []
    assert det.update(30, 50.0).score > 6
    assert det.update(31, float("inf")).score == float("inf")
    assert det.update(32, float("nan")) is not None


def test_data_windows_skip_overlapping_ranges():
    w = DataWindows([(9, 11), (12, 13), (20, 20)])
    assert [w.next_data_step(s) for s in (8, 9, 11, 12, 14, 20)] == [8, 14, 14, 14, 14, 21]


@pytest.mark.parametrize(
    "spikes,message",
    [
        ({"window": 1}, "spikes.window=1 must be >= 2"),
        ({"rollback_after": 3, "rollback_within": 2}, "spikes.rollback_within=2"),
        ({"skip_data": [[5, 3]]}, "spikes.skip_data[0]=[5, 3]"),
        ({"skip_data": [[0, 3]]}, "spikes.skip_data[0][0]=0 must be >= 1"),
        ({"faults": [{"step": 0}]}, "spikes.faults[0].step=0 must be >= 1"),
        ({"faults": [{"step": 3, "kind": "boom"}]}, "spikes.faults[0].kind='boom'"),
    ],
)
def test_bad_spike_settings_name_the_field(tmp_path, data, spikes, message):
    with pytest.raises(ConfigError) as e:
        _cfg(tmp_path, data, spikes=spikes)  # refused as the config is read
    assert message in str(e.value)


def test_old_spike_keys_say_where_they_moved(tmp_path, data):
    raw = tiny_config(tmp_path, data, logging={"spike_window": 30})
    with pytest.raises(ConfigError, match="logging.spike_window is now spikes.window"):
        from_dict(Config, raw)


def test_mitigation_is_off_by_default():
    cfg = Config()
    assert not cfg.spikes.skip_step and cfg.spikes.rollback_after == 0
    assert cfg.train.z_loss == 0 and cfg.model.attn_logit_softcap == 0
    assert not cfg.spikes.faults and not cfg.spikes.skip_data
    assert [type(s).__name__ for s in build_sinks(cfg)][0] == "Console"  # spike warnings
