"""One tokenizer interface over Hugging Face tokenizer.json, SentencePiece, characters and bytes.

    tok = load_tokenizer("../shared/data/tokenizers/gpt-neox-20b_tokenizer.json")
    tok.encode("Hello world")        # [12092, 1533]
    tok.save("run/tokenizer")        # a folder that load_tokenizer reads back
    load_tokenizer("run/tokenizer").identifier == tok.identifier

Specs accepted by `load_tokenizer`:
    path/to/tokenizer.json     Hugging Face `tokenizers` file (GPT-NeoX-20B / Pythia, Llama 3, ...)
    path/to/tokenizer.model    SentencePiece model (Llama 2, ...)
    path/to/folder             a folder written by `Tokenizer.save`
    bytes                      UTF-8 bytes 0..255, end-of-document 256 (vocab 257)
    chars:path/to/vocab.json   character vocabulary written by `CharTokenizer.save`
    EleutherAI/pythia-1b       a Hugging Face hub name (needs the network; fast tokenizers only)

Every tokenizer has a content hash (`sha256`): prepared data records it, and training refuses
data whose recorded tokenizer differs from the one it would decode with.
"""

from __future__ import annotations

import hashlib
import json
import os
from abc import ABC, abstractmethod
from pathlib import Path

import numpy as np

from pretrain.errors import UserError
from pretrain.run_layout import atomic_write

META_FILE = "tokenizer_meta.json"
EOD_TEXT = "<|endoftext|>"
# End-of-document tokens of common tokenizers, most common first.
_EOD_CANDIDATES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "<|im_end|>", "[SEP]")


class TokenizerError(UserError, ValueError):
    """A tokenizer cannot be loaded or used; the message names the file and the fix."""


def _sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


class Tokenizer(ABC):
    """Text <-> token ids. Subclasses set `kind`, `name`, `sha256`, `vocab_size`, `eod_id`."""

    kind: str
    name: str
    sha256: str

    @property
    @abstractmethod
    def vocab_size(self) -> int:
        """Number of ids the tokenizer can produce (the model pads its embedding above this)."""

    @property
    @abstractmethod
    def eod_id(self) -> int | None:
        """End-of-document id appended after each document, or None (character-level data)."""

    @abstractmethod
    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Token ids of each text, without special tokens."""

    @abstractmethod
    def decode(self, ids: list[int] | np.ndarray) -> str:
        """Text of the ids; the end-of-document id reads as <|endoftext|> where it has no text."""

    @abstractmethod
    def _save_files(self, directory: Path) -> None:
        """Write the files `_load_saved` needs into `directory`."""

    def encode(self, text: str) -> list[int]:
        return self.encode_batch([text])[0]

    def encode_batch_np(self, texts: list[str]) -> list[np.ndarray]:
        """As `encode_batch`, as int64 arrays (what the preparation pipeline writes)."""
        return [np.asarray(ids, dtype=np.int64) for ids in self.encode_batch(texts)]

    @property
    def identifier(self) -> str:
        """Stable across machines and paths: kind, name and the first 12 hex of the content hash."""
        return f"{self.kind}:{self.name}:{self.sha256[:12]}"

    def describe(self) -> dict:
        return {
            "kind": self.kind,
            "name": self.name,
            "identifier": self.identifier,
            "sha256": self.sha256,
            "vocab_size": self.vocab_size,
            "eod_id": self.eod_id,
        }

    def save(self, directory: str | Path) -> Path:
        """Write the tokenizer into `directory` (created); `load_tokenizer(directory)` reads it."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        self._save_files(directory)
        atomic_write(directory / META_FILE, (json.dumps(self.describe(), indent=2) + "\n").encode())
        return directory

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.identifier}, vocab_size={self.vocab_size}, eod_id={self.eod_id})"


# ----------------------------------------------------------------------------- Hugging Face


class HFTokenizer(Tokenizer):
    """A Hugging Face `tokenizers` tokenizer.json (batched encoding in Rust)."""

    kind = "hf"
    FILE = "tokenizer.json"

    def __init__(
        self, data: bytes, name: str, eod_token: str | None = None, source: str = ""
    ) -> None:
        from tokenizers import Tokenizer as RustTokenizer

        try:
            self._tok = RustTokenizer.from_str(data.decode("utf-8"))
        except Exception as e:  # the Rust error says what is wrong with the JSON
            raise TokenizerError(
                f"{source or name}: not a valid Hugging Face tokenizer.json ({e})"
            ) from None
        self._data = data
        self.name = name
        self.sha256 = _sha256_bytes(data)
        self._vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        candidates = (eod_token,) if eod_token else _EOD_CANDIDATES
        self._eod = next(
            (i for t in candidates if (i := self._tok.token_to_id(t)) is not None), None
        )
        if self._eod is None:
            raise TokenizerError(
                f"{source or name}: none of the end-of-document tokens {list(candidates)} is in the "
                f"vocabulary; pass eod_token= the tokenizer's end-of-text token"
            )
        self.eod_token = self._tok.id_to_token(self._eod)

    @classmethod
    def from_file(
        cls, path: Path, name: str | None = None, eod_token: str | None = None
    ) -> HFTokenizer:
        return cls(path.read_bytes(), name or path.stem, eod_token, source=str(path))

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def eod_id(self) -> int:
        return self._eod

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        # encode_batch_fast skips offset tracking (~2x faster); both give the same ids.
        return [e.ids for e in self._tok.encode_batch_fast(texts, add_special_tokens=False)]

    def decode(self, ids) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)

    def describe(self) -> dict:
        return {**super().describe(), "eod_token": self.eod_token}

    def _save_files(self, directory: Path) -> None:
        atomic_write(directory / self.FILE, self._data)


# ----------------------------------------------------------------------------- SentencePiece


class SentencePieceTokenizer(Tokenizer):
    """A SentencePiece .model; documents end with its eos id (Llama 2: 2), no bos is added."""

    kind = "sentencepiece"
    FILE = "tokenizer.model"

    def __init__(self, data: bytes, name: str, source: str = "") -> None:
        import sentencepiece as spm

        self._sp = spm.SentencePieceProcessor()
        try:
            self._sp.LoadFromSerializedProto(data)
        except Exception as e:
            raise TokenizerError(
                f"{source or name}: not a valid SentencePiece model ({e})"
            ) from None
        self._data = data
        self.name = name
        self.sha256 = _sha256_bytes(data)
        if self._sp.eos_id() < 0:
            raise TokenizerError(
                f"{source or name}: the SentencePiece model has no eos piece to end documents"
            )

    @classmethod
    def from_file(cls, path: Path, name: str | None = None) -> SentencePieceTokenizer:
        return cls(path.read_bytes(), name or path.stem, source=str(path))

    @property
    def vocab_size(self) -> int:
        return self._sp.get_piece_size()

    @property
    def eod_id(self) -> int:
        return self._sp.eos_id()

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return self._sp.encode(list(texts))

    def decode(self, ids) -> str:
        ids = [int(i) for i in ids]
        eod = self.eod_id
        # SentencePiece drops control pieces when decoding; keep document ends visible.
        parts, start = [], 0
        for k, i in enumerate(ids):
            if i == eod:
                parts.append(self._sp.decode(ids[start:k]) + EOD_TEXT)
                start = k + 1
        parts.append(self._sp.decode(ids[start:]))
        return "".join(parts)

    def _save_files(self, directory: Path) -> None:
        atomic_write(directory / self.FILE, self._data)


# ----------------------------------------------------------------------------- characters


class CharTokenizer(Tokenizer):
    """Character-level: id = position of the character in a sorted vocabulary (nanoGPT's).

    Built from the training text (`CharTokenizer.from_text`); the vocabulary is saved with
    the data. No end-of-document id: the theta study's corpora are each one stream of text.
    """

    kind = "chars"
    FILE = "vocab.json"

    def __init__(self, chars: list[str], name: str = "chars") -> None:
        if len(set(chars)) != len(chars) or any(len(c) != 1 for c in chars):
            raise TokenizerError("a character vocabulary must list distinct single characters")
        self.chars = sorted(chars)
        self.name = name
        data = json.dumps({"chars": self.chars}, ensure_ascii=True).encode()
        self.sha256 = _sha256_bytes(data)
        # Encoding looks code points up in a sorted array: fast for 100M-character corpora.
        self._codes = np.array([ord(c) for c in self.chars], dtype=np.uint32)
        self._lookup = {c: i for i, c in enumerate(self.chars)}

    @classmethod
    def from_text(cls, text: str, name: str = "chars") -> CharTokenizer:
        codes = np.unique(np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32))
        return cls([chr(c) for c in codes], name)

    @classmethod
    def from_file(cls, path: Path) -> CharTokenizer:
        try:
            payload = json.loads(path.read_text(encoding="utf-8"))
            chars = payload["chars"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise TokenizerError(
                f"{path}: not a character vocabulary written by CharTokenizer.save ({e})"
            ) from None
        return cls(chars, payload.get("name", "chars"))

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    @property
    def eod_id(self) -> None:
        return None

    def encode_np(self, text: str) -> np.ndarray:
        codes = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)
        ids = np.searchsorted(self._codes, codes)
        ids_clipped = np.minimum(ids, len(self._codes) - 1)
        unknown = self._codes[ids_clipped] != codes
        if unknown.any():
            bad = sorted({chr(c) for c in codes[unknown]})[:10]
            raise TokenizerError(
                f"characters {bad!r} are not in the {self.vocab_size}-character vocabulary; "
                f"build the vocabulary from text that contains them"
            )
        return ids.astype(np.int64)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [self.encode_np(t).tolist() for t in texts]

    def encode_batch_np(self, texts: list[str]) -> list[np.ndarray]:
        return [self.encode_np(t) for t in texts]

    def decode(self, ids) -> str:
        return "".join(self.chars[int(i)] for i in ids)

    def _save_files(self, directory: Path) -> None:
        payload = {"chars": self.chars, "name": self.name}
        atomic_write(directory / self.FILE, json.dumps(payload, ensure_ascii=True).encode())


# ----------------------------------------------------------------------------- bytes


class ByteTokenizer(Tokenizer):
    """UTF-8 bytes as ids 0..255 and end-of-document 256: exists everywhere, needs no file."""

    kind = "bytes"
    name = "utf8"
    sha256 = _sha256_bytes(b"pretrain.data.tokenizer.ByteTokenizer v1: utf-8 bytes 0-255, eod 256")

    @property
    def vocab_size(self) -> int:
        return 257

    @property
    def eod_id(self) -> int:
        return 256

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [list(t.encode("utf-8")) for t in texts]

    def encode_batch_np(self, texts: list[str]) -> list[np.ndarray]:
        return [np.frombuffer(t.encode("utf-8"), dtype=np.uint8).astype(np.int64) for t in texts]

    def decode(self, ids) -> str:
        out, buf = [], bytearray()
        for i in ids:
            i = int(i)
            if i == 256:
                out.append(buf.decode("utf-8", errors="replace") + EOD_TEXT)
                buf = bytearray()
            else:
                buf.append(i)
        out.append(buf.decode("utf-8", errors="replace"))
        return "".join(out)

    def _save_files(self, directory: Path) -> None:
        pass  # the meta file is all there is


# ----------------------------------------------------------------------------- loading


def _load_saved(directory: Path) -> Tokenizer:
    meta_path = directory / META_FILE
    try:
        meta = json.loads(meta_path.read_text())
        kind, name = meta["kind"], meta["name"]
    except (OSError, ValueError, KeyError) as e:
        raise TokenizerError(
            f"{meta_path}: unreadable tokenizer metadata ({e}); save the tokenizer again"
        ) from None
    if kind == "hf":
        tok: Tokenizer = HFTokenizer.from_file(
            directory / HFTokenizer.FILE, name, meta.get("eod_token")
        )
    elif kind == "sentencepiece":
        tok = SentencePieceTokenizer.from_file(directory / SentencePieceTokenizer.FILE, name)
    elif kind == "chars":
        tok = CharTokenizer.from_file(directory / CharTokenizer.FILE)
    elif kind == "bytes":
        tok = ByteTokenizer()
    else:
        raise TokenizerError(f"{meta_path}: unknown tokenizer kind {kind!r}")
    if meta.get("sha256") and meta["sha256"] != tok.sha256:
        raise TokenizerError(
            f"{directory}: the tokenizer files do not match the hash in {META_FILE} "
            f"(changed after saving?); save the tokenizer again"
        )
    return tok


def _load_hub(name: str) -> Tokenizer:
    try:
        from transformers import AutoTokenizer

        hf = AutoTokenizer.from_pretrained(name)
    except Exception as e:
        raise TokenizerError(
            f"tokenizer {name!r} is not a file, a saved tokenizer folder, 'bytes' or 'chars:VOCAB', "
            f"and loading it from the Hugging Face hub failed ({type(e).__name__}: {str(e).splitlines()[0][:200]}); "
            f"on an offline machine pass the path of its tokenizer.json"
        ) from None
    backend = getattr(hf, "backend_tokenizer", None)
    if backend is None:
        raise TokenizerError(
            f"{name!r} has no fast tokenizer; pass its tokenizer.json or .model file instead"
        )
    eod = hf.eos_token if hf.eos_token else None
    return HFTokenizer(backend.to_str().encode(), name.replace("/", "--"), eod, source=name)


def load_tokenizer(spec: str | Path, eod_token: str | None = None) -> Tokenizer:
    """Load a tokenizer from a spec (see the module docstring)."""
    spec_s = str(spec)
    if spec_s == "bytes":
        return ByteTokenizer()
    if spec_s.startswith("chars:"):
        path = Path(spec_s[len("chars:") :])
        if not path.is_file():
            raise TokenizerError(
                f"character vocabulary not found: {path} (written by prepare_data.py beside the data)"
            )
        return CharTokenizer.from_file(path)
    path = Path(spec_s).expanduser()
    if path.is_dir():
        if (path / META_FILE).is_file():
            return _load_saved(path)
        for fname in ("tokenizer.json", "tokenizer.model"):
            if (path / fname).is_file():
                return load_tokenizer(path / fname, eod_token)
        raise TokenizerError(
            f"{path} is a folder without {META_FILE}, tokenizer.json or tokenizer.model"
        )
    if path.is_file():
        if path.suffix == ".json":
            try:
                head = json.loads(path.read_text(encoding="utf-8"))
            except (UnicodeDecodeError, ValueError) as e:
                raise TokenizerError(f"{path}: not valid JSON ({e})") from None
            if isinstance(head, dict) and "chars" in head:
                return CharTokenizer.from_file(path)
            return HFTokenizer.from_file(path, eod_token=eod_token)
        if path.suffix == ".model":
            return SentencePieceTokenizer.from_file(path)
        raise TokenizerError(
            f"{path}: unknown tokenizer file type; expected a tokenizer.json or a SentencePiece .model"
        )
    looks_like_path = (
        spec_s.startswith((".", "/", "~"))
        or spec_s.endswith((".json", ".model"))
        or os.sep * 2 in spec_s
    )
    if looks_like_path or spec_s.count("/") > 1:
        raise TokenizerError(f"tokenizer file not found: {spec_s}")
    return _load_hub(spec_s)
