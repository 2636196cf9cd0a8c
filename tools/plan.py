#!/usr/bin/env python
"""Memory and time plan of a run, traced on fake tensors (no GPU needed).

    python tools/plan.py configs/paper/llama1b_rope10.yaml --gpu h200 --gpus 32
    python tools/plan.py CONFIG --gpu h100 --checkpointing auto
    python tools/plan.py --validate          # the planner against the CPU allocator
    python tools/plan.py --paper             # docs/performance.md's table

The logic lives in pretrain/cli/plan.py (`main`; the planner is pretrain/planner/); see docs/performance.md.
"""

import sys

from pretrain.cli.plan import main

if __name__ == "__main__":
    sys.exit(main())
