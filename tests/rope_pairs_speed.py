"""What a pair selection (model.rope_pairs) costs against full RoPE on this CPU, side by side
in one run: `python tests/rope_pairs_speed.py` (docs/pair_selection.md quotes what it prints).

Two measurements, one thread, CPU time (time.process_time), after a warmup:

- the training step (forward + backward) of a small model of llama1b's heads (head_dim 64,
  4 query heads on 1 KV head, 2 layers, 512 tokens): full RoPE, a selection of 1/4 of the
  pairs that differs per layer and KV head (`usage`-like: drawn at random), the highest 1/4
  (`high`), and NeoX 25% partial RoPE for scale. The models share one set of weights; each
  round times every model once in a fresh random order and divides by the round's median
  (machine noise lands on all alike); a model's figure is the median over rounds, relative to
  full RoPE's.
- apply_rope alone, forward + backward, on q and k of the full llama1b layer (32 query heads,
  8 KV heads, head_dim 64, 2048 tokens): full RoPE against the masked rotation of a selection.
"""

from __future__ import annotations

import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pretrain.model import Transformer  # noqa: E402
from pretrain.model.config import ModelConfig  # noqa: E402
from pretrain.model.rope import apply_rope, rope_cache  # noqa: E402

SHAPE = dict(
    vocab_size=512,
    pad_vocab_to_multiple=1,
    n_layers=2,
    d_model=256,
    n_heads=4,
    n_kv_heads=1,
    d_ff=688,
    max_seq_len=512,
)
ROUNDS, WARMUP, SEED = 40, 3, 0


def random_selection(layers: int, kv: int, pairs: int, keep: int, seed: int) -> list:
    rng = random.Random(seed)
    return [[sorted(rng.sample(range(pairs), keep)) for _ in range(kv)] for _ in range(layers)]


def models() -> dict[str, Transformer]:
    full = ModelConfig(**SHAPE)
    P = full.head_dim // 2
    configs = {
        "full RoPE": full,
        "1/4 of pairs, per layer and KV head": full.replace(
            rope_pairs={"selected": random_selection(2, 1, P, P // 4, SEED)}
        ),
        "1/4 of pairs, highest (high)": full.replace(
            rope_pairs={"strategy": "high", "pairs": P // 4}
        ),
        "NeoX 25% partial RoPE": full.replace(rope_fraction=0.25),
    }
    torch.manual_seed(SEED)
    base = Transformer(full)
    out = {}
    for name, cfg in configs.items():
        m = Transformer(cfg)
        m.load_state_dict(base.state_dict())
        out[name] = m.train()
    return out


def step_ratios() -> dict[str, float]:
    nets = models()
    g = torch.Generator().manual_seed(SEED)
    x = torch.randint(0, 512, (1, 512), generator=g)

    def step(m: Transformer) -> float:
        t0 = time.process_time()
        m(x, x).loss.backward()
        dt = time.process_time() - t0
        m.zero_grad(set_to_none=True)
        return dt

    for m in nets.values():
        for _ in range(WARMUP):
            step(m)
    ratios: dict[str, list[float]] = {name: [] for name in nets}
    rng, order = random.Random(SEED), list(nets)
    for _ in range(ROUNDS):
        rng.shuffle(order)
        times = {name: step(nets[name]) for name in order}
        middle = statistics.median(times.values())
        for name, t in times.items():
            ratios[name].append(t / middle)
    base = statistics.median(ratios["full RoPE"])
    return {name: statistics.median(r) / base for name, r in ratios.items()}


def rope_alone() -> tuple[float, float]:
    """(seconds of full RoPE, of the masked rotation): medians of 40 interleaved rounds."""
    H, KV, D, T = 32, 8, 64, 2048
    g = torch.Generator().manual_seed(SEED)
    q = torch.randn(1, T, H, D, generator=g).transpose(1, 2).requires_grad_()
    k = torch.randn(1, T, KV, D, generator=g).transpose(1, 2).requires_grad_()
    cos, sin = rope_cache(T, D, 10000.0)
    sel = random_selection(1, KV, D // 2, D // 8, SEED)[0]
    keep_k = torch.zeros(KV, 1, D, dtype=torch.bool)
    for h, kept in enumerate(sel):
        keep_k[h, 0, kept] = keep_k[h, 0, [j + D // 2 for j in kept]] = True
    keep_q = keep_k.repeat_interleave(H // KV, dim=0)
    cases = {"full": (None, None), "masked": (keep_q, keep_k)}
    samples: dict[str, list[float]] = {name: [] for name in cases}
    rng, order = random.Random(SEED), list(cases)
    for i in range(ROUNDS + 1):  # round 0 warms up
        rng.shuffle(order)
        for name in order:
            kq, kk = cases[name]
            t0 = time.process_time()
            (apply_rope(q, cos, sin, kq).sum() + apply_rope(k, cos, sin, kk).sum()).backward()
            dt = time.process_time() - t0
            q.grad = k.grad = None
            if i:
                samples[name].append(dt)
    return statistics.median(samples["full"]), statistics.median(samples["masked"])


def main() -> None:
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, 1 thread, CPU time, {ROUNDS} rounds")
    print("training step (forward + backward), llama1b heads, 2 layers, 512 tokens:")
    for name, ratio in step_ratios().items():
        print(f"  {name:<38} {ratio:.3f} x full RoPE")
    full, masked = rope_alone()
    print("apply_rope alone on q and k of a llama1b layer (32 / 8 heads x 64, 2048 tokens):")
    print(f"  full RoPE {1e3 * full:.1f} ms, masked (1/8 of pairs) {1e3 * masked:.1f} ms: "
          f"{masked / full:.3f} x")  # fmt: skip


if __name__ == "__main__":
    main()
