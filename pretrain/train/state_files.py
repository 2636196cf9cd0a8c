"""Our state files in a checkpoint as data that cannot run code, and which files still can.

A checkpoint is input that others write (shared run folders, copied checkpoints). Unpickling
a file can call any function it names, so every file this toolkit writes is data:

    trainer_state.json       step, data position, callbacks' and the spike guard's state: JSON
    model.safetensors        the weights: safetensors; config.yaml: YAML (safe_load)
    rng/rank_00000.pt        RNG states: torch's generators as uint8 tensors, Python's and
                             NumPy's as ints and lists, read with torch.load(weights_only=True)

DeepSpeed's own files (model states, ZeRO optimizer shards, the universal form of
pretrain/train/reshard.py) are pickles that DeepSpeed loads with weights_only=False: loading
them can execute code, which `pickle_files` names for tools/check_checkpoint.py and
docs/checkpoints.md ("Trust") explains.

RNG files written before this format (a pickled `random.getstate()` and NumPy arrays) are read
through a compatibility path: the same restricted unpickler with NumPy's array-rebuilding
functions allowed, nothing else, and one warning. Anything else is refused in one line
without being run.
"""

from __future__ import annotations

import pickle
import random
import re
import warnings
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pretrain.errors import UserError
from pretrain.run_layout import RNG_DIR, STATE_FILE

RNG_FORMAT = 2  # the plain-data layout below; the old pickled tuples had no "format"

# What unpickling the old file's one array (MT19937's uint32 key) needs, under NumPy 2's
# module name and NumPy 1's (a file records the name of the NumPy that wrote it); the dtype's
# class because the unpickler checks what it sets a state on. They rebuild an array from
# bytes and call nothing the restricted unpickler does not allow itself.
_NUMPY_ARRAY_GLOBALS: list[Any] = [
    np._core.multiarray._reconstruct,
    (np._core.multiarray._reconstruct, "numpy.core.multiarray._reconstruct"),
    np.ndarray,
    np.dtype,
    np.dtypes.UInt32DType,
]


class RngStateError(UserError, ValueError):
    """A checkpoint's RNG file is not one this toolkit wrote: refused without being run."""

    label = "checkpoint error"


def rng_state() -> dict[str, Any]:
    """This process's random states as data: torch.load reads them with weights_only=True."""
    version, internal, gauss_next = random.getstate()
    kind, key, pos, has_gauss, cached = np.random.get_state()
    state: dict[str, Any] = {
        "format": RNG_FORMAT,
        "python": {"version": version, "state": list(internal), "gauss_next": gauss_next},
        "numpy": {
            "bit_generator": kind,
            "key": [int(k) for k in key],
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        },
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what `rng_state` (or `read_rng_state`) returned."""
    py, npy = state["python"], state["numpy"]
    random.setstate((py["version"], tuple(py["state"]), py["gauss_next"]))
    key = np.asarray(npy["key"], dtype=np.uint32)
    np.random.set_state(
        (npy["bit_generator"], key, npy["pos"], npy["has_gauss"], npy["cached_gaussian"])
    )
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _from_old_format(old: dict[str, Any]) -> dict[str, Any]:
    """The old layout ({"python": getstate() tuple, "numpy": get_state() tuple, torch's
    tensors}) in the new one."""
    version, internal, gauss_next = old["python"]
    kind, key, pos, has_gauss, cached = old["numpy"]
    state = {
        "format": RNG_FORMAT,
        "python": {"version": version, "state": list(internal), "gauss_next": gauss_next},
        "numpy": {
            "bit_generator": str(kind),
            "key": [int(k) for k in np.asarray(key)],
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        },
        "torch": old["torch"],
    }
    if "cuda" in old:
        state["cuda"] = old["cuda"]
    return state


def _load(path: Path, allowed: list[Any]) -> Any:
    # torch warns (on stderr, several lines) about a raw pickle's protocol before refusing it.
    with warnings.catch_warnings(), torch.serialization.safe_globals(allowed):
        warnings.simplefilter("ignore")
        return torch.load(path, map_location="cpu", weights_only=True)


def _why_refused(path: Path, error: Exception) -> str:
    """What made the restricted unpickler stop, in a few words: the functions the file would
    call when torch.save wrote it, else the unpickler's own reason."""
    try:
        names = torch.serialization.get_unsafe_globals_in_checkpoint(path)
    except Exception:  # not a torch.save zip: a raw pickle, or not a pickle at all
        names = []
    if names:
        return f"it would call {', '.join(names)}"
    found = re.search(r"Unsupported [^\n.]*", str(error))
    return found.group(0).strip() if found else f"{type(error).__name__}"


def read_rng_state(path: Path, warn: bool = True) -> dict[str, Any]:
    """The RNG states of `path`, read without running code from it. A file of the old format
    is read through NumPy's array globals only, with one warning (when `warn`); anything else
    raises RngStateError, one line."""

    def refuse(why: str) -> RngStateError:
        return RngStateError(
            f"{path} is not an RNG state file this toolkit wrote and was not loaded ({why}); "
            f"loading it could run code: move {path.parent.parent} away to resume from the "
            f"previous checkpoint, and see docs/checkpoints.md, 'Trust'"
        )

    try:
        state, old = _load(path, []), False
    except pickle.UnpicklingError:
        try:
            state, old = _load(path, _NUMPY_ARRAY_GLOBALS), True
        except pickle.UnpicklingError as e:
            raise refuse(_why_refused(path, e)) from None
        except Exception as e:
            raise refuse(type(e).__name__) from None
    except Exception as e:  # not a zip, a cut file: torch's RuntimeError and others
        raise refuse(f"unreadable: {type(e).__name__}") from None
    try:
        if old:
            state = _from_old_format(state)
        elif state.get("format") != RNG_FORMAT:
            raise KeyError("format")
        _check_rng_state(state)
    except (AttributeError, KeyError, TypeError, ValueError) as e:
        raise refuse(f"no RNG states in it: {type(e).__name__} {e}") from None
    if old and warn:
        print(
            f"warning: {path} is in the old RNG format (pickled NumPy arrays): read through "
            f"the compatibility path (NumPy's array globals only, no code run); the next "
            f"checkpoint is written in the new one",
            flush=True,
        )
    return state


def rng_file_problem(path: Path) -> str | None:
    """None for an RNG file of the current format; what a resume makes of any other: the
    old format's compatibility path, or the one line of its refusal."""
    try:
        state = _load(path, [])
        if isinstance(state, dict) and state.get("format") == RNG_FORMAT:
            _check_rng_state(state)
            return None
    except Exception:
        pass  # told apart below, by the reading a resume does
    try:
        read_rng_state(path, warn=False)
    except RngStateError as e:
        return f"REFUSED: {e}"
    return "old format (pickled NumPy arrays): read through the compatibility path, no code run"


def _check_rng_state(state: dict[str, Any]) -> None:
    """Raise (KeyError, TypeError, ValueError) unless `set_rng_state` can take `state`: every
    part is tried on throwaway generators, so a bad file changes no state of this process."""
    py, npy = state["python"], state["numpy"]
    random.Random().setstate((py["version"], tuple(py["state"]), py["gauss_next"]))
    np.random.RandomState().set_state(
        (
            npy["bit_generator"],
            np.asarray(npy["key"], dtype=np.uint32),
            npy["pos"],
            npy["has_gauss"],
            npy["cached_gaussian"],
        )
    )
    for name in ("torch", *(("cuda",) if "cuda" in state else ())):
        t = state[name]
        if not (isinstance(t, torch.Tensor) and t.dtype == torch.uint8 and t.dim() == 1):
            raise TypeError(f"{name} is not a uint8 tensor")
    torch.Generator().set_state(state["torch"])


def seed_value(seed: int, step: int, rank: int) -> int:
    """One 32-bit seed from (train.seed, step, rank), the same in every process."""
    return int(np.random.SeedSequence([seed, step, rank]).generate_state(1)[0])


def seed_python_numpy(seed: int, rank: int) -> None:
    """Seed Python's `random` and NumPy at the start of a run, from (train.seed, rank): two
    identical runs then write identical RNG files, and ranks draw different streams. torch
    is seeded from train.seed alone where the model is built (engine.build_engine: identical
    initial weights on every rank); these two draw nothing of torch's stream."""
    value = seed_value(seed, 0, rank)
    random.seed(value)
    np.random.seed(value)


def reseed(seed: int, step: int, rank: int) -> None:
    """Seed python, numpy and torch from (seed, step, rank): a resume that cannot restore the
    saved states (another world size) neither repeats step 0's dropout nor shares a stream
    between ranks."""
    value = seed_value(seed, step, rank)
    random.seed(value)
    np.random.seed(value)
    torch.manual_seed(value)


# Our data files in a checkpoint folder, by path (the RNG files are read as above).
_OURS = re.compile(
    rf"^({re.escape(STATE_FILE)}|model\.safetensors|config\.yaml|tokenizer/.*|"
    rf"{re.escape(RNG_DIR)}/rank_\d+\.pt)$"
)


def _is_pickle(path: Path) -> bool:
    """torch.save's zip (a data.pkl inside) or a raw pickle (protocol 2 and later)."""
    with open(path, "rb") as f:
        head = f.read(4)
    return head.startswith(b"\x80") or (head == b"PK\x03\x04" and zipfile.is_zipfile(path))


def pickle_files(folder: Path) -> list[str]:
    """The pickles of a checkpoint folder that are not ours (relative paths, sorted):
    DeepSpeed's model and optimizer states and its universal form. DeepSpeed loads them with
    weights_only=False, so loading one can execute code."""
    folder = Path(folder)
    out = []
    for p in sorted(folder.rglob("*")):
        rel = p.relative_to(folder).as_posix()
        if p.is_file() and not _OURS.match(rel) and _is_pickle(p):
            out.append(rel)
    return out
