"""The optional PositionEvaluation evaluator: loss by position during training."""

from __future__ import annotations

from train_support import baseline_run, metrics, run_main, tiny_config, write_config

from pretrain.eval.positions import position_ranges


def test_position_ranges_cover_the_sequence():
    assert position_ranges(32) == [(0, 16), (16, 32)]
    assert position_ranges(2048) == [(0, 16), (16, 256), (256, 512), (512, 1024), (1024, 2048)]


def test_training_logs_loss_by_position_that_averages_to_the_valid_loss(tmp_path_factory, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    data, _ = baseline_run(tmp_path_factory)
    cb = {"class": "pretrain.train.evaluators.PositionEvaluation", "interval": 4}
    cfg = tiny_config(tmp_path / "run", data)
    cfg["callbacks"] = [cb]
    r = run_main(write_config(tmp_path / "run.yaml", cfg))
    assert r.returncode == 0, r.stdout + r.stderr
    m = metrics(tmp_path / "run")
    for step in (4, 8):
        first, rest = m[step]["valid_position/0-16"], m[step]["valid_position/16-32"]
        # Full rows: both ranges hold the same number of tokens, over the same batches as
        # valid/loss, so their mean is the valid loss.
        assert abs((first + rest) / 2 - m[step]["valid/loss"]) < 1e-6
    events = EventAccumulator(str(tmp_path / "run" / "tensorboard"), size_guidance={"images": 0})
    events.Reload()
    images = events.Images("valid_position/curve")
    assert [i.step for i in images] == [4, 8]
    assert images[0].encoded_image_string[:8] == b"\x89PNG\r\n\x1a\n"
