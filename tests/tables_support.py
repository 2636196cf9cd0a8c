"""Markdown tables as the tests read them: pretrain/tables.py pads each column to its
widest cell, so a test that looks for a row looks for it with the padding taken out."""

from __future__ import annotations


def unpadded(text: str) -> str:
    """`text` with every markdown table row rewritten as `| a | 1.0 |`, one space around each
    cell, whatever the column widths; other lines as they are."""
    return "\n".join(
        "| " + " | ".join(c.strip() for c in line[1:-1].split("|")) + " |"
        if line.startswith("|") and line.endswith("|")
        else line
        for line in text.splitlines()
    )
