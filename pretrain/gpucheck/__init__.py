"""The GPU acceptance run: `make gpu-check` (tools/gpu_check.py, pretrain/cli/gpu_check.py).

Everything the docs claim about a GPU is derived on CPU (memory traced on fake
tensors, FLOPs counted, the attention kernel from documented constraints, speed as ratios
on CPU). This package measures those claims on one GPU in stages that each fit in one
10-minute command, and flags every figure more than 5% off:

    runner.py     the stages within a call's budget; resume at the next call
    stages.py     the stage list and budgets; the GPU tests and peers stages
    memory.py     planner vs torch.cuda's allocator, speed and MFU, compile on/off
    training.py   real Trainer steps measured by one callback (memory, time, profiler split)
    kernels.py    the SDPA kernel per attention shape, measured vs predicted
    numerics.py   bf16 on the GPU vs fp32 on CPU
    science.py    the RoPE-theta study against the seed paper (--science)
    sizes.py      the GPU sizes and the CPU smoke's tiny ones; the stages' Context
    results.py    results.json, its schema, checks; report.py: markdown and summary

What the benchmarks measure as well (the peers race, the RoPE variants, the measured
training run) comes from pretrain/measure/, below both: this package never imports
pretrain/benchmarks/.

`--cpu-smoke` runs the same stage functions at tiny sizes on CPU (tests/test_gpu_check.py),
so only the CUDA calls themselves go unexercised between GPU loans.
"""
