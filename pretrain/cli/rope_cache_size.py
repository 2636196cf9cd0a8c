"""RoPE cos/sin cache memory against context length and rotary fraction.

    python tools/rope_cache_size.py                        # head_dim 256 (the paper's Figure 1)
    python tools/rope_cache_size.py --preset llama1b --plot rope_cache_llama1b.png
    python tools/rope_cache_size.py --check                # formula vs buffers of built models
    python tools/rope_cache_size.py --kv                   # KV cache, latent, the paper's models
    python tools/rope_cache_size.py --kv --config run.yaml --latent-rank 8,16,32 --plot kv.png

bytes = 2 (cos, sin) x context length x rotary_dims x bytes per element. The model keeps
one fp32 cache shared by all layers; the second table shows a per-layer layout (GPT-NeoX).

--kv: the K+V cache per sequence (2 x layers x KV heads x head_dim x bytes per element per
token), the position-free part of each key, and the MLA-style cache a latent of rank d_kv
per KV head makes of it (MHA2MLA), for full RoPE, a 1/4 and a 1/8 pair selection, 10%% RoPE
and NoPE of each model. The formulas: pretrain/analysis/kv_cache.py.
"""

import argparse
import sys
from pathlib import Path

from pretrain.analysis import kv_cache as kc
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
    models = p.add_mutually_exclusive_group()
    models.add_argument(
        "--preset",
        default=None,
        help=f"take head_dim and layers from a model preset ({', '.join(preset_names())}) "
        f"or a preset YAML path; with --kv a comma-separated list (default "
        f"{','.join(kc.DEFAULT_MODELS)}, the paper's models)",
    )
    models.add_argument(
        "--config",
        default=None,
        metavar="FILE",
        help="a run config (its model section, inherit: resolved) or a model YAML, in place "
        "of --preset",
    )
    p.add_argument(
        "--precision",
        default=None,
        choices=sorted(rc.PRECISION_BYTES),
        help="element type of the cache in the table and plot (default fp32 for the cos/sin "
        "cache: what the model keeps and what the paper plots; bf16 for --kv's K and V)",
    )
    p.add_argument(
        "--seq-lens",
        default=None,
        help="comma-separated context lengths; k = 1024, M = 1024^2 "
        "(default 2k,8k,32k,128k,1M,10M; 4k,32k,128k,1M with --kv)",
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
        "--kv",
        action="store_true",
        help="report the K+V cache per sequence, the position-free part of each key and the "
        "latent (MLA-style) cache instead of the cos/sin tables alone",
    )
    p.add_argument(
        "--latent-rank",
        default=None,
        metavar="D_KV[,D_KV...]",
        help="with --kv: the latent's rank per KV head, d_kv (MHA2MLA's low_rank; a layer's "
        "latent is KV heads x d_kv wide); comma-separated for several (default head_dim / 4, "
        "MHA2MLA's middle choice: 16 at head_dim 64, 32 at 128)",
    )
    p.add_argument(
        "--markdown",
        action="store_true",
        help="with --kv: the tables as markdown (as docs/pair_selection.md shows them)",
    )
    p.add_argument(
        "--plot",
        default=None,
        metavar="PATH",
        help="also write a PNG: log-scale lines of cache bytes against context length "
        "up to the largest --seq-lens, one per fraction (with --kv a panel per model: K+V, "
        "each variant's latent cache at the first --latent-rank, its cos/sin tables)",
    )
    p.add_argument(
        "--check",
        action="store_true",
        help="build every preset in configs/models (or --preset) at several fractions, "
        "on meta and CPU, in fp32 and cast to bf16, and compare the bytes of its "
        "rope buffers with the formula (they must stay fp32); also two pair selections of "
        "each (on meta), and --kv's K+V formula against the bytes our KVCache allocates; "
        "exit 1 on a mismatch",
    )
    args = p.parse_args(argv)

    if args.kv:
        return kv_report(args)
    for flag, value in (("--latent-rank", args.latent_rank), ("--markdown", args.markdown)):
        if value:
            raise ConfigError(f"{flag} goes with --kv; add --kv or leave {flag} out")
    seq_lens = parse_seq_lens(args.seq_lens or ",".join(map(str, rc.DEFAULT_SEQ_LENS)))
    precision = args.precision or "fp32"
    fractions = (
        [rc.parse_fraction(s) for s in args.fractions.split(",") if s.strip()]
        if args.fractions
        else None
    )
    if args.layers is not None and args.layers < 1:
        raise ConfigError(f"--layers={args.layers} must be >= 1")
    if args.head_dim is not None and (args.head_dim < 2 or args.head_dim % 2):
        raise ConfigError(f"--head-dim={args.head_dim} must be an even number >= 2")
    cfg = load_preset(args.preset or args.config) if args.preset or args.config else None
    head_dim = args.head_dim or (cfg.head_dim if cfg else 256)
    layers = args.layers or (cfg.n_layers if cfg else 16)

    if args.check:
        given = args.preset or args.config
        presets = [given] if given else preset_names()
        results = rc.check_presets(presets, fractions or rc.CHECK_FRACTIONS)
        for name in presets:
            results += kc.check_selection_tables(load_preset(name), name)
        kv = [kc.check_kv_cache(load_preset(name), name) for name in presets]
        print(rc.format_check(results))
        print("\n" + kc.format_kv_check(kv))
        ok = all(r.ok for r in results) and all(r.ok for r in kv)
        sys.exit(EXIT_OK if ok else EXIT_FAILED)

    fractions = fractions or list(rc.DEFAULT_FRACTIONS)
    rows = rc.cache_table(head_dim, seq_lens, fractions, precision, layers)
    print(rc.format_cache_table(rows, seq_lens, head_dim, precision, layers, args.units))
    theta = cfg.rope_theta if cfg else 10000.0
    spectra = rc.spectrum_rows(head_dim, theta, fractions)
    print("\n" + rc.format_spectrum_table(spectra, head_dim, theta))
    if args.plot:
        path = rc.plot_cache(head_dim, fractions, precision, layers, max(seq_lens), args.plot)
        print(f"\nwrote {path}")
    return EXIT_OK


def parse_seq_lens(text: str) -> list[int]:
    seq_lens = [rc.parse_seq_len(s) for s in text.split(",") if s.strip()]
    if not seq_lens:
        raise ConfigError("--seq-lens is empty; use e.g. 2k,32k,1M")
    return seq_lens


def kv_report(args: argparse.Namespace) -> int:
    """--kv: each model's tables (pretrain/analysis/kv_cache.py), then the plot."""
    for flag, value in (
        ("--head-dim", args.head_dim),
        ("--layers", args.layers),
        ("--fractions", args.fractions),
        ("--check", args.check),
    ):
        if value:
            raise ConfigError(
                f"{flag} does not go with --kv (it reads every shape from the model and "
                f"compares fixed position variants); leave {flag} out"
            )
    seq_lens = parse_seq_lens(args.seq_lens or ",".join(map(str, kc.DEFAULT_KV_SEQ_LENS)))
    precision = args.precision or "bf16"
    if args.config:
        names = [args.config]
    else:
        names = [n.strip() for n in (args.preset or ",".join(kc.DEFAULT_MODELS)).split(",")]
        names = [n for n in names if n]
    panels = []
    blocks = []
    for name in names:
        cfg = load_preset(name)
        label = name if name in preset_names() else Path(name).stem
        ranks = kc.parse_latent_ranks(args.latent_rank, cfg.head_dim)
        models = [kc.model_kv(c, label, pos) for pos, c in kc.position_variants(cfg)]
        rows = kc.kv_rows(models, seq_lens, ranks, rc.PRECISION_BYTES[precision])
        blocks.append(
            kc.format_kv_tables(cfg, label, rows, seq_lens, precision, args.units, args.markdown)
        )
        panels.append((label, cfg, models))
    print("\n\n".join(blocks))
    if args.plot:
        ranks = kc.parse_latent_ranks(args.latent_rank, 0) if args.latent_rank else [None]
        path = kc.plot_kv(panels, ranks[0], precision, max(seq_lens), args.plot)
        print(f"\nwrote {path}")
    return EXIT_OK
