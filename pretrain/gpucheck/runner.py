"""Running the stages of a check within one command's time, and going on at the next call.

A call runs the stages that are not done, in order, while the next one's budget fits in
what is left of `budget_s` (the first stage of a call always runs, so every call makes
progress). After each stage results.json is rewritten. A stage left "started" by an earlier
call (the command was killed inside it) is marked "interrupted" and skipped, so one stage
that cannot finish does not stop the others; `--stage NAME` runs it again, `--fresh` starts
the whole check over. A chunked stage (science) returns "partial" when its time is up and
continues from its kept rows at the next call.
"""

from __future__ import annotations

import gc
import shutil
import subprocess
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch

from pretrain.errors import UserError
from pretrain.exit_codes import EXIT_FAILED, EXIT_MORE, EXIT_OK
from pretrain.gpucheck.report import markdown, summary, update_docs
from pretrain.gpucheck.results import DONE, RESULTS_MD, ResultsFolder, Stage, check_schema
from pretrain.gpucheck.sizes import GPU_SIZES, REPO, SMOKE_SIZES, Context, this_gpu
from pretrain.gpucheck.stages import all_stages
from pretrain.run_layout import atomic_write
from pretrain.train.deepspeed_adapter import quiet_logs

SMOKE_SHARE = 0.05  # a stage's smoke takes at most this share of its GPU budget
DOCS = REPO / "docs" / "gpu_check.md"


@dataclass
class Options:
    smoke: bool = False
    science: bool = False
    stages: tuple[str, ...] = ()
    fresh: bool = False
    results: Path | None = None
    budget_s: float = 540.0
    shakespeare: Path | None = None
    update_docs: bool = False
    report_only: bool = False


def slug(name: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in name.lower()).strip("-")


def results_folder(opts: Options, device_name: str) -> Path:
    """--results, else the newest runs/gpu_check/<date>_<device> (a new one with --fresh)."""
    if opts.results is not None:
        return opts.results
    root = REPO / "runs" / "gpu_check"
    tag = slug(device_name)
    existing = sorted(root.glob(f"*_{tag}"))
    if existing and not opts.fresh:
        return existing[-1]
    return root / f"{time.strftime('%Y-%m-%d')}_{tag}"


def _commit() -> str:
    try:
        out = subprocess.run(
            # --dirty: a tree that is not its HEAD's says so (a GPU loan that sends the working
            # tree with an older .git recorded that older commit for newer code)
            ["git", "describe", "--always", "--dirty", "--abbrev=7", "--exclude=*"],
            cwd=REPO,
            capture_output=True,
            text=True,
        )
        return out.stdout.strip() or "?"
    except OSError:
        return "?"


def selected(opts: Options) -> list:
    stages = [(s, fn) for s, fn in all_stages() if opts.science or not s.science]
    if opts.stages:
        known = {s.name for s, _ in all_stages()}
        unknown = [n for n in opts.stages if n not in known]
        if unknown:
            raise UserError(
                f"--stage {', '.join(unknown)}: no such stage; the stages are "
                f"{', '.join(sorted(known))} (--list shows them)"
            )
        stages = [(s, fn) for s, fn in all_stages() if s.name in opts.stages]
    return stages


def _clean(device: torch.device) -> None:
    """Free what the last stage left, then freeze what lives on: DeepSpeed calls
    gc.collect() dozens of times per engine (see_memory_usage), each a third of a second
    over everything torch, transformers and DeepSpeed imported, unless that is frozen (as
    planner.validation.measure_cpu_step does)."""
    gc.collect()
    gc.freeze()
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def _device(opts: Options) -> torch.device:
    if opts.smoke:
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise UserError(
            "no CUDA GPU here: the GPU check needs one (`--cpu-smoke` runs its code at tiny "
            "sizes on CPU; `--report` prints the results of a folder)"
        )
    return torch.device("cuda", 0)


def run_check(opts: Options, log=print) -> int:
    """Run (or continue) the check; returns EXIT_OK, EXIT_FAILED or EXIT_MORE."""
    try:
        return _run(opts, log)
    finally:
        gc.unfreeze()  # (_clean froze what lived; a caller's process collects it again)


def _run(opts: Options, log) -> int:
    start = time.monotonic()
    stages = selected(opts)
    stage_list = [s for s, _ in stages]
    if opts.report_only:
        return _report(opts, stages, log)
    device = _device(opts)
    gpu, target = this_gpu(device)
    folder = results_folder(opts, "cpu-smoke" if opts.smoke else gpu.name)
    if opts.fresh and folder.exists():
        for name in ("results.json", RESULTS_MD, "runs", "science", "shakespeare_char"):
            path = folder / name
            shutil.rmtree(path) if path.is_dir() else path.unlink(missing_ok=True)
    results = ResultsFolder(folder)
    # Each stage keeps the commit it ran at: a later call may rerun some stages on new code.
    # Results from before stages kept theirs ran at the folder's last recorded commit.
    for result in results.stages.values():
        result.setdefault("commit", results.meta.get("commit", "?"))
    results.meta.update(
        device=gpu.name,
        mode="cpu-smoke" if opts.smoke else "gpu",
        torch=torch.__version__,
        date=time.strftime("%Y-%m-%d"),
        commit=_commit(),
        gpu_gib=round(gpu.gib, 2),
    )
    quiet_logs()  # its per-engine memory reports
    log(f"GPU check ({results.meta['mode']}) on {gpu.name}; results in {folder}")
    ran = 0
    left = []
    for stage, fn in stages:
        previous = results.stages.get(stage.name, {})
        status = previous.get("status")
        asked = stage.name in opts.stages
        if status in DONE and not asked:
            continue
        if status == "started" and not asked:
            previous["status"] = "interrupted"
            results.save()
            log(f"{stage.name}: interrupted in an earlier call; skipped (--stage {stage.name})")
            continue
        if status == "interrupted" and not asked:
            continue
        remaining = opts.budget_s - (time.monotonic() - start)
        needs = stage.budget_s * (SMOKE_SHARE if opts.smoke else 1.0)
        if ran and needs > remaining:
            left = [s.name for s, _ in stages if s.name not in _finished(results)]
            break
        ctx = Context(
            sizes=SMOKE_SIZES if opts.smoke else GPU_SIZES,
            device=device,
            folder=folder,
            gpu=gpu,
            target=target,
            deadline=start + opts.budget_s,
            previous=previous if status == "partial" else {},
            shakespeare=opts.shakespeare,
            log=log,
        )
        log(f"{stage.name}: {stage.what} (budget {stage.budget_s} s)")
        results.start(stage)
        _clean(device)
        t0 = time.monotonic()
        try:
            result = {"status": "ok", **fn(ctx)}
        except Exception:  # a failed stage is a finding; the others still run
            result = {"status": "failed", "error": traceback.format_exc(limit=8)}
            result.setdefault("checks", [])
            log(f"{stage.name}: failed\n{result['error']}")
        finally:
            _clean(device)
        result["commit"] = results.meta["commit"]
        results.finish(stage, result, time.monotonic() - t0)
        atomic_write(folder / RESULTS_MD, markdown(_data(results), stage_list), fsync=False)
        ran += 1
        if result["status"] == "partial":
            left = [stage.name]
            break
    data = _data(results)
    for line in summary(data, stage_list):
        log(line)
    if left:
        log(f"not done yet: {', '.join(left)}; run the same command again to go on")
        return EXIT_MORE
    code = _finish(opts, data, stages, folder, log)
    return code


def _finished(results: ResultsFolder) -> set[str]:
    return {k for k, v in results.stages.items() if v.get("status") in (*DONE, "interrupted")}


def _data(results: ResultsFolder) -> dict:
    return {"meta": results.meta, "stages": results.stages}


def _finish(opts: Options, data: dict, stages: list, folder: Path, log) -> int:
    stage_list: list[Stage] = [s for s, _ in stages]
    problems = check_schema(data, stage_list) if opts.smoke else []
    for p in problems:
        log(f"schema: {p}")
    if opts.smoke and not problems:
        log(f"schema: every stage present and done, every row with its fields ({folder})")
    if opts.update_docs:
        _write_docs(data, stage_list, log)
    failed = [s.name for s in stage_list if data["stages"].get(s.name, {}).get("status") != "ok"]
    if failed:
        log(f"not ok: {', '.join(failed)}")
    return EXIT_FAILED if failed or problems else EXIT_OK


def _write_docs(data: dict, stages: list[Stage], log) -> None:
    if data.get("meta", {}).get("mode") != "gpu":
        raise UserError("--update-docs takes the results of a GPU run, not of --cpu-smoke")
    update_docs(DOCS, markdown(data, stages))
    log(f"wrote the tables of {DOCS.relative_to(REPO)}")


def _report(opts: Options, stages: list, log) -> int:
    if opts.results is None or not (opts.results / "results.json").is_file():
        raise UserError("--report needs --results DIR, a folder holding a results.json")
    results = ResultsFolder(opts.results)
    data = _data(results)
    stage_list = [s for s, _ in stages]
    for line in summary(data, stage_list):
        log(line)
    atomic_write(opts.results / RESULTS_MD, markdown(data, stage_list), fsync=False)
    if opts.update_docs:
        _write_docs(data, stage_list, log)
    return EXIT_OK
