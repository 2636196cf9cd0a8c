"""Reading a Hugging Face folder's JSON files, refusing a damaged one in one line.

Below both folder.py (config.json, the shards' index) and tokenizer.py (tokenizer.json,
tokenizer_config.json), which folder.py imports: one place for the message and its fix.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pretrain.hf.targets.base import HFConversionError

# The fix for a damaged file of a folder: its files came from a download or an export.
REFETCH = "download the folder again or export it again"


def read_json_object(file: Path) -> dict[str, Any]:
    """A folder's JSON file that holds an object (config.json, the shards' index, the
    tokenizer's files), or one line naming the file and what it holds instead."""
    try:
        data = json.loads(file.read_bytes())
    except json.JSONDecodeError as e:
        raise HFConversionError(
            f"{file} is not JSON ({e.msg} at line {e.lineno} column {e.colno}); {REFETCH}"
        ) from None
    except UnicodeDecodeError:
        raise HFConversionError(f"{file} is not JSON (its bytes are not text); {REFETCH}") from None
    if not isinstance(data, dict):
        raise HFConversionError(
            f"{file} holds a JSON {type(data).__name__}, not an object ({{...}}); {REFETCH}"
        )
    return data
