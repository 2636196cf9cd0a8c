"""The architecture's figures, from the code's own imports and definitions.

    python tests/architecture.py          # print them (the closing notes quote this)

tests/test_architecture.py asserts the rules docs/architecture.md states; this module only
measures. It reads source with `ast`, imports nothing of ours, so it runs on a broken tree.
"""

from __future__ import annotations

import ast
import sys
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "pretrain"


@dataclass
class Module:
    name: str  # dotted: pretrain.train.trainer
    path: Path
    lines: int
    top_imports: set[str] = field(default_factory=set)  # our modules imported at load time
    inner_imports: set[str] = field(default_factory=set)  # ... inside functions
    inner_count: int = 0  # import statements of ours inside functions
    # Under `if TYPE_CHECKING:` (also in top_imports: annotations tie layers together too),
    # never executed, so not imported at load time.
    typing_imports: set[str] = field(default_factory=set)

    @property
    def load_time_imports(self) -> set[str]:
        """Our modules that `import` of this one really loads."""
        return self.top_imports - self.typing_imports

    @property
    def imports(self) -> set[str]:
        return self.top_imports | self.inner_imports


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


def _targets(node: ast.AST, current: str, is_package: bool, known: set[str]) -> set[str]:
    """Our modules an import statement loads (`from a import b` may name module a.b)."""
    out = set()
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    else:
        base = _resolve(node, current, is_package)
        names = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
    for name in names:
        while name and name not in known:
            name = name.rpartition(".")[0]
        if name.startswith("pretrain"):
            out.add(name)
    return out


def _is_type_checking(node: ast.AST) -> bool:
    test = getattr(node, "test", None) if isinstance(node, ast.If) else None
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def load_modules(root: Path = ROOT) -> dict[str, Module]:
    """Every module of `root`/pretrain and the modules of ours each imports."""
    # hf/remote_code is shipped inside exports and imports nothing of ours; it is a module
    # like the others here, so that importing it is not mistaken for importing hf/__init__.
    paths = list((root / "pretrain").rglob("*.py"))
    known = {module_name(p, root) for p in paths}
    modules = {}
    for path in sorted(paths):
        name = module_name(path, root)
        source = path.read_text()
        mod = Module(name, path, len(source.splitlines()))
        is_package = path.name == "__init__.py"

        def visit(node: ast.AST, parents: list[ast.AST], mod=mod, name=name, ip=is_package):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                targets = _targets(node, name, ip, known) - {name}
                in_function = any(
                    isinstance(p, (ast.FunctionDef, ast.AsyncFunctionDef)) for p in parents
                )
                # An import for annotations only still ties the layers together: counted.
                if in_function:
                    mod.inner_imports |= targets
                    mod.inner_count += bool(targets)
                else:
                    mod.top_imports |= targets
                    if any(_is_type_checking(p) for p in parents):
                        mod.typing_imports |= targets
            for child in ast.iter_child_nodes(node):
                visit(child, [*parents, node])

        visit(ast.parse(source), [])
        modules[name] = mod
    return modules


def strongly_connected(graph: dict[str, set[str]]) -> list[set[str]]:
    """Tarjan's components with more than one member: the import circles."""
    index, low, stack, on, out = {}, {}, [], set(), []
    counter = [0]

    def connect(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on.discard(w)
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(comp)

    sys.setrecursionlimit(10000)
    for v in graph:
        if v not in index:
            connect(v)
    return out


def import_circles(modules: dict[str, Module]) -> list[set[str]]:
    """Circles counting every import of ours, at load time or inside a function."""
    graph = {m.name: m.top_imports | m.inner_imports for m in modules.values()}
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


def function_lines(path: Path, qualname: str) -> int:
    cls, _, fn = qualname.rpartition(".")
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ClassDef) and node.name == cls:
            for sub in node.body:
                if isinstance(sub, ast.FunctionDef) and sub.name == fn:
                    return sub.end_lineno - sub.lineno + 1
    return 0


def report() -> list[str]:
    modules = load_modules()
    circles = import_circles(modules)
    longest = max(modules.values(), key=lambda m: m.lines)
    trainer = PACKAGE / "train" / "trainer.py"
    callback_names = trainer_names_used_by_callbacks()
    by_count = defaultdict(int)
    for m in modules.values():
        by_count[m.name] = m.inner_count
    lines = [
        f"import circles: {len(circles)}; files in them: {sum(len(c) for c in circles)}",
        *(f"  circle: {', '.join(sorted(c))}" for c in circles),
        f"imports of our modules inside functions: {sum(by_count.values())}",
        f"  most: {', '.join(f'{k} {v}' for k, v in sorted(by_count.items(), key=lambda kv: -kv[1])[:5])}",
        f"longest module: {longest.name} ({longest.lines} lines)",
        f"trainer.py lines: {len(trainer.read_text().splitlines())}",
        f"Trainer.rollback lines: {function_lines(trainer, 'Trainer.rollback')}",
        f"Trainer attributes created outside __init__: {len(attributes_outside_init(trainer, 'Trainer'))}",
        f"trainer names used by callbacks: {len(callback_names)} ({', '.join(sorted(callback_names))})",
    ]
    return lines


if __name__ == "__main__":
    print("\n".join(report()))
