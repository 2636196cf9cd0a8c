#!/usr/bin/env python
"""`python tools/benchmark.py --help`; the program is pretrain/cli/benchmark.py (installed: pretrain-benchmark)."""

import sys

from pretrain.cli.benchmark import main

if __name__ == "__main__":
    sys.exit(main())
