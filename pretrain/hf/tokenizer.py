"""Our tokenizers as Hugging Face tokenizer files, and back.

`write_hf_tokenizer(tok, folder)` writes tokenizer.json and tokenizer_config.json so that
`AutoTokenizer.from_pretrained(folder)` encodes text to the same ids as `tok` (with
add_special_tokens=False, as lm-eval's `hf` model does for causal models):

    hf             the tokenizer.json itself, byte for byte
    bytes          byte-level BPE without merges: byte b -> id b, end-of-document <|endoftext|> = 256
    chars          BPE without merges over the character vocabulary: character i -> id i
    sentencepiece  not written: transformers' conversion of a SentencePiece model splits runs
                   of spaces differently (tested on Llama 2's), so no exact form exists

Each written tokenizer is checked against ours on a probe text before it is kept. The
end-of-document token is both eos_token and bos_token: the models were trained with it
between documents and never saw another start token, and it is what lm-eval conditions
an empty context on.

`read_hf_tokenizer(folder, record)` gives our tokenizer back; with the record that export
wrote into config.json it is the same kind, with the same content hash.
"""

from __future__ import annotations

import json
import logging
import tempfile
from pathlib import Path
from typing import Any

from pretrain.data.tokenizer import (
    EOD_TEXT,
    ByteTokenizer,
    CharTokenizer,
    HFTokenizer,
    Tokenizer,
)
from pretrain.errors import UserError
from pretrain.hf.files import REFETCH, read_json_object
from pretrain.hf.targets.base import HFConversionError

log = logging.getLogger(__name__)

TOKENIZER_JSON = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
PROBE = (
    "Hello world! The 2 quick brown foxes jumped over 13 lazy dogs.\n\n"
    "  Indented  text,\ttabs; ünïcödé — 漢字 and emoji 🙂. def f(x):\n    return x ** 2\n"
)


class TokenizerExportError(UserError, ValueError):
    """The tokenizer cannot be written as Hugging Face files that encode exactly like it."""


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's printable stand-in character for each byte (what ByteLevel BPE works on)."""
    bs = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs, strict=True)}


def _byte_tokenizer_json() -> str:
    from tokenizers import Tokenizer as Rust
    from tokenizers import decoders, models, pre_tokenizers

    vocab = {ch: b for b, ch in _bytes_to_unicode().items()}
    rust = Rust(models.BPE(vocab=vocab, merges=[]))
    rust.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    rust.decoder = decoders.ByteLevel()
    rust.add_special_tokens([EOD_TEXT])  # id 256
    return rust.to_str()


def _char_tokenizer_json(chars: list[str]) -> str:
    from tokenizers import Tokenizer as Rust
    from tokenizers import decoders, models

    rust = Rust(models.BPE(vocab={c: i for i, c in enumerate(chars)}, merges=[]))
    rust.decoder = decoders.Fuse()
    return rust.to_str()


def hf_tokenizer_json(tok: Tokenizer) -> str:
    """tokenizer.json text that encodes like `tok` (not yet checked)."""
    if tok.kind == "hf":
        with tempfile.TemporaryDirectory() as tmp:
            tok.save(tmp)
            return (Path(tmp) / TOKENIZER_JSON).read_text(encoding="utf-8")
    if tok.kind == "bytes":
        return _byte_tokenizer_json()
    if tok.kind == "chars":
        return _char_tokenizer_json(tok.chars)
    if tok.kind == "sentencepiece":
        raise TokenizerExportError(
            f"SentencePiece tokenizer {tok.identifier} has no exact Hugging Face form (transformers' "
            f"conversion splits runs of spaces differently); give users its .model file separately"
        )
    raise TokenizerExportError(f"tokenizer kind {tok.kind!r} has no Hugging Face form")


def _probe_text(tok: Tokenizer) -> str:
    if tok.kind == "chars":  # only characters of the vocabulary can be encoded
        return "".join(tok.chars) + "".join(c for c in PROBE if c in tok.chars)
    return PROBE


def _check_same(tok: Tokenizer, tokenizer_json: str) -> None:
    from tokenizers import Tokenizer as Rust

    rust = Rust.from_str(tokenizer_json)
    text = _probe_text(tok)
    ours = tok.encode(text)
    theirs = rust.encode(text, add_special_tokens=False).ids
    if ours != theirs:
        k = next(
            (i for i, (a, b) in enumerate(zip(ours, theirs, strict=False)) if a != b),
            min(len(ours), len(theirs)),
        )
        raise TokenizerExportError(
            f"the Hugging Face form of tokenizer {tok.identifier} encodes differently (first at token {k}); "
            f"give users the tokenizer separately"
        )
    if rust.decode(theirs, skip_special_tokens=False) != tok.decode(ours):
        raise TokenizerExportError(
            f"the Hugging Face form of tokenizer {tok.identifier} decodes differently"
        )


def write_hf_tokenizer(tok: Tokenizer, out: str | Path, max_length: int | None = None) -> list[str]:
    """Write tokenizer files into `out` that AutoTokenizer loads; returns their names.

    Raises TokenizerExportError (and writes nothing) when the Hugging Face form would not
    encode exactly like `tok`.
    """
    out = Path(out)
    text = hf_tokenizer_json(tok)
    _check_same(tok, text)
    (out / TOKENIZER_JSON).write_text(text, encoding="utf-8")
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
    }
    if tok.eod_id is not None:
        from tokenizers import Tokenizer as Rust

        eod = Rust.from_str(text).id_to_token(tok.eod_id)
        config.update(eos_token=eod, bos_token=eod)
    if max_length:
        config["model_max_length"] = max_length
    (out / TOKENIZER_CONFIG).write_text(
        json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8"
    )
    return [TOKENIZER_JSON, TOKENIZER_CONFIG]


def _refused(path: Path, error: Exception) -> HFConversionError:
    """The `tokenizers` library's refusal of a tokenizer.json, in one line naming the file."""
    reason = " ".join(str(error).split()) or type(error).__name__
    return HFConversionError(
        f"{path} is not a tokenizer the tokenizers library reads ({reason}); {REFETCH}"
    )


def _char_vocab(path: Path) -> list[str]:
    """The characters of a chars tokenizer's tokenizer.json, in id order."""
    model = read_json_object(path).get("model")
    vocab = model.get("vocab") if isinstance(model, dict) else None
    if not (
        isinstance(vocab, dict)
        and vocab
        and all(isinstance(c, str) and len(c) == 1 and type(i) is int for c, i in vocab.items())
    ):
        raise HFConversionError(
            f"{path} has no model.vocab of single characters (character -> id), as its "
            f"characters tokenizer needs; {REFETCH}"
        )
    return sorted(vocab, key=vocab.get)


def _eos_token(folder: Path) -> str | None:
    """tokenizer_config.json's eos_token (a string, or an added token's content), if any."""
    file = folder / TOKENIZER_CONFIG
    if not file.is_file():
        return None
    eos = read_json_object(file).get("eos_token")
    eos = eos.get("content") if isinstance(eos, dict) else eos
    return eos if isinstance(eos, str) and eos else None


def read_hf_tokenizer(folder: str | Path, record: dict[str, Any] | None = None) -> Tokenizer | None:
    """Our tokenizer from a Hugging Face folder, or None when it has no tokenizer.json.

    `record` is the tokenizer description export stored in config.json (kind, name, sha256):
    it restores the same kind of tokenizer; without it a tokenizer.json is read as is. A
    tokenizer.json or tokenizer_config.json that is damaged (not a JSON object, or not a
    tokenizer the `tokenizers` library reads) is refused in one line naming the file.
    """
    folder = Path(folder)
    path = folder / TOKENIZER_JSON
    if not path.is_file():
        return None
    record = record if isinstance(record, dict) else {}
    kind, name = record.get("kind"), record.get("name")
    if kind == "bytes":
        tok: Tokenizer = ByteTokenizer()
    elif kind == "chars":
        tok = CharTokenizer(_char_vocab(path), name or "chars")
    else:
        read_json_object(path)  # not JSON, not text, a list: the same line as config.json's
        data = path.read_bytes()
        try:
            from tokenizers import Tokenizer as Rust

            Rust.from_str(data.decode("utf-8"))
        except Exception as e:  # the Rust error says what is wrong with it
            raise _refused(path, e) from None
        eos = _eos_token(folder)  # read even when the record names it: a damaged file is told
        tok = HFTokenizer(
            data, name or folder.name, record.get("eod_token") or eos, source=str(path)
        )
    if record.get("sha256") and record["sha256"] != tok.sha256:
        log.warning(
            "the tokenizer in %s differs from the one the model was exported with (%s)",
            folder,
            record.get("identifier"),
        )
    return tok
