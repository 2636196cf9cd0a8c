#!/usr/bin/env python
"""`python tools/rope_cache_size.py --help`; the program is pretrain/cli/rope_cache_size.py (installed: pretrain-rope-cache-size)."""

import sys

from pretrain.cli.rope_cache_size import main

if __name__ == "__main__":
    sys.exit(main())
