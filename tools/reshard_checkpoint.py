#!/usr/bin/env python
"""`python tools/reshard_checkpoint.py --help`; the program is pretrain/cli/reshard_checkpoint.py (installed: pretrain-reshard-checkpoint)."""

import sys

from pretrain.cli.reshard_checkpoint import main

if __name__ == "__main__":
    sys.exit(main())
