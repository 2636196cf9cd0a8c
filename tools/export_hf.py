#!/usr/bin/env python
"""Export a checkpoint to a Hugging Face folder; `--help` for the options.

    python tools/export_hf.py --run runs/llama1b_rope10 --out exports/llama1b_rope10 --check

Every config in configs/ exports: the native transformers class where it holds the model
exactly (LlamaForCausalLM, GPTNeoXForCausalLM), else RopeLM remote code written into the
folder (AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True)). See docs/hf.md.
"""

import sys

from pretrain.cli.export_hf import main

if __name__ == "__main__":
    sys.exit(main())
