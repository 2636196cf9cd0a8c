#!/usr/bin/env python
"""`python tools/prepare_data.py --help`; the program is pretrain/cli/prepare_data.py (installed: pretrain-prepare-data)."""

import sys

from pretrain.cli.prepare_data import main

if __name__ == "__main__":
    sys.exit(main())
