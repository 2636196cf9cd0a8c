"""The planner: live-tensor accounting, DeepSpeed's buffers and FLOPs against formulas
written out here, the choice of recompute, the command line, and the plan of real
DeepSpeed steps checked against the CPU allocator (torch's profiler)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from pretrain import planner as P
from pretrain.cli import plan as plan_cli
from pretrain.config import ConfigError
from pretrain.planner import trace, validation

MiB = 2**20


# ----------------------------------------------------------------------------- accounting


def test_live_tensors_counts_new_storages_once_and_frees_them():
    keep = torch.zeros(1000)  # exists before: never counted
    with P.LiveTensors() as acct:
        a = torch.empty(256, dtype=torch.float32)  # 1 KiB
        b = a.view(16, 16).t()  # a view: same storage
        keep.add_(1)  # in place on an old storage
        c = torch.empty(512, dtype=torch.bfloat16)  # 1 KiB
        assert acct.live == 2048
        del a, b
        assert acct.live == 1024  # a's storage died with its last view
        d = torch.ones(1024, dtype=torch.float64)  # 8 KiB
        del c, d
    assert acct.live == 0
    assert acct.peak == 1024 + 8192


def test_cpu_workspace_of_mixed_dtype_pointwise_ops():
    a, b = torch.zeros(100), torch.zeros(100, dtype=torch.bfloat16)
    ws = P.cpu_kernel_workspace
    assert ws(torch.ops.aten.add_.Tensor, (a, b), {}) == 400  # b cast to fp32
    assert ws(torch.ops.aten.add_.Tensor, (b, a), {}) == 800  # b cast, and an fp32 result
    assert ws(torch.ops.aten.add_.Tensor, (a, a), {}) == 0


def test_flash_attention_stand_in_allocates_as_flash_attention_2():
    B, H, KV, T, D = 2, 8, 2, 200, 64
    with FakeTensorMode():
        q = torch.empty(B, H, T, D, dtype=torch.bfloat16, requires_grad=True)
        k = torch.empty(B, KV, T, D, dtype=torch.bfloat16, requires_grad=True)
        v = torch.empty(B, KV, T, D, dtype=torch.bfloat16, requires_grad=True)
        with P.LiveTensors() as acct:
            out = trace._flash_sdpa(q, k, v, is_causal=True, enable_gqa=True)
            fwd = acct.live
            out.backward(torch.empty_like(out))
    bf, f32 = 2, 4
    assert fwd == B * T * H * D * bf + B * H * T * f32  # out + log-sum-exp
    grads = (B * T * H * D + 2 * B * T * KV * D) * bf  # dq, dk, dv
    t_r = 256  # seqlen rounded to 128
    work = B * H * t_r * f32 + B * t_r * H * D * f32 + 2 * B * T * H * D * bf  # GQA: dk/dv expanded
    assert acct.peak - fwd == grads + work + B * T * H * D * bf  # + the incoming gradient


# ----------------------------------------------------------------------------- formulas


def test_deepspeed_buffers_of_the_bf16_optimizer():
    groups = [[1000, 3000], [10, 10]]  # decay, no decay
    N = 8
    ds = P.deepspeed_memory(groups, N, "bf16", "fp32", 1, fused_adam=True)
    flat = [4000, 32]  # each group padded to a multiple of 2 x N = 16
    assert ds.optimizer == "BF16_Optimizer"
    assert ds.static == {
        "bf16 weights (flat)": 2 * sum(flat),
        "fp32 gradient buffer (whole model)": 4 * sum(flat),  # every parameter, not 1/N
        "fp32 master weights (1/N)": 4 * sum(flat) // N,
        "Adam moments (1/N)": 8 * sum(flat) // N,
    }
    assert ds.grads == 2 * 4020
    assert ds.after_backward == 4 * 3000  # fp32 copy of the largest gradient
    assert ds.step == 0  # FusedAdam
    assert P.deepspeed_memory(groups, N, "bf16", "fp32", 1, fused_adam=False).step == 8 * 4000 // N


def test_deepspeed_buffers_of_the_zero_optimizer():
    ds = P.deepspeed_memory([[10**6]], 4, "bf16", "bf16", 1, fused_adam=True)
    assert ds.optimizer.startswith("DeepSpeedZeroOptimizer")
    assert ds.grads == 2 * 10**6
    assert ds.backward == 2 * P.REDUCE_BUCKET  # reduce bucket of the parameters' dtype
    over = {"zero_optimization": {"reduce_bucket_size": 1000, "overlap_comm": True}}
    assert P.deepspeed_memory([[10**6]], 4, "bf16", "bf16", 1, True, over).backward == 2 * 2 * 1000


def test_flops_per_token_with_recompute():
    cfg = P.validation_config(P.VALIDATION_SHAPES["llama (GQA, sequential)"]).model
    T = 256
    d, L, H, KV, hd, ff, V = 64, 4, 4, 2, 16, 192, 512
    block = d * (H + 2 * KV) * hd + H * hd * d + d * 2 * ff + ff * d
    model = 6 * (L * block + V * d) + 12 * L * H * hd * T
    for n in (0, 2, 4):
        got = P.flops_per_token(cfg, T, n)
        assert got[0] == model
        assert got[1] == model + n * (2 * block + 4 * H * hd * T)


def test_time_and_slurm_hours():
    cfg = P.validation_config(P.VALIDATION_SHAPES["llama (GQA, sequential)"], micro_batch=2)
    plan = P.plan_run(cfg, P.GPUS["h200"], 1, layers=4)
    tokens = cfg.train.global_batch_size * 256
    assert plan.step_time(0.5) == pytest.approx(plan.model_flops * tokens / (989e12 * 0.5))
    assert plan.run_time(1.0) == pytest.approx(10 * plan.step_time(1.0))
    assert plan.gpu_hours(1.0) == pytest.approx(plan.run_time(1.0) / 3600)
    assert P.slurm_hours(plan) == 1  # seconds of work: the half-hour margin, rounded up


# ----------------------------------------------------------------------------- choices


def test_choose_takes_the_least_recompute_that_fits():
    cfg = P.validation_config(
        P.VALIDATION_SHAPES["pythia (parallel, MHA)"], seq_len=128, accumulation=2
    )
    cfg.train.compile = False  # the eager step: compile's auto is tests/test_plan_compiled.py's
    peaks = {n: P.plan_run(cfg, P.GPUS["h200"], 1, layers=n).peak for n in range(5)}
    assert all(peaks[n] > peaks[n + 1] for n in range(4))  # more recompute, less memory
    gpu = P.GPU("test", (peaks[2] + peaks[1]) // 2, 1e12)  # fits with 2, not with 1
    plan = P.choose(cfg, gpu, 1, change_micro_batch=False, reserve=0)
    assert plan.layers == 2 and plan.fits
    assert P.choose(cfg, P.GPU("tiny", peaks[4] // 2, 1e12), 1, False, reserve=0) is None
    # Allowed to halve the micro batch (global batch kept), it needs less recompute.
    halved = P.choose(cfg, gpu, 1, change_micro_batch=True, reserve=0)
    assert halved.micro_batch * halved.grad_accum == 8
    assert halved.executed_flops <= plan.executed_flops


def test_cli_plan_and_errors(tmp_path, capsys):
    cfg = tmp_path / "tiny.yaml"
    cfg.write_text(
        "model: {vocab_size: 512, n_layers: 2, d_model: 64, n_heads: 4, d_ff: 128, max_seq_len: 128}\n"
        "train: {train_iters: 100, global_batch_size: 16, micro_batch_size: 4, "
        "activation_checkpointing: auto}\n"
    )
    assert plan_cli.main([str(cfg), "--gpu", "h100", "--gpus", "2"]) == 0
    out = capsys.readouterr().out
    for words in (
        "FITS",
        "train peak",
        "eval peak",
        "largest micro batch",
        "executed",
        "at 40% MFU",
        "GPU-hours",
        "auto picked micro batch 4 x 2 accumulation, recompute: none",
    ):
        assert words in out
    for argv, words in (
        (["--gpu", "a100"], "--gpu 'a100' is unknown; use h100, h200 or a memory size in GiB"),
        (["--checkpointing", "some"], "train.activation_checkpointing='some'"),
        (["--checkpointing", "9"], "train.activation_checkpointing=9 is not a number of layers"),
        (["--gpus", "3"], "divisible"),
        (["--mfu", "40"], "--mfu 40.0 must be in (0, 1]"),
    ):
        assert plan_cli.main([str(cfg), *argv]) == 2
        err = capsys.readouterr().err.strip()
        assert err.count("\n") == 0 and words in err, err


# ----------------------------------------------------------------------------- the check


def test_plan_equals_the_cpu_allocator_within_half_a_percent(monkeypatch):
    """A real DeepSpeed step (bf16, ZeRO-1, fp32 gradient accumulation, BF16_Optimizer; 2 of
    4 blocks recomputed) of three model shapes, measured by c10's CPU allocator through
    torch's profiler, against the plan for the CPU (the same tracer, CPU kernels). Micro
    batch 2 x 128 here (`tools/plan.py --validate`: 4 x 256) to keep the test short. The
    tolerance is the one docs/performance.md states, on any x86 CPU: every measured step runs
    with torch's oneDNN switch off, so bf16 matmuls take ATen's GEMM (ATen checks
    `userEnabledMkldnn()` before the CPU; oneDNN's scratch on AVX-512-BF16 is not planned),
    and with the one-rank all-reduce inline (validation.one_rank_all_reduce_inline: gloo's thread
    freed a buffer the profiler never saw, failing about one run in five)."""
    assert P.VALIDATION_TOLERANCE <= 0.005
    profile_steps, seen, all_reduce = validation._profile_steps, [], torch.distributed.all_reduce

    def watched(*args, **kwargs):
        seen.append((torch.backends.mkldnn.enabled, torch.distributed.all_reduce is all_reduce))
        return profile_steps(*args, **kwargs)

    monkeypatch.setattr(validation, "_profile_steps", watched)
    before = torch.backends.mkldnn.enabled
    results = P.validate(micro_batch=2, seq_len=128)
    # oneDNN off and the one-rank all-reduce inline in every window; both back afterwards
    assert seen == [(False, False)] * 3
    assert torch.backends.mkldnn.enabled == before and torch.distributed.all_reduce is all_reduce
    assert len(results) == 6  # training and evaluation of each shape
    for v in results:
        assert abs(v.error) <= P.VALIDATION_TOLERANCE, (v.name, v.predicted, v.measured)


def test_bad_gpu_and_auto_without_choice():
    with pytest.raises(ConfigError, match="--gpu '0'"):
        P.parse_gpu("0")
    assert P.parse_gpu("80").memory == 80 * 2**30
    cfg = P.validation_config(P.VALIDATION_SHAPES["llama (GQA, sequential)"], layers=0)
    cfg.train.activation_checkpointing = "auto"
    with pytest.raises(ConfigError, match="auto"):
        P.plan_run(cfg, P.GPUS["h100"], 1)
    assert P.resolve_activation_checkpointing(cfg, 1, torch.device("cpu")) == 0


# ----------------------------------------------------------------------------- paper runs


def test_paper_plan_covers_every_run_and_meets_the_targets():
    """pretrain/sweep_plan.json (`tools/plan.py --paper --write`): every run of the grid,
    planned; each fits an H200 and an H100 as configured; with `auto` on an H200 every 1B
    run executes at most 1.15x the model's FLOPs."""
    import json

    from pretrain.study import load_study

    paper = load_study(Path(__file__).resolve().parents[1] / "studies" / "partial_rope.yaml")
    rows = {r["name"]: r for r in json.loads(P.PAPER_PLAN.read_text())["runs"]}
    assert set(rows) == {run.name for run in paper.runs}
    for name, r in rows.items():
        assert r["fits_h200"] and r["fits_h100"], name
        auto = r["auto_h200"]
        assert auto["train_peak_gib"] + 2 + 0.05 * 140.4 <= 140.4, name
        if "1b" in name:
            assert auto["recompute_ratio"] <= 1.15, name
            assert auto["micro_batch"] * auto["grad_accum"] * 32 == r["global_batch"], name
        assert 1 <= auto["slurm_hours"] <= P.SLURM_MAX_HOURS


def test_paper_plan_is_current():
    """Re-plan one paper run as configured: the stored row holds the same figures."""
    import json

    from pretrain.config import load_config

    name = "pythia1b_rope10"
    stored = {r["name"]: r for r in json.loads(P.PAPER_PLAN.read_text())["runs"]}[name]
    cfg = load_config(Path(__file__).resolve().parents[1] / "configs" / "paper" / f"{name}.yaml")
    fresh = P.plan_run(cfg, P.GPUS["h200"], 32)
    assert round(fresh.train_peak / 2**30, 2) == stored["train_peak_gib"]
    assert round(fresh.eval_peak / 2**30, 2) == stored["eval_peak_gib"]
    assert (fresh.micro_batch, fresh.layers, fresh.executed_flops) == (
        stored["micro_batch"],
        stored["checkpointing"],
        stored["executed_flops"],
    )


def test_document_mask_counts_only_the_attended_pairs(tmp_path, paragraphs):
    """With data.document_mask the executed FLOPs count the attention pairs the mask keeps
    (measured on data.train's documents); the model FLOPs, MFU's numerator, do not change;
    the mask's and the per-token cos/sin's bytes are planned."""
    from pretrain.config import load_config
    from pretrain.data.dataset import document_lengths
    from pretrain.data.documents import attended_fraction
    from pretrain.planner.search import document_buffers, document_fraction, flops_per_token

    data = paragraphs
    REPO = Path(__file__).resolve().parents[1]
    sets = ["data.document_mask=true", "data.position_reset=true", f"data.train=[{data}]"]
    cfg = load_config(REPO / "configs" / "quickstart.yaml", sets)
    fraction, note = document_fraction(cfg)
    assert fraction == attended_fraction(document_lengths([str(data)]), 128)
    assert 0.05 < fraction < 0.9 and f"{100 * fraction:.1f}% of causal attention pairs" in note
    m = cfg.model
    model1, plain = flops_per_token(m, 128, layers=2)
    model2, masked = flops_per_token(m, 128, layers=2, attended=fraction)
    attention = 4 * m.n_heads * m.head_dim * 128  # QK^T and AV, one forward of one block
    assert model1 == model2
    assert plain - masked == pytest.approx((1 - fraction) * attention * (3 * m.n_layers + 2))
    buffers = document_buffers(cfg, micro_batch=16, target="cuda")
    assert buffers == {
        "document mask (BlockMask tiles)": 4 * 16 * 1 * 1 * 4,
        "per-token RoPE cos/sin": 2 * 16 * 128 * m.rope_dims * 4,
    }
    assert document_buffers(cfg, 16, "cpu")["document mask (B x T x T)"] == 16 * 128 * 128
    off = load_config(REPO / "configs" / "quickstart.yaml")
    assert document_fraction(off) == (1.0, None) and document_buffers(off, 16, "cuda") == {}
    missing = load_config(
        REPO / "configs" / "quickstart.yaml",
        ["data.document_mask=true", f"data.train=[{tmp_path / 'absent'}]"],
    )
    fraction, note = document_fraction(missing)
    assert fraction == 1.0 and "upper bound" in note
