"""The layering of docs/architecture.md as import contracts, checked by `make lint`.

    python tests/contracts.py            # exit 1 and one line per broken rule

Read from the source with `ast` (tests/architecture.py), importing nothing of ours, so it
runs on a broken tree in a second. Our own checker rather than import-linter: a contract
here needs to tell an import that runs when a module loads from one inside a function or
under `if TYPE_CHECKING:` ("pretrain.study loads no training"), which import-linter's graph
does not record; the rest is a dozen lines on the graph tests/architecture.py already builds.
tests/test_architecture.py shows each contract failing on a deliberate violation.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from architecture import ROOT, Module, import_circles, load_modules

# The base: imported by everything, imports only itself and the config's sections.
BASE = (
    "pretrain",
    "pretrain.config",
    "pretrain.schema",
    "pretrain.errors",
    "pretrain.exit_codes",
    "pretrain.faults",
    "pretrain.integrity",
    "pretrain.launch_env",
    "pretrain.run_layout",
    "pretrain.slurm_limits",
    "pretrain.tables",
)
# Each section of the config, beside its feature, and the names they check against.
SECTIONS = (
    "pretrain.model.config",
    "pretrain.model.recompute",
    "pretrain.data.config",
    "pretrain.train.config",
    "pretrain.eval.config",
    "pretrain.eval.tasks",
)
# The in-loop downstream and position evaluators reuse the offline tools' scoring.
EVAL_FOR_TRAINING = (
    "pretrain.eval.metrics",
    "pretrain.eval.positions",
    "pretrain.eval.position_plots",
    "pretrain.eval.harness",
    "pretrain.eval.suite",
)
ABOVE_TRAINING = ("pretrain.planner", "pretrain.study", "pretrain.analysis", "pretrain.cli")

# docs/architecture.md's table: a layer (by module prefix) and what of ours it may import
# besides itself. A module belongs to the longest prefix that names it.
LAYERS: dict[str, tuple[str, ...]] = {
    **dict.fromkeys(BASE, BASE + SECTIONS),
    **dict.fromkeys(SECTIONS, BASE + SECTIONS),
    # Model code reads its own section, never the aggregate (which loads every section).
    "pretrain.model": ("pretrain.model.config", "pretrain.schema", "pretrain.errors"),
    "pretrain.weights": (*BASE, *SECTIONS, "pretrain.model"),
    "pretrain.preflight": (*BASE, *SECTIONS, "pretrain.model", "pretrain.weights"),
    "pretrain.data": BASE + SECTIONS,
    "pretrain.eval": (*BASE, *SECTIONS, "pretrain.model", "pretrain.weights", "pretrain.data"),
    "pretrain.train": (
        *BASE,
        *SECTIONS,
        "pretrain.preflight",
        "pretrain.model",
        "pretrain.weights",
        "pretrain.data",
        *EVAL_FOR_TRAINING,
    ),
    "pretrain.hf": (
        *BASE,
        *SECTIONS,
        "pretrain.model",
        "pretrain.weights",
        "pretrain.data",
        "pretrain.eval",
    ),
    # The planner traces the real engine: DeepSpeed's config, the rank setup, fp8's wrap.
    "pretrain.planner": (
        *BASE,
        *SECTIONS,
        "pretrain.model",
        "pretrain.data",
        "pretrain.train.engine",
        "pretrain.train.distributed",
        "pretrain.train.fp8",
    ),
    # What benchmarks/ and gpucheck/ both run: the peers' race, RoPE variants, a measured run;
    # and what DeepSpeed's engine sends (deepspeed_comms: the engine as training builds it).
    "pretrain.measure": (
        *BASE,
        *SECTIONS,
        "pretrain.model",
        "pretrain.hf",
        "pretrain.train.engine",
        "pretrain.train.deepspeed_adapter",
    ),
    "pretrain.analysis": (*BASE, *SECTIONS, "pretrain.model"),
    "pretrain.study": (*BASE, *SECTIONS, "pretrain.eval", "pretrain.planner"),
    "pretrain.benchmarks": (
        *BASE,
        *SECTIONS,
        "pretrain.model",
        "pretrain.weights",
        "pretrain.data",
        "pretrain.eval",
        "pretrain.train",
        "pretrain.hf",
        "pretrain.analysis",
        "pretrain.measure",
        "pretrain.planner",
    ),
    "pretrain.gpucheck": (
        *BASE,
        *SECTIONS,
        "pretrain.model",
        "pretrain.weights",
        "pretrain.data",
        "pretrain.eval",
        "pretrain.train",
        "pretrain.planner",
        "pretrain.analysis",
        "pretrain.measure",
    ),
    "pretrain.cli": ("pretrain",),  # everything (_allowed)
    "pretrain.main": ("pretrain.cli",),
}


def layer_of(name: str) -> str | None:
    """The longest LAYERS prefix that names `name` (None: a module no layer holds)."""
    best = None
    for prefix in LAYERS:
        if _within(name, prefix) and (best is None or len(prefix) > len(best)):
            best = prefix
    return best


def _within(name: str, prefix: str) -> bool:
    # "pretrain" stands for the package's own __init__ only, not for everything under it.
    return name == prefix or (prefix != "pretrain" and name.startswith(prefix + "."))


def _allowed(layer: str, target: str) -> bool:
    allowed = LAYERS[layer]
    if layer == "pretrain.cli":
        return True  # programs may import everything
    return layer_of(target) == layer or any(_within(target, p) for p in allowed)


@dataclass(frozen=True)
class Contract:
    name: str
    rule: str  # one sentence: what holds, as docs/architecture.md says it
    check: Callable[[dict[str, Module], Path], list[str]]


def _layers(modules: dict[str, Module], root: Path) -> list[str]:
    bad = [f"{n}: in no layer of tests/contracts.py LAYERS" for n in modules if not layer_of(n)]
    for name, mod in sorted(modules.items()):
        layer = layer_of(name)
        if layer:
            bad += [f"{name} -> {t}" for t in sorted(mod.imports) if not _allowed(layer, t)]
    return bad


def _forbid(
    layer: str, forbidden: tuple[str, ...], load_time_only: bool = False
) -> Callable[[dict[str, Module], Path], list[str]]:
    def check(modules: dict[str, Module], root: Path) -> list[str]:
        bad = []
        for name, mod in sorted(modules.items()):
            if name == layer or name.startswith(layer + "."):
                targets = mod.load_time_imports if load_time_only else mod.imports
                bad += [
                    f"{name} -> {t}"
                    for t in sorted(targets)
                    if any(_within(t, f) for f in forbidden)
                ]
        return bad

    return check


def _no_circles(modules: dict[str, Module], root: Path) -> list[str]:
    bad = [" <-> ".join(sorted(c)) for c in import_circles(modules)]
    # A module importing a package that holds it runs that package's __init__ half-way
    # (hf/targets/remote.py importing pretrain.hf.targets): a circle Python hides.
    for name, mod in sorted(modules.items()):
        bad += [
            f"{name} -> {t} (its own package)"
            for t in sorted(mod.imports)
            if name.startswith(t + ".") and t != "pretrain"
        ]
    return bad


def _programs_in_cli(modules: dict[str, Module], root: Path) -> list[str]:
    bad = [
        f"{name} -> {t}"
        for name, mod in sorted(modules.items())
        if not name.startswith("pretrain.cli") and name != "pretrain.main"
        for t in sorted(mod.imports)
        if t.startswith("pretrain.cli")
    ]
    for name, mod in sorted(modules.items()):
        if name.startswith("pretrain.cli") or name == "pretrain.main":
            continue
        source = mod.path.read_text()
        if '__name__ == "__main__"' in source:
            bad.append(f"{name}: a __main__ block (a program belongs in pretrain/cli/)")
        if "ArgumentParser(" in source and not name.startswith("pretrain.benchmarks"):
            bad.append(f"{name}: an ArgumentParser (flags belong in pretrain/cli/)")
    return bad


_EXIT_CALLS = {("sys", "exit"), ("os", "_exit")}


def _exit_codes_named_once(modules: dict[str, Module], root: Path) -> list[str]:
    bad = []
    for name, mod in sorted(modules.items()):
        if name == "pretrain.exit_codes":
            continue
        for node in ast.walk(ast.parse(mod.path.read_text())):
            if isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                bad += [
                    f"{name}:{node.lineno}: defines {t.id} (exit codes live in exit_codes.py)"
                    for t in targets
                    if isinstance(t, ast.Name) and t.id.startswith("EXIT_")
                ]
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and isinstance(node.func.value, ast.Name)
                and (node.func.value.id, node.func.attr) in _EXIT_CALLS
                and node.args
                and isinstance(node.args[0], ast.Constant)
                and isinstance(node.args[0].value, int)
            ):
                bad.append(f"{name}:{node.lineno}: exit code {node.args[0].value} unnamed")
    return bad


CONTRACTS = [
    Contract("layers", "each layer imports only the layers below it (LAYERS)", _layers),
    Contract(
        "model-imports-only-its-section",
        "pretrain.model imports only its own config section, the schema and errors of ours",
        _forbid(
            "pretrain.model",
            tuple(
                p
                for p in [*LAYERS, "pretrain.run_layout", "pretrain.integrity"]
                if p not in {"pretrain", "pretrain.schema", "pretrain.errors"}
                and not p.startswith("pretrain.model")
            ),
        ),
    ),
    Contract(
        "data-below-evaluation",
        "pretrain.data imports neither evaluation, training nor anything above",
        _forbid("pretrain.data", ("pretrain.eval", "pretrain.train", *ABOVE_TRAINING)),
    ),
    Contract(
        "study-loads-no-training",
        "no module of pretrain.study imports training or the planner when it loads",
        _forbid("pretrain.study", ("pretrain.train", "pretrain.planner"), load_time_only=True),
    ),
    Contract(
        "gpucheck-apart-from-benchmarks",
        "pretrain.gpucheck does not import pretrain.benchmarks (what both need is below)",
        _forbid("pretrain.gpucheck", ("pretrain.benchmarks",)),
    ),
    Contract("no-circles", "no import circle, none through a module's own package", _no_circles),
    Contract(
        "programs-in-cli", "programs, flags and __main__ only in pretrain/cli/", _programs_in_cli
    ),
    Contract(
        "exit-codes-named", "every exit code named once, in exit_codes.py", _exit_codes_named_once
    ),
]


def broken(root: Path = ROOT) -> dict[str, list[str]]:
    """Each contract's violations in the tree at `root` (empty lists: all kept)."""
    modules = load_modules(root)
    return {c.name: c.check(modules, root) for c in CONTRACTS}


def main() -> int:
    result = broken()
    failed = {k: v for k, v in result.items() if v}
    for contract in CONTRACTS:
        for line in failed.get(contract.name, []):
            print(f"contract {contract.name} ({contract.rule}): {line}")
    print(f"import contracts: {len(CONTRACTS) - len(failed)} kept, {len(failed)} broken")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
