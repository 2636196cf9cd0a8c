"""The import rules of docs/architecture.md that import-linter does not state.

    python tests/contracts.py            # exit 1 and one line per broken rule

`make lint` runs `lint-imports` first: the layers and what each may import are import-linter's
contracts, in pyproject.toml. What its graph cannot say is here, read from the source with
`ast` (tests/architecture.py, importing nothing of ours): which imports run when a module
loads (an import inside a function or under `if TYPE_CHECKING:` does not), import circles
between modules (import-linter's acyclic_siblings checks packages, and the config's sections,
kept in their features' packages and put together by config.py, tie those together by
design), and two rules about what modules hold. tests/test_architecture.py shows each failing
on a deliberate violation.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Callable
from dataclasses import dataclass

from architecture import ROOT, Module, import_circles, load_modules, packages_loaded

# What a module (by prefix) may import inside a function but not when it loads.
LOAD_TIME: dict[str, tuple[str, tuple[str, ...]]] = {
    # `study write`, `status` and `submit` load no torch; `study plan` traces inside functions.
    "study-loads-no-training": ("pretrain.study", ("pretrain.train", "pretrain.planner")),
    # The planner answers a run's `auto` fields when the run asks (LazyPlanner), not at every
    # start of every rank.
    "train-program-plans-on-demand": ("pretrain.cli.train", ("pretrain.planner",)),
}
# Third-party packages heavy to load (a second or more, or needed by few runs): the one other
# reason for an import of our modules inside a function.
HEAVY = {
    "torch", "deepspeed", "megatron", "transformers", "lm_eval", "datasets", "matplotlib",
    "torchao", "wandb", "litgpt",
}  # fmt: skip


def _within(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def _load_time_rule(importer: str, target: str) -> str | None:
    """The LOAD_TIME contract that forbids `importer` to import `target` when it loads."""
    for contract, (source, forbidden) in LOAD_TIME.items():
        if _within(importer, source) and any(_within(target, f) for f in forbidden):
            return contract
    return None


@dataclass(frozen=True)
class Contract:
    name: str
    rule: str  # one sentence: what holds, as docs/architecture.md says it
    check: Callable[[dict[str, Module]], list[str]]


def _loads(contract: str) -> Callable[[dict[str, Module]], list[str]]:
    def check(modules: dict[str, Module]) -> list[str]:
        return [
            f"{name} -> {t}"
            for name, mod in sorted(modules.items())
            for t in sorted(mod.load_imports)
            if _load_time_rule(name, t) == contract
        ]

    return check


def _no_circles(modules: dict[str, Module]) -> list[str]:
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


def _reasoned_inner_imports(modules: dict[str, Module]) -> list[str]:
    bad = []
    for name, mod in sorted(modules.items()):
        heavy_here = packages_loaded(modules, name) & HEAVY
        for s in mod.inner:
            if any(_load_time_rule(name, t) for t in s.loads):
                continue
            if set().union(*(packages_loaded(modules, t) for t in s.loads)) & (HEAVY - heavy_here):
                continue
            bad.append(
                f"{name}:{s.line} imports {', '.join(sorted(s.ours))} inside {s.function}(): "
                "no load-time contract forbids it and it loads no heavy package the module "
                "does not (import it at the top)"
            )
    return bad


def _programs_in_cli(modules: dict[str, Module]) -> list[str]:
    # That nothing outside cli/ imports cli/ is the layers contract's (lint-imports).
    bad = []
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


def _exit_codes_named_once(modules: dict[str, Module]) -> list[str]:
    bad = []
    for name, mod in sorted(modules.items()):
        if name == "pretrain.exit_codes":
            continue
        for node in ast.walk(mod.tree):
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
    Contract(
        "study-loads-no-training",
        "no module of pretrain.study imports training or the planner when it loads",
        _loads("study-loads-no-training"),
    ),
    Contract(
        "train-program-plans-on-demand",
        "pretrain/cli/train.py imports the planner inside the functions a run's `auto` calls",
        _loads("train-program-plans-on-demand"),
    ),
    Contract(
        "imports-inside-functions",
        "an import of ours inside a function only where the load-time one breaks a LOAD_TIME "
        "contract or loads a HEAVY package the module does not",
        _reasoned_inner_imports,
    ),
    Contract("no-circles", "no import circle, none through a module's own package", _no_circles),
    Contract("programs-in-cli", "flags and __main__ only in pretrain/cli/", _programs_in_cli),
    Contract(
        "exit-codes-named", "every exit code named once, in exit_codes.py", _exit_codes_named_once
    ),
]


def broken(root=ROOT) -> dict[str, list[str]]:
    """Each contract's violations in the tree at `root` (empty lists: all kept)."""
    modules = load_modules(root)
    return {c.name: c.check(modules) for c in CONTRACTS}


def main() -> int:
    result = broken()
    failed = {k: v for k, v in result.items() if v}
    for contract in CONTRACTS:
        for line in failed.get(contract.name, []):
            print(f"contract {contract.name} ({contract.rule}): {line}")
    print(
        f"import contracts (tests/contracts.py): {len(CONTRACTS) - len(failed)} kept, {len(failed)} broken"
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
