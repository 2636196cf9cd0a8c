#!/usr/bin/env python
"""The GPU acceptance run (`make gpu-check`); `--cpu-smoke` runs its code on CPU.

The program is pretrain/cli/gpu_check.py (the stages: pretrain/gpucheck/); see
docs/gpu_check.md.
"""

import sys

from pretrain.cli.gpu_check import main

if __name__ == "__main__":
    sys.exit(main())
