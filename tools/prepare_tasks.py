#!/usr/bin/env python
"""Prepare the evaluation tasks from local files (offline machines); `--help` for the options.

python tools/prepare_tasks.py --data-dir ../shared/data/evals --output DIR --skip-missing
"""

import sys

from pretrain.cli.prepare_tasks import main

if __name__ == "__main__":
    sys.exit(main())
