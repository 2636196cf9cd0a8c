"""The base of every error a user causes and can fix: programs print it in one line.

A `UserError`'s message names the field, file or flag and says the fix; the programs
(pretrain/cli/) print `LABEL: MESSAGE` and exit 2 instead of a traceback (`PRETRAIN_DEBUG=1`
brings the traceback back). Anything that is not a UserError is a bug or a failure of the
machine and keeps its traceback. The error types keep their standard base too (ValueError,
FileNotFoundError), so code that catches those still does.

This module imports nothing: every layer may raise a UserError.
"""

from __future__ import annotations


class UserError(Exception):
    """An error in what the user gave (config, flag, path, data, checkpoint choice)."""

    label = "error"  # the one line's prefix: `error: ...`, `config error: ...`
