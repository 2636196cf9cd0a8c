"""One line and exit code 2 for every error a user causes; `PRETRAIN_DEBUG=1` for the traceback.

Every program (pretrain/cli/*; pretrain/main.py launches cli/train.py) wraps
its `main` in `user_errors` and builds its parser with `ArgumentParser`:

- a bad flag prints `error: PROG: MESSAGE (see --help)` and exits 2 (argparse's usage dump
  is left out: `--help` shows it);
- a bad config file, field, path, data file, checkpoint or tokenizer (the project's error
  types that carry a message naming the thing and the fix, YAML syntax errors, and
  FileNotFoundError and its kin for a path the user gave) prints one line
  `error: MESSAGE` (or the error's own label, e.g. `config error:`) and exits 2;
- anything else is a bug or a failure of the machine and keeps its traceback (exit 1).

With PRETRAIN_DEBUG=1 (any value but empty or 0) user errors raise as they are, traceback
included. The programs' exit codes are named in pretrain/exit_codes.py.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
from collections.abc import Callable
from typing import Any

import yaml

from pretrain.config import yaml_error_message
from pretrain.errors import UserError
from pretrain.exit_codes import EXIT_USER_ERROR

DEBUG_ENV = "PRETRAIN_DEBUG"

# OSErrors that a path given by the user causes, with the fix to say.
_PATH_FIXES: dict[type[OSError], str] = {
    FileNotFoundError: "check the path",
    NotADirectoryError: "a part of the path is a file, not a folder; choose another path",
    IsADirectoryError: "it is a folder; give a file",
    FileExistsError: "it is in the way; remove it or choose another path",
    PermissionError: "no permission; choose a path you may read or write",
}


def debug() -> bool:
    """True when PRETRAIN_DEBUG asks for tracebacks."""
    return os.environ.get(DEBUG_ENV, "").strip() not in ("", "0")


def is_user_error(e: BaseException) -> bool:
    """The project's UserErrors, YAML syntax errors and a path the user gave that is wrong."""
    return isinstance(e, (UserError, yaml.YAMLError, *_PATH_FIXES))


def message(e: BaseException) -> str:
    """The one line that names the thing and the fix."""
    if isinstance(e, yaml.YAMLError):
        text = yaml_error_message(e)
    elif (
        isinstance(e, OSError) and type(e) in _PATH_FIXES and e.filename is not None and e.strerror
    ):
        text = f"{e.filename}: {e.strerror.lower()}; {_PATH_FIXES[type(e)]}"
    else:
        text = str(e) or type(e).__name__
    return " ".join(line.strip() for line in text.splitlines() if line.strip())


def report(e: BaseException) -> None:
    """Print the one line (rank 0 only: every rank of a run fails alike)."""
    if os.environ.get("RANK", "0") != "0":
        return
    label = e.label if isinstance(e, UserError) else "error"
    print(f"{label}: {message(e)}", file=sys.stderr, flush=True)


def user_errors(fn: Callable[..., int | None]) -> Callable[..., int]:
    """Decorate a program's `main(argv=None) -> int`: a user error -> one line and exit 2.

    The line starts with the error type's label (`config error:`, `checkpoint error:`,
    `data error:`; `error:` for the rest)."""

    @functools.wraps(fn)
    def run(argv: list[str] | None = None) -> int:
        try:
            return fn(argv) or 0
        except BrokenPipeError:  # `tool | head` closed the pipe: the reader has what it wanted
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            return 0
        except Exception as e:
            if debug() or not is_user_error(e):
                raise
            report(e)
            return EXIT_USER_ERROR

    return run


class ArgumentParser(argparse.ArgumentParser):
    """argparse with a one-line error: `error: PROG: MESSAGE (see --help)`, exit 2."""

    def error(self, message: str) -> Any:  # type: ignore[override]
        self.exit(EXIT_USER_ERROR, f"error: {self.prog}: {message} (see --help)\n")

    def add_checkpoint_arguments(self, verb: str) -> None:
        """--run and --step, as every program that reads a checkpoint takes them
        (pretrain/weights.py find_weights_dir resolves them)."""
        self.add_argument(
            "--run",
            required=True,
            help="run folder (runs/NAME: its newest checkpoint), a checkpoint folder, or a "
            "weights folder",
        )
        self.add_argument(
            "--step",
            type=int,
            default=None,
            help=f"{verb} this step's checkpoint instead of the newest",
        )


__all__ = [
    "DEBUG_ENV",
    "ArgumentParser",
    "debug",
    "is_user_error",
    "message",
    "report",
    "user_errors",
    "yaml_error_message",
]
