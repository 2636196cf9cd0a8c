"""lm-eval adapter throughput: loglikelihood and rolling-loglikelihood requests per second.

    python tools/benchmark.py eval                         # CPU: a small Pythia-shaped model
    python tools/benchmark.py eval --preset pythia1b --device cuda --requests 2000
    python tools/benchmark.py eval --compare-hf            # also the harness's own HF model

Requests are made from real text: multiple-choice-like loglikelihood requests (a context of
20-300 words, four continuations of 1-4 words each, as ARC/PIQA/SciQ send) and rolling
requests over whole documents (as perplexity tasks send). The model is randomly
initialised: speed does not depend on the weights. Times are wall-clock of the adapter's
calls (tokenization, batching, forward, scoring), after one warm-up call; on CPU the
process CPU time is reported too: with --threads 1 requests per CPU-second is the figure
that other jobs on a shared machine do not move.
`--compare-hf` runs the same requests through lm-eval's HFLM on the exported weights
(GPT-NeoX or Llama shapes only), the number to beat.
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path

import torch

from pretrain.analysis.presets import preset_path
from pretrain.config import ModelConfig, load_model_config
from pretrain.model import Transformer

REPO = Path(__file__).resolve().parents[2]
SHARED = REPO.parent / "shared" / "data"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--preset",
        default="pythia1b",
        help="model preset (configs/models); on CPU it is shrunk by --layers/--d-model "
        "unless --full (default pythia1b: GPT-NeoX shape, exportable for --compare-hf)",
    )
    p.add_argument("--full", action="store_true", help="use the preset at full size (GPU)")
    p.add_argument("--layers", type=int, default=4, help="shrunk model: layers (default 4)")
    p.add_argument(
        "--d-model", type=int, default=256, help="shrunk model: width (default 256, 4 heads)"
    )
    p.add_argument(
        "--max-seq-len",
        type=int,
        default=None,
        help="context window (default: the preset's; shrunk: 512)",
    )
    p.add_argument("--requests", type=int, default=400, help="loglikelihood requests (default 400)")
    p.add_argument(
        "--rolling", type=int, default=40, help="rolling-loglikelihood documents (default 40)"
    )
    p.add_argument("--batch-size", type=int, default=64, help="adapter batch size (default 64)")
    p.add_argument(
        "--max-batch-tokens", type=int, default=None, help="adapter token budget per forward"
    )
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument(
        "--dtype", default="auto", help="auto (bf16 on GPU, fp32 on CPU), float32, bfloat16"
    )
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    p.add_argument(
        "--tokenizer",
        default=None,
        help="tokenizer spec (default: the shared GPT-NeoX tokenizer.json, else bytes)",
    )
    p.add_argument(
        "--text",
        default=None,
        help="JSONL with a text field, or a .txt, to build requests from (default: shared "
        "FineWeb-Edu sample, else the Python standard library's sources)",
    )
    p.add_argument(
        "--compare-hf",
        action="store_true",
        help="also time lm-eval's HFLM on the same requests and weights (exported to HF)",
    )
    p.add_argument("--seed", type=int, default=0, help="request sampling seed")
    p.add_argument("--json", default=None, help="also write the figures to this JSON file")


def _texts(path: str | None) -> list[str]:
    if path is None:
        default = SHARED / "webtext" / "fineweb_edu_10BT_150docs.jsonl"
        if default.is_file():
            path = str(default)
    if path is None:
        import sysconfig

        files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[:200]
        return [f.read_text(errors="ignore") for f in files]
    p = Path(path)
    if p.suffix == ".jsonl":
        return [json.loads(line)["text"] for line in p.open() if line.strip()]
    return [t for t in p.read_text().split("\n\n") if t.strip()]


def _requests(texts: list[str], n: int, rolling: int, seed: int):
    from lm_eval.api.instance import Instance

    rng = random.Random(seed)
    words = [t.split() for t in texts if len(t.split()) > 40]
    ll = []
    while len(ll) < n:
        w = rng.choice(words)
        k = rng.randint(20, min(300, len(w) - 5))
        ctx = " ".join(w[:k])
        for _ in range(4):  # four choices of one context, like a multiple-choice question
            j = rng.randint(0, len(w) - 5)
            ll.append(
                Instance(
                    "loglikelihood",
                    {},
                    (ctx, " " + " ".join(w[j : j + rng.randint(1, 4)])),
                    len(ll),
                )
            )
    docs = rng.sample(texts, min(rolling, len(texts)))
    roll = [Instance("loglikelihood_rolling", {}, (d,), i) for i, d in enumerate(docs)]
    return ll[:n], roll


def _model(args):

    cfg = load_model_config(preset_path(args.preset))
    over = {}
    if not args.full:
        over = dict(
            n_layers=args.layers,
            d_model=args.d_model,
            n_heads=4,
            n_kv_heads=None,
            d_ff=4 * args.d_model,
            max_seq_len=512,
        )
    if args.max_seq_len:
        over["max_seq_len"] = args.max_seq_len
    if over:
        from dataclasses import asdict

        d = asdict(cfg)
        d.update(over)
        cfg = ModelConfig(**d)
    torch.manual_seed(0)
    return Transformer(cfg)


def _time(fn, reqs):
    fn(reqs[: max(1, len(reqs) // 10)])  # warm-up: allocator, kernels, lazy imports
    w0, c0 = time.perf_counter(), time.process_time()
    fn(reqs)
    return time.perf_counter() - w0, time.process_time() - c0


def run(args: argparse.Namespace) -> None:
    from pretrain.data.tokenizer import load_tokenizer
    from pretrain.eval.harness import PretrainLM, default_device, resolve_dtype

    if args.threads:
        torch.set_num_threads(args.threads)
    device = args.device or default_device()
    dtype = resolve_dtype(args.dtype, device)
    tok_spec = args.tokenizer or (
        str(SHARED / "tokenizers" / "gpt-neox-20b_tokenizer.json")
        if (SHARED / "tokenizers").is_dir()
        else "bytes"
    )
    tok = load_tokenizer(tok_spec)
    model = _model(args)
    if model.cfg.vocab_size < tok.vocab_size:
        raise SystemExit(
            f"the preset's vocab_size {model.cfg.vocab_size} is below the tokenizer's "
            f"{tok.vocab_size}; pass a matching --tokenizer"
        )
    model = model.to(device=device, dtype=dtype).eval()
    lm = PretrainLM(
        model=model,
        tokenizer=tok,
        batch_size=args.batch_size,
        max_batch_tokens=args.max_batch_tokens,
    )
    ll, roll = _requests(_texts(args.text), args.requests, args.rolling, args.seed)
    n_ll_tokens = sum(len(tok.encode(r.args[0] + r.args[1])) for r in ll)
    n_roll_tokens = sum(len(tok.encode(r.args[0])) for r in roll)
    print(
        f"model: {args.preset}{'' if args.full else ' (shrunk)'} {model.num_params() / 1e6:.1f}M params, "
        f"{model.cfg.n_layers} layers, d {model.cfg.d_model}, max_seq_len {model.cfg.max_seq_len}, "
        f"{device} {str(dtype).replace('torch.', '')}, threads {torch.get_num_threads()}"
    )
    print(
        f"requests: {len(ll)} loglikelihood ({n_ll_tokens} tokens), {len(roll)} rolling ({n_roll_tokens} tokens)"
    )
    figures = {
        "device": device,
        "dtype": str(dtype),
        "params": model.num_params(),
        "preset": args.preset,
        "full": args.full,
    }

    def report(name, kind, n, tokens, wall, cpu):
        figures[f"{name}/{kind}"] = {
            "requests_per_s": n / wall,
            "tokens_per_s": tokens / wall,
            "wall_s": wall,
            "cpu_s": cpu,
            "requests_per_cpu_s": n / cpu,
        }
        extra = f"; per CPU-second {n / cpu:.1f} req, cpu {cpu:.2f} s" if device == "cpu" else ""
        print(
            f"{name:8s} {kind:14s} {n / wall:9.1f} req/s {tokens / wall:11.0f} tok/s  (wall {wall:.2f} s{extra})"
        )

    def sync(fn):
        def wrapped(reqs):
            out = fn(reqs, disable_tqdm=True)
            if device.startswith("cuda"):
                torch.cuda.synchronize()
            return out

        return wrapped

    runners = [("pretrain", lm)]
    if args.compare_hf:
        from lm_eval.models.huggingface import HFLM
        from transformers import PreTrainedTokenizerFast

        from pretrain.hf import export_hf

        if tok.kind != "hf":
            raise SystemExit("--compare-hf needs a Hugging Face tokenizer.json (--tokenizer)")
        tmp = tempfile.mkdtemp(prefix="bench_eval_hf_")
        export_hf(model.float().cpu(), tmp, dtype=dtype)
        model.to(device=device, dtype=dtype)
        hf_tok = PreTrainedTokenizerFast(tokenizer_file=tok_spec, eos_token=tok.eod_token)
        hf = HFLM(
            pretrained=tmp,
            tokenizer=hf_tok,
            device=device,
            batch_size=args.batch_size,
            dtype=str(dtype).replace("torch.", ""),
            trust_remote_code=True,
        )
        runners.append(("hf", hf))
    for name, obj in runners:
        wall, cpu = _time(sync(obj.loglikelihood), ll)
        report(name, "loglikelihood", len(ll), n_ll_tokens, wall, cpu)
        wall, cpu = _time(sync(obj.loglikelihood_rolling), roll)
        report(name, "rolling", len(roll), n_roll_tokens, wall, cpu)
    if args.compare_hf:
        for kind in ("loglikelihood", "rolling"):
            ratio = (
                figures[f"pretrain/{kind}"]["requests_per_s"]
                / figures[f"hf/{kind}"]["requests_per_s"]
            )
            figures[f"speedup_vs_hf/{kind}"] = ratio
            print(f"pretrain / hf {kind}: {ratio:.2f}x")
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2) + "\n")
        print(f"wrote {args.json}")
