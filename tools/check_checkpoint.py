#!/usr/bin/env python
"""`python tools/check_checkpoint.py --help`; the program is pretrain/cli/check_checkpoint.py (installed: pretrain-check-checkpoint)."""

import sys

from pretrain.cli.check_checkpoint import main

if __name__ == "__main__":
    sys.exit(main())
