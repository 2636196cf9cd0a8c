"""Export a checkpoint to a Hugging Face folder that transformers loads.

    python tools/export_hf.py --run runs/pythia1b_rope10 --out exports/pythia1b_rope10 --check
    python -c "from transformers import AutoModelForCausalLM as M; \\
               M.from_pretrained('exports/pythia1b_rope10', trust_remote_code=True)"

Every model the toolkit trains exports. The target is the native transformers class when
it holds the model exactly (LlamaForCausalLM: sequential RMSNorm SwiGLU with full RoPE;
GPTNeoXForCausalLM: LayerNorm GeLU MHA with full or partial RoPE), and otherwise RopeLM,
a self-contained remote-code model written into the folder (partial RoPE or NoPE on
Llama, the paper's Pythia with RMSNorm and SwiGLU, QK-Norm, learned positions): load it
with trust_remote_code=True. The folder also gets the tokenizer (when it has an exact
Hugging Face form), generation_config.json, and a README.md model card with the run's
training tokens and evaluation results. --check loads the folder with transformers and
compares logits with the toolkit's model.
"""

from __future__ import annotations

import argparse
import logging
import sys

from pretrain.cli.errors import ArgumentParser, user_errors
from pretrain.data.tokenizer import load_tokenizer
from pretrain.hf.card import run_info, write_card
from pretrain.hf.check import DEFAULT_TOLERANCE, check_parity
from pretrain.hf.convert import TARGETS
from pretrain.hf.folder import export_hf
from pretrain.weights import find_weights_dir, load_weights


@user_errors
def main(argv: list[str] | None = None) -> int:
    p = ArgumentParser(
        prog="export_hf.py",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_checkpoint_arguments("export")
    p.add_argument("--out", required=True, help="output folder (new, empty, or an earlier export)")
    p.add_argument(
        "--target",
        choices=("auto", *TARGETS),
        default="auto",
        help="auto (default): the native class when it holds the model exactly, else rope_lm "
        "(remote code); llama / gpt_neox / rope_lm force one",
    )
    p.add_argument(
        "--dtype",
        choices=["float32", "bfloat16", "float16"],
        default="float32",
        help="dtype of the written weights (default float32)",
    )
    p.add_argument(
        "--max-shard-size",
        default="5GB",
        help="largest safetensors file; bigger models are sharded (default 5GB)",
    )
    p.add_argument(
        "--tokenizer",
        default=None,
        help="tokenizer spec to include instead of the checkpoint's tokenizer/ folder "
        "(tokenizer.json, 'bytes', 'chars:vocab.json')",
    )
    p.add_argument(
        "--check",
        action="store_true",
        help="load the export with transformers and compare logits with the toolkit's model",
    )
    p.add_argument(
        "--tolerance",
        type=float,
        default=DEFAULT_TOLERANCE,
        help=f"--check fails above this max |logit difference| (default {DEFAULT_TOLERANCE:g})",
    )
    p.add_argument("--check-device", default="cpu", help="device of --check (default cpu)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")

    import torch

    wdir = find_weights_dir(args.run, args.step)
    model, _ = load_weights(wdir)
    tok = None
    if args.tokenizer:
        tok = load_tokenizer(args.tokenizer)
    elif (wdir / "tokenizer").is_dir():
        tok = load_tokenizer(wdir / "tokenizer")
    info = run_info(wdir)
    export = export_hf(
        model,
        args.out,
        args.target,
        getattr(torch, args.dtype),
        tokenizer=tok,
        max_shard_size=args.max_shard_size,
        run=info,
        provenance={"source": str(wdir.resolve()), "step": info.step},
    )
    kind = "remote code, load with trust_remote_code=True" if export.remote_code else "native"
    print(f"exported {wdir} as {export.class_name} ({kind}) to {export.path}")
    if export.tokenizer_note:
        print(f"note: no tokenizer in the export: {export.tokenizer_note}")
    if not args.check:
        return 0
    report = check_parity(model, export.path, tolerance=args.tolerance, device=args.check_device)
    info.parity = report
    write_card(export, model, tok, info)
    print(
        f"check: max |logit diff| {report['max_logit_diff']:.3g} (full forward), "
        f"{report['max_cached_diff']:.3g} (with the KV cache); greedy {report['greedy_tokens']} tokens "
        f"{'identical' if report['greedy_identical'] else 'DIFFERENT'}; tolerance {args.tolerance:g}"
    )
    if not report["ok"]:  # exit 1, not 2: the export is wrong, not the command line
        print(
            "error: the export differs from the toolkit's model: " + "; ".join(report["problems"]),
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
