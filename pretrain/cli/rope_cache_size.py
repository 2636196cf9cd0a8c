"""RoPE cos/sin cache memory against context length and rotary fraction.

    python tools/rope_cache_size.py                        # head_dim 256 (the paper's Figure 1)
    python tools/rope_cache_size.py --preset llama1b --plot rope_cache_llama1b.png
    python tools/rope_cache_size.py --check                # formula vs buffers of built models

bytes = 2 (cos, sin) x context length x rotary_dims x bytes per element. The model keeps
one fp32 cache shared by all layers; the second table shows a per-layer layout (GPT-NeoX).
"""

import argparse
import sys

from pretrain.analysis import rope_cache as rc
from pretrain.analysis.presets import load_preset, preset_names
from pretrain.cli.errors import ArgumentParser, user_errors
from pretrain.config import ConfigError
from pretrain.exit_codes import EXIT_FAILED, EXIT_OK


@user_errors
def main(argv: list[str] | None = None) -> int:
    p = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--head-dim",
        type=int,
        default=None,
        help="dims per attention head (default 256, the paper's Pythia-1B; "
        "or the preset's when --preset is given)",
    )
    p.add_argument(
        "--preset",
        default=None,
        help=f"take head_dim and layers from a model preset ({', '.join(preset_names())}) "
        f"or a preset YAML path",
    )
    p.add_argument(
        "--precision",
        default="fp32",
        choices=sorted(rc.PRECISION_BYTES),
        help="element type of the cache in the table and plot (default fp32: what the "
        "model keeps and what the paper plots; bf16 shows a half-size cache)",
    )
    p.add_argument(
        "--seq-lens",
        default=",".join(map(str, rc.DEFAULT_SEQ_LENS)),
        help="comma-separated context lengths; k = 1024, M = 1024^2 "
        "(default 2k,8k,32k,128k,1M,10M)",
    )
    p.add_argument(
        "--fractions",
        default=None,
        help="comma-separated rotary fractions as 0.1 or 10%% (default 0,1,4,10,25,50,75,100%% "
        "for the table; 0,10,25,50,100%% for --check)",
    )
    p.add_argument(
        "--layers",
        type=int,
        default=None,
        help="layers for the per-layer layout figure (default 16, or the preset's)",
    )
    p.add_argument(
        "--units",
        choices=("auto", "bytes"),
        default="auto",
        help="table cells as KiB/MiB/GiB (auto) or exact integer bytes",
    )
    p.add_argument(
        "--plot",
        default=None,
        metavar="PATH",
        help="also write a PNG: log-scale lines of cache bytes against context length "
        "up to the largest --seq-lens, one per fraction",
    )
    p.add_argument(
        "--check",
        action="store_true",
        help="build every preset in configs/models (or --preset) at several fractions, "
        "on meta and CPU, in fp32 and cast to bf16, and compare the bytes of its "
        "rope buffers with the formula (they must stay fp32); exit 1 on a mismatch",
    )
    args = p.parse_args(argv)

    seq_lens = [rc.parse_seq_len(s) for s in args.seq_lens.split(",") if s.strip()]
    fractions = (
        [rc.parse_fraction(s) for s in args.fractions.split(",") if s.strip()]
        if args.fractions
        else None
    )
    if args.layers is not None and args.layers < 1:
        raise ConfigError(f"--layers={args.layers} must be >= 1")
    if args.head_dim is not None and (args.head_dim < 2 or args.head_dim % 2):
        raise ConfigError(f"--head-dim={args.head_dim} must be an even number >= 2")
    cfg = load_preset(args.preset) if args.preset else None
    head_dim = args.head_dim or (cfg.head_dim if cfg else 256)
    layers = args.layers or (cfg.n_layers if cfg else 16)

    if args.check:
        presets = [args.preset] if args.preset else preset_names()
        results = rc.check_presets(presets, fractions or rc.CHECK_FRACTIONS)
        print(rc.format_check(results))
        sys.exit(EXIT_OK if all(r.ok for r in results) else EXIT_FAILED)

    fractions = fractions or list(rc.DEFAULT_FRACTIONS)
    rows = rc.cache_table(head_dim, seq_lens, fractions, args.precision, layers)
    print(rc.format_cache_table(rows, seq_lens, head_dim, args.precision, layers, args.units))
    theta = cfg.rope_theta if cfg else 10000.0
    spectra = rc.spectrum_rows(head_dim, theta, fractions)
    print("\n" + rc.format_spectrum_table(spectra, head_dim, theta))
    if args.plot:
        path = rc.plot_cache(head_dim, fractions, args.precision, layers, max(seq_lens), args.plot)
        print(f"\nwrote {path}")
