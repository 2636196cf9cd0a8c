"""No doc or comment names a file that is not there (tests/stale_paths.py, which `make lint`
runs): the tree as it stands, and names planted in a module and a page that must be caught."""

from __future__ import annotations

import re

from stale_paths import ROOT, Stale, find_stale, stale_in


def test_every_file_the_docs_and_comments_name_is_in_the_repository():
    stale = find_stale()
    assert stale == [], "names of missing files (fix the pointer or drop it):\n" + "\n".join(
        map(str, stale)
    )
    lint = re.search(r"^lint:.*?(?=^\S)", (ROOT / "Makefile").read_text(), re.M | re.S)
    assert lint and "tests/stale_paths.py" in lint.group(0), "make lint does not run the check"


PLANTED_MODULE = '''"""The pre-emption is callbacks/checkpointing.py's (moved since), the
engine train/engine.py and pretrain/train/callbacks/hang.py (both there)."""

# Checked once, in pretrain/config_checks.py; tested in tests/conftest.py.
X = "runs/out/configs/written_by_this.yaml"  # a file code writes: not a pointer, not read
MESSAGE = "see docs/gone_page.md, 'A section'"  # a message's pointer into the docs


def f():
    """Megatron's megatron/core/datasets/gpt_dataset.py, a run's runs/NAME/metrics.jsonl,
    studies/NAME.yaml, tests/test_X.py, studies/.../rope25_s1.sh, a study's report
    studies/tiny_example/report/report.md (git ignores it: an output) and the record
    tests/data/resolved_configs.json.gz: none of them a missing file of ours."""
'''

PLANTED_PAGE = """# A page

![a plot](img/loss_spikes.png) and ![gone](img/no_such_plot.png)

    python tools/compare_runs.py runs/* --plot docs/img/loss_spikes.png
    python tools/no_such_tool.py --config configs/quickstart.yaml
"""


def test_a_planted_name_of_a_missing_file_is_caught_with_its_line():
    module = stale_in(ROOT / "pretrain" / "train" / "planted.py", PLANTED_MODULE)
    assert module == [
        Stale("pretrain/train/planted.py", 1, "callbacks/checkpointing.py"),
        Stale("pretrain/train/planted.py", 4, "pretrain/config_checks.py"),
        Stale("pretrain/train/planted.py", 6, "docs/gone_page.md"),
    ]
    assert str(module[0]) == (
        "pretrain/train/planted.py:1: callbacks/checkpointing.py (no such file)"
    )
    page = stale_in(ROOT / "docs" / "planted.md", PLANTED_PAGE)
    assert page == [
        Stale("docs/planted.md", 3, "img/no_such_plot.png"),
        Stale("docs/planted.md", 6, "tools/no_such_tool.py"),
    ]


def test_the_environments_make_builds_are_not_the_repositorys_folders(tmp_path):
    """After `make test-latest`, .venv-latest/ holds torch/ and the like: a comment naming
    another project's torch/x.py must not turn into a missing file of ours."""
    (tmp_path / "pretrain").mkdir()
    (tmp_path / ".venv-latest" / "lib" / "torch").mkdir(parents=True)
    (tmp_path / ".venv-latest" / "lib" / "torch" / "y.py").write_text("")
    planted = '"""As torch/x.py does, and as pretrain/gone.py did."""\n'
    assert stale_in(tmp_path / "pretrain" / "m.py", planted, tmp_path) == [
        Stale("pretrain/m.py", 1, "pretrain/gone.py")
    ]
