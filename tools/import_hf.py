#!/usr/bin/env python
"""Import a Hugging Face folder (an export of this toolkit, or a native Llama / GPT-NeoX
model) into a weights folder that evaluation and export read; `--help` for the options.

    python tools/import_hf.py --hf exports/llama1b_rope10 --out runs/imported/llama1b_rope10
"""

import sys

from pretrain.cli.import_hf import main

if __name__ == "__main__":
    sys.exit(main())
