"""Every table the package prints or writes, drawn one way: through `tabulate`.

The programs used to measure column widths and ljust/rjust by hand, and to join markdown
rows with pipes, each a little differently. Here is the only place that draws a table:

- `text_table`: aligned plain text for the terminal, two spaces between columns, by default
  the first column left and the others (numbers) right;
- `pipe_table`: a GitHub-flavoured markdown pipe table for docs and reports (tabulate pads
  its columns to a common width; that renders the same). The evaluation reports take it
  through pretrain/eval/tables.py's `markdown_table`, which ends it with a newline.

Cells are strings that the caller has already formatted, and they are printed as given:
tabulate's number parsing (which would print "1.50" as "1.5") and its whitespace stripping
are off. A row with more or fewer cells than the header is refused. No line ends in blank
space, and the result has no final newline.

A base module: it imports only tabulate and the standard library, so any layer may use it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

from tabulate import tabulate

Align = Literal["left", "right"]


def _columns(
    header: Sequence[str], rows: Sequence[Sequence[str]], align: Sequence[Align] | None
) -> list[Align]:
    """The column alignments (by default the first column left, the others right), after
    checking that every row and `align` have one entry per header cell."""
    n = len(header)
    for i, row in enumerate(rows):
        if len(row) != n:
            raise ValueError(f"table row {i} has {len(row)} cells for {n} columns: {list(row)}")
    if align is None:
        return ["left"] + ["right"] * (n - 1)
    if len(align) != n:
        raise ValueError(f"{len(align)} alignments for {n} columns")
    return list(align)


def text_table(
    header: Sequence[str], rows: Sequence[Sequence[str]], align: Sequence[Align] | None = None
) -> str:
    """The header and rows as aligned text: two spaces between columns, each column as wide
    as its widest cell (header included) and aligned per `align` (default: the first column
    left, the others right)."""
    colalign = _columns(header, rows, align)
    # The header goes in as a row: tabulate would pad a header cell by two more spaces.
    return tabulate(
        [list(header), *map(list, rows)],
        tablefmt="plain",
        colalign=colalign,
        disable_numparse=True,
        preserve_whitespace=True,
    )


def pipe_table(
    header: Sequence[str], rows: Sequence[Sequence[str]], align: Sequence[Align] | None = None
) -> str:
    """The header and rows as a markdown pipe table. Without `align`, the separator row is
    plain dashes (the renderer's default, left); with it, colons mark each column's side."""
    colalign = _columns(header, rows, align)
    return tabulate(
        [list(row) for row in rows],
        headers=list(header),
        tablefmt="github" if align is None else "pipe",
        colalign=colalign if align is not None else None,
        disable_numparse=True,
        preserve_whitespace=True,
    )
