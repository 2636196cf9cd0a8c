"""tools/gpu_check.py --cpu-smoke: every stage of the GPU acceptance run at tiny sizes on CPU,
so the kit cannot rot between GPU loans. It checks the result files' shape (every stage
present and done, every row with its fields), the resume of a chunked stage, and the
figures that are exact on CPU too; not GPU figures."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
from conftest import shared_path

from pretrain.cli.gpu_check import main
from pretrain.errors import UserError
from pretrain.exit_codes import EXIT_MORE, EXIT_OK
from pretrain.gpucheck.kernels import DEFAULT_PRIORITY, Shape, kernel_family, predicted_kernel
from pretrain.gpucheck.report import BEGIN, END, TABLE_TITLES, update_docs
from pretrain.gpucheck.results import TABLES, check, check_schema
from pretrain.gpucheck.runner import DOCS, Options, run_check
from pretrain.gpucheck.stages import all_stages


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    """Two calls, as on a GPU loan: the first has no time left after its first stage (the
    science stage, whose run stops at the deadline with a checkpoint), the second runs the
    rest and resumes that run."""
    folder = tmp_path_factory.mktemp("gpu_check")
    text = str(shared_path("tinyshakespeare.txt"))
    common = ["--cpu-smoke", "--science", "--results", str(folder), "--shakespeare", text]
    first = main([*common, "--stage", "science", "--budget", "0"])
    after_first = json.loads((folder / "results.json").read_text())
    second = main(common)
    data = json.loads((folder / "results.json").read_text())
    return folder, first, after_first, second, data


def test_cpu_smoke_fills_every_stage_and_row(smoke):
    folder, _, _, second, data = smoke
    assert second == EXIT_OK
    stages = [s for s, _ in all_stages()]
    assert check_schema(data, stages) == []
    assert data["meta"]["mode"] == "cpu-smoke"
    # Each stage names the commit it ran at (calls of one loan may run different code).
    assert {r["commit"] for r in data["stages"].values()} == {data["meta"]["commit"]}
    md = (folder / "results.md").read_text()
    for table in TABLES:
        assert TABLE_TITLES[table] in md, table
    t = {k: [r for s in data["stages"].values() for r in s["tables"].get(k, [])] for k in TABLES}
    # Memory: the plan's figures on CPU; the allocator's are a GPU's (none here).
    # 2 models x 2 recompute x 2 phases; compile: eager (2 phases), compiled and compiled by
    # blocks (training)
    assert len(t["memory"]) == 2 * 2 * 2 + 2 * (2 + 1 + 1)
    assert sum(", compiled (blocks)" in r["run"] for r in t["memory"]) == 2
    assert all(r["predicted_gib"] > 0 and r["allocated_gib"] is None for r in t["memory"])
    assert {r["recompute"] for r in t["memory"]} == {0, 1}  # none and full (1 of 1 layers)
    assert {r["compile"] for r in t["speed"]} == {False, True}
    # The plan's scaling from each measured MFU (eager, compiled): 2 models x 2 x 3 counts.
    assert len(t["scaling"]) == 2 * 2 * 3 and {r["gpus"] for r in t["scaling"]} == {32, 256, 1024}
    assert all(0 < r["efficiency"] <= 1 and r["mfu_model"] > 0 for r in t["scaling"])
    # The profiler saw the engine's three calls of the profiled step.
    assert all(r["forward_ms"] > 0 and r["backward_ms"] > 0 for r in t["split"])
    assert all(r["optimizer_ms"] > 0 for r in t["split"])
    # Kernels: every attention shape of configs/paper and the char study; on CPU torch's
    # flash kernel, the math path with dropout, as predicted.
    assert {r["measured"] for r in t["kernels"]} == {"flash", "math"}
    assert all(r["measured"] == r["predicted"] for r in t["kernels"])
    assert {r["head_dim"] for r in t["kernels"]} == {64, 128, 256}
    # Numerics: fp32 on the same device is exact; bf16 is not.
    fp32, bf16 = t["numerics"]
    assert fp32["loss_rel_error"] == 0 and fp32["grad_rel_error_max"] == 0
    assert 0 < bf16["grad_rel_error_max"] < 0.1
    # The GPU tests are collected and skip on CPU.
    assert t["tests"] and {r["outcome"] for r in t["tests"]} == {"skipped"}
    # Peers: both paper shapes, every model in bf16 weights (the compiled rows are a GPU's:
    # tests/test_benchmark_peers.py runs them on CPU).
    for shape in ("llama1b", "pythia1b"):
        rows = [r for r in t["peers"] if r["shape"] == shape]
        assert {r["model"] for r in rows} == {"ours", "transformers", "litgpt"}, shape
        assert {r["precision"] for r in rows} == {"bf16 weights"}


def test_a_stage_stopped_by_its_deadline_resumes_at_the_next_call(smoke):
    _, first, after_first, _, data = smoke
    assert first == EXIT_MORE
    science = after_first["stages"]["science"]
    assert science["status"] == "partial"
    (stopped,) = science["tables"]["science"]
    # Stopped through the pre-emption path, which all ranks agree on a step or two after
    # the signal (the flag travels with a step's collective): before the run's 4 steps.
    assert 1 <= stopped["steps"] < 4 and stopped["status"].startswith("stopped")
    runs = data["stages"]["science"]["tables"]["science"]
    assert [(r["theta"], r["steps"], r["status"]) for r in runs] == [
        (5000.0, 4, "done"),
        (10000.0, 4, "done"),
    ]
    assert [r["theta"] for r in data["stages"]["science"]["tables"]["science_speed"]] == [
        5000.0,
        10000.0,
    ]


def test_report_and_docs_refuse_smoke_results(smoke, capsys):
    folder = smoke[0]
    assert run_check(Options(report_only=True, results=folder, science=True)) == EXIT_OK
    assert "figure(s) flagged" in capsys.readouterr().out
    with pytest.raises(UserError, match="GPU run"):
        run_check(Options(report_only=True, results=folder, update_docs=True))


def test_checks_flag_more_than_five_percent():
    assert not check("x", 1.049, 1.0)["flagged"]
    assert check("x", 1.051, 1.0)["flagged"]
    assert check("x", 0.949, 1.0)["flagged"]
    assert not check("x", None, 1.0)["flagged"]


class _Profile:  # what phase_times reads of torch.profiler.profile: its events
    def __init__(self, events):
        self._events = events

    def events(self):
        return self._events


def test_the_step_split_gives_each_kernel_to_the_phase_that_launched_it():
    """On a GPU the backward's operators run on autograd's device threads, outside the label's
    scope: their kernels count for the labelled call running when they were launched (the
    first H200 run, reading the label's own kernels, gave the backward 1% of the step). Built
    from torch's own profiler events: a labelled forward, backward and step on the main
    thread, operators on the main and on an autograd thread, an NCCL kernel in the backward."""
    from torch.autograd import DeviceType
    from torch.autograd.profiler_util import EventList, FunctionEvent

    from pretrain.gpucheck.training import phase_times

    ids = iter(range(1, 100))

    def op(name, thread, start, end, kernels=()):
        e = FunctionEvent(next(ids), name, thread, start, end, device_type=DeviceType.CPU)
        for kernel, us in kernels:
            e.append_kernel(kernel, 0, us)
        return e

    main, autograd = 1, 2
    events = EventList(
        [
            op("gpucheck/forward", main, 0, 100),
            op("aten::mm", main, 10, 20, [("sm90_gemm", 4000)]),
            op("gpucheck/backward", main, 100, 300),
            op("aten::mm", autograd, 120, 130, [("sm90_gemm", 7000)]),
            op("aten::mul", autograd, 140, 150, [("elementwise", 500)]),
            op("c10d::allreduce_", main, 290, 295, [("ncclDevKernel_AllReduce", 1500)]),
            op("gpucheck/optimizer", main, 300, 400),
            op("multi_tensor_apply", main, 310, 320, [("adam_kernel", 900)]),
            op("aten::copy_", main, 450, 460, [("memcpy", 100)]),  # outside every phase
        ]
    )
    split = phase_times(_Profile(events), on_gpu=True)
    assert split == {
        "forward": 4.0,
        "backward": 9.0,  # 7 + 0.5 from the autograd thread, 1.5 of NCCL
        "optimizer": 0.9,
        "communication": 1.5,
    }


def test_update_docs_rewrites_only_between_the_markers(tmp_path):
    doc = tmp_path / "performance.md"
    doc.write_text(f"before\n{BEGIN}\nold table\n{END}\nafter\n")
    update_docs(doc, "new table\n")
    assert doc.read_text() == f"before\n{BEGIN}\nnew table\n{END}\nafter\n"
    real = DOCS.read_text()
    assert real.count(BEGIN) == 1 and real.count(END) == 1


def test_kernel_names_of_each_family():
    """Real CUDA kernel names (and the CPU operators) of each family."""
    names = {
        "void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<64, 128>>(Flash_fwd_params)": "flash",
        "fmha_cutlassF_bf16_aligned_64x64_rf_sm80(PyTorchMemEffAttention::AttentionKernel)": "memory-efficient",
        "cudnn_generated_fort_native_sdpa_sm90_knob_7_64x128x64_4x1x1_kernel0_0": "cudnn",
        "cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_7_64x128x64": "cudnn",
        "aten::_scaled_dot_product_attention_math": "math",
        "aten::_scaled_dot_product_flash_attention_for_cpu": "flash",
        "ampere_bf16_s16816gemm_bf16_128x64_ldg8_f2f_stages_64x4_tn": None,
    }
    assert {n: kernel_family(n) for n in names} == names


# The expected kernels below come from torch's aten/src/ATen/native/transformers/cuda/
# sdp_utils.cpp (select_sdp_backend, priority_order, check_prefer_cudnn_attention and each
# can_use_*_attention's checks), as compiled into the v2.11.0-v2.13.0 cu130 wheels.
CUDA, BF16 = torch.device("cuda"), torch.bfloat16
# The H200 run: compute capability 9.0 and torch 2.11.0+cu130, whose wheel pins
# nvidia-cudnn-cu13==9.19.0.56 (torch.backends.cudnn.version() 91900).
H200_RUN = {"capability": (9, 0), "cudnn_version": 91900, "torch_version": (2, 11)}
A100 = {**H200_RUN, "capability": (8, 0)}


def _shape(head_dim=64, heads=32, kv=8, seq=2048, dropout=0.0, documents=False, softcap=0.0):
    return Shape(head_dim, heads, kv, seq, dropout, softcap, documents)


# What the H200 run measured (cuDNN's kernels for each): GQA 32/8 at head_dim 64 and four
# lengths, and at head_dim 128; 8-head MHA at head_dim 256; the character-level model's
# 6 heads at length 256 with dropout 0.2.
MEASURED_ON_THE_H200 = [
    *(_shape(seq=t) for t in (1024, 2048, 4096, 8192)),
    _shape(128),
    _shape(256, 8, 8),
    _shape(64, 6, 6, 256, dropout=0.2),
]


@pytest.mark.parametrize("shape", MEASURED_ON_THE_H200, ids=Shape.label)
def test_kernel_prediction_of_the_h200_run_is_cudnn(shape):
    # cuDNN 9.19 is newer than 9.15.0 on sm 9.0: check_prefer_cudnn_attention puts cuDNN
    # first. can_use_cudnn_attention takes bf16, GQA, causal, head_dim up to 256 on sm90
    # from cuDNN 9.10 (check_cudnn_tensor_shapes), and dropout: torch 2.11 has no 1/16 check.
    assert predicted_kernel(shape, CUDA, BF16, **H200_RUN) == "cudnn"


@pytest.mark.parametrize("shape", MEASURED_ON_THE_H200, ids=Shape.label)
def test_kernel_prediction_on_an_a100_is_flash(shape):
    # sm80 is not sm9x/sm10x: torch's default order, flash first, which takes bf16, GQA,
    # dropout and head_dim up to 256 (sm80 is not among the GPUs limiting its backward).
    assert predicted_kernel(shape, CUDA, BF16, **A100) == "flash"


def test_a_shape_cudnn_refuses_runs_the_next_backend_in_priority():
    h200 = H200_RUN
    # fp32: cuDNN and flash take fp16/bf16 only; memory-efficient takes fp32 but no GQA.
    assert predicted_kernel(_shape(64, 8, 8), CUDA, torch.float32, **h200) == "memory-efficient"
    assert predicted_kernel(_shape(), CUDA, torch.float32, **h200) == "math"
    # head_dim 512: past cuDNN's 256 and flash's 256.
    assert predicted_kernel(_shape(512, 8, 8), CUDA, BF16, **h200) == "memory-efficient"
    assert predicted_kernel(_shape(512), CUDA, BF16, **h200) == "math"
    # sm 10.0 (B200) puts cuDNN first too, but its head_dim limit there is 128.
    b200 = {**h200, "capability": (10, 0)}
    assert predicted_kernel(_shape(128, 8, 8), CUDA, BF16, **b200) == "cudnn"
    assert predicted_kernel(_shape(256, 8, 8), CUDA, BF16, **b200) == "flash"
    # From torch 2.12 cuDNN's dropout must be a multiple of 1/16 (check_cudnn_dropout).
    char = _shape(64, 6, 6, 256, dropout=0.2)
    later = {**h200, "torch_version": (2, 13)}
    assert predicted_kernel(char, CUDA, BF16, **later) == "flash"
    assert predicted_kernel(replace(char, dropout=0.25), CUDA, BF16, **later) == "cudnn"
    # cuDNN 9.15.0 is not newer than 9.15.0: flash keeps first place.
    assert predicted_kernel(_shape(), CUDA, BF16, **{**h200, "cudnn_version": 91500}) == "flash"
    # An order of the caller's (sdpa_kernel's set_priority, TORCH_CUDNN_SDPA_DEPRIORITIZED).
    assert predicted_kernel(_shape(), CUDA, BF16, **h200, priority=DEFAULT_PRIORITY) == "flash"


def test_kernel_prediction_of_masks_soft_caps_and_flash_backward_limits():
    # A document mask with dropout takes the masked SDPA: flash takes no mask, cuDNN does.
    masked = _shape(64, 6, 6, 256, dropout=0.2, documents=True)
    assert predicted_kernel(masked, CUDA, BF16, **H200_RUN) == "cudnn"
    assert predicted_kernel(masked, CUDA, BF16, **A100) == "memory-efficient"
    assert predicted_kernel(replace(masked, dropout=0.0), CUDA, BF16, **A100) == "flex"
    assert predicted_kernel(_shape(softcap=30.0), CUDA, BF16, **H200_RUN) == "unfused"
    # sm86 (A10, RTX 30xx): flash trains head_dim 256 only without dropout.
    sm86 = {**A100, "capability": (8, 6)}
    assert predicted_kernel(_shape(256, 8, 8), CUDA, BF16, **sm86) == "flash"
    assert predicted_kernel(_shape(256, 8, 8, dropout=0.1), CUDA, BF16, **sm86) == (
        "memory-efficient"
    )


def test_kernel_prediction_refuses_what_it_cannot_know(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="capability"):
        predicted_kernel(_shape(), CUDA, BF16)  # no GPU here to ask
    with pytest.raises(ValueError, match="priority"):
        predicted_kernel(_shape(), CUDA, BF16, **H200_RUN, priority=("flash", "math"))
    with pytest.raises(ValueError, match="major, minor"):
        predicted_kernel(_shape(), CUDA, BF16, **{**H200_RUN, "capability": (9,)})
