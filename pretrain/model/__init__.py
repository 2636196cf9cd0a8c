"""The model: one transformer class for Llama- and Pythia-style networks with partial RoPE.

The package loads no torch until a model class is asked for, so that reading a config
(pretrain/model/config.py, the `model:` section) stays light: `import pretrain.study` and the
config loader import no torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "KVCache": "pretrain.model.attention",
    "Transformer": "pretrain.model.transformer",
    "ModelConfig": "pretrain.model.config",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'pretrain.model' has no attribute {name!r}")


__all__ = ["KVCache", "ModelConfig", "Transformer"]
