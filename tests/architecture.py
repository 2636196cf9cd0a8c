"""The architecture's figures, from the code's own imports and definitions.

    python tests/architecture.py          # print them (the closing notes quote this)

tests/contracts.py and tests/test_architecture.py assert the rules docs/architecture.md states;
this module only measures. It reads source with `ast`, imports nothing of ours, so it runs on a broken tree.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "pretrain"


@dataclass
class Import:
    """One import statement."""

    line: int
    ours: set[str]  # our modules it names (the import graph's edges)
    loads: set[str]  # ... and those it loads: a lazy package's names, their modules
    packages: set[str]  # the third-party packages it names (top-level: torch)
    function: str | None  # the function it is in; None: it runs when the module loads
    typing_only: bool  # in the body of `if TYPE_CHECKING:`: never runs


@dataclass
class Module:
    name: str  # dotted: pretrain.train.trainer
    path: Path
    lines: int
    tree: ast.Module = field(repr=False)
    statements: list[Import] = field(default_factory=list)

    @property
    def imports(self) -> set[str]:
        """Our modules it imports: when it loads, inside a function or for annotations only
        (an annotation ties two layers together too)."""
        return {t for s in self.statements for t in s.ours}

    @property
    def load_time(self) -> list[Import]:
        """The statements that run when the module loads."""
        return [s for s in self.statements if s.function is None and not s.typing_only]

    @property
    def load_imports(self) -> set[str]:
        """Our modules that `import` of this one really loads, directly. A module imported
        both under `if TYPE_CHECKING:` and for real is here."""
        return {t for s in self.load_time for t in s.loads}

    @property
    def inner(self) -> list[Import]:
        """Its imports of our modules inside functions."""
        return [s for s in self.statements if s.function and s.ours]


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _resolve(node: ast.ImportFrom, current: str, is_package: bool) -> str:
    if not node.level:
        return node.module or ""
    base = current.split(".")
    base = base if is_package else base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _names(node: ast.Import | ast.ImportFrom, current: str, is_package: bool) -> list[str]:
    """The dotted names an import statement names (`from a import b`: a.b, which may be a
    module or a name in a)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    base = _resolve(node, current, is_package)
    return [f"{base}.{a.name}" for a in node.names]


def _ours(name: str, known: set[str]) -> str | None:
    """The module of ours a dotted name is, or is in (None: not ours)."""
    while name and name not in known:
        name = name.rpartition(".")[0]
    return name if name.startswith("pretrain") else None


def _lazy_names(tree: ast.Module, known: set[str]) -> dict[str, str]:
    """A package whose `__getattr__` loads a module when one of its names is first asked for
    (model/__init__.py, planner/__init__.py): its table, name -> module."""
    if not any(isinstance(n, ast.FunctionDef) and n.name == "__getattr__" for n in tree.body):
        return {}
    table = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Dict):
            for k, v in zip(node.value.keys, node.value.values, strict=True):
                if isinstance(k, ast.Constant) and isinstance(v, ast.Constant) and v.value in known:
                    table[k.value] = v.value
    return table


def _is_type_checking(node: ast.AST) -> bool:
    test = getattr(node, "test", None) if isinstance(node, ast.If) else None
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def load_modules(root: Path = ROOT) -> dict[str, Module]:
    """Every module of `root`/pretrain and its import statements."""
    # hf/remote_code is shipped inside exports and imports nothing of ours; it is a module
    # like the others here, so that importing it is not mistaken for importing hf/__init__.
    paths = sorted((root / "pretrain").rglob("*.py"))
    known = {module_name(p, root) for p in paths}
    sources = {module_name(p, root): (p, p.read_text()) for p in paths}
    trees = {name: ast.parse(source) for name, (_, source) in sources.items()}
    lazy = {name: _lazy_names(tree, known) for name, tree in trees.items()}
    modules = {}
    for name, (path, source) in sources.items():
        tree = trees[name]
        mod = Module(name, path, len(source.splitlines()), tree)
        is_package = path.name == "__init__.py"

        def visit(node, function, typing_only, mod=mod, name=name, is_package=is_package):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                function = node.name if function is None else f"{function}.{node.name}"
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names = _names(node, name, is_package)
                ours = {o for n in names if (o := _ours(n, known))} - {name}
                loads = set(ours)
                for n in names:  # `from pretrain.planner import plan_run` loads planner.search
                    package, _, attr = n.rpartition(".")
                    if attr in lazy.get(package, {}) and isinstance(node, ast.ImportFrom):
                        loads.add(lazy[package][attr])
                packages = {n.split(".")[0] for n in names if not n.startswith("pretrain")}
                mod.statements.append(
                    Import(node.lineno, ours, loads, packages, function, typing_only)
                )
            if _is_type_checking(node):  # the body never runs; an `else:` does
                for child in node.body:
                    visit(child, function, True)
                for child in node.orelse:
                    visit(child, function, typing_only)
                return
            for child in ast.iter_child_nodes(node):
                visit(child, function, typing_only)

        visit(tree, None, False)
        modules[name] = mod
    return modules


def packages_loaded(modules: dict[str, Module], name: str) -> set[str]:
    """The third-party packages (top-level names) that loading module `name` loads with import
    statements: its own that run when it loads, those of the modules of ours they load, and
    of the packages that hold each."""
    seen, todo, out = set(), [name], set()
    while todo:
        current = todo.pop()
        if current in seen or current not in modules:
            continue
        seen.add(current)
        parts = current.split(".")
        todo += [".".join(parts[:i]) for i in range(1, len(parts))]  # its packages' __init__
        for statement in modules[current].load_time:
            todo += statement.loads
            out |= statement.packages
    return out


def strongly_connected(graph: dict[str, set[str]]) -> list[set[str]]:
    """The groups of two or more nodes that each reach all the others: the import circles."""
    reach = {}
    for v in graph:
        seen, todo = set(), list(graph[v])
        while todo:
            w = todo.pop()
            if w not in seen:
                seen.add(w)
                todo += graph.get(w, ())
        reach[v] = seen
    circles = {frozenset(w for w in reach[v] if v in reach.get(w, ())) for v in graph}
    return [set(c) for c in circles if len(c) > 1]


def import_circles(modules: dict[str, Module]) -> list[set[str]]:
    """Circles counting every import of ours, at load time or inside a function."""
    graph = {m.name: m.imports for m in modules.values()}
    # An edge is what the code names: `from pretrain.model import X` depends on the package's
    # __init__, `from pretrain.model.rope import X` on rope.py alone.
    return strongly_connected(graph)


def attributes_outside_init(path: Path, cls: str) -> set[str]:
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name == cls:
            inside, outside = set(), set()
            for fn in node.body:
                if not isinstance(fn, ast.FunctionDef):
                    continue
                for sub in ast.walk(fn):
                    targets = []
                    if isinstance(sub, ast.Assign):
                        targets = sub.targets
                    elif isinstance(sub, (ast.AnnAssign, ast.AugAssign)):
                        targets = [sub.target]
                    for t in targets:
                        if (
                            isinstance(t, ast.Attribute)
                            and isinstance(t.value, ast.Name)
                            and t.value.id == "self"
                        ):
                            (inside if fn.name == "__init__" else outside).add(t.attr)
            return outside - inside
    return set()


def trainer_names_used_by_callbacks() -> set[str]:
    """Attributes callbacks read from the trainer they are handed (`trainer.X`)."""
    names = set()
    for path in (PACKAGE / "train" / "callbacks").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id == "trainer"
            ):
                names.add(node.attr)
    return names


# The config and the studies, wherever their code lives: the loader, the schema, the run's
# machine checks, every section beside its feature, the study package and its programs.
CONFIG_AND_STUDIES = (
    "config.py", "schema.py", "preflight.py", "*/config.py", "study/*.py", "cli/study*.py",
    "cli/config_schema.py",
)  # fmt: skip


def config_and_studies_lines() -> int:
    files = {p for pattern in CONFIG_AND_STUDIES for p in PACKAGE.glob(pattern)}
    return sum(len(p.read_text().splitlines()) for p in files)


def function_lines(path: Path, qualname: str) -> int:
    cls, _, fn = qualname.rpartition(".")
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ClassDef) and node.name == cls:
            for sub in node.body:
                if isinstance(sub, ast.FunctionDef) and sub.name == fn:
                    return sub.end_lineno - sub.lineno + 1
    return 0


# The limits tests/test_architecture.py holds the figures to (docs/architecture.md, "Figures").
LIMITS = {
    "module lines": 600,
    "config and studies lines": 5000,
    "trainer.py lines": 380,
    "Trainer.rollback lines": 20,
    "trainer names used by callbacks": 12,
}


def report() -> list[str]:
    modules = load_modules()
    circles = import_circles(modules)
    longest = max(modules.values(), key=lambda m: m.lines)
    trainer = PACKAGE / "train" / "trainer.py"
    callback_names = trainer_names_used_by_callbacks()
    by_count = {m.name: len(m.inner) for m in modules.values()}
    lines = [
        f"import circles: {len(circles)}; files in them: {sum(len(c) for c in circles)}",
        *(f"  circle: {', '.join(sorted(c))}" for c in circles),
        f"imports of our modules inside functions: {sum(by_count.values())}",
        f"  most: {', '.join(f'{k} {v}' for k, v in sorted(by_count.items(), key=lambda kv: -kv[1])[:5])}",
        f"longest module: {longest.name} ({longest.lines} lines; at most {LIMITS['module lines']})",
        f"config and studies: {config_and_studies_lines()} lines (at most "
        f"{LIMITS['config and studies lines']})",
        f"trainer.py lines: {len(trainer.read_text().splitlines())} (at most "
        f"{LIMITS['trainer.py lines']})",
        f"Trainer.rollback lines: {function_lines(trainer, 'Trainer.rollback')} (at most "
        f"{LIMITS['Trainer.rollback lines']})",
        f"Trainer attributes created outside __init__: {len(attributes_outside_init(trainer, 'Trainer'))}",
        f"trainer names used by callbacks: {len(callback_names)} (at most "
        f"{LIMITS['trainer names used by callbacks']}: {', '.join(sorted(callback_names))})",
    ]
    return lines


if __name__ == "__main__":
    print("\n".join(report()))
