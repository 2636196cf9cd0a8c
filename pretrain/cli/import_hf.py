"""Import a Hugging Face folder back into a toolkit weights folder.

    python tools/import_hf.py --hf exports/pythia1b_rope10 --out runs/imported/pythia1b_rope10
    python tools/evaluate.py --run runs/imported/pythia1b_rope10 --tasks piqa

Reads folders written by tools/export_hf.py (exactly: same weights, same config, same
tokenizer) and native Llama / GPT-NeoX folders (e.g. EleutherAI's Pythia). No code from
the folder is run. Writes the weights, the run config and tokenizer/ (when the folder
has a tokenizer.json), what evaluation and export read.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from pretrain.cli.errors import ArgumentParser, user_errors
from pretrain.errors import UserError
from pretrain.hf.folder import read_hf_folder
from pretrain.weights import save_weights


@user_errors
def main(argv: list[str] | None = None) -> int:
    p = ArgumentParser(
        prog="import_hf.py",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--hf", required=True, help="Hugging Face model folder (config.json + safetensors)"
    )
    p.add_argument("--out", required=True, help="weights folder to write")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")

    out = Path(args.out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UserError(f"{out} exists and is not an empty folder; choose a new one")
    model, tok, _ = read_hf_folder(args.hf)
    save_weights(model, out)
    if tok is not None:
        tok.save(out / "tokenizer")
    print(
        f"imported {args.hf} ({model.cfg.n_layers} layers, {model.num_params():,} parameters) to {out}"
        + ("" if tok is not None else " (no tokenizer.json in the folder: no tokenizer/)")
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
