"""The docs' pages against what the code prints: tables a command writes are that command's,
and the user docs speak of the toolkit, not of its history (the site is `make docs`)."""

from __future__ import annotations

import json
import re
from pathlib import Path

from pretrain.planner.paper import PAPER_PLAN, paper_table

REPO = Path(__file__).resolve().parents[1]
USER_DOCS = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]


def test_the_paper_plan_table_is_the_planners():
    """docs/performance.md's table of every paper run is what `tools/plan.py --paper` prints
    for the plans it wrote to pretrain/sweep_plan.json (`--write`)."""
    rows = json.loads(PAPER_PLAN.read_text())["runs"]
    doc = (REPO / "docs" / "performance.md").read_text()
    for row in paper_table(rows).splitlines():
        assert row in doc, f"docs/performance.md's paper table is stale; expected\n{row}"


def test_user_docs_name_no_issue_numbers():
    """What changed when is docs/changelog.md's, written from git log; the pages say what is."""
    found = [
        f"{path.relative_to(REPO)}:{i}: {line.strip()}"
        for path in USER_DOCS
        for i, line in enumerate(path.read_text().splitlines(), 1)
        if re.search(r"issue [0-9]", line, re.IGNORECASE)
    ]
    assert not found, "\n".join(found)
