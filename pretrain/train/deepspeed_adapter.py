"""DeepSpeed behind one module: the only place that touches its private names.

What the toolkit needs of DeepSpeed beyond its documented API, and where:

    initialize               the engine, DeepSpeed's logs quieted
    wrap_stepped_optimizer   an OptimizerWrapper (the skip-step guard's) in the place of the
                             torch optimizer DeepSpeed steps, given a reader of the step's
                             global gradient norm (DeepSpeed's private `_global_grad_norm`, or
                             for ZeRO 0 in fp32 a clip that keeps the norm it computes)
    advance_schedule         steps the LR schedule that DeepSpeed holds on a step it skipped
    capture_checkpoint_files `engine.save_checkpoint` with its files kept, not written: the
                             checkpoint engine swapped for one save (checkpoint.async)
    wrap_engine_calls        the engine's forward, backward and step wrapped (gpu-check labels)
    compile_engine           `engine.compile` with the backend `compile_backend` chose
    load_universal           `engine.load_checkpoint` switched to the universal format
    init_distributed         the process group, without the CPU shared-memory op build

Every name used here that DeepSpeed does not document is in RELIES_ON, with the function that
relies on it; tests/test_train_deepspeed_adapter.py checks each against the installed
DeepSpeed, so an upgrade that renames or changes one fails there with a message naming the
name and the function, not silently in a run. DeepSpeed is imported inside the functions:
tools/check_checkpoint.py imports checkpoint.py (and so this module) without it.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

DESIGNED_FOR = "0.19.8"  # the DeepSpeed version whose source this module was read against


@dataclass(frozen=True)
class Reliance:
    name: str  # as DeepSpeed spells it
    used_by: str  # the function of this module that breaks when it changes
    why: str


RELIES_ON = (
    Reliance(
        "BF16_Optimizer.optimizer",
        "wrap_stepped_optimizer",
        "the torch optimizer BF16_Optimizer.step calls (self.optimizer.step()) after computing "
        "the global norm and returning early on a non-finite one",
    ),
    Reliance(
        "DeepSpeedZeroOptimizer.optimizer",
        "wrap_stepped_optimizer",
        "the torch optimizer ZeRO 1/2 steps once per parameter group (_optimizer_step), "
        "reassigning its param_groups around each call",
    ),
    Reliance(
        "DeepSpeedEngine.optimizer",
        "wrap_stepped_optimizer",
        "without a DeepSpeed wrapper (ZeRO 0 in fp32) the engine steps the torch optimizer "
        "itself in _take_model_step",
    ),
    Reliance(
        "BF16_Optimizer._global_grad_norm",
        "wrap_stepped_optimizer",
        "the step's global gradient norm, set before the inner step is called",
    ),
    Reliance(
        "DeepSpeedZeroOptimizer._global_grad_norm",
        "wrap_stepped_optimizer",
        "the step's global gradient norm, set before the inner step is called",
    ),
    Reliance(
        "DeepSpeedEngine.clip_fp32_gradients",
        "wrap_stepped_optimizer",
        "ZeRO 0 in fp32 clips there (clip_grad_norm_ of deepspeed.runtime.utils) and drops the "
        "norm; replaced by the same call keeping it",
    ),
    Reliance(
        "DeepSpeedEngine._take_model_step",
        "advance_schedule",
        "holds the LR schedule on a step its optimizer skipped (optimizer.overflow)",
    ),
    Reliance(
        "DeepSpeedEngine.checkpoint_engine",
        "capture_checkpoint_files",
        "save_checkpoint hands every file to checkpoint_engine.save(state_dict, path); "
        "TorchCheckpointEngine writes it with torch.save",
    ),
    Reliance(
        "DeepSpeedEngine.forward/backward/step",
        "wrap_engine_calls",
        "instance attributes shadow the methods: engine(...) reaches forward through "
        "nn.Module.__call__",
    ),
    Reliance(
        "DeepSpeedEngine.compile(backend=)",
        "compile_engine",
        "the backend argument of engine.compile",
    ),
    Reliance(
        "DeepSpeedEngine._config.load_universal_checkpoint",
        "load_universal",
        "read at every load_checkpoint (load_universal_checkpoint()), not at initialisation",
    ),
    Reliance(
        "deepspeed.ops.__compatible_ops__",
        "init_distributed",
        "the op table comm/torch.py reads before JIT-building the shared-memory all-reduce",
    ),
)


def changed(name: str, detail: str) -> str:
    """The message of a check that found `name` changed in the installed DeepSpeed."""
    import deepspeed

    used_by = next(r.used_by for r in RELIES_ON if r.name == name)
    return (
        f"DeepSpeed {deepspeed.__version__} changed `{name}`: "
        f"pretrain/train/deepspeed_adapter.py {used_by} relies on it ({detail}); "
        f"see RELIES_ON there (read against DeepSpeed {DESIGNED_FOR})"
    )


# ----------------------------------------------------------------------------- the engine


def quiet_logs() -> None:
    """DeepSpeed's logger at WARNING: its INFO lines (configs, memory reports) per engine."""
    from deepspeed.utils import logger

    logger.setLevel(logging.WARNING)


def initialize(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    model_parameters: Any,
    config: dict[str, Any],
    lr_scheduler: Callable[[torch.optim.Optimizer], Any] | None,
) -> Any:
    """deepspeed.initialize on a process group that already exists; the engine."""
    import deepspeed

    quiet_logs()
    engine, _, _, _ = deepspeed.initialize(
        model=model,
        optimizer=optimizer,
        model_parameters=model_parameters,
        config=config,
        lr_scheduler=lr_scheduler,
        dist_init_required=False,
    )
    return engine


_compile_backend: str | None = None  # None: DeepSpeed's default (the accelerator's)


@contextlib.contextmanager
def compile_backend(backend: str) -> Iterator[None]:
    """Engines compiled within (`compile_engine`, train.compile) use `backend`: gpu-check's
    smoke compiles with "eager" through the trainer's own build."""
    global _compile_backend
    before, _compile_backend = _compile_backend, backend
    try:
        yield
    finally:
        _compile_backend = before


def compile_engine(engine: Any) -> None:
    if _compile_backend is None:
        engine.compile()
    else:
        engine.compile(backend=_compile_backend)


def compile_blocks(blocks: Any) -> None:
    """train.compile_regions='blocks': each block compiled in place (`nn.Module.compile`),
    before DeepSpeed wraps the model, with the backend `compile_engine` would use (inductor,
    DeepSpeed's default on CUDA, unless `compile_backend` says otherwise). Here, beside
    compile_engine, so that both compiles read one backend choice."""
    for block in blocks:
        block.compile(backend=_compile_backend or "inductor")


def wrap_engine_calls(
    engine: Any, wrap: Callable[[str, Callable[..., Any]], Callable[..., Any]]
) -> Callable[[], None]:
    """Every call of the engine's forward, backward and step goes through `wrap(name, call)`
    (gpu-check's profiler labels); DeepSpeed has no hook around its backward or step, so
    instance attributes shadow the methods. Returns the function that takes them away."""
    names = ("forward", "backward", "step")
    for name in names:
        setattr(engine, name, wrap(name, getattr(engine, name)))

    def unwrap() -> None:
        for name in names:
            engine.__dict__.pop(name, None)

    return unwrap


@contextlib.contextmanager
def load_universal(engine: Any, on: bool) -> Iterator[None]:
    """Within, `engine.load_checkpoint` reads the universal format when `on`: DeepSpeed reads
    the switch at each load, and one run may load both kinds (pretrain/train/reshard.py)."""
    config = engine._config
    before = config.load_universal_checkpoint
    config.load_universal_checkpoint = on
    try:
        yield
    finally:
        config.load_universal_checkpoint = before


def init_distributed(device_type: str) -> None:
    """deepspeed.init_distributed: gloo on CPU, NCCL otherwise."""
    import deepspeed

    if device_type == "cpu":
        # DeepSpeed's TorchBackend JIT-compiles a shared-memory all-reduce (about 45 s on two
        # cores) that only its inference path uses; training's collectives go through gloo.
        import deepspeed.ops

        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
        deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False, verbose=False)
    else:
        deepspeed.init_distributed(dist_backend="nccl", auto_mpi_discovery=False, verbose=False)


def reset_comms_log() -> None:
    """Empty DeepSpeed's communication logger, its timers too (they keep running totals)."""
    import deepspeed.comm as dc

    dc.comms_logger.comms_dict.clear()
    for timer in dc.comm.timers.get_timers().values():
        timer.reset()


def comms_log() -> dict[str, Any]:
    """DeepSpeed's logger: op -> message bytes -> [calls, each call's running total (ms) of
    the op's timer, algbw, busbw] (pretrain/measure/deepspeed_comms.py reads it)."""
    import deepspeed.comm as dc

    return dc.comms_logger.get_raw_data()


# ----------------------------------------------------------------------------- the step


class OptimizerWrapper(torch.optim.Optimizer):
    """A torch optimizer that DeepSpeed steps in the place of `optimizer`, passing everything
    else through: DeepSpeed reads and reassigns the parameter groups (ZeRO steps one group at
    a time), links the state to its parameters and saves the state dict, and the LR
    scheduler holds `optimizer` itself, so all of it stays `optimizer`'s (a checkpoint's
    bytes do not change). Subclasses decide what `step` does."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        # No Optimizer.__init__: it would make groups and a state of this object's own.
        self.__dict__["optimizer"] = optimizer

    def __getattr__(self, name: str) -> Any:  # hooks, torch's bookkeeping, anything else
        return getattr(self.__dict__["optimizer"], name)

    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, groups: list[dict[str, Any]]) -> None:
        self.optimizer.param_groups = groups

    @property
    def state(self) -> Any:  # type: ignore[override]
        return self.optimizer.state

    @state.setter
    def state(self, state: Any) -> None:
        self.optimizer.state = state

    @property
    def defaults(self) -> dict[str, Any]:  # type: ignore[override]
        return self.optimizer.defaults

    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        return self.optimizer.step() if closure is None else self.optimizer.step(closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state_dict)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        self.optimizer.add_param_group(param_group)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.optimizer!r})"


W = TypeVar("W", bound=OptimizerWrapper)


def _holder(engine: Any) -> Any:
    """The object whose `.optimizer` DeepSpeed steps: its BF16_Optimizer or ZeRO wrapper,
    else (ZeRO 0 in fp32) the engine, which steps the torch optimizer itself."""
    opt = engine.optimizer
    if isinstance(opt, OptimizerWrapper):
        return engine
    return opt if isinstance(getattr(opt, "optimizer", None), torch.optim.Optimizer) else engine


def stepped_optimizer(engine: Any) -> torch.optim.Optimizer:
    """What DeepSpeed steps: the wrapper once `wrap_stepped_optimizer` put one in."""
    return _holder(engine).optimizer


def inner_optimizer(engine: Any) -> torch.optim.Optimizer:
    """The torch optimizer that applies the update: the rank's fp32 master partition under
    BF16_Optimizer and ZeRO, the parameters themselves otherwise."""
    opt = stepped_optimizer(engine)
    return opt.optimizer if isinstance(opt, OptimizerWrapper) else opt


def _copy(norm: Any) -> Any:
    # DeepSpeed assigns a new tensor each step; a copy keeps this step's value regardless.
    return norm.detach().clone() if isinstance(norm, torch.Tensor) else norm


def _grad_norm_reader(engine: Any, holder: Any) -> Callable[[], Any]:
    """A function that returns the step's global gradient norm (before clipping) when called
    in the inner step: a device tensor (not read), a float, or None where there is none."""
    if holder is not engine:
        return lambda: _copy(getattr(holder, "_global_grad_norm", None))
    if engine.gradient_clipping() > 0:
        kept: list[Any] = [None]

        def clip_and_keep_norm() -> None:
            from deepspeed.runtime.utils import clip_grad_norm_

            kept[0] = clip_grad_norm_(
                parameters=engine.module.parameters(),
                max_norm=engine.gradient_clipping(),
                mpu=engine.mpu,
            )

        engine.clip_fp32_gradients = clip_and_keep_norm

        def read_kept() -> Any:
            norm, kept[0] = kept[0], None  # the clip runs before every inner step
            return norm

        return read_kept

    def total_norm() -> Any:
        grads = [p.grad for p in engine.module.parameters() if p.grad is not None]
        return torch.nn.utils.get_total_norm(grads) if grads else None

    return total_norm


def wrap_stepped_optimizer(
    engine: Any, wrap: Callable[[torch.optim.Optimizer, Callable[[], Any]], W]
) -> W:
    """Put `wrap(inner optimizer, grad norm reader)` where DeepSpeed steps the torch optimizer
    (once: the wrapper already there is returned). DeepSpeed calls the wrapper's `step` after
    it computed (and for ZeRO 0 in fp32, clipped) the global gradient norm and before any
    weight changed; a call that returns without stepping the inner optimizer leaves the
    master weights, the moments and the step counts as they were, and DeepSpeed's copy back
    to bf16 then writes the same weights."""
    holder = _holder(engine)
    current = holder.optimizer
    if isinstance(current, OptimizerWrapper):
        return current  # type: ignore[return-value]
    wrapper = wrap(current, _grad_norm_reader(engine, holder))
    holder.optimizer = wrapper
    return wrapper


def advance_schedule(engine: Any) -> None:
    """One LR schedule step: for a step DeepSpeed skipped itself (non-finite gradients),
    where it holds the schedule."""
    if engine.lr_scheduler is not None:
        engine.lr_scheduler.step()


# ----------------------------------------------------------------------------- checkpoints


class CapturedFiles:
    """DeepSpeed's files of one save, kept: (path, kept state dict) in the order DeepSpeed
    handed them over, and how its checkpoint engine would have written them."""

    def __init__(self, zipfile_serialization: bool) -> None:
        self.files: list[tuple[str, Any]] = []
        self.zipfile_serialization = zipfile_serialization

    def write(self) -> list[str]:
        """Write them as the real engine would (its torch.save arguments); their paths."""
        for path, state in self.files:
            torch.save(state, path, _use_new_zipfile_serialization=self.zipfile_serialization)
        return [path for path, _ in self.files]


class _Capturing:
    """DeepSpeed's checkpoint engine for one save: folders are made, files only kept.
    Everything but create/save/commit is the real engine's (a stand-in, not a subclass, so
    that importing this module imports no DeepSpeed)."""

    def __init__(self, real: Any, keep: Callable[[Any], Any], into: CapturedFiles) -> None:
        self.real, self.keep, self.into = real, keep, into

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real, name)

    def create(self, info: Any) -> None:
        pass  # the real engine's only logs

    def save(self, state_dict: Any, path: str) -> None:
        self.into.files.append((path, self.keep(state_dict)))

    def commit(self, info: Any) -> bool:
        return True


@contextlib.contextmanager
def capture_checkpoint_files(engine: Any, keep: Callable[[Any], Any]) -> Iterator[CapturedFiles]:
    """Within the block, `engine.save_checkpoint` builds its state dicts (and runs its
    collectives) as always but writes no file: each is kept as `keep(state_dict)` in the
    CapturedFiles yielded, for its `write()` later. Every file name and state dict stays
    DeepSpeed's, and the writing is the same torch.save call."""
    real = engine.checkpoint_engine
    if real.name != "TorchCheckpointEngine":  # another writer: its bytes are its own
        raise ValueError(
            f"checkpoint.async needs DeepSpeed's torch checkpoint engine, not {real.name}; "
            f"remove the checkpoint writer from train.deepspeed, or set checkpoint.async=false"
        )
    captured = CapturedFiles(real.zipfile_serialization)
    engine.checkpoint_engine = _Capturing(real, keep, captured)
    try:
        yield captured
    finally:
        engine.checkpoint_engine = real
