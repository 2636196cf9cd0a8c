"""Ready-made corpora, one call each: the stdlib quickstart and the theta study's char-level sets.

    prepare_stdlib_corpus("data/stdlib", max_bytes=4_000_000)      # bytes; exists everywhere
    prepare_tinyshakespeare("data/shakespeare_char", "input.txt")  # chars, 90/10 as nanoGPT
    prepare_enwik8("data/enwik8", "enwik8.zip")                    # bytes as chars, 90M/5M/5M
    prepare_text8("data/text8", "text8.zip")                       # chars, 90M/5M/5M

Each writes the same layout as prepare.prepare (OUT/tokenizer, OUT/<split>/shards + manifest),
so `data.train: [OUT]` and `data.valid: [OUT]` work in a run config.
"""

from __future__ import annotations

import logging
import sys
import sysconfig
import zipfile
from pathlib import Path

from pretrain.data.prepare import DEFAULT_SHARD_TOKENS, run_units
from pretrain.data.shards import PrepareError
from pretrain.data.sources import Unit
from pretrain.data.tokenize_workers import default_workers
from pretrain.data.tokenizer import ByteTokenizer, CharTokenizer

log = logging.getLogger(__name__)

# The standard splits of the Hutter-prize files (Al-Rfou et al. 2018; Transformer-XL).
HUTTER_SPLITS = (90_000_000, 5_000_000, 5_000_000)


def stdlib_files(max_bytes: int) -> list[Path]:
    """The installed standard library's .py files in sorted relative-path order, up to max_bytes.

    The same Python version gives the same list on any machine: no site-packages, no test
    suites (they hold deliberately odd encodings), only files that decode as UTF-8.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "dist-packages", "test", "tests", "idlelib", "__pycache__", "lib2to3"}
    chosen, total = [], 0
    for path in sorted(root.rglob("*.py"), key=lambda p: p.relative_to(root).as_posix()):
        if skip.intersection(path.relative_to(root).parts[:-1]):
            continue
        data = path.read_bytes()
        try:
            data.decode("utf-8")
        except UnicodeDecodeError:
            continue
        if not data.strip():
            continue
        chosen.append(path)
        total += len(data)
        if total >= max_bytes:
            break
    if not chosen:
        raise PrepareError(f"no .py files found under the standard library at {root}")
    return chosen


def prepare_stdlib_corpus(
    out_dir: str | Path,
    max_bytes: int = 4_000_000,
    valid_fraction: float = 0.05,
    workers: int | None = 1,
    progress: bool = True,
    overwrite: bool = False,
) -> Path:
    """Byte-level quickstart data from the standard library's .py files (one document each).

    Returns `out_dir`, which holds train/ and valid/ (document-disjoint) and tokenizer/.
    """
    files = stdlib_files(max_bytes)
    tok = ByteTokenizer()
    root = Path(sysconfig.get_paths()["stdlib"])
    settings = {
        "recipe": "stdlib",
        "python": sys.version.split()[0],
        "max_bytes": max_bytes,
        "valid_fraction": valid_fraction,
        "files": len(files),
    }
    per_unit = 64
    units = (
        Unit(("files", [str(p) for p in files[i : i + per_unit]]))
        for i in range(0, len(files), per_unit)
    )
    run_units(
        out_dir,
        tok,
        units,
        splits=["train", "valid"],
        settings=settings,
        sources=[
            {
                "stdlib": str(root),
                "files": len(files),
                "bytes": sum(p.stat().st_size for p in files),
            }
        ],
        total_units=-(-len(files) // per_unit),
        valid_fraction=valid_fraction,
        workers=default_workers() if workers is None else workers,
        progress=progress,
        overwrite=overwrite,
    )
    return Path(out_dir)


def _prepare_char_splits(
    out_dir: str | Path,
    texts: dict[str, str],
    vocab_text: str,
    name: str,
    sources: list[dict],
    settings: dict,
    progress: bool,
    overwrite: bool,
) -> Path:
    tok = CharTokenizer.from_text(vocab_text, name=name)
    units = iter([Unit(("texts", [t]), split=s) for s, t in texts.items()])
    run_units(
        out_dir,
        tok,
        units,
        splits=list(texts),
        settings={**settings, "recipe": name},
        sources=sources,
        total_units=len(texts),
        workers=1,
        shard_tokens=DEFAULT_SHARD_TOKENS,
        progress=progress,
        overwrite=overwrite,
    )
    log.info(
        "%s: %d characters in the vocabulary; splits %s",
        name,
        tok.vocab_size,
        {s: len(t) for s, t in texts.items()},
    )
    return Path(out_dir)


def prepare_tinyshakespeare(
    out_dir: str | Path,
    path: str | Path,
    train_fraction: float = 0.9,
    progress: bool = True,
    overwrite: bool = False,
) -> Path:
    """Tiny Shakespeare, character-level, first 90% train / last 10% valid (nanoGPT's split).

    The vocabulary (65 characters) comes from the whole text, as nanoGPT's prepare.py.
    """
    path = Path(path)
    if not path.is_file():
        raise PrepareError(
            f"Tiny Shakespeare not found: {path}; download input.txt from "
            f"karpathy/char-rnn data/tinyshakespeare and pass its path"
        )
    text = path.read_text(encoding="utf-8")
    n = int(len(text) * train_fraction)
    return _prepare_char_splits(
        out_dir,
        {"train": text[:n], "valid": text[n:]},
        text,
        "tinyshakespeare",
        [{"path": str(path.resolve()), "bytes": path.stat().st_size}],
        {"train_fraction": train_fraction},
        progress,
        overwrite,
    )


def _read_zip_member(path: Path, member: str) -> bytes:
    if not path.is_file():
        raise PrepareError(
            f"{path} not found; download {member}.zip (http://mattmahoney.net/dc/{member}.zip)"
        )
    try:
        with zipfile.ZipFile(path) as z:
            names = z.namelist()
            if member not in names:
                raise PrepareError(f"{path} has no member {member!r} (members: {names[:5]})")
            return z.read(member)
    except zipfile.BadZipFile as e:
        raise PrepareError(f"{path}: not a readable zip file ({e}); download it again") from None


def _hutter_splits(data: str, sizes: tuple[int, int, int], path: Path) -> dict[str, str]:
    n_train, n_valid, n_test = sizes
    if len(data) < n_train + n_valid + n_test:
        raise PrepareError(
            f"{path}: {len(data):,} characters, fewer than the {n_train + n_valid + n_test:,} "
            f"the standard splits need; is the file complete?"
        )
    return {
        "train": data[:n_train],
        "valid": data[n_train : n_train + n_valid],
        "test": data[n_train + n_valid : n_train + n_valid + n_test],
    }


def prepare_enwik8(
    out_dir: str | Path,
    zip_path: str | Path,
    sizes: tuple[int, int, int] = HUTTER_SPLITS,
    progress: bool = True,
    overwrite: bool = False,
) -> Path:
    """enwik8: the first 90M/5M/5M bytes as train/valid/test, one token per byte.

    Bytes are read as Latin-1 so each byte is one character; bits per character on this
    data are the bits per byte the literature reports. Vocabulary: the bytes that occur.
    """
    zip_path = Path(zip_path)
    data = _read_zip_member(zip_path, "enwik8").decode("latin-1")
    return _prepare_char_splits(
        out_dir,
        _hutter_splits(data, sizes, zip_path),
        data,
        "enwik8",
        [{"path": str(zip_path.resolve()), "member": "enwik8"}],
        {"sizes": list(sizes), "encoding": "latin-1 (one char per byte)"},
        progress,
        overwrite,
    )


def prepare_text8(
    out_dir: str | Path,
    zip_path: str | Path,
    sizes: tuple[int, int, int] = HUTTER_SPLITS,
    progress: bool = True,
    overwrite: bool = False,
) -> Path:
    """text8: the first 90M/5M/5M characters as train/valid/test (27 characters: a-z and space)."""
    zip_path = Path(zip_path)
    data = _read_zip_member(zip_path, "text8").decode("ascii")
    return _prepare_char_splits(
        out_dir,
        _hutter_splits(data, sizes, zip_path),
        data,
        "text8",
        [{"path": str(zip_path.resolve()), "member": "text8"}],
        {"sizes": list(sizes)},
        progress,
        overwrite,
    )
