"""Asynchronous checkpoints (`checkpoint.async: true`): a host copy now, the files later.

A checkpoint is written by one protocol (pretrain/train/checkpoint.py, Checkpointer.save and
_write) through a writer. The synchronous writer stops training while every rank writes,
fsyncs and checksums its files. With `checkpoint.async` the AsyncWriter of this module only
copies the state to host memory in the save step; a background thread runs the rest of the
same protocol, and training goes on meanwhile:

    main thread, at the save step              background thread
    wait for the save in flight (at most one)
    engine.save_checkpoint with its files      write DeepSpeed's files (torch.save), the RNG
      captured: DeepSpeed builds its state       states and the weights folder; fsync them;
      dicts (and runs its collectives) as        gather every rank's outcome; CRC-32 the
      always, but each file is kept as a         files, the ranks sharing them; rank 0: the
      HostCopy instead of written                marker, the rename, `latest`, retention,
    the weights and RNG states, host-copied      exactly as a synchronous save; gather
    train on                                     rank 0's outcome

Why DeepSpeed's checkpoint engine: it is where DeepSpeed 0.19.8 hands over every file of a
checkpoint (model states, each rank's ZeRO shard), after building them on the main thread
with its own collectives. Replacing it for the duration of one `save_checkpoint`
(deepspeed_adapter.capture_checkpoint_files) keeps every file name and every state dict
DeepSpeed's, and the writing is the same `torch.save` call.

Byte-identical files: torch.save writes each storage a tensor views once, whole, and the
views as (storage, offset, size, stride). HostCopy copies each distinct storage once and
rebuilds every tensor as the same view into its copy (also dtype, requires_grad, Parameter,
Python attributes), keeps shared objects shared (pickle writes a second reference as a
memo entry) and deep-copies the few other objects (e.g. a loss scaler) that training
mutates. On a GPU the copies are non-blocking into pinned buffers on the current stream
(training's later kernels run after them) and the writer waits on a CUDA event; torch.save
tags a storage by its device ("cuda:0"), so a tagger registered with torch.serialization
gives each host copy its original device's tag. The buffers are kept for the next save:
the memory cost is one host copy of the state (weights + optimizer shard of each rank).

Why a dedicated gloo group for the background collectives: the main thread keeps training
with collectives on the default group, and two threads issuing collectives on one group
can interleave them (gloo matches operations by order), a hang or silent corruption. A
second process group, created by every rank at set-up (`new_group(backend="gloo")`), has
its own connections and order; the file system or the store would do too, but need
polling and a protocol of their own, while a failed peer shows up as a gloo error.
Every rank reports its outcome in each of the protocol's gathers, which are also its
barriers ("every rank's files are on disk"); rank 0 commits only then, and a last gather
gives every rank rank 0's outcome, so all ranks raise the same error at their next wait
(CheckpointSaveError, through checkpoint.save_failed), the previous checkpoint untouched.
"""

from __future__ import annotations

import contextlib
import copy
import os
import sys
import threading
from collections.abc import Callable
from typing import Any, Protocol

import torch

from pretrain.faults import fault_point
from pretrain.train.deepspeed_adapter import CapturedFiles, capture_checkpoint_files
from pretrain.weights import weights_state

# Host copy storage (its _cdata) -> the device of the original, for torch.save's tag.
_LOCATIONS: dict[int, torch.device] = {}


class _OnDevice:
    def __init__(self, device: torch.device) -> None:
        self.device = device


def _original_location(storage: Any) -> str | None:
    """The tag ("cuda:0") torch's own taggers give the original: built anew at every call,
    as theirs are. One string object per storage would change the bytes: pickle writes an
    object seen before as a memo reference, and torch asks once per tensor, not per storage
    (views of one storage, tensors held twice)."""
    device = _LOCATIONS.get(getattr(storage, "_cdata", None))
    return None if device is None else torch.serialization.location_tag(_OnDevice(device))


def _restore_nothing(storage: Any, location: str) -> None:
    return None  # loading is torch's business: this package only tags at save time


# Priority 0: asked before torch's own taggers (cpu is 10); None for every other storage.
torch.serialization.register_package(0, _original_location, _restore_nothing)

_ATOMS = (str, bytes, int, float, complex, type(None), torch.dtype, torch.device, torch.Size)


class HostBuffers:
    """Host storages kept from one save to the next (pinned on a GPU): allocating and
    pinning gigabytes at every save would cost more than copying into them."""

    def __init__(self) -> None:
        self._free: dict[tuple[int, bool], list[torch.UntypedStorage]] = {}
        self._used: list[torch.UntypedStorage] = []

    def take(self, nbytes: int, pinned: bool) -> torch.UntypedStorage:
        free = self._free.get((nbytes, pinned))
        buf = free.pop() if free else None
        if buf is None:
            buf = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned).untyped_storage()
        self._used.append(buf)
        return buf

    def release(self) -> None:
        """The save that used the buffers is on disk: they serve the next one (buffers the
        last save did not need are dropped, so at most one save's worth is held)."""
        self._free = {}
        for buf in self._used:
            self._free.setdefault((buf.nbytes(), buf.is_pinned()), []).append(buf)
            _LOCATIONS.pop(buf._cdata, None)
        self._used = []


class HostCopy:
    """Copies state dicts to host memory so that torch.save writes the same bytes from the
    copy as from the original (see the module docstring). One per save: `__call__` for
    each object, `seal()` after the last, `wait()` (writer thread) before reading them."""

    def __init__(self, buffers: HostBuffers) -> None:
        self.buffers = buffers
        self._memo: dict[int, Any] = {}  # id(original) -> copy; also copy.deepcopy's memo
        self._storages: dict[int, torch.UntypedStorage] = {}  # original _cdata -> host copy
        self._originals: list[Any] = []  # alive until the copies are done (ids stay unique)
        self._event: Any = None  # CUDA event after the last copy
        self._on_gpu = False  # some copies are non-blocking copies from a GPU

    def __call__(self, obj: Any) -> Any:
        if isinstance(obj, _ATOMS):
            return obj
        key = id(obj)
        if key in self._memo:
            return self._memo[key]
        if isinstance(obj, torch.Tensor):
            new = self._tensor(obj)
        elif isinstance(obj, dict):
            new = copy.copy(obj)  # same class (OrderedDict, defaultdict), same key order
            for k, v in obj.items():
                new[k] = self(v)
        elif type(obj) is list:
            new = [self(v) for v in obj]
        elif type(obj) is tuple:
            new = tuple(self(v) for v in obj)
        elif isinstance(obj, tuple) and hasattr(obj, "_fields"):  # a namedtuple
            new = type(obj)._make(self(v) for v in obj)
        else:  # anything else training may mutate (a loss scaler, a dataclass): a deep copy
            new = copy.deepcopy(obj, self._memo)
        self._memo[key] = new
        self._originals.append(obj)
        return new

    def _tensor(self, t: torch.Tensor) -> torch.Tensor:
        if type(t) not in (torch.Tensor, torch.nn.Parameter) or t.layout != torch.strided:
            raise TypeError(f"cannot copy a {type(t).__name__} ({t.layout}) for a checkpoint")
        if t.is_conj() or t.is_neg() or t.is_quantized:
            raise TypeError("cannot copy a conjugate, negative-bit or quantized tensor")
        src = t.untyped_storage()
        host = self._storages.get(src._cdata)
        if host is None:
            on_gpu = src.device.type == "cuda"
            self._on_gpu |= on_gpu
            host = self.buffers.take(src.nbytes(), pinned=on_gpu)
            host.copy_(src, non_blocking=on_gpu)
            if src.device.type != "cpu":
                _LOCATIONS[host._cdata] = src.device
            self._storages[src._cdata] = host
            self._originals.append(src)
        new = torch.empty(0, dtype=t.dtype).set_(host, t.storage_offset(), t.size(), t.stride())
        if type(t) is torch.nn.Parameter:
            new = torch.nn.Parameter(new, requires_grad=t.requires_grad)
        elif t.requires_grad:
            new.requires_grad_(True)
        if t.__dict__:
            new.__dict__.update(self(dict(t.__dict__)))
        return new

    def seal(self) -> None:
        """Every object is copied (main thread): the GPU copies are queued before training's
        next kernels; record where they end."""
        self._memo.clear()
        if self._on_gpu:
            self._event = torch.cuda.Event()
            self._event.record()

    def wait(self) -> None:
        """The copies are complete (writer thread, before reading them)."""
        if self._event is not None:
            self._event.synchronize()
        self._originals.clear()


class DeepSpeedFiles(Protocol):
    """DeepSpeed's files of one save as a writer holds them."""

    def write(self) -> list[str]:
        """Write what is not on disk yet; the paths written now."""
        ...


class _Captured:
    """DeepSpeed's files of one save, host-copied, for the writer thread."""

    def __init__(self, captured: CapturedFiles, host_copy: HostCopy, step: int) -> None:
        self.captured, self.host_copy, self.step = captured, host_copy, step

    def write(self) -> list[str]:
        self.host_copy.wait()
        written = self.captured.write()
        fault_point("async_write", self.step)
        return written


WRITER_NICENESS = 10


def _yield_to_training() -> None:
    """Lower this (writer) thread's CPU priority: where training keeps every core busy (CPU
    runs: its OpenMP threads wait for the slowest of them), a writer at the same priority
    slows every step it runs beside; a slower write only costs host memory for longer.
    Linux sets the priority of one thread by its id; elsewhere this does nothing."""
    with contextlib.suppress(AttributeError, OSError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), WRITER_NICENESS)


def say(line: str) -> None:
    """One line to stdout from any thread (one write, so lines never interleave)."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


class AsyncWriter:
    """The asynchronous writer (see the module docstring): `capture`, `keep` and `weights`
    host-copy in the save step, `seal` after the last copy; `start(step, work)` runs the
    protocol's `work()` in a thread (it returns an error text, or None for success), at most
    one at a time; `wait()` joins it and returns (step, error text) when it failed.
    `gather(obj)` is an all_gather on the dedicated group, for `work`."""

    asynchronous = True

    def __init__(self) -> None:
        dist = torch.distributed
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        # Every rank creates it, at the same point of set-up (new_group is collective).
        self.group = dist.new_group(backend="gloo") if self.world > 1 else None
        self.buffers = HostBuffers()
        self._copy: HostCopy | None = None  # the save being captured
        self._thread: threading.Thread | None = None
        self._step = 0
        self._error: str | None = None

    @property
    def in_flight(self) -> bool:
        return self._thread is not None

    def capture(self, engine: Any, step: int, save: Callable[[], None]) -> DeepSpeedFiles:
        """`save()` (engine.save_checkpoint) with DeepSpeed's files host-copied, not written."""
        self._copy = HostCopy(self.buffers)
        with capture_checkpoint_files(engine, self._copy) as captured:
            save()
        return _Captured(captured, self._copy, step)

    def keep(self, obj: Any) -> Any:
        return self._copy(obj)

    def weights(self, module: Any) -> Any:
        return self._copy(weights_state(module, dtype=None))

    def seal(self) -> None:
        self._copy.seal()
        self._copy = None

    def start(self, step: int, work: Callable[[], str | None]) -> None:
        if self._thread is not None:
            raise RuntimeError("a checkpoint save is already in flight; wait() for it first")

        def run() -> None:
            try:
                _yield_to_training()
                self._error = work()
            except Exception as e:  # a bug of the writer: still reported at the wait
                self._error = f"{type(e).__name__}: {e}"
            finally:
                self.buffers.release()

        self._step, self._error = step, None
        self._thread = threading.Thread(target=run, name=f"checkpoint-{step}", daemon=True)
        self._thread.start()

    def wait(self) -> tuple[int, str] | None:
        """Block until the save in flight is done; (step, error) when it failed, else None."""
        if self._thread is None:
            return None
        self._thread.join()
        self._thread = None
        return (self._step, self._error) if self._error else None

    def gather(self, obj: Any) -> list[Any]:
        if self.group is None:
            return [obj]
        out: list[Any] = [None] * self.world
        torch.distributed.all_gather_object(out, obj, group=self.group)
        return out
