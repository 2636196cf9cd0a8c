#!/usr/bin/env python
"""`python tools/frequency_use.py --help`; the program is pretrain/cli/frequency_use.py."""

import sys

from pretrain.cli.frequency_use import main

if __name__ == "__main__":
    sys.exit(main())
