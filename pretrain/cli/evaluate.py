"""Evaluate a checkpoint with lm-eval-harness (the paper's suite) and/or validation loss.

    python tools/evaluate.py --run runs/llama1b_rope10                      # newest checkpoint, online
    python tools/evaluate.py --run runs/llama1b_rope10 --step 12000 --data-dir ../shared/data/evals
    python tools/evaluate.py --run runs/x --tasks arc_easy,piqa --limit 100 --batch-size 32
    python tools/evaluate.py --run runs/char_theta --tasks none --val       # bits per character
    python tools/evaluate.py --run runs/x --tasks none --val --per-position # loss by position
    python tools/evaluate.py --run runs/x --tasks none --lengths 1x,2x,4x,8x --rope-scaling yarn:8

Writes RUN/eval/<step>/lm_eval_results.json (the harness's JSON), valid_metrics.json (--val),
positions.json/.csv/.png (--per-position, --lengths: loss by position, curve) and results.md (the paper's accuracy table, LAMBADA perplexities, validation figures).
Suite `paper`: arc_challenge, arc_easy, logiqa, lambada_openai, lambada_standard, piqa, sciq,
pubmedqa, winogrande, wsc273. See docs/evaluation.md.
"""

import argparse
import logging
import os

from pretrain.cli.errors import ArgumentParser, user_errors


def parse_args(argv=None) -> argparse.Namespace:
    p = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_checkpoint_arguments("evaluate")
    p.add_argument(
        "--tasks",
        default="paper",
        help="'paper' (the paper's suite), comma-separated harness task names, or 'none' "
        "(only --val); default: paper",
    )
    p.add_argument(
        "--limit",
        type=float,
        default=None,
        help="only the first N documents of each task (or a fraction < 1): for smoke tests; "
        "the numbers are then not comparable with published ones",
    )
    p.add_argument(
        "--data-dir",
        default=None,
        help="offline: read each task's data from the original files in this folder "
        "(e.g. ../shared/data/evals) instead of the Hugging Face hub",
    )
    p.add_argument(
        "--skip-missing",
        action="store_true",
        help="skip tasks that cannot run here instead of stopping: with --data-dir, tasks whose "
        "files are missing; and tasks with answers (continuations) longer than the model's "
        "context. Shown as – in the table, with the reason in results.md",
    )
    p.add_argument(
        "--num-fewshot",
        type=int,
        default=None,
        help="few-shot examples per prompt (default: each task's own, 0 for the paper suite)",
    )
    p.add_argument(
        "--bootstrap-iters",
        type=int,
        default=None,
        help="bootstrap resamples for the stderr of perplexity (default: the harness's, 100000; "
        "fewer is faster, 0 skips stderrs)",
    )
    p.add_argument(
        "--batch-size", type=int, default=64, help="most sequences per forward pass (default 64)"
    )
    p.add_argument(
        "--max-length",
        type=int,
        default=None,
        help="context window in tokens (default: the model's max_seq_len; RoPE and NoPE models "
        "may go past it, learned positions may not)",
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
        "--val",
        action="store_true",
        help="also compute validation loss, perplexity, bits per token and per byte (per "
        "character for character-level models) on the run's validation split",
    )
    p.add_argument(
        "--val-data",
        action="append",
        default=None,
        help="with --val: a prepared dataset folder or PREFIX to use instead of the run's "
        "data.valid (repeatable)",
    )
    p.add_argument(
        "--val-samples",
        type=int,
        default=256,
        help="with --val: number of validation sequences (default 256)",
    )
    p.add_argument(
        "--per-position",
        action="store_true",
        help="with --val: also the loss at each position of the validation samples (every "
        "position below 256, then 4 buckets per octave), from the same forward passes: "
        "positions.json, .csv and a PNG curve",
    )
    p.add_argument(
        "--lengths",
        default=None,
        metavar="LIST",
        help="evaluate loss by position at these window lengths: multiples of the training "
        "length (1x,2x,4x,8x) and/or token counts (8192), on the validation documents read in "
        "order; each length scores the same --val-samples x training-length tokens. RoPE, "
        "partial RoPE and NoPE run at any length; learned positions stop at their table",
    )
    p.add_argument(
        "--stride",
        type=int,
        default=None,
        help="with --lengths: slide each window by this many tokens, scoring only the tokens "
        "past the overlap (each with at least length - stride tokens of context); default: "
        "disjoint windows (stride = length)",
    )
    p.add_argument(
        "--rope-scaling",
        default=None,
        metavar="SPEC",
        help="evaluate with this RoPE scaling on the rotary dims: TYPE:FACTOR with TYPE linear, "
        "ntk, yarn or dynamic_ntk (e.g. yarn:4), or a mapping of model.rope_scaling's fields "
        "('{type: yarn, factor: 4, original_max_seq_len: 2048})",
    )
    p.add_argument("--output", default=None, help="output folder (default: RUN/eval/<step tag>)")
    return p.parse_args(argv)


@user_errors
def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    if args.data_dir:
        # Offline: nothing may reach for the hub (set before the datasets library is imported).
        os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from pretrain.eval.checkpoint_eval import evaluate

    limit = args.limit
    if limit is not None and limit >= 1:
        limit = int(limit)
    outcome = evaluate(
        args.run,
        step=args.step,
        tasks=args.tasks,
        limit=limit,
        data_dir=args.data_dir,
        output=args.output,
        batch_size=args.batch_size,
        device=args.device,
        dtype=args.dtype,
        num_fewshot=args.num_fewshot,
        skip_missing=args.skip_missing,
        val=args.val,
        val_data=args.val_data,
        val_samples=args.val_samples,
        max_length=args.max_length,
        bootstrap_iters=args.bootstrap_iters,
        per_position=args.per_position,
        lengths=args.lengths,
        stride=args.stride,
        rope_scaling=args.rope_scaling,
    )
    print((outcome.output_dir / "results.md").read_text())
    for f in outcome.files:
        print(f"wrote {f}")
    return 0
