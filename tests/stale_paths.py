"""Files the docs and the code's comments name that are not in the repository.

    python tests/stale_paths.py          # exit 1 and one line per missing file: FILE:LINE: PATH

`make lint` runs it; tests/test_stale_paths.py runs it on the tree and shows it catching a
planted name. Read: the comments and docstrings of pretrain/, tools/ and tests/ (and in the
other strings of pretrain/ and tools/, the names under docs/: a message's pointer to its
page), and the markdown of docs/ and README.md.

A name is a word like `folder/.../name.ext` (ext: one of EXTENSIONS) whose first folder is the
name of one of the repository's folders (pretrain, docs, train, callbacks, ...): a name in
another project (`megatron/core/datasets/gpt_dataset.py`) is not read, nor a bare `name.py`,
which as often names another project's file or a command's output. It is found when a file
of the repository ends with it: `pretrain/train/engine.py`, `train/engine.py` and
`callbacks/hang.py` (pretrain/train/callbacks/hang.py) are all found.

Not names of files: a folder or file name with a word in capitals is a placeholder
(`studies/NAME.yaml`, `tests/test_X.py`), a `...` folder an elision, a path under a folder
git ignores is what a command writes (a study's report under studies/tiny_example/, a run
under runs/), and EXAMPLES are files a reader or a test is to write.
"""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys
import tokenize
from dataclasses import dataclass
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
EXTENSIONS = ("py", "md", "yaml", "yml", "sh", "json", "toml", "txt", "png")
# The files read: code (comments and docstrings) and docs (every line).
CODE = ("pretrain", "tools", "tests")
MESSAGES = ("pretrain", "tools")  # of these, every string is read for names under docs/
DOCS = ("docs",)
# Folders that are no part of the repository's files: environments, caches, outputs.
NOT_OURS = {".git", ".venv", "__pycache__", "runs", "site", "node_modules", ".whl", ".gl"}

# A path starts where a word cannot go on (not after a letter, `.`, `/`, `-`, `~`, `$`) and
# ends at its extension, followed by neither a path's letter, a `/` nor another extension
# (`x.json.gz` is not `x.json`).
PATH = re.compile(
    r"(?<![\w./~$-])((?:[\w.-]+/)+[\w-][\w.-]*\.(?:" + "|".join(EXTENSIONS) + r"))(?![\w/-]|\.\w)"
)
PLACEHOLDER = re.compile(r"^[A-Z][A-Z0-9]*$")  # a word of a name: NAME, X, CORPUS
# Files a reader or a test writes, named as examples.
EXAMPLES = {
    "studies/mine.yaml",  # the reader's own study (docs' examples of a study's errors)
    "studies/small.yaml",  # a study tests/test_study_plan_cache.py writes
}


@dataclass(frozen=True)
class Stale:
    file: str  # repository-relative
    line: int
    path: str  # as written

    def __str__(self) -> str:
        return f"{self.file}:{self.line}: {self.path} (no such file)"


@cache
def _tree(root: Path) -> tuple[frozenset[str], frozenset[str]]:
    """(the names of the repository's folders, every tail of its files' paths: for
    pretrain/train/engine.py, that path, train/engine.py and engine.py), outputs left out."""
    folders, tails = set(), set()
    for top, dirs, files in os.walk(root):
        # Every environment the Makefile builds (.venv-latest, .venv-hf-newest, ...) too: the
        # packages inside would pass `torch/x.py` or `path/to/x.json` off as our files.
        dirs[:] = [
            d
            for d in dirs
            if d not in NOT_OURS and not d.startswith(".venv") and not d.endswith(".egg-info")
        ]
        folders.update(dirs)
        rel = Path(top).relative_to(root).parts
        for name in files:
            parts = (*rel, name)
            tails.update("/".join(parts[i:]) for i in range(len(parts)))
    return frozenset(folders), frozenset(tails)


def _python_lines(source: str) -> list[tuple[int, str, bool]]:
    """(line, text, prose) of Python source's comments and docstrings (a string that is a
    statement of its own: prose, every name read) and of its other strings (a message's
    pointer into the docs: only names under docs/ read; the rest are the files code and tests
    write); [] when it does not tokenize."""
    strings = {tokenize.STRING, getattr(tokenize, "FSTRING_MIDDLE", tokenize.STRING)}
    out: list[tuple[int, str, bool]] = []
    statement_start = True  # the next token starts a statement
    try:
        for tok in tokenize.generate_tokens(io.StringIO(source).readline):
            if tok.type == tokenize.COMMENT:
                out.append((tok.start[0], tok.string, True))
            elif tok.type in strings:
                prose = statement_start and tok.type == tokenize.STRING
                for i, text in enumerate(tok.string.splitlines()):
                    out.append((tok.start[0] + i, text, prose))
            if tok.type not in (tokenize.COMMENT, tokenize.NL):
                statement_start = tok.type in (tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT)
    except (tokenize.TokenError, SyntaxError):
        return []
    return out


def _names(text: str, folders: frozenset[str]) -> list[str]:
    """The repository paths a line names."""
    out = []
    for match in PATH.finditer(text):
        path = match.group(1)
        parts = path.split("/")
        words = [w for part in parts for w in re.split(r"[_.-]", part)]
        if (
            len(parts) > 1
            and parts[0] in folders
            and "..." not in parts
            and not any(PLACEHOLDER.match(w) for w in words)
            and path not in EXAMPLES
        ):
            out.append(path)
    return out


def _outputs(paths: list[str], root: Path) -> set[str]:
    """Those of `paths` (relative to `root`) under a folder git ignores (runs/,
    studies/tiny_example/): what a command writes. A name git ignores by its extension alone
    (`*.png`) is not one: docs/img/ keeps its images."""
    if not paths:
        return set()
    done = subprocess.run(
        ["git", "check-ignore", "--verbose", "--no-index", "--stdin"],
        cwd=root,
        input="\n".join(paths) + "\n",
        capture_output=True,
        text=True,
        check=False,
    )
    out = set()
    for line in done.stdout.splitlines():  # SOURCE:LINE:PATTERN<tab>PATH
        pattern, path = line.split(":", 2)[2].split("\t", 1)
        if "/" in pattern and not pattern.startswith("!"):
            out.add(path)
    return out


def stale_in(file: Path, text: str, root: Path = ROOT) -> list[Stale]:
    """The names in `text`, the content of `file` (a path under `root`, which need not exist),
    that are not files of the repository."""
    folders, tails = _tree(root)
    if file.suffix == ".py":
        # The code's messages point users into the docs; a test's strings are its fixtures.
        messages = file.relative_to(root).parts[0] in MESSAGES
        lines = [(n, t, prose, messages) for n, t, prose in _python_lines(text)]
    else:
        lines = [(n, line, True, False) for n, line in enumerate(text.splitlines(), 1)]
    missing = [
        (line, path)
        for line, content, prose, messages in lines
        for path in _names(content, folders)
        if (prose or (messages and path.startswith("docs/")))
        and path.removeprefix("./") not in tails
    ]
    outputs = _outputs(sorted({p for _, p in missing}), root)
    rel = file.relative_to(root).as_posix()
    return [Stale(rel, line, path) for line, path in missing if path not in outputs]


def files_read(root: Path = ROOT) -> list[Path]:
    out = [root / "README.md"]
    for top in CODE:
        out += sorted((root / top).rglob("*.py"))
    for top in DOCS:
        out += sorted((root / top).rglob("*.md"))
    return [p for p in out if p.is_file() and not set(p.relative_to(root).parts) & NOT_OURS]


def find_stale(root: Path = ROOT) -> list[Stale]:
    """Every name of a missing file in the files read."""
    return [s for f in files_read(root) for s in stale_in(f, f.read_text(), root)]


def main() -> int:
    stale = find_stale()
    for s in stale:
        print(s)
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main())
