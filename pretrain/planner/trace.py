"""Tracing a step on fake tensors: live-tensor accounting of the real model code.

The model's injection points (Transformer.set_attention_fn, Transformer.loss_fn) put
FlashAttention-2's allocations and the whole-logits loss in; no global is rebound.
"""

from __future__ import annotations

import gc
import weakref
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from pretrain.config import ModelConfig
from pretrain.model.loss import reference_cross_entropy
from pretrain.model.probes import attention_logit_maxima
from pretrain.model.transformer import Transformer
from pretrain.train.fp8 import convert_to_fp8


class LiveTensors(TorchDispatchMode):
    """Live-tensor accounting at the dispatcher: bytes of the storages operators create.

    A storage counts from the operator that returns it (unless it is one of the operator's
    inputs' storages: views and in-place results) until it is freed (a weak reference's
    callback). `live` is the running total and `peak` its maximum. Storages that existed
    before the mode (parameters, the optimizer's state) are not counted: they are the plan's
    static part. `workspace(func, args, kwargs)`, when given, returns the bytes a kernel
    allocates and frees inside the operator (invisible at the dispatcher), which count
    towards the peak while the operator runs.
    """

    def __init__(self, workspace=None) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self.workspace = workspace
        self._refs: dict[int, tuple[weakref.ref, int]] = {}

    def _freed(self, key: int, nbytes: int) -> None:
        if self._refs.pop(key, None) is not None:
            self.live -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        inputs = {
            t.untyped_storage()._cdata
            for t in tree_leaves((args, kwargs))
            if isinstance(t, torch.Tensor)
        }
        work = self.workspace(func, args, kwargs) if self.workspace is not None else 0
        out = func(*args, **kwargs)
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor):
                continue
            st = t.untyped_storage()
            key = st._cdata
            if key in inputs or key in self._refs:
                continue
            nbytes = st.nbytes()
            ref = weakref.ref(st, lambda _r, key=key, n=nbytes: self._freed(key, n))
            self._refs[key] = (ref, nbytes)
            self.live += nbytes
        self.peak = max(self.peak, self.live + work)
        return out


def _cpu_flash_splits(q_len: int, kv_len: int) -> tuple[int, int]:
    """Query and key block sizes of torch's CPU flash attention (FlashAttentionKernel.cpp)."""
    q_split = 256 if q_len >= 768 else 64 if q_len >= 192 else 32
    return min(q_split, q_len), min(512, kv_len)


def cpu_kernel_workspace(func, args, kwargs) -> int:
    """Bytes that CPU kernels allocate and free inside one operator (read from ATen):

    - flash attention forward (aten/src/ATen/native/cpu/FlashAttentionKernel.cpp): per
      thread an fp32 buffer of qSplit x kvSplit + 2 qSplit + qSplit x head_dim, and for
      bf16 a qSplit x kvSplit buffer in bf16;
    - its backward: grad_out.contiguous(), per thread 2 qSplit x kvSplit in fp32 (and in
      bf16), and the fp32 row sums `dsum` (qSplit);
    - pointwise operators with operands of another dtype than the result (TensorIterator on
      CPU casts them into temporaries; CUDA casts in the kernel): one temporary per such
      operand, and one for an in-place output of another dtype.
    """
    aten = torch.ops.aten
    threads = torch.get_num_threads()
    if func is aten._scaled_dot_product_flash_attention_for_cpu.default:
        q, k = args[0], args[1]
        qs, ks = _cpu_flash_splits(q.shape[2], k.shape[2])
        reduced = q.dtype in (torch.bfloat16, torch.float16)
        work = threads * (qs * ks + 2 * qs + qs * q.shape[3]) * 4
        return work + (threads * qs * ks * q.element_size() if reduced else 0)
    if func is aten._scaled_dot_product_flash_attention_for_cpu_backward.default:
        grad_out, q, k = args[0], args[1], args[2]
        qs, ks = _cpu_flash_splits(q.shape[2], k.shape[2])
        reduced = q.dtype in (torch.bfloat16, torch.float16)
        work = threads * (2 * qs * ks + qs) * 4
        work += threads * 2 * qs * ks * q.element_size() if reduced else 0
        if not grad_out.transpose(1, 2).is_contiguous():
            work += grad_out.numel() * grad_out.element_size()
        return work
    if torch.Tag.pointwise in func.tags:
        tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        if len({t.dtype for t in tensors}) < 2:
            return 0
        common = torch.result_type(*tensors[:2]) if len(tensors) >= 2 else tensors[0].dtype
        for t in tensors[2:]:
            common = torch.promote_types(common, t.dtype)
        item = torch.empty((), dtype=common).element_size()
        work = sum(t.numel() * item for t in tensors if t.dtype != common and t.dim() > 0)
        if func._schema.name.endswith("_") and tensors[0].dtype != common:
            work += tensors[0].numel() * item  # in-place result computed in the common dtype
        return work
    return 0


class _FlashAttention2(torch.autograd.Function):
    """Stand-in for SDPA on a GPU (FlashAttention-2): its allocations, no arithmetic."""

    @staticmethod
    def forward(ctx, q, k, v):
        B, H, T, D = q.shape
        out = q.new_empty(B, T, H, D).transpose(1, 2)  # (B, T, H, D) memory, (B, H, T, D) view
        lse = q.new_empty(B, H, T, dtype=torch.float32)
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        B, H, T, D = q.shape
        KV, S = k.shape[1], k.shape[2]
        t_round = -(-T // 128) * 128
        d_round = -(-D // 32) * 32 if D <= 192 else 256  # flash_api.cpp: head_size_rounded
        dq = q.new_empty(B, T, H, D).transpose(1, 2)
        dk = k.new_empty(B, S, KV, D).transpose(1, 2)
        dv = v.new_empty(B, S, KV, D).transpose(1, 2)
        work = [
            q.new_empty(B, H, t_round, dtype=torch.float32),  # softmax_d
            q.new_empty(B, t_round, H, d_round, dtype=torch.float32),  # dq_accum
        ]
        if KV != H:  # dk/dv per query head, summed over each group into dk/dv
            work += [k.new_empty(B, S, H, D), v.new_empty(B, S, H, D)]
        del work
        return dq, dk, dv


def _flash_sdpa(
    q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False
):
    return _FlashAttention2.apply(q, k, v)


def _fake_model(cfg: ModelConfig, dtype: torch.dtype, fp8: str = "off", target: str = "cuda"):
    """(fake mode, Transformer built in it with `dtype` weights and the fp32 RoPE cache; its
    blocks' linears in fp8 as training converts them (train.fp8): torchao's fp8 casts and
    torch._scaled_mm have fake kernels, so the trace holds what they allocate; on the CPU
    target, torchao's emulation, the only fp8 a CPU runs)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode()
    previous = torch.get_default_dtype()
    with mode:
        torch.set_default_dtype(dtype)
        try:
            model = Transformer(cfg)
            if fp8 != "off":
                convert_to_fp8(model, fp8, emulate=target != "cuda")
        finally:
            torch.set_default_dtype(previous)
    return mode, model


@dataclass
class Trace:
    """Peak bytes above the state that exists before each phase (weights, gradients, ...)."""

    train: int  # forward + backward of one micro batch, inputs included
    train_forward: int  # the forward part alone
    eval: int  # evaluation forward with targets, no gradients
    probe: int  # max attention logits of one sequence


_TRAIN_CACHE: dict[tuple, tuple[int, int]] = {}
_EVAL_CACHE: dict[tuple, tuple[int, int]] = {}


def _whole_logits_loss(hidden, weight, targets, ignore_index, z_loss=0.0):
    """The model's loss before the chunked one (whole fp32 logits), for before/after figures."""
    return reference_cross_entropy(hidden, weight, targets, ignore_index), hidden.new_zeros(())


def _use_kernels(model, target: str, whole_logits: bool) -> None:
    """Through the model's injection points: SDPA allocates as on `target` ("cuda":
    FlashAttention-2, "cpu": torch's own), and the loss is the chunked or the whole-logits one."""
    # A soft cap runs the unfused path on every device, which no SDPA kernel stands for (the
    # model refuses to hand it an injected kernel): its memory is the eager trace's.
    if target == "cuda" and model.cfg.attn_logit_softcap == 0:
        model.set_attention_fn(_flash_sdpa)
    if whole_logits:
        model.loss_fn = _whole_logits_loss


def trace_train(
    cfg: ModelConfig,
    micro_batch: int,
    seq_len: int,
    dtype: torch.dtype,
    layers: int,
    target: str = "cuda",
    grads_exist: bool = True,
    whole_logits: bool = False,
    fp8: str = "off",
) -> tuple[int, int]:
    """(peak of forward + backward, peak of the forward) of one micro batch on fake tensors,
    bytes above what existed before. `grads_exist`: the parameters' .grad exist before the
    backward (a later micro batch of a step with gradient accumulation); else the backward
    creates them, inside the trace. `fp8`: train.fp8's recipe (off, tensorwise, rowwise)."""
    key = (repr(cfg), micro_batch, seq_len, dtype, layers, target, grads_exist, whole_logits)
    key += (fp8,)
    if key not in _TRAIN_CACHE:
        mode, model = _fake_model(cfg, dtype, fp8, target)
        _use_kernels(model, target, whole_logits)
        with mode:
            if grads_exist:
                for p in model.parameters():
                    p.grad = torch.zeros_like(p)
            model.train()
            model.gradient_checkpointing = layers
            acct = LiveTensors(cpu_kernel_workspace if target == "cpu" else None)
            with acct:
                x = torch.randint(0, cfg.vocab_size, (micro_batch, seq_len))
                y = torch.randint(0, cfg.vocab_size, (micro_batch, seq_len))
                loss = model(x, y).loss
                forward = acct.peak
                loss.backward()
                del loss, x, y
        del model
        gc.collect()
        _TRAIN_CACHE[key] = (acct.peak, forward)
    return _TRAIN_CACHE[key]


def trace_eval(
    cfg: ModelConfig,
    micro_batch: int,
    seq_len: int,
    dtype: torch.dtype,
    target: str = "cuda",
    whole_logits: bool = False,
    fp8: str = "off",
) -> tuple[int, int]:
    """(peak of the evaluation forward with targets, peak of the max-logit probe on one
    sequence), no gradients, on fake tensors, in bytes above what existed before."""
    key = (repr(cfg), micro_batch, seq_len, dtype, target, whole_logits, fp8)
    if key not in _EVAL_CACHE:
        mode, model = _fake_model(cfg, dtype, fp8, target)
        workspace = cpu_kernel_workspace if target == "cpu" else None
        _use_kernels(model, target, whole_logits)
        with mode, torch.no_grad():
            model.eval()
            acct = LiveTensors(workspace)
            with acct:
                x = torch.randint(0, cfg.vocab_size, (micro_batch, seq_len))
                y = torch.randint(0, cfg.vocab_size, (micro_batch, seq_len))
                model(x, y)
                del x, y
            gc.collect()
            probe = LiveTensors(workspace)
            with probe:
                attention_logit_maxima(model, torch.randint(0, cfg.vocab_size, (1, seq_len)))
        del model
        gc.collect()
        _EVAL_CACHE[key] = (acct.peak, probe.peak)
    return _EVAL_CACHE[key]


def trace_step(
    cfg: ModelConfig,
    micro_batch: int,
    seq_len: int,
    dtype: torch.dtype,
    layers: int,
    target: str = "cuda",
    grads_exist: bool = True,
    whole_logits: bool = False,
    fp8: str = "off",
) -> Trace:
    """Every traced phase of a micro batch (train, eval, probe), of the model as it trains
    (`fp8`: train.fp8's recipe)."""
    train, forward = trace_train(
        cfg, micro_batch, seq_len, dtype, layers, target, grads_exist, whole_logits, fp8
    )
    evaluation, probe = trace_eval(cfg, micro_batch, seq_len, dtype, target, whole_logits, fp8)
    return Trace(train, forward, evaluation, probe)
