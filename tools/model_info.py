#!/usr/bin/env python
"""`python tools/model_info.py --help`; the program is pretrain/cli/model_info.py (installed: pretrain-model-info)."""

import sys

from pretrain.cli.model_info import main

if __name__ == "__main__":
    sys.exit(main())
