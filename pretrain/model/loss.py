"""The output layer and cross-entropy, a chunk of tokens at a time: logits are never whole.

`linear_cross_entropy(hidden, weight, targets)` equals
`F.cross_entropy((hidden @ weight.T).float(), targets, ignore_index=-100)` (mean over the
targets that are not ignored), the loss the model computed before, but it never holds the
(tokens x vocab) logits of the whole micro batch: for a 1B model at 131,072 tokens per micro
batch and a 50,304 vocabulary those were 24.6 GiB in fp32, with the log-softmax output and
its incoming and outgoing gradients live at the same time (~74 GiB).

How: the tokens are split into chunks of `chunk_tokens` rows. For each chunk the logits are
computed in the weight's dtype (as `lm_head` did), cast to fp32, and reduced to the loss;
when a gradient is needed, the same chunk's gradients are computed at once (softmax minus
one-hot, scaled by 1 / number of targets): d hidden for the chunk's rows and d weight
accumulated in fp32 (Liger-Kernel's "fused linear cross-entropy" scheme). The backward only
scales them by the incoming gradient. Executed FLOPs are those of the unfused layer
(forward 2NdV, backward 4NdV): nothing is recomputed. Memory: one chunk's logits (fp32 plus
one copy in the compute dtype), d hidden (the size of hidden) and an fp32 d weight (V x d).

Numerics: in fp32 the result equals the unfused loss to rounding (tests: <= 1e-6 on the
loss and on both gradients). In bf16 the logits of each row are the same bf16 matmul
results as before; the loss is computed in fp32 as before; d weight is accumulated over
chunks in fp32 from per-chunk bf16 products, then rounded to bf16 (the unfused path rounds
one bf16 matmul over all tokens): its error against an fp64 reference is 1.2-1.35x the
unfused path's, both below bf16's epsilon (tests: <= 1.5x); d hidden is the same bf16
matmul per row as before.

`backend`: "chunked" (this file, any device) or "liger" (liger-kernel's fused Triton kernel,
CUDA only; on CPU tensors, or when liger-kernel is not installed, the chunked path runs).
The config chooses it (`train.loss_backend`, default "chunked"). Liger is opt-in: its bf16
gradients accumulate differently, it is not checked here (no GPU), and the planner
(pretrain/planner/) traces the chunked path's memory.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100
# Bytes of fp32 logits one chunk may hold: 1,024 tokens of a 50,304 vocabulary (206 MB),
# matmuls of 1024 x d x 50304, large enough for a GPU to run at full speed.
CHUNK_LOGIT_BYTES = 256 * 2**20


def default_chunk_tokens(vocab: int, n_tokens: int, budget_bytes: int = CHUNK_LOGIT_BYTES) -> int:
    """Tokens per chunk: the largest power of two whose fp32 logits fit in `budget_bytes`,
    at least 128 and at most `n_tokens` (a small vocabulary runs in one chunk)."""
    rows = max(128, 2 ** int(math.log2(max(1, budget_bytes // (4 * vocab)))))
    return max(1, min(rows, n_tokens))


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx, hidden, weight, targets, ignore_index, chunk, need_grad_h, need_grad_w, z_loss
    ):
        d = hidden.shape[-1]
        h = hidden.reshape(-1, d)
        t = targets.reshape(-1)
        n_rows = h.shape[0]
        valid = t != ignore_index
        count = valid.sum().to(torch.float32)  # 0 targets -> 0/0 = nan, as F.cross_entropy
        safe_t = torch.where(valid, t, torch.zeros_like(t))
        total = torch.zeros((), dtype=torch.float32, device=h.device)
        z_total = torch.zeros((), dtype=torch.float32, device=h.device)
        grad_h = torch.empty_like(h) if need_grad_h else None
        # Written by the first chunk (no zero fill: V x d fp32, 100 MB at 50k x 512), then
        # accumulated into.
        grad_w = (
            torch.empty(weight.shape, dtype=torch.float32, device=h.device) if need_grad_w else None
        )
        scale = count.reciprocal()
        # Every matmul here, the gradients' too, runs in the dtype F.linear(h, weight) computes
        # in: under autocast with fp32 weights that is bf16, as autograd through F.linear would
        # do (fp32 matmuls there ran 10x slower on an H200), and the weight is cast once, not
        # once per chunk.
        cdt = compute_dtype(h, weight)
        w = weight.to(cdt)
        for start in range(0, n_rows, chunk):
            end = min(start + chunk, n_rows)
            hc, tc, vc = h[start:end].to(cdt), safe_t[start:end, None], valid[start:end]
            logits = F.linear(hc, w).float()  # (c, V) in the compute dtype, then fp32
            picked = logits.gather(1, tc)[:, 0]
            # log-sum-exp in place (torch.logsumexp would allocate a second (c, V) buffer):
            # logits <- exp(logits - max), then lse = log(sum) + max.
            top = logits.amax(dim=-1, keepdim=True)
            sums = logits.sub_(top).exp_().sum(dim=-1)
            lse = sums.log() + top[:, 0]
            total = total + torch.where(vc, lse - picked, 0.0).sum()
            if z_loss:
                z_total = z_total + torch.where(vc, lse * lse, 0.0).sum()
            if grad_h is None and grad_w is None:
                continue
            # d(sum of losses / count) / d logits = (softmax - one_hot) / count on kept rows;
            # the z-loss adds z * 2 lse * softmax / count.
            g = logits.div_(sums[:, None])
            if z_loss:
                g.mul_((1.0 + 2.0 * z_loss * lse)[:, None])
            g.scatter_add_(1, tc, torch.full_like(picked[:, None], -1.0))
            g.mul_(torch.where(vc, scale, 0.0)[:, None])
            g = g.to(cdt)
            if grad_h is not None:
                if grad_h.dtype == cdt:
                    torch.mm(g, w, out=grad_h[start:end])
                else:  # fp32 hidden states under autocast
                    grad_h[start:end] = torch.mm(g, w)
            if grad_w is not None:
                if g.dtype == torch.float32:
                    if start == 0:
                        torch.mm(g.t(), hc, out=grad_w)
                    else:
                        grad_w.addmm_(g.t(), hc)
                elif start == 0:
                    grad_w.copy_(torch.mm(g.t(), hc))
                else:
                    grad_w.add_(torch.mm(g.t(), hc))
            del g, logits
        ctx.save_for_backward(grad_h, grad_w)
        ctx.shapes = (hidden.shape, hidden.dtype, weight.dtype)
        z_term = z_loss * z_total / count
        ctx.mark_non_differentiable(z_term)
        return total / count + z_term, z_term

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out, _grad_z_term):
        grad_h, grad_w = ctx.saved_tensors
        shape, h_dtype, w_dtype = ctx.shapes
        dh = dw = None
        if grad_h is not None and ctx.needs_input_grad[0]:
            dh = grad_h.mul_(grad_out.to(h_dtype)).view(shape)
        if grad_w is not None and ctx.needs_input_grad[1]:
            dw = grad_w.mul_(grad_out).to(w_dtype)
        return dh, dw, None, None, None, None, None, None


def compute_dtype(hidden: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """The dtype `F.linear(hidden, weight)` multiplies in here: autocast's where it is on for
    the tensors' device, else the inputs' promoted dtype."""
    device = hidden.device.type
    if torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return torch.promote_types(hidden.dtype, weight.dtype)


def _liger_available(t: torch.Tensor) -> bool:
    if t.device.type != "cuda":
        return False
    try:
        import liger_kernel.transformers.functional  # noqa: F401
    except ImportError:
        return False
    return True


BACKENDS = ("chunked", "liger")


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    ignore_index: int = IGNORE_INDEX,
    chunk_tokens: int | None = None,
    backend: str = "chunked",
    z_loss: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss, z term): the mean cross-entropy (fp32 scalar) of `hidden @ weight.T` against
    `targets`, plus the z term, and the z term alone, detached (0 when `z_loss` is 0).

    hidden: (..., d) final hidden states; weight: (V, d) output matrix (no bias); targets:
    (...) token ids, `ignore_index` = not scored. The cross-entropy equals the unfused
    `F.cross_entropy(F.linear(hidden, weight).float().view(-1, V), targets.view(-1))`.
    The z term (chunked backend only) is z_loss x the mean over scored tokens of
    logsumexp(logits)^2 (PaLM).
    """
    if backend not in BACKENDS:
        raise ValueError(f"train.loss_backend={backend!r} is unknown; use 'chunked' or 'liger'")
    if backend == "liger" and _liger_available(hidden) and not z_loss:
        from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

        d = hidden.shape[-1]
        out = liger_fused_linear_cross_entropy(
            hidden.reshape(-1, d), weight, targets.reshape(-1), ignore_index=ignore_index
        )
        loss = (out[0] if isinstance(out, tuple) else out).float()
        return loss, loss.new_zeros(())
    n_tokens = targets.numel()
    chunk = chunk_tokens or default_chunk_tokens(weight.shape[0], n_tokens)
    grad_on = torch.is_grad_enabled()
    loss, z_term = _ChunkedLinearCrossEntropy.apply(
        hidden,
        weight,
        targets,
        ignore_index,
        chunk,
        grad_on and hidden.requires_grad,
        grad_on and weight.requires_grad,
        float(z_loss),
    )
    return loss, z_term


@torch.no_grad()
def token_losses(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    ignore_index: int = IGNORE_INDEX,
    chunk_tokens: int | None = None,
) -> torch.Tensor:
    """Each target's cross-entropy (fp32, targets' shape; 0 where ignored), a chunk of tokens
    at a time as `linear_cross_entropy`'s forward computes it (the same logits, the same
    log-sum-exp): loss by position costs no second forward and never holds whole logits."""
    d = hidden.shape[-1]
    h, t = hidden.reshape(-1, d), targets.reshape(-1)
    valid = t != ignore_index
    safe_t = torch.where(valid, t, torch.zeros_like(t))
    out = torch.empty(t.shape, dtype=torch.float32, device=h.device)
    chunk = chunk_tokens or default_chunk_tokens(weight.shape[0], t.numel())
    for start in range(0, t.numel(), chunk):
        end = min(start + chunk, t.numel())
        logits = F.linear(h[start:end], weight).float()
        picked = logits.gather(1, safe_t[start:end, None])[:, 0]
        top = logits.amax(dim=-1, keepdim=True)
        lse = logits.sub_(top).exp_().sum(dim=-1).log() + top[:, 0]
        out[start:end] = torch.where(valid[start:end], lse - picked, 0.0)
    return out.view(targets.shape)


def reference_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    ignore_index: int = IGNORE_INDEX,
) -> torch.Tensor:
    """The unfused loss (whole fp32 logits): what the model computed before the chunked one."""
    logits = F.linear(hidden, weight)
    return F.cross_entropy(
        logits.float().view(-1, logits.size(-1)), targets.reshape(-1), ignore_index=ignore_index
    )
