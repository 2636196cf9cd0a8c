"""Passkey retrieval: find a 5-digit key hidden in filler text, over prompt lengths x depths.

    python tools/passkey.py --run runs/llama1b_rope10                       # 1x,2x,4x x 5 depths
    python tools/passkey.py --run runs/x --lengths 1x,2x,4x,8x --trials 10 --rope-scaling yarn:4
    python tools/passkey.py --run runs/x --step 12000 --lengths 512,1024,2048 --depths 0,0.5,1

Each prompt (Mohtashami & Jaggi 2023) is filler text ("The grass is green. The sky is blue.
...") with "The pass key is 68048. Remember it. 68048 is the pass key." at a depth (0 = the
start, 1 = right before the question), then "What is the pass key? The pass key is". Prompts
are built here from --seed, sized in tokens of the run's tokenizer: nothing is downloaded.
A trial passes when the first number of the greedy continuation is the key.

Writes RUN/eval/<step>/passkey.json (the grid and every trial), passkey.csv (one row per
cell) and passkey.png (heat map: depth down, length across, accuracy in colour), and prints
the grid as a markdown table. See docs/passkey.md.
"""

import argparse
import datetime as dt
import logging
from pathlib import Path

from pretrain.cli.errors import ArgumentParser, user_errors
from pretrain.config import to_dict
from pretrain.eval.checkpoint_eval import default_output_dir
from pretrain.eval.lengths import LengthError, parse_lengths, parse_rope_scaling
from pretrain.eval.passkey import parse_depths, run_passkey, write_passkey
from pretrain.eval.suite import EvalError
from pretrain.run_layout import CHECKPOINTS_DIR
from pretrain.weights import WeightsError, find_weights_dir


def parse_args(argv=None) -> argparse.Namespace:
    p = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_checkpoint_arguments("evaluate")
    p.add_argument(
        "--lengths",
        default="1x,2x,4x",
        help="prompt lengths in tokens (prompt + answer): multiples of the training length "
        "(train.seq_len, else model.max_seq_len) such as 2x, and/or token counts such as 4096; "
        "default 1x,2x,4x",
    )
    p.add_argument(
        "--depths",
        default="0,0.25,0.5,0.75,1",
        help="where the key goes, as fractions of the filler: 0 = first, 1 = right before the "
        "question; default 0,0.25,0.5,0.75,1",
    )
    p.add_argument(
        "--trials",
        type=int,
        default=5,
        help="prompts per (depth, length) cell, each with its own key; trial t has the same key "
        "in every cell (default 5)",
    )
    p.add_argument(
        "--seed",
        type=int,
        default=0,
        help="seed of the keys: the same seed gives the same prompts (default 0)",
    )
    p.add_argument(
        "--rope-scaling",
        default=None,
        help="evaluate with this RoPE scaling instead of the checkpoint's: TYPE:FACTOR "
        "(linear, ntk, yarn, dynamic_ntk; e.g. yarn:4), a mapping such as "
        "'{type: yarn, factor: 4, original_max_seq_len: 2048}', or none; default: the "
        "checkpoint's own",
    )
    p.add_argument(
        "--device", default=None, help="cuda, cuda:N or cpu (default: cuda when available)"
    )
    p.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16", "float16"],
        help="weights and activations dtype; auto = bfloat16 on GPU, float32 on CPU",
    )
    p.add_argument(
        "--output",
        default=None,
        help="output folder (default: RUN/eval/<step tag>, beside evaluate.py's results)",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p.parse_args(argv)


@user_errors
def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    from pretrain.eval.harness import load_checkpoint  # imports lm_eval: not for --help

    if args.trials < 1:
        raise LengthError(f"--trials {args.trials}: at least 1 trial per cell")
    depths = parse_depths(args.depths)
    scaling = parse_rope_scaling(args.rope_scaling) if args.rope_scaling is not None else None
    try:
        wdir = find_weights_dir(args.run, args.step)
    except WeightsError as e:
        raise EvalError(str(e)) from None
    model, tok, _, config = load_checkpoint(wdir, device=args.device, dtype=args.dtype)
    train_len = (config.get("train") or {}).get("seq_len") or model.cfg.max_seq_len
    lengths = parse_lengths(args.lengths, train_len)
    if args.rope_scaling is not None:
        model.set_rope_scaling(scaling)
    grid = run_passkey(
        model, tok, lengths, depths, args.trials, args.seed, progress=not args.no_progress
    )
    label = (
        wdir.parent.parent.name + "@" + wdir.name
        if wdir.parent.name == CHECKPOINTS_DIR
        else wdir.name
    )
    param = next(model.parameters())
    grid.info.update(
        label=label,
        weights=str(wdir),
        train_len=train_len,
        rope_scaling=to_dict(model.cfg.rope_scaling),
        device=str(param.device),
        dtype=str(param.dtype).removeprefix("torch."),
        date=dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
    )
    files = write_passkey(
        grid, Path(args.output) if args.output else default_output_dir(wdir, scaling)
    )
    print(f"# Passkey retrieval of {label}\n")
    print(f"accuracy (correct/trials), greedy, exact match; {grid.overall:.2f} overall\n")
    print(grid.markdown())
    for f in files:
        print(f"wrote {f}")
    return 0
