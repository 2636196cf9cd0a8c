"""pretrain/train/deepspeed_adapter.py against the installed DeepSpeed: one check per name in
its RELIES_ON (a DeepSpeed upgrade that renames or changes one fails here, naming the name
and the adapter function that relies on it), the same through real engines (the step
wrapper sees the gradient norm before the update on each of DeepSpeed's three step paths;
captured checkpoint files have a direct save's bytes), the wrapper's transparency, and no
DeepSpeed private name outside the adapter."""

from __future__ import annotations

import importlib
import inspect
import io
import re
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from pretrain.config import Config, from_dict
from pretrain.train import deepspeed_adapter
from pretrain.train.deepspeed_adapter import RELIES_ON, OptimizerWrapper, changed
from pretrain.train.spikes import SkipStepOptimizer

REPO = Path(__file__).resolve().parents[1]


def _source(obj: object) -> str:
    """Source without line breaks or runs of spaces: a reformatting is not a change."""
    return re.sub(r"\s+", " ", inspect.getsource(obj))


def _in_order(text: str, *parts: str) -> str | None:
    """None when `parts` occur in `text` in this order, else what is missing."""
    at = 0
    for part in parts:
        found = text.find(part, at)
        if found < 0:
            return f"no `{part}`" + (f" after `{parts[parts.index(part) - 1]}`" if at else "")
        at = found + len(part)
    return None


def _bf16_optimizer():
    from deepspeed.runtime.bf16_optimizer import BF16_Optimizer

    return BF16_Optimizer


def _zero_optimizer():
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    return DeepSpeedZeroOptimizer


def _engine_class():
    from deepspeed.runtime.engine import DeepSpeedEngine

    return DeepSpeedEngine


# ----------------------------------------------------------------- one check per name


def _check_bf16_slot() -> str | None:
    return _in_order(
        _source(_bf16_optimizer().step),
        "self._global_grad_norm = all_groups_norm",
        "if is_invalid_grad_norm(all_groups_norm):",
        "return",
        "self.optimizer.step()",
    )


def _check_bf16_norm() -> str | None:
    return _in_order(
        _source(_bf16_optimizer().step), "self._global_grad_norm =", "self.optimizer.step()"
    )


def _check_zero_slot() -> str | None:
    zero = _zero_optimizer()
    missing = _in_order(
        _source(zero._optimizer_step),
        "self.optimizer.param_groups = [original_param_groups[group_no]]",
        "self.optimizer.step()",
        "self.optimizer.param_groups = original_param_groups",
    )
    return missing or _in_order(_source(zero.step), "self._optimizer_step(")


def _check_zero_norm() -> str | None:
    return _in_order(
        _source(_zero_optimizer().step), "self._global_grad_norm =", "self._optimizer_step("
    )


def _check_engine_optimizer() -> str | None:
    return _in_order(_source(_engine_class()._take_model_step), "self.optimizer.step()")


def _check_clip() -> str | None:
    from deepspeed.runtime import utils

    engine = _engine_class()
    if list(inspect.signature(engine.clip_fp32_gradients).parameters) != ["self"]:
        return f"its signature is {inspect.signature(engine.clip_fp32_gradients)}"
    # The replacement repeats this call, keeping its result: it must still be the whole method.
    body = _source(engine.clip_fp32_gradients)
    call = (
        "clip_grad_norm_(parameters=self.module.parameters(), max_norm=self.gradient_clipping(),"
        " mpu=self.mpu)"
    )
    if call not in body:
        return f"its body is no longer `{call}`"
    params = inspect.signature(utils.clip_grad_norm_).parameters
    if not {"parameters", "max_norm", "mpu"} <= set(params):
        return f"clip_grad_norm_ takes {list(params)}"
    missing = _in_order(_source(utils.clip_grad_norm_), "return total_norm")
    return missing or _in_order(
        _source(engine._take_model_step), "self.clip_fp32_gradients()", "self.optimizer.step()"
    )


def _check_schedule_hold() -> str | None:
    return _in_order(
        _source(_engine_class()._take_model_step),
        "overflow = self.optimizer.overflow",
        "if overflow: self.skipped_steps += 1 else:",
        "self.lr_scheduler.step(",
    )


def _check_checkpoint_engine() -> str | None:
    from deepspeed.runtime.checkpoint_engine import torch_checkpoint_engine as module

    engine = _engine_class()
    missing = _in_order(_source(engine._configure_checkpointing), "self.checkpoint_engine =")
    missing = missing or _in_order(
        _source(engine._save_checkpoint), "self.checkpoint_engine.save(state_dict=", "path="
    )
    missing = missing or _in_order(_source(engine._save_zero_checkpoint), "checkpoint_engine.save(")
    missing = missing or _in_order(_source(engine.save_checkpoint), "checkpoint_engine.create(")
    if missing:
        return missing
    real = module.TorchCheckpointEngine
    for name, params in (("save", ["self", "state_dict", "path"]), ("create", ["self", "info"])):
        got = list(inspect.signature(getattr(real, name)).parameters)
        if got != params:
            return f"TorchCheckpointEngine.{name} takes {got}, not {params}"
    if module.ENGINE_NAME != "TorchCheckpointEngine":
        return f"the torch engine is named {module.ENGINE_NAME}"
    return _in_order(
        _source(real),
        "self.name = ENGINE_NAME",
        "self.zipfile_serialization =",
        "torch.save(state_dict, path, _use_new_zipfile_serialization=self.zipfile_serialization)",
    )


def _check_engine_calls() -> str | None:
    engine = _engine_class()
    if engine.__call__ is not torch.nn.Module.__call__:
        return "DeepSpeedEngine defines its own __call__ (engine(...) may bypass forward)"
    for name in ("forward", "backward", "step"):
        if not inspect.isfunction(getattr(engine, name, None)):
            return f"DeepSpeedEngine.{name} is not a method"
    return None


def _check_compile() -> str | None:
    params = inspect.signature(_engine_class().compile).parameters
    return None if "backend" in params else f"compile takes {list(params)}"


def _check_universal() -> str | None:
    from deepspeed.runtime.config import DeepSpeedConfig

    missing = _in_order(
        _source(_engine_class().load_universal_checkpoint),
        "return self._config.load_universal_checkpoint",
    )
    return missing or _in_order(_source(DeepSpeedConfig), "self.load_universal_checkpoint =")


def _check_compatible_ops() -> str | None:
    import deepspeed.ops
    from deepspeed.ops.op_builder.cpu.comm import ShareMemCommBuilder

    comm_torch = importlib.import_module("deepspeed.comm.torch")  # not deepspeed.comm's `torch`

    if ShareMemCommBuilder.NAME != "deepspeed_shm_comm":
        return f"the shared-memory op is named {ShareMemCommBuilder.NAME}"
    missing = _in_order(_source(comm_torch.build_shm_op), "__compatible_ops__.get(builder.NAME")
    return missing or _in_order(_source(deepspeed.ops), '"__compatible_ops__"')


CHECKS: dict[str, Callable[[], str | None]] = {
    "BF16_Optimizer.optimizer": _check_bf16_slot,
    "DeepSpeedZeroOptimizer.optimizer": _check_zero_slot,
    "DeepSpeedEngine.optimizer": _check_engine_optimizer,
    "BF16_Optimizer._global_grad_norm": _check_bf16_norm,
    "DeepSpeedZeroOptimizer._global_grad_norm": _check_zero_norm,
    "DeepSpeedEngine.clip_fp32_gradients": _check_clip,
    "DeepSpeedEngine._take_model_step": _check_schedule_hold,
    "DeepSpeedEngine.checkpoint_engine": _check_checkpoint_engine,
    "DeepSpeedEngine.forward/backward/step": _check_engine_calls,
    "DeepSpeedEngine.compile(backend=)": _check_compile,
    "DeepSpeedEngine._config.load_universal_checkpoint": _check_universal,
    "deepspeed.ops.__compatible_ops__": _check_compatible_ops,
}


@pytest.mark.parametrize("name", [r.name for r in RELIES_ON])
def test_deepspeed_still_has(name):
    assert name in CHECKS, f"deepspeed_adapter.RELIES_ON names `{name}`, but no check covers it"
    try:
        problem = CHECKS[name]()
    except (AttributeError, ImportError, TypeError, OSError) as e:  # a module or name is gone
        problem = f"{type(e).__name__}: {e}"
    assert problem is None, changed(name, problem)


def test_every_check_is_of_a_name_the_adapter_relies_on():
    assert set(CHECKS) == {r.name for r in RELIES_ON}


# ----------------------------------------------------------------- through real engines

CLIP = 1e-3  # below any gradient norm of the untrained model: every step is clipped
MODEL = {
    "vocab_size": 97,
    "pad_vocab_to_multiple": 1,
    "n_layers": 2,
    "d_model": 32,
    "n_heads": 4,
    "d_ff": 64,
    "max_seq_len": 16,
    "rope_fraction": 0.25,
}


@pytest.fixture(scope="module")
def process_group():
    """One process's group for the engines, as tests/test_train_optimizer.py makes it: kept
    (DeepSpeed caches its groups), with the launcher variables DeepSpeed reads at every
    engine (LOCAL_RANK) in os.environ."""
    from pretrain.train import distributed as dist_utils

    dist_utils.setup_env()
    if not torch.distributed.is_initialized():
        dist_utils.init_process_group(torch.device("cpu"))


def _engine(zero_stage: int, precision: str):
    from pretrain.train.engine import build_engine

    cfg = from_dict(
        Config,
        {
            "model": MODEL,
            "optim": {"lr": 3e-3, "grad_clip": CLIP},
            "train": {
                "train_iters": 4,
                "global_batch_size": 2,
                "micro_batch_size": 2,
                "seq_len": 16,
                "precision": precision,
                "zero_stage": zero_stage,
            },
        },
    )
    return build_engine(cfg, 1, torch.device("cpu"), recompute=0)


def _backward(engine, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 97, (2, 16), generator=gen)
    loss = engine(x, targets=x).loss
    engine.backward(loss)
    return loss.detach()


PATHS = {  # DeepSpeed's three step paths, and the private name each reads the norm from
    (0, "fp32"): "DeepSpeedEngine.clip_fp32_gradients",
    (1, "bf16"): "BF16_Optimizer._global_grad_norm",
    (2, "bf16"): "DeepSpeedZeroOptimizer._global_grad_norm",
}


@pytest.mark.parametrize("zero_stage,precision", list(PATHS))
def test_the_wrapper_sees_the_norm_before_any_update(process_group, zero_stage, precision):
    """build_engine puts a SkipStepOptimizer where DeepSpeed steps; armed, DeepSpeed
    calls it once per step with the step's global norm readable and no weight changed yet, and
    a skip leaves the weights as they were. The norm is the one before clipping (above CLIP),
    the engine's own report of it where it keeps one."""
    name = PATHS[(zero_stage, precision)]
    engine = _engine(zero_stage, precision)
    wrapper = deepspeed_adapter.stepped_optimizer(engine)
    assert isinstance(wrapper, SkipStepOptimizer), changed(name, f"it steps {wrapper!r}")
    inner = deepspeed_adapter.inner_optimizer(engine)
    masters = [p for g in inner.param_groups for p in g["params"]]
    seen = []

    def judge(norm):
        seen.append((norm, [m.detach().clone() for m in masters]))
        return True

    before = [m.detach().clone() for m in masters]
    _backward(engine)
    wrapper.arm(judge)
    engine.step()
    called, norm = wrapper.disarm()
    assert called and len(seen) == 1, changed(name, "DeepSpeed did not call the wrapped step")
    ok = norm is not None and float(norm) > 2 * CLIP
    assert ok, changed(name, f"the step's norm read {norm!r}, not the norm before clipping")
    reported = engine.get_global_grad_norm()
    if reported is not None:
        assert float(norm) == float(reported), changed(name, f"{norm!r} != {reported!r}")
    for m, b, s in zip(masters, before, seen[0][1], strict=True):
        assert torch.equal(s, b), changed(name, "a weight changed before the wrapped step")
        assert torch.equal(m, b), changed(name, "a skipped step changed a weight")
    _backward(engine, 1)
    wrapper.arm(None)  # read the norm only: the next step applies its update
    engine.step()
    assert wrapper.disarm()[0]
    assert any(not torch.equal(m, b) for m, b in zip(masters, before, strict=True))


def test_captured_checkpoint_files_have_a_direct_saves_bytes(process_group, tmp_path):
    """Within capture_checkpoint_files, save_checkpoint makes the folder and writes no state
    (only its recovery scripts, zero_to_*.py); written afterwards, every file has the bytes
    of a direct save of the same state."""
    name = "DeepSpeedEngine.checkpoint_engine"
    engine = _engine(1, "bf16")
    _backward(engine)
    engine.step()
    engine.save_checkpoint(str(tmp_path / "direct"), tag="t", client_state={}, save_latest=False)
    with deepspeed_adapter.capture_checkpoint_files(engine, lambda state: state) as captured:
        engine.save_checkpoint(str(tmp_path / "kept"), tag="t", client_state={}, save_latest=False)
    assert (tmp_path / "kept" / "t").is_dir()
    on_disk = [p.name for p in (tmp_path / "kept").rglob("*") if p.suffix != ".py" and p.is_file()]
    assert on_disk == [], changed(name, f"a captured save wrote {on_disk}")
    direct = sorted(p.name for p in (tmp_path / "direct" / "t").iterdir())
    assert sorted(Path(p).name for p, _ in captured.files) == [
        n for n in direct if n.endswith(".pt")
    ], changed(name, "DeepSpeed wrote a .pt file around the checkpoint engine")
    for path in captured.write():
        a = Path(path).read_bytes()
        assert a == (tmp_path / "direct" / "t" / Path(path).name).read_bytes(), changed(name, path)
    assert engine.checkpoint_engine.name == "TorchCheckpointEngine"  # the real one is back


def test_labels_and_the_universal_switch_are_undone(process_group):
    engine = _engine(0, "fp32")
    calls = []

    def wrap(name, fn):
        def call(*args, **kwargs):
            calls.append(name)
            return fn(*args, **kwargs)

        return call

    undo = deepspeed_adapter.wrap_engine_calls(engine, wrap)
    _backward(engine)
    engine.step()
    assert calls == ["forward", "backward", "step"], changed(
        "DeepSpeedEngine.forward/backward/step", f"the calls went {calls}"
    )
    undo()
    _backward(engine)
    assert calls == ["forward", "backward", "step"] and "forward" not in vars(engine)
    with deepspeed_adapter.load_universal(engine, True):
        assert engine.load_universal_checkpoint() is True, changed(
            "DeepSpeedEngine._config.load_universal_checkpoint", "the switch does not reach it"
        )
    assert engine.load_universal_checkpoint() is False


# ----------------------------------------------------------------- the wrapper alone


def _adamw() -> tuple[torch.optim.AdamW, list[torch.nn.Parameter]]:
    params = [torch.nn.Parameter(torch.randn(4, 3)), torch.nn.Parameter(torch.randn(3))]
    opt = torch.optim.AdamW([{"params": params[:1]}, {"params": params[1:], "weight_decay": 0}])
    for p in params:
        p.grad = torch.ones_like(p)
    return opt, params


def _bytes(obj: object) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def test_the_wrapper_is_the_optimizer_it_wraps_to_deepspeed():
    """What DeepSpeed and the LR scheduler do to the optimizer they step lands on the wrapped
    one: groups (ZeRO reassigns them around each group's step), state, state dict bytes."""
    opt, params = _adamw()
    twin, twin_params = _adamw()
    with torch.no_grad():
        for p, q in zip(params, twin_params, strict=True):
            q.copy_(p)
    wrapper = OptimizerWrapper(opt)
    assert wrapper.param_groups is opt.param_groups and wrapper.defaults is opt.defaults
    groups = wrapper.param_groups
    wrapper.param_groups = [groups[1]]
    assert opt.param_groups == [groups[1]]
    wrapper.param_groups = groups
    wrapper.step()
    twin.step()
    assert wrapper.state is opt.state and len(opt.state) == 2
    assert _bytes(wrapper.state_dict()) == _bytes(twin.state_dict())
    wrapper.load_state_dict(twin.state_dict())
    assert wrapper.state is opt.state  # torch replaces the dict on a load: still the inner's
    assert wrapper._optimizer_step_pre_hooks is opt._optimizer_step_pre_hooks
    wrapper.zero_grad()
    assert all(p.grad is None for p in params)


def test_a_skipped_step_changes_nothing_and_an_unarmed_step_passes_through():
    opt, params = _adamw()
    norms = iter([2.0, 3.0])
    wrapper = SkipStepOptimizer(opt, lambda: next(norms))
    before = [p.detach().clone() for p in params]
    wrapper.arm(lambda norm: norm < 2.5)
    wrapper.step()
    wrapper.step()  # ZeRO's second group: judged once, skipped too
    assert wrapper.disarm() == (True, 2.0)
    assert all(torch.equal(p, b) for p, b in zip(params, before, strict=True)) and not opt.state
    wrapper.arm(lambda norm: norm < 2.5)
    wrapper.step()
    assert wrapper.disarm() == (True, 3.0) and len(opt.state) == 2
    wrapper.step()  # not armed: not judged, not read
    assert wrapper.disarm() == (False, None)
    assert all(int(s["step"]) == 2 for s in opt.state.values())


# ----------------------------------------------------------------- nowhere else

PRIVATE = re.compile(
    r"_global_grad_norm|checkpoint_engine|clip_fp32_gradients|__compatible_ops__|"
    r"\._config\b|__defaults__|lr_scheduler\.step\(|^\s*(import|from) deepspeed\b",
    re.MULTILINE,
)
# Modules their owners have still to move onto the adapter: the function each should call.
NOT_YET_MOVED = {
    # DeepSpeed's public deepspeed.initialize and logger only; the planner layer may import
    # train/engine.py alone of train/ (docs/architecture.md).
    "pretrain/planner/validation.py": "",
}


def test_no_module_but_the_adapter_touches_deepspeeds_private_names():
    adapter = "pretrain/train/deepspeed_adapter.py"
    found = {}
    for path in sorted((REPO / "pretrain").rglob("*.py")):
        rel = path.relative_to(REPO).as_posix()
        code = "\n".join(line.split("#")[0] for line in path.read_text().splitlines())
        hits = sorted({m.group(0).strip() for m in PRIVATE.finditer(code)})
        if hits:
            found[rel] = hits
    assert adapter in found  # the pattern still finds what the adapter does
    moved = sorted(set(NOT_YET_MOVED) - set(found))
    assert not moved, f"{moved} touch DeepSpeed no more: take them out of NOT_YET_MOVED"
    outside = {r: hits for r, hits in found.items() if r != adapter and r not in NOT_YET_MOVED}
    assert not outside, f"DeepSpeed's private names outside {adapter}: {outside}"
