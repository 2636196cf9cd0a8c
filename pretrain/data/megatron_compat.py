"""Importing megatron-core quietly.

`import megatron.core...` pulls in its distributed/optimizer packages, which warn that
Transformer Engine and Apex are missing. We use only the dataset classes, which need
neither, so those warnings would only alarm users.
"""

from __future__ import annotations

import logging
import warnings
from types import ModuleType


def import_quietly(module: str) -> ModuleType:
    import importlib

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*Transformer Engine.*")
        warnings.filterwarnings("ignore", message=".*Apex.*")
        warnings.filterwarnings(
            "ignore", category=DeprecationWarning
        )  # torch.jit use inside megatron
        logging.getLogger("megatron.core.distributed").setLevel(logging.WARNING)
        return importlib.import_module(module)
