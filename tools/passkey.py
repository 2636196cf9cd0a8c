#!/usr/bin/env python
"""`python tools/passkey.py --help`; the program is pretrain/cli/passkey.py (installed: pretrain-passkey)."""

import sys

from pretrain.cli.passkey import main

if __name__ == "__main__":
    sys.exit(main())
