"""Model on a CUDA GPU: bf16 through the flash/cuDNN SDPA kernels. Skipped without a GPU."""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from pretrain.config import ModelConfig
from pretrain.model import KVCache, Transformer

pytestmark = pytest.mark.gpu


def _cfg(**kw) -> ModelConfig:
    base = dict(
        vocab_size=1000,
        n_layers=2,
        d_model=256,
        n_heads=4,
        n_kv_heads=2,
        d_ff=512,
        max_seq_len=512,
        rope_fraction=0.25,
        qk_norm=True,
    )
    base.update(kw)
    return ModelConfig(**base)


@pytest.mark.parametrize("block", ["sequential", "parallel"])
def test_bf16_flash_attention_matches_fp32(block):
    torch.manual_seed(0)
    ref = Transformer(_cfg(block=block)).cuda()
    x = torch.randint(0, 1000, (2, 512), device="cuda")
    with torch.no_grad():
        want = ref(x).float()
        model = Transformer(_cfg(block=block)).cuda()
        model.load_state_dict(ref.state_dict())
        model.to(torch.bfloat16)
        assert model.rope.cos.dtype == torch.float32
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION]):
            got = model(x).float()
    assert (got - want).abs().max() < 0.1 * want.abs().max()


def test_kv_cache_on_gpu_matches_full_forward():
    torch.manual_seed(0)
    model = Transformer(_cfg()).cuda().eval()
    x = torch.randint(0, 1000, (2, 64), device="cuda")
    with torch.no_grad():
        full = model(x)
        cache = KVCache(model.cfg, 2, device="cuda")
        parts = [model(x[:, :40], kv_cache=cache)] + [
            model(x[:, i : i + 1], kv_cache=cache) for i in range(40, 64)
        ]
    torch.testing.assert_close(torch.cat(parts, 1), full, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rmsnorm_fused_cuda_kernel_matches_the_cpu_paths(dtype):
    """On CUDA RMSNorm runs torch's fused kernel (F.rms_norm): forward and gradients against
    the CPU training path (closed-form backward) on the same inputs: fp32 within 1e-6 of the
    largest value, bf16 within one bf16 rounding; the output stays in x's dtype under
    autocast (no fp32 q/k)."""
    from pretrain.model.norm import rms_norm

    g = torch.Generator().manual_seed(0)
    x0 = torch.randn(4, 256, 512, generator=g).to(dtype)
    w0 = 1 + 0.2 * torch.randn(512, generator=g)
    g0 = torch.randn(4, 256, 512, generator=g).to(dtype)
    out = []
    for device in ("cpu", "cuda"):
        # detach(): on CPU .to() returns x0 itself, and a grad-requiring x0 would make the
        # CUDA copy a non-leaf without .grad.
        x = x0.detach().to(device).requires_grad_()
        w = w0.detach().to(device).requires_grad_()
        with torch.autocast(device, dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
            y = rms_norm(x, w, 1e-5)
        y.backward(g0.to(device))
        assert y.dtype == dtype
        out.append([t.detach().float().cpu() for t in (y, x.grad, w.grad)])
    tol = 1e-6 if dtype == torch.float32 else 2**-7
    for cpu, cuda in zip(*out, strict=True):
        assert (cuda - cpu).abs().max() <= tol * cpu.abs().max()
