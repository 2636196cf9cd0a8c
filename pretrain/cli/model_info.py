"""Parameters, rotary dims, FLOPs per token and RoPE cache bytes of a model preset.

    python tools/model_info.py --preset llama1b
    python tools/model_info.py --preset pythia1b_paper --set rope_fraction=0.1
    python tools/model_info.py --all            # one markdown row per preset

The model is built on the meta device (instant, no memory), so the counts are its own.
"""

import argparse
import json
from dataclasses import asdict
from pathlib import Path

from pretrain.analysis.model_info import format_info, format_info_table, model_info
from pretrain.analysis.presets import load_preset, preset_names
from pretrain.cli.errors import ArgumentParser, user_errors
from pretrain.config import add_set_option


@user_errors
def main(argv: list[str] | None = None) -> int:
    p = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--preset",
        help=f"model preset: {', '.join(preset_names())}, or a path to a "
        f"YAML of model fields (or a run config with a model: section)",
    )
    p.add_argument(
        "--all", action="store_true", help="every preset in configs/models, as a markdown table"
    )
    add_set_option(p, "rope_fraction=0.1")
    p.add_argument(
        "--seq-len",
        type=int,
        default=None,
        help="sequence length for FLOPs per token (default: the model's max_seq_len)",
    )
    p.add_argument("--json", action="store_true", help="print the figures as JSON instead")
    args = p.parse_args(argv)
    if not args.preset and not args.all:
        p.error("give --preset NAME or --all")
    if args.seq_len is not None and args.seq_len < 1:
        p.error(f"--seq-len={args.seq_len} must be >= 1")
    names = preset_names() if args.all else [args.preset]
    infos = [model_info(load_preset(n, args.overrides), Path(n).stem, args.seq_len) for n in names]
    if args.json:
        print(json.dumps([asdict(i) for i in infos] if args.all else asdict(infos[0]), indent=2))
    elif args.all:
        print(format_info_table(infos))
    else:
        print(format_info(infos[0]))
