"""The rules of docs/architecture.md, checked on the code's own imports and definitions.

Each rule names the files that break it, so a failure says what to move. The figures come
from tests/architecture.py (`python tests/architecture.py` prints them).
"""

from __future__ import annotations

import ast
import re

import pytest
import tomllib
from architecture import (
    PACKAGE,
    ROOT,
    attributes_outside_init,
    function_lines,
    import_circles,
    load_modules,
    strongly_connected,
    trainer_names_used_by_callbacks,
)

MODULES = load_modules()


def _imports(name: str) -> set[str]:
    mod = MODULES[name]
    return mod.top_imports | mod.inner_imports


def _layer_violations(layer: str, forbidden: tuple[str, ...]) -> list[str]:
    bad = []
    for name in MODULES:
        if name == layer or name.startswith(layer + "."):
            bad += [
                f"{name} -> {t}"
                for t in sorted(_imports(name))
                if any(t == f or t.startswith(f + ".") for f in forbidden)
            ]
    return bad


def test_the_circle_finder_finds_circles():
    # The measuring tool itself: a circle of three, a self-standing chain, a two-cycle.
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"f"}, "f": {"e"}}
    assert sorted(map(sorted, strongly_connected(graph))) == [["a", "b", "c"], ["e", "f"]]


def test_no_import_circles():
    circles = import_circles(MODULES)
    assert not circles, "import circles (imports inside functions count): " + "; ".join(
        " <-> ".join(sorted(c)) for c in circles
    )


def test_few_imports_of_our_modules_inside_functions():
    # Only a heavy optional dependency justifies a late import; our own modules are light.
    counts = {m.name: m.inner_count for m in MODULES.values() if m.inner_count}
    assert sum(counts.values()) <= 50, sorted(counts.items(), key=lambda kv: -kv[1])[:10]


@pytest.mark.parametrize(
    "layer, forbidden",
    [
        # model/ imports nothing of ours but the base (config, errors, the run folder's names).
        (
            "pretrain.model",
            (
                "pretrain.train",
                "pretrain.data",
                "pretrain.eval",
                "pretrain.planner",
                "pretrain.cli",
                "pretrain.hf",
                "pretrain.study",
                "pretrain.config_checks",
            ),
        ),
        ("pretrain.data", ("pretrain.train", "pretrain.eval", "pretrain.planner", "pretrain.cli")),
        ("pretrain.train", ("pretrain.planner", "pretrain.cli", "pretrain.study")),
        ("pretrain.planner", ("pretrain.cli",)),
        ("pretrain.eval", ("pretrain.planner", "pretrain.cli")),
        ("pretrain.hf", ("pretrain.cli", "pretrain.train", "pretrain.planner")),
    ],
)
def test_dependencies_point_down(layer, forbidden):
    assert not _layer_violations(layer, forbidden)


# The config's sections, each declared beside its feature, and what they check against.
SECTIONS = {
    "pretrain.model.config",
    "pretrain.model.recompute",
    "pretrain.data.config",
    "pretrain.train.config",
    "pretrain.eval.config",
    "pretrain.eval.tasks",
    "pretrain.eval.tasks.convert",
}


def test_the_base_imports_only_the_base():
    # The base (config, its schema, errors, the run folder's names) and the config's
    # sections import only each other: reading a config loads no model, trainer or torch.
    base = {
        "pretrain.config",
        "pretrain.schema",
        "pretrain.errors",
        "pretrain.faults",
        "pretrain.integrity",
        "pretrain.run_layout",
        "pretrain.slurm_limits",
        *SECTIONS,
    }
    bad = [
        f"{name} -> {t}"
        for name in sorted(base & set(MODULES))
        for t in sorted(_imports(name))
        if t not in base and t != "pretrain"
    ]
    assert not bad


def test_nothing_imports_the_programs():
    bad = [
        f"{name} -> {t}"
        for name in MODULES
        if not name.startswith("pretrain.cli") and name != "pretrain.main"
        for t in _imports(name)
        if t.startswith("pretrain.cli")
    ]
    assert not bad


def test_planner_modules_are_small():
    sizes = {m.name: m.lines for m in MODULES.values() if m.name.startswith("pretrain.planner")}
    assert len(sizes) >= 4, f"pretrain/planner/ should be a package of parts: {sizes}"
    assert max(sizes.values()) <= 600, sizes


def test_planner_rebinds_no_globals():
    # The tracer uses the model's injection points, not `module.function = stand_in`.
    pattern = re.compile(
        r"^\s*(F|torch\.nn\.functional|\w+\.(transformer|attention|loss))\.\w+\s*="
    )
    bad = [
        f"{path.relative_to(ROOT)}:{i}"
        for path in (PACKAGE / "planner").glob("*.py")
        for i, line in enumerate(path.read_text().splitlines(), 1)
        if pattern.match(line) or "setattr(F," in line or "setattr(transformer" in line
    ]
    assert not bad


def test_trainer_is_a_short_loop():
    trainer = PACKAGE / "train" / "trainer.py"
    assert len(trainer.read_text().splitlines()) <= 380
    assert 0 < function_lines(trainer, "Trainer.rollback") <= 20
    assert attributes_outside_init(trainer, "Trainer") == set()
    assert attributes_outside_init(PACKAGE / "train" / "module.py", "TrainModule") == set()


def test_the_step_has_no_fault_argument():
    source = (PACKAGE / "train" / "trainer.py").read_text()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.FunctionDef) and node.name in {"train_step", "forward_backward"}:
            assert "fault" not in {a.arg for a in node.args.args}, node.name


def test_callbacks_use_a_small_view_of_the_trainer():
    names = trainer_names_used_by_callbacks()
    assert len(names) <= 12, sorted(names)
    assert "guard" not in names


def test_test_hooks_are_read_in_one_module():
    readers = sorted(
        str(p.relative_to(ROOT)) for p in PACKAGE.rglob("*.py") if "PRETRAIN_TEST_" in p.read_text()
    )
    assert readers == ["pretrain/faults.py"]


def test_model_reads_no_environment():
    bad = [str(p) for p in (PACKAGE / "model").rglob("*.py") if "os.environ" in p.read_text()]
    assert not bad


def test_ignore_index_defined_once():
    defs = [
        str(p.relative_to(ROOT))
        for p in PACKAGE.rglob("*.py")
        if re.search(r"^IGNORE_INDEX\s*=", p.read_text(), re.M)
    ]
    assert defs == ["pretrain/model/loss.py"]


def test_programs_live_in_cli():
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert {k: v for k, v in scripts.items() if not v.startswith("pretrain.cli.")} == {}
    for tool in (ROOT / "tools").glob("*.py"):
        targets = {
            node.module
            for node in ast.walk(ast.parse(tool.read_text()))
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("pretrain")
        }
        assert targets and all(t.startswith("pretrain.cli") for t in targets), (tool, targets)
    parsers = sorted(
        str(p.relative_to(ROOT))
        for p in PACKAGE.rglob("*.py")
        if "ArgumentParser(" in p.read_text() and p.parent.name not in {"cli", "benchmarks"}
    )
    assert parsers == []


def test_public_functions_are_defined_once():
    seen: dict[str, list[str]] = {}
    for name, mod in MODULES.items():
        if name.startswith("pretrain.hf.remote_code"):
            continue  # shipped inside exports, where pretrain/ is absent: it repeats on purpose
        for node in ast.parse(mod.path.read_text()).body:
            if isinstance(node, ast.FunctionDef) and not node.name.startswith("_"):
                seen.setdefault(node.name, []).append(name)
    # Conventions, not duplicates: every program's `main` (and its `parse_args`), and the
    # protocol each benchmark module offers pretrain/cli/benchmark.py.
    protocol = {"main", "parse_args", "add_arguments", "run"}
    dupes = {k: v for k, v in seen.items() if len(v) > 1 and k not in protocol}
    assert not dupes


def test_all_is_the_last_statement():
    bad = []
    for mod in MODULES.values():
        body = ast.parse(mod.path.read_text()).body
        for i, node in enumerate(body):
            if (
                isinstance(node, ast.Assign)
                and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets)
                and i != len(body) - 1
            ):
                bad.append(mod.name)
    assert not bad


def test_recompute_is_not_called_checkpointing():
    assert not (PACKAGE / "model" / "checkpointing.py").exists()
    assert (PACKAGE / "model" / "recompute.py").exists()


def _our_exception_classes() -> dict[str, type]:
    import importlib
    import inspect

    found = {}
    for name in sorted(MODULES):
        if name.startswith(("pretrain.benchmarks.peer", "pretrain.main")) or name.endswith(
            "__main__"
        ):
            continue  # litgpt's model (optional); the launcher's script shim
        module = importlib.import_module(name)
        for cls_name, cls in inspect.getmembers(module, inspect.isclass):
            if issubclass(cls, Exception) and cls.__module__ == name:
                found[f"{name}.{cls_name}"] = cls
    return found


def test_every_error_of_ours_is_a_user_error_unless_named_a_failure():
    from pretrain.cli.errors import is_user_error
    from pretrain.config import ConfigError
    from pretrain.errors import UserError

    # Failures of the machine, not of what the user gave: a traceback-free line, exit 1.
    failures = {"pretrain.run_layout.CheckpointSaveError"}
    classes = _our_exception_classes()
    assert len(classes) >= 13 and failures <= set(classes), sorted(classes)
    users = {k: c for k, c in classes.items() if k not in failures}
    assert {k for k, c in users.items() if not issubclass(c, UserError)} == set()
    assert not any(issubclass(classes[k], UserError) for k in failures)
    assert all(is_user_error(c.__new__(c)) for c in users.values())
    # Only configuration errors are ConfigErrors.
    config_like = {k for k, c in users.items() if issubclass(c, ConfigError)}
    assert config_like == {"pretrain.schema.ConfigError"}, config_like
    # The error handler knows them by type, not by a list of class paths in strings.
    tree = ast.parse((PACKAGE / "cli" / "errors.py").read_text())
    names = [
        n.value
        for n in ast.walk(tree)
        if isinstance(n, ast.Constant) and isinstance(n.value, str) and "pretrain." in n.value
    ]
    assert not any(re.search(r"pretrain\.[\w.]+\.[A-Z]\w+", v) for v in names), names
