"""The planner's communication (issue 45): the collectives of a step equal, exactly, what
DeepSpeed's own communication logger records on 2 and 4 CPU ranks (gloo) for ZeRO 0, 1 and 2,
with and without accumulation, on two model shapes, and for the bf16 paths, small buckets and
the bucket options (`reduce_scatter: false`, `use_multi_rank_bucket_allreduce: false`); the
trainer's own collectives equal what the real trainer sends on 2 ranks, step by step; `--gpus
N` and `--scaling` shrink a micro batch by one rule; the ring's time follows nccl-tests'
formulas, and its bus bandwidth across nodes lands in the published measurements."""

from __future__ import annotations

import math
from collections import Counter, defaultdict

import pytest
from train_support import tiny_config

from pretrain.config import Config, from_dict, load_config
from pretrain.measure.deepspeed_comms import measure
from pretrain.planner.comms import (
    LOG_STEP,
    STEP_METRICS,
    STEP_PARTS,
    TRAINER_SUMS,
    Collective,
    engine_comms,
    model_params,
    padded,
    step_collectives,
    step_time,
    trainer_collectives,
)
from pretrain.planner.gpus import GPUS
from pretrain.planner.network import GB, HOPPER_IB, fabric

STEPS = 2
WIDE = {"d_model": 48, "n_heads": 6, "n_kv_heads": 2, "n_layers": 3, "d_ff": 80, "head_dim": 12}
# reduce_scatter: false: a parameter past the bucket all-reduced whole. 1,000-element buckets:
# the wide model's 7,680-element MLP weights straddle a partition with a slice past the bucket.
WHOLE = {"zero_optimization": {"reduce_bucket_size": 1000, "reduce_scatter": False}}
# use_multi_rank_bucket_allreduce: false: a bucket's slices reduced to each partition's owner
OWNERS = {
    "zero_optimization": {"reduce_bucket_size": 5000, "use_multi_rank_bucket_allreduce": False}
}


def config(n: int, model: dict | None = None, accum: int = 1, **train) -> Config:
    data = tiny_config(
        "unused",
        "unused",
        model=model or {},
        train={
            "eval_interval": 0,
            "micro_batch_size": 2,
            "global_batch_size": 2 * n * accum,
            **train,
        },
    )
    return from_dict(Config, data)


def settings(n: int) -> dict[str, Config]:
    small = {"zero_optimization": {"reduce_bucket_size": 5000}}
    out = {
        f"{shape}_zero{stage}_acc{accum}": config(n, model, accum, zero_stage=stage)
        for shape, model in (("tiny", None), ("wide", WIDE))
        for stage in (0, 1, 2)
        for accum in (1, 2)
    }
    out |= {
        # the paper's: bf16, fp32 accumulation, ZeRO 1 (DeepSpeed's BF16_Optimizer)
        "bf16_fp32acc_zero1": config(n, accum=2, precision="bf16", zero_stage=1),
        "bf16_bf16acc_zero0": config(
            n, accum=2, precision="bf16", grad_accum_dtype="bf16", zero_stage=0
        ),
        # buckets smaller than the embedding: split, the embedding alone, hook order
        "bf16_bf16acc_zero2_buckets": config(
            n, accum=2, precision="bf16", grad_accum_dtype="bf16", zero_stage=2, deepspeed=small
        ),
        "fp32_zero1_buckets": config(n, zero_stage=1, deepspeed=small),
        "fp32_zero1_buckets_overlap": config(
            n,
            WIDE,
            zero_stage=1,
            deepspeed={"zero_optimization": {"reduce_bucket_size": 3000, "overlap_comm": True}},
        ),
        # the bucket options: hook order at ZeRO 2, group order at ZeRO 1
        "wide_zero2_whole_buckets": config(n, WIDE, zero_stage=2, deepspeed=WHOLE),
        "wide_zero1_reduce_to_owners": config(n, WIDE, zero_stage=1, deepspeed=OWNERS),
        "bf16_bf16acc_zero2_reduce_to_owners": config(
            n, accum=2, precision="bf16", grad_accum_dtype="bf16", zero_stage=2, deepspeed=OWNERS
        ),
    }
    return out


def planned(cfg: Config, n: int) -> dict[str, dict[int, int]]:
    out: dict[str, dict[int, int]] = {}
    for c in step_collectives(cfg, n):
        sizes = out.setdefault(c.op, {})
        sizes[c.size] = sizes.get(c.size, 0) + c.calls * STEPS
    return out


@pytest.mark.parametrize("n", [2, 4])
def test_the_plans_collectives_are_what_deepspeeds_logger_records(n):
    cases = settings(n)
    logged = measure(cases, n, steps=STEPS)
    problems = []
    for name, cfg in cases.items():
        ranks = [
            {op: {b: v["calls"] for b, v in s.items()} for op, s in r.items()} for r in logged[name]
        ]
        assert all(r == ranks[0] for r in ranks), f"{name}: the ranks logged differently"
        if ranks[0] != planned(cfg, n):
            problems.append(f"{name}: logged {ranks[0]}, planned {planned(cfg, n)}")
    assert not problems, "\n".join(problems)


def test_the_small_bucket_cases_do_split():
    """The bucket cases above test what they say: several gradient buckets, the embedding
    (8224 elements, past 5000) alone, and the ZeRO 2 ones every micro step."""
    cfg = settings(2)["bf16_bf16acc_zero2_buckets"]
    grads = [
        c
        for c in step_collectives(cfg, 2)
        if c.what.endswith("bucket") or c.what.endswith("buckets")
    ]
    assert sum(c.calls for c in grads) >= 2 * 4 and all(c.calls % 2 == 0 for c in grads)
    assert any(c.size == 4 * 257 * 32 for c in grads)  # the embedding, alone


def _default(ds: dict, key: str) -> dict:
    return {"zero_optimization": {k: v for k, v in ds["zero_optimization"].items() if k != key}}


@pytest.mark.parametrize("n", [2, 4])
def test_the_bucket_option_cases_change_what_is_sent(n):
    """The bucket option cases above test what they say: `reduce_scatter: false` sends fewer
    calls than the same buckets cut at the partitions (a parameter past the bucket all-reduced
    whole: same bytes, a call less per cut), and `use_multi_rank_bucket_allreduce: false`
    sends the gradients as `reduce` calls, more than the all-reduces they replace (a bucket
    that spans partitions: one per owner), the same bytes over the partitions."""
    cases = settings(n)

    def sent(cfg: Config, op: str) -> tuple[int, int]:
        grads = [c for c in step_collectives(cfg, n) if c.op == op and "gradient" in c.what]
        return sum(c.calls for c in grads), sum(c.calls * c.size for c in grads)

    whole = sent(cases["wide_zero2_whole_buckets"], "all_reduce")
    cut = sent(
        config(n, WIDE, zero_stage=2, deepspeed=_default(WHOLE, "reduce_scatter")), "all_reduce"
    )
    assert whole[0] < cut[0] and whole[1] == cut[1], (whole, cut)
    for name, model, stage, extra in (
        ("wide_zero1_reduce_to_owners", WIDE, 1, {}),
        (
            "bf16_bf16acc_zero2_reduce_to_owners",
            None,
            2,
            {"accum": 2, "precision": "bf16", "grad_accum_dtype": "bf16"},
        ),
    ):
        together = config(
            n,
            model,
            zero_stage=stage,
            deepspeed=_default(OWNERS, "use_multi_rank_bucket_allreduce"),
            **extra,
        )
        owners, reduced = sent(cases[name], "reduce"), sent(together, "all_reduce")
        assert sent(cases[name], "all_reduce") == (0, 0)
        assert owners[0] > reduced[0] and owners[1] == reduced[1], (name, owners, reduced)


def test_the_papers_1b_step_sends_its_fp32_gradients_and_bf16_parameters():
    """Llama-1B at the paper's setting on 32 GPUs: BF16_Optimizer all-reduces each group's
    fp32 gradients padded to 2 x 32 elements, in one bucket unless the first passes 5e8, and
    all-gathers each group's bf16 partition; no scalar collective."""
    cfg = load_config("configs/paper/llama1b_rope10.yaml")
    e = engine_comms(cfg, 32)
    assert e.path == "bf16_optimizer"
    groups = [sum(g) for g in model_params(cfg).groups]
    assert sum(groups) == sum(p for g in model_params(cfg).groups for p in g)
    padded_groups = [math.ceil(g / 64) * 64 for g in groups]
    collectives = step_collectives(cfg, 32)
    reduce = [c for c in collectives if c.op == "all_reduce"]
    assert sum(c.size * c.calls for c in reduce) == 4 * sum(padded_groups)
    gather = sorted(c.size for c in collectives if c.op == "all_gather_into_tensor")
    assert gather == sorted(2 * g // 32 for g in padded_groups)
    assert padded(groups[0], 32) == padded_groups[0]


def test_zero2_with_bf16_accumulation_reduces_every_micro_step_in_buckets():
    """The 8B shape at ZeRO 2 with 4 micro steps: every bucket at most reduce_bucket_size
    elements, all the gradients once per micro step."""
    cfg = load_config(
        "configs/paper/llama8b_rope10.yaml",
        ["train.zero_stage=2", "train.grad_accum_dtype=bf16", "train.micro_batch_size=2"],
    )
    n = 32
    accum = cfg.train.global_batch_size // (2 * n)
    params = model_params(cfg).total
    grads = [c for c in step_collectives(cfg, n) if "gradient" in c.what]
    assert all(c.size <= 4 * 500_000_000 for c in grads)
    assert sum(c.size * c.calls for c in grads) == 4 * params * accum


def test_the_ring_times_follow_the_bus_bandwidth_formulas():
    f = HOPPER_IB
    size = 2**30
    # in a node: 2(n-1) steps and 2(n-1)/n of the buffer at NVLink's 370 GB/s
    assert f.time("all_reduce", size, 8) == pytest.approx(
        14 * 1.9e-6 + 2 * 7 / 8 * size / (370 * GB)
    )
    assert f.time("all_gather_into_tensor", size, 8) == pytest.approx(
        7 * 1.9e-6 + 7 / 8 * size / (370 * GB)
    )
    # across nodes the bandwidth is the smaller of NVLink's and the node's 8 NICs'
    slow = fabric(nic_gbs=25)
    assert slow.bandwidth(16) == 8 * 25 * GB and slow.bandwidth(8) == 370 * GB
    assert f.time("all_reduce", size, 1) == 0.0


@pytest.mark.parametrize("gpus, low, high", [(8, 365, 370), (16, 330, 480), (32, 330, 380)])
def test_the_models_bus_bandwidth_is_in_the_published_measurements(gpus, low, high):
    """nccl-tests all-reduce bus bandwidth at 8 GiB (ring, no SHARP): 365-370 GB/s on one
    8 x H100/H200 node; 330-380 GB/s on 2-4 nodes with 8 x 400 Gb/s (docs/scaling.md cites
    each); the model's busbw = algbw x 2(n-1)/n."""
    size = 8 * 2**30
    busbw = size / HOPPER_IB.time("all_reduce", size, gpus) * 2 * (gpus - 1) / gpus
    assert low * GB <= busbw <= high * GB, busbw / GB


def test_overlap_hides_all_but_the_last_bucket_up_to_the_backward():
    f = HOPPER_IB
    bucket = Collective("all_reduce", 2 * 10**9, 3, "backward", "gradient buckets", hideable=True)
    last = Collective("all_reduce", 10**9, 1, "backward", "last gradient bucket")
    t_bucket = f.time("all_reduce", 2 * 10**9, 64)
    long = step_time([bucket, last], f, 64, compute=30.0, grad_accum=1)
    assert long.exposed == pytest.approx(f.time("all_reduce", 10**9, 64))
    short = step_time([bucket, last], f, 64, compute=3 * t_bucket / 2, grad_accum=1)
    assert short.exposed == pytest.approx(short.communication - t_bucket)  # 2/3 of compute hid
    plain = step_time([Collective("all_reduce", 10**9, 2, "after backward", "x")], f, 64, 1.0, 1)
    assert (
        plain.exposed == plain.communication == pytest.approx(2 * f.time("all_reduce", 10**9, 64))
    )


# ----------------------------------------------------------------------------- the trainer's


def trainer_config(n: int, steps: int = 4, log_interval: int = 2, **sections) -> Config:
    train = sections.pop("train", {})
    data = tiny_config(
        "unused",
        "unused",
        train={
            "eval_interval": 0,
            "micro_batch_size": 2,
            "global_batch_size": 2 * n,
            "train_iters": steps,
            **train,
        },
        logging={"log_interval": log_interval},
        **sections,
    )
    data["data"] = {"train": [], "valid": []}  # the measurement gives random tokens
    return from_dict(Config, data)


def test_the_trainers_own_collectives_are_what_the_trainer_sends():
    """The trainer's collectives (outside DeepSpeed's logger), counted by wrapping
    torch.distributed in the real trainer (its callbacks, 2 gloo ranks, 4 steps, logging every
    2): every step Trainer.train_step's all-reduce of its stop flag and mean loss (16 B) and,
    under spikes.skip_step, the guard's verdict; at each logging step the metrics' all_gather
    (2 steps x names x 8 B) and SpeedMonitor's all-reduce (2 ranks x 5 parts x 8 B). Step by
    step, on both ranks, equal to the plan's."""
    from trainer_comms import measure as measure_trainer

    from pretrain.train.metrics import GRAD_NORM, LOSS
    from pretrain.train.step_parts import PARTS

    n, steps, interval = 2, 4, 2
    cases = {
        "fp32_zero0": trainer_config(n, steps, interval, train={"zero_stage": 0}),
        "fp32_zero1": trainer_config(n, steps, interval),
        "bf16_zero2_zloss_skip_step": trainer_config(
            n,
            steps,
            interval,
            train={
                "zero_stage": 2,
                "precision": "bf16",
                "grad_accum_dtype": "bf16",
                "z_loss": 1e-4,
            },
            spikes={"skip_step": True},
        ),
    }
    measured = measure_trainer(cases, n)
    assert TRAINER_SUMS == 16 and len(PARTS) == STEP_PARTS
    assert {LOSS, GRAD_NORM} <= set(STEP_METRICS)  # the planner names them, not imports them
    for name, cfg in cases.items():
        planned = trainer_collectives(cfg, n)
        every = Counter({(c.op, c.size): c.calls for c in planned if c.phase != LOG_STEP})
        logging = Counter({(c.op, c.size): c.calls for c in planned if c.phase == LOG_STEP})
        expected = {
            s: every + (logging if s % interval == 0 else Counter()) for s in range(1, steps + 1)
        }
        assert every[("all_reduce", 16)] == 1 and sum(logging.values()) == 2, name
        for rank, calls in enumerate(measured[name]):
            by_step: dict[int, Counter] = defaultdict(Counter)
            for call in calls:
                by_step[call.step][(call.op, call.size)] += 1
            assert dict(by_step) == expected, (name, rank, [c for c in calls])
    skip = trainer_collectives(cases["bf16_zero2_zloss_skip_step"], n)
    assert ("all_reduce", 4) in {(c.op, c.size) for c in skip}  # the guard's verdict
    assert ("all_gather", 2 * 4 * 8) in {(c.op, c.size) for c in skip}  # the z-loss's column


# ----------------------------------------------------------------------------- the plan


def test_the_plan_shows_the_steps_collectives_and_its_split(tmp_path, capsys):
    import json

    from pretrain.cli import plan as plan_cli

    cfg = tmp_path / "tiny.yaml"
    cfg.write_text(
        "model: {vocab_size: 512, n_layers: 2, d_model: 64, n_heads: 4, d_ff: 128, max_seq_len: 128}\n"
        "train: {train_iters: 100, global_batch_size: 64, micro_batch_size: 4}\n"
    )
    assert plan_cli.main([str(cfg), "--gpus", "16"]) == 0
    out = capsys.readouterr().out
    assert "communication per step on 16 GPUs" in out and "all_gather_into_tensor" in out
    assert "exposed communication" in out and "efficiency" in out
    assert plan_cli.main([str(cfg), "--gpus", "16", "--json"]) == 0
    comm = json.loads(capsys.readouterr().out)["communication"]
    planned = step_collectives(load_config(str(cfg)), 16)
    assert len(comm["collectives"]) == len(planned)
    assert comm["step_s"] == pytest.approx(
        comm["compute_s"] + comm["exposed_s"] + comm["optimizer_s"]
    )
    # a slower network: more exposed time, lower efficiency
    assert plan_cli.main([str(cfg), "--gpus", "16", "--json", "--nic-gbs", "5"]) == 0
    slow = json.loads(capsys.readouterr().out)["communication"]
    assert slow["exposed_s"] > comm["exposed_s"] and slow["efficiency"] < comm["efficiency"]
    assert plan_cli.main([str(cfg), "--gpus", "16", "--nic-gbs", "0"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "--nic-gbs 0.0 must be > 0" in err


def test_scaling_names_where_efficiency_falls_and_overlap_moves_it(tmp_path, capsys):
    from pretrain.cli import plan as plan_cli
    from pretrain.planner.scaling import first_below, scaling

    cfg = load_config("configs/paper/llama8b_rope10.yaml")
    points = scaling(cfg, GPUS["h200"], HOPPER_IB, 0.45)
    assert [p.gpus for p in points] == [8, 16, 32, 64, 128, 256, 512, 1024]
    efficiency = [p.time.efficiency for p in points]
    assert efficiency == sorted(efficiency, reverse=True)  # more GPUs, a smaller share computes
    assert all(p.micro_batch * p.grad_accum * p.gpus == cfg.train.global_batch_size for p in points)
    below = first_below(points)
    assert below is not None and points[[p.gpus for p in points].index(below)].time.efficiency < 0.9
    overlap = load_config(
        "configs/paper/llama8b_rope10.yaml", ["train.deepspeed.zero_optimization.overlap_comm=true"]
    )
    hidden = scaling(overlap, GPUS["h200"], HOPPER_IB, 0.45)
    assert all(h.time.exposed < p.time.exposed for h, p in zip(hidden, points, strict=True))
    plot = tmp_path / "s.png"
    args = ["configs/paper/llama1b_rope10.yaml", "--scaling", "--plot", str(plot)]
    assert plan_cli.main(args) == 0
    out = capsys.readouterr().out
    assert "| 1024 " in out and "efficiency falls under 90% at" in out
    assert plot.stat().st_size > 10_000


def test_gpus_and_scaling_shrink_the_micro_batch_by_one_rule(tmp_path, capsys):
    """`--gpus N` plans the config's micro batch where it divides each GPU's share of the
    global batch, else the largest that does, and says so in its first line (JSON: its
    notes), as `--scaling`'s points do: the paper 1B's 64 is 16 on 256 GPUs (4096 / 256);
    both agree at every count; a micro batch given with --micro-batch is never changed."""
    import json

    from pretrain.cli import plan as plan_cli
    from pretrain.planner.scaling import point, scaling
    from pretrain.planner.search import micro_batch_on

    paper = load_config("configs/paper/llama1b_rope10.yaml")
    micro, note = micro_batch_on(paper, 256)
    assert micro == 16 and note.startswith("micro batch shrunk from 64 to 16 on 256 GPUs")
    assert "fewer than the config's micro batch 64" in note
    assert "--set train.micro_batch_size=16" in note
    assert micro_batch_on(paper, 64) == (64, None)
    at_256 = point(paper, GPUS["h200"], 256, HOPPER_IB, 0.4)
    assert (at_256.micro_batch, at_256.note) == (16, note)
    odd = config(2, accum=1, micro_batch_size=32, global_batch_size=96)  # 48 a GPU
    assert micro_batch_on(odd, 2)[0] == 24 and "not a multiple" in micro_batch_on(odd, 2)[1]

    cfg = tmp_path / "tiny.yaml"
    cfg.write_text(
        "model: {vocab_size: 512, n_layers: 2, d_model: 64, n_heads: 4, d_ff: 128, max_seq_len: 128}\n"
        "train: {train_iters: 100, global_batch_size: 64, micro_batch_size: 8}\n"
    )
    points = scaling(load_config(str(cfg)), GPUS["h200"], HOPPER_IB, 0.4)
    assert [(p.gpus, p.micro_batch) for p in points] == [(8, 8), (16, 4), (32, 2), (64, 1)]
    for p in points:
        assert plan_cli.main([str(cfg), "--gpus", str(p.gpus), "--json"]) == 0
        got = json.loads(capsys.readouterr().out)
        assert got["micro_batch"] == p.micro_batch and got["notes"][: bool(p.note)] == (
            [p.note] if p.note else []
        )
    assert plan_cli.main([str(cfg), "--gpus", "32"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == points[2].note and "micro batch 2 x 1 accumulation x 32 GPUs" in out[2]
    assert plan_cli.main([str(cfg), "--scaling"]) == 0
    out = capsys.readouterr().out
    assert all(p.note in out for p in points[1:]) and "| 32     | 2 x 1" in out
    assert plan_cli.main([str(cfg), "--gpus", "32", "--micro-batch", "8"]) == 2
    assert "choose a micro batch that divides 2" in capsys.readouterr().err
    assert plan_cli.main([str(cfg), "--gpus", "48"]) == 2
    assert "global_batch_size=64 is not divisible by 48 GPUs" in capsys.readouterr().err


def test_a_global_batch_smaller_than_the_gpus_stops_the_table():
    from pretrain.planner.scaling import at_scale

    cfg = config(2, accum=4)  # 16 sequences a step
    assert at_scale(cfg, 16).train.micro_batch_size == 1
    assert at_scale(cfg, 4).train.micro_batch_size == 2
    assert at_scale(cfg, 32) is None and at_scale(cfg, 3) is None


# ----------------------------------------------------------------------------- the gloo check


def test_the_gloo_fit_recovers_a_known_alpha_and_bandwidth():
    """tools/benchmark.py comms fits alpha and bandwidth to timings; on timings a known ring
    made (4 ranks, 300 us a step, 1.2 GB/s) it gives them back."""
    from pretrain.benchmarks.comms import SIZES, fit_ring
    from pretrain.planner.network import Fabric

    made = Fabric("known", 4, 1.2 * GB, 1.2 * GB, 300e-6, 300e-6)
    ops = ("all_reduce", "all_gather_into_tensor")
    times = {op: {s: made.time(op, s, 4) for s in SIZES} for op in ops}
    fit = fit_ring(times, 4)
    assert fit.nvlink_alpha == pytest.approx(300e-6, rel=1e-6)
    assert fit.nvlink_bandwidth == pytest.approx(1.2 * GB, rel=1e-6)


def test_deepspeeds_running_totals_become_each_calls_time():
    """DeepSpeed 0.19's logger records, per call, the running total of its op's timer over
    every size; sorted, the differences are each call's own time."""
    from pretrain.measure.deepspeed_comms import _logged

    # all_reduce calls in this order: 4 B (1 ms), 400 B (3 ms), 4 B (2 ms), 400 B (5 ms)
    raw = {"all_reduce": {4: [2, [1.0, 6.0], 0, 0], 400: [2, [4.0, 11.0], 0, 0]}}
    got = _logged(raw)["all_reduce"]
    assert got[4] == {"calls": 2, "latencies": pytest.approx([1e-3, 2e-3])}
    assert got[400] == {"calls": 2, "latencies": pytest.approx([3e-3, 5e-3])}


def test_the_docs_scaling_table_and_collectives_are_the_codes():
    """docs/scaling.md's paper scaling table is what `tools/plan.py --paper-scaling --mfu
    0.45` prints, and its Llama-1B step on 32 GPUs lists the plan's collectives."""
    from pathlib import Path

    from pretrain.planner.scaling import paper_scaling
    from pretrain.planner.scaling_report import scaling_table
    from pretrain.study.spec import load_study

    repo = Path(__file__).resolve().parents[1]
    doc = (repo / "docs" / "scaling.md").read_text()
    runs = load_study(repo / "studies" / "partial_rope.yaml").runs
    results = paper_scaling([repo / r.config_path for r in runs], GPUS["h200"], HOPPER_IB, 0.45)
    for row in scaling_table(results).splitlines():
        assert row in doc, f"docs/scaling.md's scaling table is stale; expected\n{row}"
    paper = load_config("configs/paper/llama1b_rope10.yaml")
    for c in step_collectives(paper, 32) + trainer_collectives(paper, 32):
        assert f"{c.op:<23} {c.size:>15,} B x {c.calls:<3}" in doc, c
