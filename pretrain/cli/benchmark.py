"""Benchmarks: `python tools/benchmark.py AREA [options]`; AREA is model, peers, data, train, optim, reads, eval, checkpoint or comms.

Each area lives in pretrain/benchmarks/AREA.py with `add_arguments(parser)` and `run(args)`.
Speed is measured here, never in tests: ratios on CPU, absolute figures on a GPU.
"""

import argparse
import importlib

from pretrain.cli.errors import ArgumentParser, user_errors

AREAS = {
    "model": "forward+backward step time across rope_theta and rope fraction; GPU tokens/s, MFU",
    "peers": "training step vs transformers and litgpt (same weights), llama1b and pythia1b: fp32, bf16 weights, autocast, eager and compiled, MFU",
    "data": "tokenization throughput per worker; projected hours for 100B tokens",
    "train": "training tokens/s and MFU through the DeepSpeed engine",
    "optim": "optimizer step time and share of a step per optim.impl (DeepSpeed's, torch foreach, fused)",
    "reads": "cold-cache samples/s and page-cache growth per sample per data.read_mode (large sparse data)",
    "eval": "lm-eval adapter requests/s (loglikelihood and rolling)",
    "checkpoint": "training stall of a checkpoint save, synchronous vs checkpoint.async",
    "comms": "the planner's communication time model vs DeepSpeed's logged collectives on CPU ranks (gloo's alpha and bandwidth fitted here)",
}


@user_errors
def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="area", required=True, metavar="AREA")
    modules = {}
    for name, help_text in AREAS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        modules[name] = importlib.import_module(f"pretrain.benchmarks.{name}")
        modules[name].add_arguments(p)
    args = parser.parse_args(argv)
    modules[args.area].run(args)
    return 0
