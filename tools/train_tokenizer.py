#!/usr/bin/env python
"""`python tools/train_tokenizer.py --help`; the program is pretrain/cli/train_tokenizer.py (installed: pretrain-train-tokenizer)."""

import sys

from pretrain.cli.train_tokenizer import main

if __name__ == "__main__":
    sys.exit(main())
