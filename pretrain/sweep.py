"""The paper's runs as one grid, and what is generated from it.

Every run of the paper is a `Run` below; `tools/sweep.py` writes from them one config
(configs/paper/NAME.yaml) and one Slurm job script (slurm/NAME.sh) per run. Nothing else
writes those files, and tests/test_sweep.py fails when the checked-in files differ from
what the grid generates, so a config and its job script cannot drift apart, nor two runs
that should differ only in their RoPE fraction.

The token budget is the paper's (Appendix B): 12,000 steps of 2^23 = 8,388,608 tokens at
every sequence length (~100.7B tokens per run). Each run's global batch is derived from it
(2^23 / seq_len sequences: 8192 / 4096 / 2048 / 1024 at seq 1024 / 2048 / 4096 / 8192), its
gradient accumulation from its micro batch and the GPUs of its Slurm layout; a run whose
layout does not divide the batch is refused, and one whose tokens differ from its budget is
reported (`budget_warnings`).

Shared settings (GPT-NeoX settings of the paper, from its public configs): Adam lr 4e-4,
betas (0.9, 0.95), eps 1e-8, weight decay 0.1, clip 1.0, cosine to 4e-5 after 5% warmup
of 12,000 iterations, ZeRO-1, BF16 with FP32 gradient accumulation and all-reduce (8B: BF16
accumulation), activation checkpointing, seed 1234, evaluation every 2000 iterations over 10
batches; 4 nodes of 8 GPUs, pure data parallelism.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import yaml

from pretrain.config import load_config
from pretrain.planner import time_limit_hours
from pretrain.run_layout import atomic_write

# ----------------------------------------------------------------------------- the grid

FRACTIONS_LLAMA = (0, 4, 10, 25, 50, 75, 100)  # percent of each head's dims that rotate
FRACTIONS_PYTHIA = (0, 1, 10, 25, 50, 75, 100)
FRACTIONS_LLAMA8B = (0, 10, 25, 50, 75, 100)


@dataclass(frozen=True)
class Budget:
    """What a run trains: optimizer steps of a fixed number of tokens."""

    tokens_per_step: int
    train_iters: int

    @property
    def total_tokens(self) -> int:
        return self.tokens_per_step * self.train_iters


# The paper's budget (Appendix B): the same steps and tokens per step at every sequence length.
PAPER_BUDGET = Budget(tokens_per_step=2**23, train_iters=12_000)
# Micro batch per GPU by sequence length, as the paper ran them: the same tokens per forward
# (131,072), so with the global batch 2^23 / seq_len the accumulation on 32 GPUs is 2 at every
# length.
MICRO_BATCH_1B = {1024: 128, 2048: 64, 4096: 32, 8192: 16}
# Folders written by tools/prepare_data.py --output (docs/data.md): one folder holds both
# splits (OUT/train, OUT/valid) and the tokenizer, which the trainer takes from there.
DATA = {
    "fineweb": {"train": ["data/fineweb100B"], "valid": ["data/fineweb100B"]},
    "fineweb-edu": {"train": ["data/fineweb-edu100B"], "valid": ["data/fineweb-edu100B"]},
}


def time_limit_s(text: str) -> int:
    """Seconds of a Slurm time limit: MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM or D-HH:MM:SS."""
    days, _, clock = text.rpartition("-")
    parts = [int(p) for p in clock.split(":")]
    if days:  # after "D-" the clock starts with hours
        h, m, s = (parts + [0, 0])[:3]
        return int(days) * 86400 + h * 3600 + m * 60 + s
    if len(parts) == 1:
        return parts[0] * 60
    return sum(p * 60**i for i, p in enumerate(reversed(parts)))


@dataclass(frozen=True)
class Slurm:
    """The #SBATCH header of a job script. Cluster-specific options (partition, account,
    QoS) are left out on purpose: give them with SBATCH_PARTITION / SBATCH_ACCOUNT in the
    environment or on the sbatch command line (docs/slurm.md)."""

    nodes: int = 4
    gpus_per_node: int = 8  # 0: CPU nodes (gloo); tasks per node then come from ntasks_per_node
    ntasks_per_node: int | None = None  # None: one task per GPU
    cpus_per_task: int | None = 8  # data loader workers need cores; many sites bind tasks
    time: str = "24:00:00"  # per job; a longer run requeues itself and resumes
    signal_margin_s: int = 600  # USR1 to the batch shell this long before the time limit
    exclusive: bool = True
    mem: str | None = "0"  # 0: all of each node's memory
    output: str = "slurm/logs/%x-%j.out"  # relative to the submit folder (the repo root)
    extra: tuple[str, ...] = ()  # further `--opt=value` lines, e.g. for a test cluster

    def lines(self, job_name: str) -> list[str]:
        if self.signal_margin_s >= time_limit_s(self.time):
            raise ValueError(
                f"Slurm signal_margin_s={self.signal_margin_s} is not below the time limit "
                f"{self.time}: the job would be told to stop as it starts"
            )
        tasks = self.ntasks_per_node or self.gpus_per_node or 1
        opts = [f"--job-name={job_name}", f"--nodes={self.nodes}", f"--ntasks-per-node={tasks}"]
        if self.gpus_per_node:
            opts.append(f"--gpus-per-node={self.gpus_per_node}")
        if self.cpus_per_task:
            opts.append(f"--cpus-per-task={self.cpus_per_task}")
        if self.exclusive:
            opts.append("--exclusive")
        if self.mem is not None:
            opts.append(f"--mem={self.mem}")
        opts += [
            f"--time={self.time}",
            "--requeue",  # launch.sh requeues after a pre-emption checkpoint
            f"--signal=B:USR1@{self.signal_margin_s}",  # to the batch shell: launch.sh forwards it
            "--open-mode=append",  # a requeued job appends to the same log
            f"--output={self.output}",
            *self.extra,
        ]
        return [f"#SBATCH {o}" for o in opts]


@dataclass(frozen=True)
class Run:
    """One training run of the paper."""

    name: str
    description: str
    preset: str  # configs/models/PRESET.yaml
    rope_percent: int  # 0 = NoPE
    dataset: str  # key of DATA
    seq_len: int = 2048
    micro_batch: int = 64
    qk_norm: bool = False
    grad_accum_dtype: str = "fp32"
    slurm: Slurm = field(default_factory=Slurm)
    budget: Budget = PAPER_BUDGET
    # Sequences per step; None derives it from the budget (tokens_per_step / seq_len). Set it
    # only to train a different budget on purpose: the generator then says so.
    global_batch: int | None = None

    @property
    def global_batch_size(self) -> int:
        if self.global_batch is not None:
            return self.global_batch
        if self.budget.tokens_per_step % self.seq_len:
            raise ValueError(
                f"run {self.name}: seq_len {self.seq_len} does not divide the budget's "
                f"{self.budget.tokens_per_step:,} tokens per step; set Run.global_batch or "
                f"choose a seq_len that divides it"
            )
        return self.budget.tokens_per_step // self.seq_len

    @property
    def data_parallel_ranks(self) -> int:
        """Processes of the Slurm layout: one per GPU (or ntasks_per_node on CPU nodes)."""
        s = self.slurm
        return s.nodes * (s.ntasks_per_node or s.gpus_per_node or 1)

    @property
    def grad_accum(self) -> int:
        per_step = self.micro_batch * self.data_parallel_ranks
        if self.global_batch_size % per_step:
            raise ValueError(
                f"run {self.name}: global batch {self.global_batch_size} is not a multiple of "
                f"micro batch {self.micro_batch} x {self.data_parallel_ranks} ranks = {per_step}; "
                f"change its micro_batch or its Slurm layout"
            )
        return self.global_batch_size // per_step

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch_size * self.seq_len

    @property
    def total_tokens(self) -> int:
        return self.tokens_per_step * self.budget.train_iters

    @property
    def config_path(self) -> str:
        return f"configs/paper/{self.name}.yaml"

    @property
    def script_path(self) -> str:
        return f"slurm/{self.name}.sh"

    @property
    def run_dir(self) -> str:
        return f"runs/{self.name}"


def _rope_desc(percent: int) -> str:
    return "NoPE" if percent == 0 else f"RoPE on {percent}% of head dims"


def paper_runs() -> list[Run]:
    """Every run of the paper, in the order of its tables."""
    runs: list[Run] = []
    for p in FRACTIONS_LLAMA:  # the main sweep
        runs.append(
            Run(
                f"llama1b_rope{p}",
                f"Llama-1B, {_rope_desc(p)}, seq 2048, FineWeb",
                "llama1b",
                p,
                "fineweb",
            )
        )
    for seq in (1024, 4096, 8192):  # sequence length
        for p in FRACTIONS_LLAMA:
            runs.append(
                Run(
                    f"llama1b_seq{seq}_rope{p}",
                    f"Llama-1B, {_rope_desc(p)}, seq {seq}, FineWeb",
                    "llama1b",
                    p,
                    "fineweb",
                    seq_len=seq,
                    micro_batch=MICRO_BATCH_1B[seq],
                )
            )
    runs.append(
        Run(
            "llama1b_seq8192_rope0_qknorm",
            "Llama-1B, NoPE + QK-Norm, seq 8192, FineWeb",
            "llama1b",
            0,
            "fineweb",
            seq_len=8192,
            micro_batch=MICRO_BATCH_1B[8192],
            qk_norm=True,
        )
    )
    for p in FRACTIONS_LLAMA:  # data quality
        runs.append(
            Run(
                f"llama1b_edu_rope{p}",
                f"Llama-1B, {_rope_desc(p)}, seq 2048, FineWeb-Edu",
                "llama1b",
                p,
                "fineweb-edu",
            )
        )
    for p in FRACTIONS_PYTHIA:  # architecture: parallel block, MHA with head_dim 256
        runs.append(
            Run(
                f"pythia1b_rope{p}",
                f"Pythia-1B, {_rope_desc(p)}, seq 2048, FineWeb-Edu",
                "pythia1b_paper",
                p,
                "fineweb-edu",
            )
        )
    runs.append(
        Run(
            "pythia1b_rope0_qknorm",
            "Pythia-1B, NoPE + QK-Norm, seq 2048, FineWeb-Edu",
            "pythia1b_paper",
            0,
            "fineweb-edu",
            qk_norm=True,
        )
    )
    slurm_8b = Slurm(signal_margin_s=900)  # bigger checkpoints: more margin
    for p in FRACTIONS_LLAMA8B:  # scale: micro batch 4 x 32 accumulation x 32 GPUs = 4096
        runs.append(
            Run(
                f"llama8b_rope{p}",
                f"Llama-8B, {_rope_desc(p)}, seq 2048, FineWeb",
                "llama8b",
                p,
                "fineweb",
                micro_batch=4,
                grad_accum_dtype="bf16",
                slurm=slurm_8b,
            )
        )
    return [_planned(run) for run in runs]


# ----------------------------------------------------------------------------- the plan
# pretrain/sweep_plan.json is the planner's verdict on every run of the grid (`python
# tools/plan.py --paper --write`, docs/performance.md): peak memory per GPU, FLOPs, run time.
# The grid takes each run's Slurm time limit from it and refuses a run that does not fit.
PLAN_FILE = Path(__file__).with_name("sweep_plan.json")


def plan_rows() -> dict[str, dict[str, Any]]:
    if not PLAN_FILE.is_file():
        return {}
    return {r["name"]: r for r in json.loads(PLAN_FILE.read_text())["runs"]}


def planned_hours(row: dict[str, Any]) -> int:
    """The job's time limit (pretrain.planner.time_limit_hours) of the run as configured: its
    planned run time at 40% MFU, scaled from model to executed FLOPs (recompute included)."""

    return time_limit_hours(row["run_hours"] * row["executed_flops"] / row["model_flops"])


def _planned(run: Run, rows: dict[str, dict[str, Any]] | None = None) -> Run:
    row = (plan_rows() if rows is None else rows).get(run.name)
    if row is None:  # a run added to the grid and not planned yet keeps the default limit
        return run
    if not row["fits_h200"]:
        raise ValueError(
            f"run {run.name}: the plan says it does not fit an H200 ({row['train_peak_gib']} "
            f"GiB per GPU); change its micro batch or checkpointing, then re-plan with "
            f"python tools/plan.py --paper --write"
        )
    return replace(run, slurm=replace(run.slurm, time=f"{planned_hours(row)}:00:00"))


# ----------------------------------------------------------------------------- rendering

GENERATED = "Generated by `python tools/sweep.py` from the grid in pretrain/sweep.py: edit the grid, not this file."


def config_dict(run: Run) -> dict[str, Any]:
    """The run config (YAML content below the `inherit:` of its model preset)."""
    run.grad_accum  # noqa: B018 (refuses a Slurm layout that does not divide the global batch)
    model: dict[str, Any] = {"max_seq_len": run.seq_len, "rope_fraction": run.rope_percent / 100}
    if run.qk_norm:
        model["qk_norm"] = True
    return {
        "inherit": {"model": f"../models/{run.preset}.yaml"},
        "model": model,
        "data": dict(DATA[run.dataset]),
        "optim": {
            "lr": 4.0e-4,
            "betas": [0.9, 0.95],
            "eps": 1.0e-8,
            "weight_decay": 0.1,
            "grad_clip": 1.0,
        },
        "schedule": {"kind": "cosine", "warmup_fraction": 0.05, "min_lr_ratio": 0.1},
        "train": {
            "train_iters": run.budget.train_iters,
            "global_batch_size": run.global_batch_size,
            "micro_batch_size": run.micro_batch,
            "seq_len": run.seq_len,
            "precision": "bf16",
            "grad_accum_dtype": run.grad_accum_dtype,
            "zero_stage": 1,
            "seed": 1234,
            "eval_interval": 2000,
            "eval_iters": 10,
            "activation_checkpointing": True,
        },
        "checkpoint": {"interval": 500, "keep_last": 2},
        "logging": {"run_dir": run.run_dir},
    }


def render_config(run: Run) -> str:
    header = (
        f"# {run.name}: {run.description}.\n# {GENERATED}\n"
        f"# Train: sbatch {run.script_path}   (or: deepspeed pretrain/main.py --config {run.config_path})\n"
    )
    return header + yaml.dump(config_dict(run), Dumper=_Dumper, sort_keys=False, width=100)


class _Dumper(yaml.SafeDumper):
    """Block-style mappings, one-line lists: `betas: [0.9, 0.95]`."""


_Dumper.add_representer(
    list,
    lambda dumper, data: dumper.represent_sequence("tag:yaml.org,2002:seq", data, flow_style=True),
)


def render_job_script(run: Run, config_path: str | None = None) -> str:
    """The sbatch script: a header, then the shared launcher with the run's config."""
    config_path = config_path or run.config_path
    return "\n".join(
        [
            "#!/bin/bash",
            f"# {run.name}: {run.description}.",
            f"# {GENERATED}",
            f"# Submit from the repository root: sbatch {run.script_path} [--set key=value ...]",
            "# (or slurm/submit.sh to chain the evaluation); adapt the header: docs/slurm.md.",
            *run.slurm.lines(run.name),
            "",
            f'exec slurm/launch.sh {config_path} "$@"',
            "",
        ]
    )


# ----------------------------------------------------------------------------- budget table


def budget_warnings(runs: list[Run] | None = None) -> list[str]:
    """One line per run whose total tokens differ from the budget its grid declares."""
    return [
        f"{r.name} trains {r.total_tokens:,} tokens ({r.global_batch_size} sequences x "
        f"{r.seq_len} x {r.budget.train_iters:,} steps), not its budget's "
        f"{r.budget.total_tokens:,} ({r.budget.tokens_per_step:,} tokens x "
        f"{r.budget.train_iters:,} steps)"
        for r in runs or paper_runs()
        if r.total_tokens != r.budget.total_tokens
    ]


TABLE_COLUMNS = (
    "run",
    "seq len",
    "global batch",
    "micro batch",
    "accum",
    "tokens/step",
    "total tokens",
    "nodes x GPUs",
)


def table_rows(runs: list[Run] | None = None) -> list[tuple[str, ...]]:
    """One row per run: how many tokens it trains and how the batch is laid out."""
    rows = []
    for r in runs or paper_runs():
        gpus = r.slurm.ntasks_per_node or r.slurm.gpus_per_node or 1
        rows.append(
            (
                r.name,
                str(r.seq_len),
                f"{r.global_batch_size:,}",
                str(r.micro_batch),
                str(r.grad_accum),
                f"{r.tokens_per_step:,}",
                f"{r.total_tokens / 1e9:.1f}B",
                f"{r.slurm.nodes} x {gpus}",
            )
        )
    return rows


def format_run_table(runs: list[Run] | None = None, markdown: bool = False) -> str:
    rows = table_rows(runs)
    if markdown:
        lines = [
            "| " + " | ".join(TABLE_COLUMNS) + " |",
            "|" + "|".join("---" if i == 0 else "---:" for i in range(len(TABLE_COLUMNS))) + "|",
        ]
        lines += ["| " + " | ".join(row) + " |" for row in rows]
        return "\n".join(lines)
    widths = [max(len(c), *(len(row[i]) for row in rows)) for i, c in enumerate(TABLE_COLUMNS)]

    def fmt(row: tuple[str, ...]) -> str:
        return "  ".join(
            v.ljust(w) if i == 0 else v.rjust(w)
            for i, (v, w) in enumerate(zip(row, widths, strict=True))
        )

    return "\n".join([fmt(TABLE_COLUMNS), *(fmt(row) for row in rows)])


# ----------------------------------------------------------------------------- char studies
# The RoPE-theta study (character-level GPT, nanoGPT's shakespeare_char recipe: batch 64 x 256,
# lr 1e-3 to 1e-4, 100 warmup steps, beta2 0.99, 5000 steps, dropout 0.2) on three corpora,
# and nanoGPT with RoPE on enwik8 (bits per character). One process each (a GPU or a CPU);
# seeds are given on the command line (docs/training.md).
THETAS = (500, 1000, 5000, 10000, 20000, 50000)
# corpus -> (prepared folder, character vocabulary of its recipe)
CHAR_DATA = {
    "shakespeare": ("data/shakespeare_char", 65),
    "enwik8": ("data/enwik8", 6064),
    "text8": ("data/text8", 27),
}


def char_configs() -> dict[str, dict[str, Any]]:
    """configs/char/NAME.yaml -> config (YAML content) for the character-level studies."""
    out: dict[str, dict[str, Any]] = {}
    for corpus, (folder, vocab) in CHAR_DATA.items():
        for theta in THETAS:
            name = f"{corpus}_theta{theta}"
            out[name] = {
                "inherit": {"model": "../models/gpt_char.yaml"},
                "model": {"vocab_size": vocab, "rope_theta": theta},
                "data": {"train": [folder], "valid": [folder]},
                "optim": {
                    "lr": 1.0e-3,
                    "betas": [0.9, 0.99],
                    "weight_decay": 0.1,
                    "grad_clip": 1.0,
                },
                "schedule": {
                    "kind": "cosine",
                    "warmup_steps": 100,
                    "warmup_fraction": None,
                    "min_lr_ratio": 0.1,
                },
                "train": {
                    "train_iters": 5000,
                    "global_batch_size": 64,
                    "micro_batch_size": 64,
                    "seq_len": 256,
                    "seed": 1337,
                    "eval_interval": 250,
                    "eval_iters": 200,
                },
                "checkpoint": {"interval": 1000, "keep_last": 1},
                "logging": {"run_dir": f"runs/char/{name}", "log_interval": 50},
            }
    out["nanogpt_rope_enwik8"] = {
        "inherit": {"model": "../models/nanogpt_rope.yaml"},
        "data": {"train": ["data/enwik8"], "valid": ["data/enwik8"]},
        "optim": {"lr": 6.0e-4, "betas": [0.9, 0.95], "weight_decay": 0.1, "grad_clip": 1.0},
        "schedule": {
            "kind": "cosine",
            "warmup_steps": 200,
            "warmup_fraction": None,
            "min_lr_ratio": 0.1,
        },
        "train": {
            "train_iters": 20000,
            "global_batch_size": 32,
            "micro_batch_size": 32,
            "seq_len": 1024,
            "seed": 1337,
            "eval_interval": 1000,
            "eval_iters": 100,
        },
        "checkpoint": {"interval": 1000, "keep_last": 2},
        "logging": {"run_dir": "runs/char/nanogpt_rope_enwik8", "log_interval": 50},
    }
    return out


def render_char_config(name: str, config: dict[str, Any]) -> str:
    header = (
        f"# {name}: character-level study run. {GENERATED}\n"
        f"# python pretrain/main.py --config configs/char/{name}.yaml "
        f"[--set train.seed=S --set logging.run_dir=runs/char/{name}_sS]\n"
    )
    return header + yaml.dump(config, Dumper=_Dumper, sort_keys=False, width=100)


def generated_files(runs: list[Run] | None = None) -> dict[str, str]:
    """Repository-relative path -> content, for every file the grid owns."""
    out: dict[str, str] = {}
    for run in runs or paper_runs():
        out[run.config_path] = render_config(run)
        out[run.script_path] = render_job_script(run)
    if runs is None:
        for name, config in char_configs().items():
            out[f"configs/char/{name}.yaml"] = render_char_config(name, config)
    return out


def stale_files(repo: Path, runs: list[Run] | None = None) -> list[str]:
    """Generated files that are missing or differ from the grid, plus configs/paper/*.yaml and
    job scripts that the grid no longer knows (left over from a renamed run)."""
    want = generated_files(runs)
    bad = [
        p for p, text in want.items() if not (repo / p).is_file() or (repo / p).read_text() != text
    ]
    owned = sorted((repo / "configs" / "paper").glob("*.yaml"))
    if runs is None:
        owned += sorted((repo / "configs" / "char").glob("*.yaml"))
    for path in owned:
        rel = path.relative_to(repo).as_posix()
        if rel not in want:
            bad.append(rel)
    for path in sorted((repo / "slurm").glob("*.sh")):
        rel = path.relative_to(repo).as_posix()
        if GENERATED in path.read_text() and rel not in want:
            bad.append(rel)
    return bad


def write_files(repo: Path, runs: list[Run] | None = None) -> list[str]:
    """Write every generated file (atomically) and return the paths that changed."""
    changed = []
    for rel, text in generated_files(runs).items():
        path = repo / rel
        if path.is_file() and path.read_text() == text:
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, text, fsync=False, mode=0o755 if rel.endswith(".sh") else 0o644)
        changed.append(rel)
    return changed


def check_configs(repo: Path, runs: list[Run] | None = None) -> None:
    """Load every generated config with the trainer's loader (raises ConfigError)."""
    for run in runs or paper_runs():
        load_config(repo / run.config_path)
    if runs is None:
        for name in char_configs():
            load_config(repo / "configs" / "char" / f"{name}.yaml")


def run_dir_of(config: str | Path, overrides: list[str] | None = None) -> str:
    """The run folder (logging.run_dir) of a config after `--set` overrides."""
    return load_config(config, overrides).logging.run_dir


def with_slurm(run: Run, **changes: Any) -> Run:
    """The same run with a different Slurm header (e.g. a test cluster's)."""
    return replace(run, slurm=replace(run.slurm, **changes))


__all__ = [
    "DATA",
    "GENERATED",
    "PAPER_BUDGET",
    "Budget",
    "Run",
    "Slurm",
    "budget_warnings",
    "char_configs",
    "check_configs",
    "config_dict",
    "format_run_table",
    "generated_files",
    "paper_runs",
    "render_config",
    "render_job_script",
    "run_dir_of",
    "stale_files",
    "with_slurm",
    "write_files",
]
