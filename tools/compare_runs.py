#!/usr/bin/env python
"""`python tools/compare_runs.py --help`; the program is pretrain/cli/compare_runs.py (installed: pretrain-compare-runs)."""

import sys

from pretrain.cli.compare_runs import main

if __name__ == "__main__":
    sys.exit(main())
