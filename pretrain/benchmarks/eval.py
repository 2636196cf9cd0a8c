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

`--generate N` also times N generate_until requests (greedy, until "\n\n", --gen-tokens
tokens at most) and two of their parts against what they replaced, paired in one run:
the prefill's output layer on the prompt's last position against the full forward's
logits of every position, and the stop-string check on a decoded tail
(pretrain/eval/stops.py) against decoding the whole continuation at every token.
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
from pretrain.config import load_model_config
from pretrain.data.tokenizer import load_tokenizer
from pretrain.eval.stops import StopStrings
from pretrain.hf import export_hf
from pretrain.model import Transformer
from pretrain.model.attention import KVCache

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
    p.add_argument(
        "--generate",
        type=int,
        default=0,
        metavar="N",
        help="also time N generate_until requests and their prefill and stop check (default 0)",
    )
    p.add_argument(
        "--gen-tokens", type=int, default=128, help="generate_until max_gen_toks (default 128)"
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
        cfg = cfg.replace(**over)
    torch.manual_seed(0)
    return Transformer(cfg)


def _time(fn, reqs):
    fn(reqs[: max(1, len(reqs) // 10)])  # warm-up: allocator, kernels, lazy imports
    w0, c0 = time.perf_counter(), time.process_time()
    fn(reqs)
    return time.perf_counter() - w0, time.process_time() - c0


def run(args: argparse.Namespace) -> None:
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
    if args.generate:
        figures["generate"] = _generation(args, lm, ll, sync)
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2) + "\n")
        print(f"wrote {args.json}")


def _paired(a, b, rounds: int = 7) -> tuple[float, float, float]:
    """(median s of a, median s of b, median per-round b / a), interleaved, CPU clock."""
    import statistics

    ta, tb = [], []
    for r in range(rounds):
        for fn, out in ((a, ta), (b, tb)) if r % 2 else ((b, tb), (a, ta)):
            c0 = time.process_time()
            fn()
            out.append(time.process_time() - c0)
    ratio = statistics.median(y / x for x, y in zip(ta, tb, strict=True))
    return statistics.median(ta), statistics.median(tb), ratio


def _generation(args, lm, ll, sync) -> dict:
    """generate_until requests/s, and its prefill and stop check against what they replaced."""
    from lm_eval.api.instance import Instance

    gen = {"until": ["\n\n"], "max_gen_toks": args.gen_tokens}
    reqs = [Instance("generate_until", {}, (r.args[0], gen), i) for i, r in enumerate(ll)]
    reqs = reqs[::4][: args.generate]  # one per context
    wall, cpu = _time(sync(lm.generate_until), reqs)
    texts = sync(lm.generate_until)(reqs)
    print(
        f"pretrain generate_until {len(reqs) / wall:9.1f} req/s  (wall {wall:.2f} s, cpu "
        f"{cpu:.2f} s; {args.gen_tokens} tokens at most, {sum(map(len, texts))} characters)"
    )
    out = {"requests_per_s": len(reqs) / wall, "wall_s": wall, "cpu_s": cpu}
    # Prefill: the prompt's last position through the output layer, or every position.
    model, budget = lm.model, lm.max_length - args.gen_tokens
    prompt = torch.tensor([lm.tok_encode(reqs[0].args[0])[-budget:]], device=lm.device)
    p = next(model.parameters())

    def prefill(last_only: bool):
        def run():
            with torch.no_grad():
                for _ in range(4):
                    cache = KVCache(model.cfg, 1, prompt.shape[1] + 1, lm.device, p.dtype)
                    if last_only:
                        model.lm_head(model.hidden_states(prompt, kv_cache=cache)[:, -1])
                    else:
                        model(prompt, kv_cache=cache)[:, -1]

        return run

    new, old, ratio = _paired(prefill(True), prefill(False))
    print(
        f"prefill of a {prompt.shape[1]}-token prompt: last position {1e3 * new / 4:.1f} ms, "
        f"every position (before) {1e3 * old / 4:.1f} ms: before / now {ratio:.2f}x"
    )
    out["prefill"] = {"tokens": prompt.shape[1], "now_s": new / 4, "before_s": old / 4}
    out["prefill"]["before_over_now"] = ratio
    # Stop check: every prefix of real continuations (the text's own tokens), as the
    # generation loop calls it, until it stops or reaches --gen-tokens.
    streams = [lm.tok_encode(r.args[0])[: args.gen_tokens] for r in reqs]
    until = gen["until"]

    def check(tail: bool):
        def run():
            for ids in streams:
                stops = StopStrings(lm.tok.decode, until)
                for n in range(1, len(ids) + 1):
                    if tail:
                        hit = stops.found(ids[:n])
                    else:
                        hit = any(s in lm.tok.decode(ids[:n]) for s in until)
                    if hit:
                        break

        return run

    new, old, ratio = _paired(check(True), check(False))
    tokens = sum(map(len, streams))
    print(
        f"stop-string check over {tokens} tokens: tail {1e6 * new / tokens:.1f} us/token, whole "
        f"output (before) {1e6 * old / tokens:.1f} us/token: before / now {ratio:.2f}x"
    )
    out["stop_check"] = {"tokens": tokens, "now_s": new, "before_s": old}
    out["stop_check"]["before_over_now"] = ratio
    return out
