#!/usr/bin/env python
"""`python tools/sweep.py --help`; the program is pretrain/cli/sweep.py (installed: pretrain-sweep)."""

import sys

from pretrain.cli.sweep import main

if __name__ == "__main__":
    sys.exit(main())
