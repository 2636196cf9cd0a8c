"""pretrain/tables.py: the one way the package draws a table (aligned text, markdown)."""

from __future__ import annotations

import re

import pytest

from pretrain.tables import pipe_table, text_table

HEADER = ["run", "loss", "tokens"]
ROWS = [["baseline", "3.50", "1,024"], ["a much longer name", "10.25", "8"]]


def _cells(line: str) -> list[str]:
    """The cells of a pipe-table line, unpadded."""
    assert line.startswith("| ") or line.startswith("|-") or line.startswith("|:"), line
    assert line.endswith("|"), line
    return [c.strip() for c in line[1:-1].split("|")]


def test_text_table_pads_columns_two_spaces_apart_text_left_numbers_right():
    out = text_table(HEADER, ROWS)
    widths = [max(len(r[i]) for r in [HEADER, *ROWS]) for i in range(len(HEADER))]
    assert widths == [18, 5, 6]
    expected = [
        "run" + " " * 15 + "  " + " loss" + "  " + "tokens",
        "baseline" + " " * 10 + "  " + " 3.50" + "  " + " 1,024",
        "a much longer name" + "  " + "10.25" + "  " + "     8",
    ]
    assert out.splitlines() == expected
    # Cells are printed as given: tabulate would have made 3.50 into 3.5 and 1,024 into 1024.
    assert "3.50" in out and "1,024" in out
    assert not out.endswith("\n")


def test_text_table_takes_an_alignment_per_column_and_leaves_no_trailing_blanks():
    out = text_table(["name", "value"], [["x", ""], ["  indented", "yes"]], align=["left", "left"])
    lines = out.splitlines()
    assert lines == ["name        value", "x", "  indented  yes"]  # leading blanks are kept
    right = text_table(["a", "bb"], [["100", "2"]], align=["right", "right"])
    assert right.splitlines() == ["  a  bb", "100   2"]


def test_text_table_of_no_rows_is_its_header():
    assert text_table(["run", "steps"], []) == "run  steps"


def test_pipe_table_has_a_header_a_separator_and_a_row_per_row():
    lines = pipe_table(HEADER, ROWS).splitlines()
    assert len(lines) == 2 + len(ROWS)
    assert _cells(lines[0]) == HEADER
    assert all(re.fullmatch(r"-{3,}", c) for c in _cells(lines[1])), lines[1]
    assert [_cells(line) for line in lines[2:]] == ROWS
    assert len({len(line) for line in lines}) == 1  # columns padded to a common width
    assert not pipe_table(HEADER, ROWS).endswith("\n")


def test_pipe_table_marks_and_applies_the_alignment_it_is_given():
    lines = pipe_table(HEADER, ROWS, align=["left", "right", "right"]).splitlines()
    sep = _cells(lines[1])
    assert sep[0].startswith(":") and not sep[0].endswith(":")
    assert sep[1].endswith(":") and sep[2].endswith(":") and not sep[1].startswith(":")
    assert [_cells(line) for line in lines[2:]] == ROWS
    # The numbers sit against the right edge of their column, the names against the left.
    raw = lines[2][1:-1].split("|")
    assert raw[0].startswith(" baseline ") and raw[1].endswith(" 3.50 ")
    assert raw[2].endswith(" 1,024 ") and raw[2].startswith("  ")


def test_pipe_table_with_an_empty_header_and_no_rows():
    lines = pipe_table(["", ""], [["parameters", "1,024"]]).splitlines()
    assert _cells(lines[0]) == ["", ""] and _cells(lines[2]) == ["parameters", "1,024"]
    empty = pipe_table(["task", "value"], []).splitlines()
    assert len(empty) == 2 and _cells(empty[0]) == ["task", "value"]


@pytest.mark.parametrize("draw", [text_table, pipe_table])
def test_a_row_of_the_wrong_width_is_refused(draw):
    with pytest.raises(ValueError, match="row 1 has 2 cells for 3 columns"):
        draw(HEADER, [ROWS[0], ["short", "row"]])
    with pytest.raises(ValueError, match="2 alignments for 3 columns"):
        draw(HEADER, ROWS, align=["left", "right"])
