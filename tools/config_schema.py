#!/usr/bin/env python
"""`python tools/config_schema.py --help`; the program is pretrain/cli/config_schema.py (installed: pretrain-config-schema)."""

import sys

from pretrain.cli.config_schema import main

if __name__ == "__main__":
    sys.exit(main())
