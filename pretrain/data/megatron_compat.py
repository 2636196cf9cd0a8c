"""Importing megatron-core's dataset classes quickly and quietly.

`import megatron.core.datasets...` first runs `megatron/core/__init__.py`, which imports
megatron's model-parallel layers, optimizers and fused kernels (dozens of `torch.compile`
decorators, inductor, Transformer Engine probes): 6.7 s of an 11.5 s tiny training run on a
2-core CPU, paid by every rank of every start, evaluation and tool that reads data. We use
only `megatron.core.datasets`, which needs `megatron.core.utils` and `parallel_state`, not
the rest. So the package is registered without running its `__init__` (its submodules load
from its folder as usual; `parallel_state` first, the order the `__init__` itself uses,
because `utils` and `parallel_state` import each other), which takes 1.6 s. The dataset
code is megatron-core's own, unchanged. If this ever fails (a megatron-core whose datasets
need more of the package), the partial modules are dropped and the package is imported
whole, as before, only slower.

Either way the warnings that Transformer Engine and Apex are missing are silenced: the
dataset classes need neither, so they would only alarm users.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import sys
import warnings
from types import ModuleType

PACKAGE = "megatron.core"
# Imported first, before any dataset module (utils <-> parallel_state import each other).
FIRST = ("megatron.core.parallel_state",)
BARE = "_registered_without_init"  # set on the package module registered bare


def _forget_package() -> None:
    for name in [m for m in sys.modules if m == PACKAGE or m.startswith(PACKAGE + ".")]:
        del sys.modules[name]


def _register_without_init() -> None:
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None:  # not installed: the import below raises the usual error
        return
    package = importlib.util.module_from_spec(spec)
    setattr(package, BARE, True)
    sys.modules[PACKAGE] = package
    try:
        for name in FIRST:
            importlib.import_module(name)
    except Exception:
        _forget_package()


def import_quietly(module: str) -> ModuleType:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*Transformer Engine.*")
        warnings.filterwarnings("ignore", message=".*Apex.*")
        warnings.filterwarnings(
            "ignore", category=DeprecationWarning
        )  # torch.jit use inside megatron
        logging.getLogger("megatron.core.distributed").setLevel(logging.WARNING)
        if PACKAGE not in sys.modules:
            _register_without_init()
        try:
            return importlib.import_module(module)
        except ImportError:
            if not getattr(sys.modules.get(PACKAGE), BARE, False):
                raise
            # A module needed more of the package than was registered: import it whole.
            _forget_package()
            importlib.import_module(PACKAGE)
            return importlib.import_module(module)
