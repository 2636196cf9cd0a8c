#!/usr/bin/env python
"""`python tools/study.py --help`; the program is pretrain/cli/study.py (installed: pretrain-study)."""

import sys

from pretrain.cli.study import main

if __name__ == "__main__":
    sys.exit(main())
