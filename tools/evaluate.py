#!/usr/bin/env python
"""`python tools/evaluate.py --help`; the program is pretrain/cli/evaluate.py (installed: pretrain-evaluate)."""

import sys

from pretrain.cli.evaluate import main

if __name__ == "__main__":
    sys.exit(main())
