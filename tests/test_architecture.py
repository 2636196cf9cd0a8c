"""The rules of docs/architecture.md, checked on the code's own imports and definitions.

Each rule names the files that break it, so a failure says what to move. The figures come
from tests/architecture.py (`python tests/architecture.py` prints them).
"""

from __future__ import annotations

import ast
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import contracts
import pytest
import tomllib
from architecture import (
    LIMITS,
    PACKAGE,
    ROOT,
    attributes_outside_init,
    config_and_studies_lines,
    function_lines,
    load_modules,
    packages_loaded,
    strongly_connected,
    trainer_names_used_by_callbacks,
)

MODULES = load_modules()


def test_the_circle_finder_finds_circles():
    # The measuring tool itself: a circle of three, a self-standing chain, a two-cycle.
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"f"}, "f": {"e"}}
    assert sorted(map(sorted, strongly_connected(graph))) == [["a", "b", "c"], ["e", "f"]]


def _tree_copy(tmp_path: Path) -> Path:
    """The package's sources and pyproject.toml (import-linter's contracts) in `tmp_path`,
    for a deliberate violation."""
    for path in PACKAGE.rglob("*.py"):
        target = tmp_path / path.relative_to(ROOT)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, target)
    shutil.copyfile(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    return tmp_path


def _append(root: Path, module: str, code: str) -> None:
    path = root / module
    path.write_text(path.read_text() + "\n" + textwrap.dedent(code))


def _lint_imports(root: Path, *args: str) -> subprocess.CompletedProcess:
    """`make lint`'s lint-imports in `root` (its pretrain/ first on the path: the cwd)."""
    command = [str(Path(sys.executable).parent / "lint-imports"), "--no-cache", "--no-logo"]
    env = {**os.environ, "COLUMNS": "300"}  # one line per import in the report
    return subprocess.run([*command, *args], cwd=root, capture_output=True, text=True, env=env)


LINTER_IDS = [
    c["id"]
    for c in tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"][
        "contracts"
    ]
]


def test_import_contracts_hold():
    # What `make lint` runs: lint-imports, then python tests/contracts.py.
    out = _lint_imports(ROOT)
    assert out.returncode == 0, out.stdout + out.stderr
    assert {k: v for k, v in contracts.broken().items() if v} == {}
    assert {c.name for c in contracts.CONTRACTS} == set(VIOLATIONS)
    assert set(LINTER_IDS) == set(LINTER_VIOLATIONS)


# One deliberate violation per import-linter contract: a module and what it imports, inside a
# function (an import there is an import like any other; lint-imports reports "a -> b").
LINTER_VIOLATIONS = {
    "layers": ("pretrain.eval.metrics", "pretrain.hf"),
    "sections": ("pretrain.train.config", "pretrain.train.engine"),
    "model-imports-only-its-section": ("pretrain.model.rope", "pretrain.config"),  # the aggregate
    "data-below-evaluation": ("pretrain.data.tokenizer", "pretrain.eval.metrics"),
    "gpucheck-apart-from-benchmarks": ("pretrain.gpucheck.report", "pretrain.benchmarks.optim"),
    "preflight-for-programs": ("pretrain.hf.card", "pretrain.preflight"),
    "row-weights": ("pretrain.weights", "pretrain.data.dataset"),
    "row-preflight": ("pretrain.preflight", "pretrain.data.dataset"),
    "row-training": ("pretrain.train.trainer", "pretrain.eval.compare"),
    "row-planner": ("pretrain.planner.gpus", "pretrain.train.trainer"),
    "row-measurements": ("pretrain.measure.measured_run", "pretrain.data.dataset"),
    "row-analysis": ("pretrain.analysis.presets", "pretrain.eval.metrics"),
    "row-study": ("pretrain.study.status", "pretrain.model.transformer"),
    "row-gpucheck": ("pretrain.gpucheck.report", "pretrain.hf"),
    "row-main": ("pretrain.main", "pretrain.config"),
}


@pytest.fixture(scope="module")
def violated_tree(tmp_path_factory) -> Path:
    """A copy of the package with every violation of LINTER_VIOLATIONS in it."""
    root = _tree_copy(tmp_path_factory.mktemp("violated"))
    for i, (importer, imported) in enumerate(LINTER_VIOLATIONS.values()):
        path = f"{importer.replace('.', '/')}.py"
        _append(root, path, f"def _violation_{i}():\n    import {imported}\n")
    return root


@pytest.mark.parametrize("contract", LINTER_IDS)
def test_each_import_linter_contract_fails_on_a_violation(violated_tree, contract):
    importer, imported = LINTER_VIOLATIONS[contract]
    out = _lint_imports(violated_tree, "--contract", contract)
    assert out.returncode == 1 and f"{importer} -> {imported}" in out.stdout, out.stdout


def test_an_import_for_annotations_only_breaks_the_layers(tmp_path):
    # import-linter counts imports under `if TYPE_CHECKING:` (exclude_type_checking_imports off).
    root = _tree_copy(tmp_path)
    code = (
        "from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n    from pretrain.hf import to_hf\n"
    )
    _append(root, "pretrain/eval/metrics.py", code)
    out = _lint_imports(root, "--contract", "layers")
    assert out.returncode == 1 and "pretrain.eval.metrics -> pretrain.hf" in out.stdout, out.stdout


def test_a_module_in_no_layer_breaks_the_layers(tmp_path):
    root = _tree_copy(tmp_path)
    (root / "pretrain" / "newcomer.py").write_text("")
    out = _lint_imports(root, "--contract", "layers")
    assert out.returncode == 1 and "pretrain.newcomer" in out.stdout, out.stdout


# One deliberate violation per contract of tests/contracts.py, as above.
VIOLATIONS = {
    "study-loads-no-training": (
        "pretrain/study/status.py",
        "from pretrain.train import distributed\n",
        "pretrain.study.status -> pretrain.train.distributed",
    ),
    "train-program-plans-on-demand": (
        "pretrain/cli/train.py",
        "from pretrain.planner import search\n",
        "pretrain.cli.train -> pretrain.planner.search",
    ),
    "imports-inside-functions": (
        "pretrain/train/trainer.py",
        "def f():\n    from pretrain.train import records\n",  # light, and loads at the top
        "imports pretrain.train.records inside f()",
    ),
    "no-circles": (
        "pretrain/hf/targets/llama.py",
        "def f():\n    from pretrain.hf.targets import get_target\n",
        "pretrain.hf.targets.llama -> pretrain.hf.targets (its own package)",
    ),
    "programs-in-cli": (
        "pretrain/eval/metrics.py",
        'if __name__ == "__main__":\n    pass\n',
        "pretrain.eval.metrics: a __main__ block (a program belongs in pretrain/cli/)",
    ),
    "exit-codes-named": (
        "pretrain/train/trainer.py",
        "def f():\n    import sys\n\n    sys.exit(3)\n",
        "exit code 3 unnamed",
    ),
}


@pytest.mark.parametrize("contract", sorted(VIOLATIONS))
def test_each_contract_fails_on_a_violation(tmp_path, contract):
    module, code, expected = VIOLATIONS[contract]
    root = _tree_copy(tmp_path)
    assert {k: v for k, v in contracts.broken(root).items() if v} == {}  # the copy is clean
    _append(root, module, code)
    lines = contracts.broken(root)[contract]
    assert any(expected in line for line in lines), lines


def test_a_circle_breaks_the_no_circles_contract(tmp_path):
    root = _tree_copy(tmp_path)
    _append(
        root, "pretrain/model/rope.py", "def f():\n    from pretrain.model import transformer\n"
    )
    lines = contracts.broken(root)["no-circles"]
    assert any("pretrain.model.rope" in line and " <-> " in line for line in lines), lines


def test_the_contract_program_fails_on_a_violation(tmp_path):
    # `make lint`'s own command: exit 1 and the broken rule named.
    root = _tree_copy(tmp_path)
    (root / "tests").mkdir()
    for name in ("contracts.py", "architecture.py"):
        shutil.copyfile(ROOT / "tests" / name, root / "tests" / name)
    command = [sys.executable, "tests/contracts.py"]
    ok = subprocess.run(command, cwd=root, capture_output=True, text=True)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    _append(root, "pretrain/study/report.py", "import pretrain.planner.search\n")
    bad = subprocess.run(command, cwd=root, capture_output=True, text=True)
    assert bad.returncode == 1
    assert "contract study-loads-no-training" in bad.stdout
    assert "pretrain.study.report -> pretrain.planner.search" in bad.stdout


def test_what_runs_when_a_module_loads(tmp_path):
    """An import under `if TYPE_CHECKING:` does not run, one in its `else:` and one beside it
    for real do: a module imported both ways is loaded."""
    package = tmp_path / "pretrain"
    package.mkdir()
    for name in ("__init__", "b", "c", "d", "e"):
        (package / f"{name}.py").write_text("")
    (package / "a.py").write_text(
        "from typing import TYPE_CHECKING\n\n"
        "if TYPE_CHECKING:\n    from pretrain import b, c\nelse:\n    import pretrain.d\n"
        "from pretrain.b import x\n\n\ndef f():\n    import pretrain.e\n"
    )
    a = load_modules(tmp_path)["pretrain.a"]
    assert a.imports == {"pretrain.b", "pretrain.c", "pretrain.d", "pretrain.e"}
    assert a.load_imports == {"pretrain.b", "pretrain.d"}
    assert [(s.function, s.ours) for s in a.inner] == [("f", {"pretrain.e"})]


def test_an_import_both_for_annotations_and_at_load_time_breaks_a_load_time_rule(tmp_path):
    # study/plan.py imports the planner's GPU for annotations: the same import for real loads it.
    root = _tree_copy(tmp_path)
    plan = root / "pretrain" / "study" / "plan.py"
    assert "    from pretrain.planner.gpus import GPU\n" in plan.read_text()
    _append(root, "pretrain/study/plan.py", "from pretrain.planner.gpus import GPU  # noqa\n")
    lines = contracts.broken(root)["study-loads-no-training"]
    assert lines == ["pretrain.study.plan -> pretrain.planner.gpus"]


def test_a_lazy_study_import_of_the_planner_is_allowed(tmp_path):
    # "When it loads": an import inside a function or for annotations only is not one.
    root = _tree_copy(tmp_path)
    code = (
        "if TYPE_CHECKING:\n    from pretrain.planner.gpus import GPU\n\n\n"
        "def f():\n    from pretrain.planner import search\n"
    )
    _append(root, "pretrain/study/status.py", code)
    assert contracts.broken(root)["study-loads-no-training"] == []


def test_an_import_of_a_heavy_module_inside_a_function_is_allowed(tmp_path):
    # eval/harness.py loads lm-eval, which eval/metrics.py does not: a reason to import it late.
    root = _tree_copy(tmp_path)
    _append(root, "pretrain/eval/metrics.py", "def f():\n    from pretrain.eval import harness\n")
    assert contracts.broken(root)["imports-inside-functions"] == []
    modules = load_modules(root)
    assert "lm_eval" in packages_loaded(modules, "pretrain.eval.harness") - packages_loaded(
        modules, "pretrain.eval.metrics"
    )


def test_exit_codes_are_the_ones_slurm_requeues():
    # slurm/launch.sh holds its own copies (a shell script cannot import them).
    from pretrain import exit_codes

    script = (ROOT / "slurm" / "launch.sh").read_text()
    for name in ("EXIT_PREEMPTED", "EXIT_HUNG"):
        assert re.search(rf"^{name}={getattr(exit_codes, name)}\b", script, re.M), name


def test_planner_is_a_package_of_parts():
    sizes = {m.name: m.lines for m in MODULES.values() if m.name.startswith("pretrain.planner")}
    assert len(sizes) >= 4, f"pretrain/planner/ should be a package of parts: {sizes}"


def test_no_module_is_over_its_limit():
    over = {m.name: m.lines for m in MODULES.values() if m.lines > LIMITS["module lines"]}
    assert not over


def test_config_and_studies_are_within_their_limit():
    """The config and the studies, counted over every file they live in (CONFIG_AND_STUDIES)."""
    assert config_and_studies_lines() <= LIMITS["config and studies lines"]


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
    assert len(trainer.read_text().splitlines()) <= LIMITS["trainer.py lines"]
    assert 0 < function_lines(trainer, "Trainer.rollback") <= LIMITS["Trainer.rollback lines"]
    assert attributes_outside_init(trainer, "Trainer") == set()
    assert attributes_outside_init(PACKAGE / "train" / "module.py", "TrainModule") == set()


def test_the_step_has_no_fault_argument():
    source = (PACKAGE / "train" / "trainer.py").read_text()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.FunctionDef) and node.name in {"train_step", "forward_backward"}:
            assert "fault" not in {a.arg for a in node.args.args}, node.name


def test_callbacks_use_a_small_view_of_the_trainer():
    names = trainer_names_used_by_callbacks()
    assert len(names) <= LIMITS["trainer names used by callbacks"], sorted(names)
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


def _all_problem(source: str, package: bool) -> str | None:
    """What is wrong with a module's `__all__`, if anything: it declares the names a module
    re-exports (a package's `__init__`, a facade such as pretrain/config.py), as its last
    statement. A name the module defines is public by having no leading underscore; a list of
    only those would say it a second time, and go stale the first time someone forgets it."""
    body = ast.parse(source).body
    found = [
        i
        for i, node in enumerate(body)
        if isinstance(node, ast.Assign)
        and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets)
    ]
    if not found:
        return None
    if found[-1] != len(body) - 1:
        return "__all__ is not the last statement"
    defined = {
        name.id
        for node in body
        if isinstance(node, (ast.Assign, ast.AnnAssign))
        for target in (node.targets if isinstance(node, ast.Assign) else [node.target])
        for name in ast.walk(target)
        if isinstance(name, ast.Name)
    } | {n.name for n in body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
    names = ast.literal_eval(body[-1].value)
    if not package and all(name in defined for name in names):
        return "__all__ lists only names defined here: remove it"
    return None


def test_all_declares_re_exports_only():
    bad = {
        m.name: problem
        for m in MODULES.values()
        if (problem := _all_problem(m.path.read_text(), m.path.name == "__init__.py"))
    }
    assert not bad
    # The rule itself, on modules made for it.
    restated = "import os\ndef f(): ...\n__all__ = ['f']\n"
    assert "remove it" in _all_problem(restated, package=False)
    assert _all_problem(restated, package=True) is None  # a package's own public names
    assert _all_problem("from os import sep\ndef f(): ...\n__all__ = ['f', 'sep']\n", False) is None
    assert "last" in _all_problem("from os import sep\n__all__ = ['sep']\nx = 1\n", False)


def test_recompute_is_not_called_checkpointing():
    assert not (PACKAGE / "model" / "checkpointing.py").exists()
    assert (PACKAGE / "model" / "recompute.py").exists()


def _our_exception_classes() -> dict[str, type]:
    import importlib
    import inspect

    found = {}
    for name in sorted(MODULES):
        if name.startswith(
            ("pretrain.benchmarks.peer", "pretrain.measure.peer", "pretrain.main")
        ) or name.endswith("__main__"):
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


# A markdown separator row in a string: `|---|`, `|:---|`, `---:|` (a table built by hand).
MARKDOWN_SEPARATOR = re.compile(r"\|\s*:?-{3,}|-{3,}:?\s*\|")
ALIGNERS = re.compile(r"\.[lr]just\(")


def _tables_by_hand(path: str, source: str) -> list[str]:
    """path:line of each ljust/rjust call and each markdown separator row literal."""
    bad = [f"{path}:{i}" for i, line in enumerate(source.splitlines(), 1) if ALIGNERS.search(line)]
    bad += [
        f"{path}:{node.lineno}"
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Constant)
        and isinstance(node.value, str)
        and MARKDOWN_SEPARATOR.search(node.value)
    ]
    return bad


def test_tables_go_through_one_helper():
    # pretrain/tables.py (over tabulate) draws every table; hf/remote_code ships inside
    # exports, without pretrain/ or tabulate.
    skip = {"pretrain/tables.py"}
    bad = [
        hit
        for path in sorted(PACKAGE.rglob("*.py"))
        if (rel := str(path.relative_to(ROOT))) not in skip
        and not rel.startswith("pretrain/hf/remote_code/")
        for hit in _tables_by_hand(rel, path.read_text())
    ]
    assert not bad, f"draw these tables with pretrain.tables (text_table, pipe_table): {bad}"
    # What it catches: an aligner, a separator row, and one inside an f-string.
    hand_made = "w = 3\nprint('a'.ljust(w), 'b'.rjust(w))\nrows = ['|---|---:|', f'{w}---|']\n"
    assert _tables_by_hand("x.py", hand_made) == ["x.py:2", "x.py:3", "x.py:3"]
    # The helper is in the base: it imports tabulate and the standard library, nothing of ours.
    import sys

    tree = ast.parse((PACKAGE / "tables.py").read_text())
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    top = {m.split(".")[0] for m in imported} - set(sys.stdlib_module_names) - {"__future__"}
    assert top == {"tabulate"}, imported


def test_the_model_loads_its_own_section_and_no_other():
    """Importing the model loads model/config.py and the schema, not the aggregate config
    (nor the data, train and eval sections it puts together)."""
    code = (
        "import json, sys, pretrain.model.transformer; "
        "print(json.dumps([m for m in sys.modules if m.startswith('pretrain')]))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    loaded = set(json.loads(out.stdout))
    assert "pretrain.model.config" in loaded, out.stderr
    others = {"pretrain.config", "pretrain.data.config", "pretrain.train.config"}
    assert not loaded & {*others, "pretrain.eval.config"}, loaded


def test_the_docs_figures_table_states_the_limits_the_tests_hold():
    """docs/architecture.md's figures table gives each figure's limit (the figures themselves,
    which move with every edit, are `python tests/architecture.py`'s to print)."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    rows = {
        "import circles": "none",
        "longest module": f"at most {LIMITS['module lines']} lines",
        "config and studies": f"at most {LIMITS['config and studies lines']:,} lines",
        "`train/trainer.py`": f"at most {LIMITS['trainer.py lines']} lines, `Trainer.rollback` "
        f"at most {LIMITS['Trainer.rollback lines']}",
        "Trainer attributes created outside `__init__`": "none",
        "trainer names used by callbacks": f"at most {LIMITS['trainer names used by callbacks']}",
    }
    for figure, value in rows.items():
        line = next(x for x in text.splitlines() if x.startswith(f"| {figure}"))
        assert line.endswith(f"| {value} |"), (line, value)
