"""Where documents come from: local parquet / jsonl(.gz) / txt files, or a Hugging Face dataset.

One policy for every format: a record whose text is null or missing reads as None (prepare.py
skips and counts it, as it does empty texts); a text that is not a string is an error naming
the file and line (parquet: a text column that is not a string column; a Hugging Face dataset:
the row). A field that the first records of a file lack altogether is a wrong --text-field.

The input is cut into *units* (a parquet row group, or at most `docs_per_unit` jsonl lines,
text files or texts) in a fixed order that depends only on the input, never on the number
of workers. A unit is a small picklable description; `read_unit` turns it into texts inside
a worker. Shards, splits and resume points are all defined in units, so any worker count
writes the same bytes.
"""

from __future__ import annotations

import glob
import gzip
import io
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from pretrain.errors import UserError


class SourceError(UserError, ValueError):
    """Input data is missing or unreadable; the message names the file and the fix."""


PARQUET = (".parquet",)
JSONL = (".jsonl", ".json", ".ndjson", ".jsonl.gz", ".json.gz", ".ndjson.gz")
TEXT = (".txt", ".txt.gz", ".text")
TXT_MODES = ("file", "line", "paragraph")
# A jsonl file must have the text field in one of its first records (else: wrong --text-field).
FIELD_CHECK_RECORDS = 100


def _kind(path: Path) -> str:
    name = path.name.lower()
    if name.endswith(PARQUET):
        return "parquet"
    if name.endswith(JSONL):
        return "jsonl"
    if name.endswith(TEXT):
        return "text"
    raise SourceError(
        f"{path}: unknown input type; use .parquet, .jsonl/.json(.gz) (one JSON object per line) "
        f"or .txt(.gz)"
    )


def _open_binary(path: Path) -> io.BufferedIOBase:
    return gzip.open(path, "rb") if path.name.endswith(".gz") else open(path, "rb")


def expand_inputs(patterns: list[str]) -> list[Path]:
    """Files named by paths or globs, each pattern's matches sorted; duplicates kept once."""
    if not patterns:
        raise SourceError("no input given; pass --input FILE_OR_GLOB ... or --hf-dataset NAME")
    out: list[Path] = []
    for pattern in patterns:
        if any(ch in pattern for ch in "*?["):
            matches = sorted(
                Path(p) for p in glob.glob(pattern, recursive=True) if Path(p).is_file()
            )
            if not matches:
                raise SourceError(f"--input {pattern!r} matches no file")
        else:
            p = Path(pattern)
            if p.is_dir():
                # A downloaded dataset folder also holds READMEs and caches: take the data files.
                matches = sorted(
                    q
                    for q in p.rglob("*")
                    if q.is_file()
                    and not q.name.startswith(".")
                    and q.name.lower().endswith(PARQUET + JSONL + TEXT)
                )
                if not matches:
                    raise SourceError(
                        f"--input {pattern}: the folder holds no .parquet, .jsonl or .txt file"
                    )
            elif p.is_file():
                matches = [p]
            else:
                raise SourceError(f"input file not found: {pattern}")
        for m in matches:
            if m not in out:
                out.append(m)
    return out


@dataclass
class Source:
    """One local input file and how to read documents from it."""

    path: Path
    kind: str
    text_field: str = "text"
    txt_mode: str = "file"
    row_groups: list[int] = field(default_factory=list)  # parquet: rows per row group

    def describe(self) -> dict:
        return {"path": str(self.path.resolve()), "bytes": self.path.stat().st_size}


def open_source(path: Path, text_field: str, txt_mode: str) -> Source:
    """Check the file now (exists, readable, has the text field) so errors come before work."""
    kind = _kind(path)
    if not path.is_file():
        raise SourceError(f"input file not found: {path}")
    if path.stat().st_size == 0:
        raise SourceError(f"input file is empty: {path}; remove it from the inputs")
    src = Source(path, kind, text_field, txt_mode)
    if kind == "parquet":
        import pyarrow.parquet as pq

        try:
            meta = pq.ParquetFile(path).metadata
        except Exception as e:
            raise SourceError(
                f"{path}: not a readable parquet file ({type(e).__name__}: {e}); download it again"
            ) from None
        schema = meta.schema.to_arrow_schema()
        if text_field not in schema.names:
            raise SourceError(
                f"{path}: no column {text_field!r} (columns: {', '.join(schema.names)}); "
                f"pass --text-field with one of them"
            )
        kind_of = schema.field(text_field).type
        if not _is_arrow_string(kind_of):
            raise SourceError(
                f"{path}: column {text_field!r} holds {kind_of}, not text; pass "
                f"--text-field naming the column with the documents' text"
            )
        src.row_groups = [meta.row_group(i).num_rows for i in range(meta.num_row_groups)]
    elif kind == "jsonl":
        # A record without the field is skipped like a null text, but a field that none of the
        # first records has is a wrong --text-field, as a missing parquet column is.
        records: list[tuple[int, dict]] = []
        try:
            with _open_binary(path) as f:
                for line_no, line in enumerate(f, 1):
                    if line.strip():
                        records.append((line_no, _parse_json_line(line, path, line_no)))
                        if len(records) == FIELD_CHECK_RECORDS:
                            break
        except (OSError, EOFError, gzip.BadGzipFile) as e:
            raise SourceError(f"{path}: unreadable ({type(e).__name__}: {e})") from None
        if not records:
            raise SourceError(f"input file has no documents: {path}")
        if not any(text_field in r for _, r in records):
            fields = list(dict.fromkeys(k for _, r in records for k in r))
            where = (
                f"line {records[0][0]} has"
                if len(records) == 1
                else f"its first {len(records)} records have"
            )
            raise SourceError(
                f"{path}: {where} no field {text_field!r} (fields: "
                f"{', '.join(fields)}); pass --text-field with one of them"
            )
    elif txt_mode not in TXT_MODES:
        raise SourceError(f"--txt-mode {txt_mode!r} is unknown; use one of {', '.join(TXT_MODES)}")
    return src


def _is_arrow_string(tp) -> bool:
    import pyarrow as pa

    checks = [pa.types.is_string, pa.types.is_large_string, pa.types.is_null]  # null: all None
    if hasattr(pa.types, "is_string_view"):
        checks.append(pa.types.is_string_view)
    return any(check(tp) for check in checks)


def text_or_none(value, where: str, text_field: str) -> str | None:
    """The document text of one record: a string, or None for a null or missing text (the
    caller skips and counts it). Anything else is an error naming the record."""
    if value is None or isinstance(value, str):
        return value
    shown = repr(value)
    shown = shown if len(shown) <= 60 else shown[:57] + "..."
    raise SourceError(
        f"{where}: field {text_field!r} is {shown} ({type(value).__name__}), not a "
        f"string; fix or remove that record, or pass --text-field naming the text field"
    )


def _parse_json_line(line: bytes, path: Path | str, line_no: int) -> dict:
    try:
        record = json.loads(line)
    except ValueError as e:
        raise SourceError(f"{path}:{line_no}: not a JSON object per line ({e})") from None
    if not isinstance(record, dict):
        raise SourceError(f"{path}:{line_no}: expected a JSON object, got {type(record).__name__}")
    return record


# ----------------------------------------------------------------------------- units
#
# ("parquet", path, row_group, field)                 one row group
# ("jsonl", path, [line numbers], [raw lines], field)
# ("files", [paths])                                  one document per text file
# ("texts", [texts or None])                          already text (txt lines, HF, recipes)


@dataclass
class Unit:
    payload: tuple
    split: str | None = None  # None: the document-hash rule decides train/valid


def iter_units(sources: list[Source], docs_per_unit: int) -> Iterator[Unit]:
    files: list[str] = []  # consecutive one-document text files, grouped docs_per_unit at a time
    for src in sources:
        if src.kind == "text" and src.txt_mode == "file":
            files.append(str(src.path))
            if len(files) == docs_per_unit:
                yield Unit(("files", files))
                files = []
            continue
        if files:
            yield Unit(("files", files))
            files = []
        if src.kind == "parquet":
            # A unit is a whole row group: slicing one would decompress it once per slice.
            for rg in range(len(src.row_groups)):
                yield Unit(("parquet", str(src.path), rg, src.text_field))
        elif src.kind == "jsonl":
            yield from _jsonl_units(src, docs_per_unit)
        else:
            yield from _text_units(src, docs_per_unit)
    if files:
        yield Unit(("files", files))


def count_units(sources: list[Source], docs_per_unit: int) -> int | None:
    """Number of units when known without reading the files (parquet, one-file documents)."""
    if any(
        src.kind == "jsonl" or (src.kind == "text" and src.txt_mode != "file") for src in sources
    ):
        return None
    return sum(1 for _ in iter_units(sources, docs_per_unit))


def _jsonl_units(src: Source, docs_per_unit: int) -> Iterator[Unit]:
    lines: list[bytes] = []
    numbers: list[int] = []  # each line's number in the file, for error messages
    try:
        with _open_binary(src.path) as f:
            for line_no, line in enumerate(f, 1):
                if not line.strip():
                    continue
                lines.append(line)
                numbers.append(line_no)
                if len(lines) == docs_per_unit:
                    yield Unit(("jsonl", str(src.path), numbers, lines, src.text_field))
                    lines, numbers = [], []
    except (OSError, EOFError, gzip.BadGzipFile) as e:
        raise SourceError(
            f"{src.path}: unreadable ({type(e).__name__}: {e}); the file may be truncated"
        ) from None
    if lines:
        yield Unit(("jsonl", str(src.path), numbers, lines, src.text_field))


def _read_text(path: Path) -> str:
    try:
        with _open_binary(path) as f:
            return f.read().decode("utf-8")
    except UnicodeDecodeError as e:
        raise SourceError(f"{path}: not UTF-8 text ({e})") from None
    except (OSError, EOFError, gzip.BadGzipFile) as e:
        raise SourceError(f"{path}: unreadable ({type(e).__name__}: {e})") from None


def _text_units(src: Source, docs_per_unit: int) -> Iterator[Unit]:
    text = _read_text(src.path)
    if src.txt_mode == "line":
        docs = [d for d in text.splitlines() if d.strip()]
    else:  # paragraph: blank-line separated
        docs = [d.strip("\n") for d in text.split("\n\n") if d.strip()]
    for i in range(0, len(docs), docs_per_unit):
        yield Unit(("texts", docs[i : i + docs_per_unit]))


def hf_units(
    name: str,
    config: str | None,
    split: str,
    text_field: str,
    docs_per_unit: int,
    streaming: bool = True,
) -> Iterator[Unit]:
    """Units from a Hugging Face dataset (streamed: no full download before tokenizing)."""
    try:
        import datasets

        ds = datasets.load_dataset(name, config, split=split, streaming=streaming)
    except Exception as e:
        raise SourceError(
            f"--hf-dataset {name} (config {config}, split {split}) could not be opened "
            f"({type(e).__name__}: {str(e).splitlines()[0][:300]}); check the name and the network, "
            f"or download its parquet files and pass them with --input"
        ) from None
    texts: list[str | None] = []
    for i, row in enumerate(ds):
        if i == 0 and text_field not in row:
            raise SourceError(
                f"--hf-dataset {name}: row {i} has no field {text_field!r} "
                f"(fields: {', '.join(row)}); pass --text-field"
            )
        texts.append(text_or_none(row.get(text_field), f"--hf-dataset {name}: row {i}", text_field))
        if len(texts) == docs_per_unit:
            yield Unit(("texts", texts))
            texts = []
    if texts:
        yield Unit(("texts", texts))


def read_unit(payload: tuple) -> list[str | None]:
    """The texts of one unit (runs in a worker); None where a record's text is null or missing."""
    kind = payload[0]
    if kind == "texts":
        return list(payload[1])
    if kind == "files":
        return [_read_text(Path(p)) for p in payload[1]]
    if kind == "jsonl":
        _, path, numbers, lines, text_field = payload
        texts = []
        for line_no, line in zip(numbers, lines, strict=True):
            record = _parse_json_line(line, path, line_no)
            texts.append(text_or_none(record.get(text_field), f"{path}:{line_no}", text_field))
        return texts
    if kind == "parquet":
        import pyarrow.parquet as pq

        _, path, rg, text_field = payload
        try:
            table = pq.ParquetFile(path).read_row_group(rg, columns=[text_field])
        except Exception as e:
            raise SourceError(
                f"{path}: row group {rg} unreadable ({type(e).__name__}: {e}); "
                f"download the file again"
            ) from None
        return table.column(0).to_pylist()  # strings (the schema was checked) or None
    raise ValueError(f"unknown unit kind {kind!r}")
