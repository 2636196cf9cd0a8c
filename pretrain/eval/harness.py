"""lm-eval-harness adapter: our checkpoints as a harness model named `pretrain`.

    import pretrain.eval.harness                      # registers the model name
    lm_eval.simple_evaluate(model="pretrain", model_args="path=runs/x,step=12000", tasks=[...])

or `PretrainLM(model=..., tokenizer=...)` around a model already in memory.

It reads only a weights folder (pretrain.weights: weights, config, tokenizer/); no DeepSpeed.
Built on the harness's `TemplateLM`, which turns (context, continuation) strings into token
requests exactly as its Hugging Face model does (trailing spaces of the context move to the
continuation; an empty context is conditioned on the end-of-document token). What is ours:

- loglikelihood: requests sorted longest first and packed into batches under a token
  budget (right padding is harmless to a causal model: padded positions come after every
  scored one); requests sharing context + continuation[:-1] run once, which makes
  multiple-choice tasks with one-token answers several times cheaper. The output layer
  runs on the scored positions only. A request longer than the context is cut on the left
  exactly as the harness's `hf` backend cuts it (the last max_length + 1 tokens of context +
  continuation, less the last, are the input; the continuation stays whole); the requests so
  cut are counted (`requests_truncated`) and a warning says so once per call. A continuation
  that alone is longer than max_length cannot be scored by any truncation (the `hf` backend
  asserts): `ContinuationTooLong` names the tasks, before anything runs.
- loglikelihood_rolling: the harness's disjoint rolling windows of max_seq_len tokens.
- generate_until: greedy (or sampled) decoding with our KV cache; prompts of equal length
  run as one batch (the model has no padding mask, so unequal ones run apart). The prompt's
  last position alone goes through the output layer at prefill, and stop strings are
  checked on a decoded tail per token (pretrain/eval/stops.py), not on the whole output.

bf16 on a GPU, fp32 on CPU, by default. Log-probabilities are taken in fp32 over the
model's full (padded) vocabulary, as training's loss and the exported Hugging Face model do.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from lm_eval import utils as lm_utils
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import Collator
from tqdm import tqdm

from pretrain.config import ConfigError, DataConfig, RopeScalingConfig, from_dict
from pretrain.data.documents import DocumentSwitches
from pretrain.data.tokenizer import load_tokenizer
from pretrain.errors import UserError
from pretrain.eval.lengths import parse_rope_scaling
from pretrain.eval.stops import StopStrings
from pretrain.model.attention import KVCache
from pretrain.model.transformer import Transformer
from pretrain.weights import find_weights_dir, load_weights

log = logging.getLogger(__name__)

TOKENIZER_DIR = "tokenizer"
_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}

# (cache key, context tokens, continuation tokens), as TemplateLM builds them
Request = tuple[Any, list[int], list[int]]


class ContinuationTooLong(UserError, ValueError):
    """Loglikelihood requests whose continuation alone is longer than max_length.

    `tasks` maps each task (None: requests without one) to (such requests, its requests,
    the longest continuation in tokens).
    """

    def __init__(self, max_length: int, tasks: dict[str | None, tuple[int, int, int]]) -> None:
        self.max_length = max_length
        self.tasks = tasks
        parts = [
            f"{'task ' + t if t else 'requests'}: {n} of {total}, the longest {longest} tokens"
            for t, (n, total, longest) in tasks.items()
        ]
        it = "them" if len(tasks) > 1 else "it"
        super().__init__(
            f"continuations longer than max_length={max_length} tokens ({'; '.join(parts)}): no "
            f"truncation of the context makes them fit, and lm-eval's hf backend refuses them too; "
            f"evaluate with a model of a longer context, or leave {it} out of --tasks"
        )


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def resolve_dtype(dtype: str | torch.dtype | None, device: str | torch.device) -> torch.dtype:
    """'auto' (or None): bf16 on a GPU, fp32 elsewhere."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype in (None, "auto"):
        return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    if dtype not in _DTYPES:
        raise ConfigError(f"dtype={dtype!r} is unknown; use auto, float32, bfloat16 or float16")
    return _DTYPES[dtype]


def load_checkpoint(
    path: str | Path,
    step: int | None = None,
    device: str | None = None,
    dtype: str | torch.dtype | None = "auto",
    tokenizer: str | None = None,
):
    """(model, tokenizer, weights folder, full config) of a run folder / checkpoint / weights folder."""

    device = device or default_device()
    wdir = find_weights_dir(path, step)
    model, config = load_weights(wdir, device=device, dtype=resolve_dtype(dtype, device))
    spec = tokenizer or wdir / TOKENIZER_DIR
    if tokenizer is None and not Path(spec).is_dir():
        raise ConfigError(
            f"{wdir} has no {TOKENIZER_DIR}/ folder; pass tokenizer=SPEC "
            f"(e.g. the tokenizer.json the run was trained with)"
        )
    return model, load_tokenizer(spec), wdir, config


@register_model("pretrain")
class PretrainLM(TemplateLM):
    """A checkpoint of this toolkit as an lm-eval-harness model.

    model_args (strings from the harness's command line are converted):
        path        run folder (newest checkpoint), checkpoint folder or weights folder
        step        checkpoint step to load instead of the newest
        device      cuda, cuda:1, cpu (default: cuda when available)
        dtype       auto (bf16 on GPU, fp32 on CPU), float32, bfloat16, float16
        batch_size  most sequences per forward (default 64)
        max_batch_tokens  most tokens (padded) per forward; bounds activation memory
                    (default 65536 on GPU, 16384 on CPU)
        max_length  context window (default: the model's max_seq_len; longer runs RoPE and
                    NoPE models past their training length, learned positions refuse)
        rope_scaling  RoPE scaling at evaluation: TYPE:FACTOR (yarn:4) or a mapping
        tokenizer   tokenizer spec overriding the checkpoint's tokenizer/ folder

    In a training process (pretrain/train/evaluators/downstream.py): `model=` the training
    model itself, `distributed=True` to take this process's rank in the initialized process
    group (the harness then scores every world_size-th document here and gathers the
    results on rank 0), `progress=False` to keep progress bars off the training log.
    """

    backend = "causal"
    # Scored positions per output-layer chunk: bounds the (positions x vocabulary) log-probs.
    score_chunk_rows = 4096

    def __init__(
        self,
        path: str | None = None,
        step: int | str | None = None,
        device: str | None = None,
        dtype: str | None = "auto",
        batch_size: int | str = 64,
        max_batch_tokens: int | str | None = None,
        max_length: int | str | None = None,
        tokenizer: Any = None,
        model: Transformer | None = None,
        max_batch_size: int | None = None,
        rope_scaling: Any = None,
        documents: DocumentSwitches | None = None,
        distributed: bool = False,
        progress: bool = True,
        **kwargs: Any,
    ) -> None:
        super().__init__()
        self.progress = progress
        if distributed and torch.distributed.is_available() and torch.distributed.is_initialized():
            self._rank = torch.distributed.get_rank()
            self._world_size = torch.distributed.get_world_size()
        if kwargs:
            log.warning("pretrain model: ignoring unknown model_args %s", sorted(kwargs))
        if model is None:
            if path is None:
                raise ConfigError("the pretrain model needs path=RUN_OR_WEIGHTS_FOLDER (or model=)")
            model, tok, self.weights_dir, config = load_checkpoint(
                path,
                int(step) if step not in (None, "") else None,
                device,
                dtype,
                tokenizer if isinstance(tokenizer, str) else None,
            )
            if tokenizer is not None and not isinstance(tokenizer, str):
                tok = tokenizer
            if documents is None:  # score as the run trained (data.document_mask, ...)
                data = from_dict(DataConfig, config.get("data"), "data")
                documents = DocumentSwitches.of(data, tok.eod_id, f"{path}'s tokenizer")
        else:
            if tokenizer is None:
                raise ConfigError("PretrainLM(model=...) also needs tokenizer=")
            tok = tokenizer
            self.weights_dir = None
        self.model = model.eval()
        self.tok = tok
        # A request with the prefix (end-of-document) token is two documents to a model that
        # trained with document masking or position reset; it gets the same inputs here.
        self.documents = documents or DocumentSwitches()
        param = next(model.parameters())
        self._device = param.device
        self.batch_size = self._positive_int(batch_size, "batch_size", default=64)
        if max_batch_size:
            self.batch_size = min(self.batch_size, int(max_batch_size))
        on_gpu = self.device.type == "cuda"
        self.max_batch_tokens = self._positive_int(
            max_batch_tokens, "max_batch_tokens", default=65536 if on_gpu else 16384
        )
        if rope_scaling not in (None, "", "none"):
            scaling = (
                rope_scaling
                if isinstance(rope_scaling, RopeScalingConfig)
                else parse_rope_scaling(str(rope_scaling), "rope_scaling")
            )
            model.set_rope_scaling(scaling)
        # RoPE and NoPE models run past max_seq_len (evaluation past the training length);
        # learned positions stop at their table.
        default, table = model.cfg.max_seq_len, model.max_positions
        self._max_length = int(max_length) if max_length else default
        if table is not None and self._max_length > table:
            raise ConfigError(
                f"max_length={self._max_length} is past the model's learned position table "
                f"({table} positions, model.learned_pos_emb); use at most {table}"
            )
        self.vocab_size = model.cfg.padded_vocab_size
        # Loglikelihood requests scored, and those whose context was cut on the left.
        self.requests_scored = 0
        self.requests_truncated = 0
        self._request_tasks: list[str | None] | None = None

    @staticmethod
    def _positive_int(value: Any, name: str, default: int) -> int:
        if value in (None, "", "auto"):
            return default
        try:
            value = int(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{name}={value!r} must be a positive integer") from None
        if value <= 0:
            raise ConfigError(f"{name}={value} must be a positive integer")
        return value

    # ------------------------------------------------------------------ what TemplateLM needs
    @property
    def eot_token_id(self) -> int:
        eod = self.tok.eod_id
        if eod is None:
            raise ConfigError(
                f"tokenizer {self.tok.identifier} has no end-of-document token; the "
                f"harness needs one to score text without a context (rolling "
                f"loglikelihood, empty contexts). Character-level models: use "
                f"tools/evaluate.py --val for bits per character"
            )
        return eod

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def tokenizer_name(self) -> str:
        return self.tok.identifier

    def tok_encode(
        self, string: str, add_special_tokens: bool | None = None, **kwargs
    ) -> list[int]:
        # Our tokenizers never add special tokens; documents were trained with only an
        # end-of-document token between them, which is the harness's prefix token here.
        return self.tok.encode(string)

    def tok_decode(self, tokens: Sequence[int]) -> str:
        return self.tok.decode(list(tokens))

    # ------------------------------------------------------------------ ranks
    # What lm-eval's evaluate() needs to shard documents over the ranks and gather them.
    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.world_size == 1:
            return tensor
        parts = [torch.empty_like(tensor) for _ in range(self.world_size)]
        torch.distributed.all_gather(parts, tensor.contiguous())
        return torch.stack(parts) if tensor.dim() == 0 else torch.cat(parts)

    def gather_object(self, obj: Any, dst: int = 0) -> list[Any] | None:
        if self.world_size == 1:
            return [obj]
        # all_gather_object rather than gather_object: NCCL has no gather of objects.
        parts: list[Any] = [None] * self.world_size
        torch.distributed.all_gather_object(parts, obj)
        return parts if self.rank == dst else None

    def barrier(self) -> None:
        if self.world_size > 1:
            torch.distributed.barrier()

    # ------------------------------------------------------------------ scoring
    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        # TemplateLM tokenizes the requests in order: remember their tasks for error messages.
        self._request_tasks = [getattr(r, "task_name", None) for r in requests]
        try:
            return super().loglikelihood(requests, disable_tqdm=disable_tqdm or not self.progress)
        finally:
            self._request_tasks = None

    def _check_lengths(self, requests: list[Request]) -> None:
        """Refuse continuations longer than max_length (naming their tasks); count and report,
        once, the requests whose context is cut on the left."""
        tasks = (
            self._request_tasks
            if self._request_tasks and len(self._request_tasks) == len(requests)
            else [None] * len(requests)
        )
        too_long: dict[str | None, list[int]] = {}
        for task, (_, _, cont) in zip(tasks, requests, strict=True):
            if not cont:
                raise ValueError("a loglikelihood request has an empty continuation")
            if len(cont) > self.max_length:
                too_long.setdefault(task, []).append(len(cont))
        if too_long:
            totals: dict[str | None, int] = {}
            for task in tasks:
                totals[task] = totals.get(task, 0) + 1
            raise ContinuationTooLong(
                self.max_length,
                {t: (len(lengths), totals[t], max(lengths)) for t, lengths in too_long.items()},
            )
        cut = sum(len(ctx) + len(cont) > self.max_length + 1 for _, ctx, cont in requests)
        self.requests_scored += len(requests)
        self.requests_truncated += cut
        if cut:
            log.warning(
                "%d of %d loglikelihood requests are longer than max_length=%d tokens: their "
                "contexts are cut on the left to the last %d tokens of context + continuation, "
                "as lm-eval's hf backend does",
                cut,
                len(requests),
                self.max_length,
                self.max_length + 1,
            )

    def _token_batches(self, ordered: list[int], requests: list[Request]) -> Iterator[list[int]]:
        """Batches of request indices (sorted longest first) under batch_size sequences and
        max_batch_tokens padded tokens."""
        batch: list[int] = []
        width = 0
        for i in ordered:
            n = min(len(requests[i][1]) + len(requests[i][2]) - 1, self.max_length)
            w = max(width, n)
            if batch and (
                len(batch) >= self.batch_size or w * (len(batch) + 1) > self.max_batch_tokens
            ):
                yield batch
                batch, w = [], n
            batch.append(i)
            width = w
        if batch:
            yield batch

    def _loglikelihood_tokens(
        self, requests: list[Request], disable_tqdm: bool = False, **kwargs: Any
    ) -> list[tuple[float, bool]]:
        """(sum of log-probs of the continuation, whether it is the greedy one) per request.

        Requests whose context + continuation[:-1] are equal (multiple choice with one-token
        answers, or one text split at different places) have the same input and differ only
        in the last token scored: one forward serves the whole group. Its representative is
        the member with the longest continuation; a member's score is the representative's
        token log-probs over the member's span but the last, plus the log-prob of the
        member's last token, read from the full row of the last position.
        """
        self._check_lengths(requests)
        groups: dict[tuple[int, ...], list[int]] = {}
        for i, (_, ctx, cont) in enumerate(requests):
            groups.setdefault(tuple(ctx + cont[:-1]), []).append(i)
        reps = [max(members, key=lambda i: len(requests[i][2])) for members in groups.values()]
        members_of = dict(zip(reps, groups.values(), strict=True))
        # Longest first: the first batch is the largest, so memory problems show at once.
        reps.sort(key=lambda i: (-len(requests[i][1]) - len(requests[i][2]), i))
        results: list[tuple[float, bool] | None] = [None] * len(requests)
        pbar = tqdm(total=len(requests), disable=disable_tqdm, desc="loglikelihood requests")
        for batch in self._token_batches(reps, requests):
            for rep, (score_lp, greedy_ok, last_lp, last_greedy) in zip(
                batch, self._score_batch([requests[i] for i in batch]), strict=True
            ):
                for m in members_of[rep]:
                    key, _, cont = requests[m]
                    n = len(cont)
                    # Positions before the last predict the same tokens for every member.
                    prefix = float(score_lp[len(score_lp) - n : -1].sum()) if n > 1 else 0.0
                    greedy = bool(greedy_ok[len(greedy_ok) - n : -1].all()) if n > 1 else True
                    answer = (prefix + float(last_lp[cont[-1]]), greedy and last_greedy == cont[-1])
                    results[m] = answer
                    if key is not None:
                        self.cache_hook.add_partial("loglikelihood", key, answer)
                    pbar.update(1)
        pbar.close()
        return results  # type: ignore[return-value]

    @torch.no_grad()
    def _score_batch(self, batch: list[Request]):
        """One forward over a batch; per request: (token log-probs of its continuation,
        whether each is the argmax, the full log-prob row of its last position, its argmax).

        The output layer and log-softmax run on the scored positions only, score_chunk_rows
        at a time, so memory stays bounded for rolling windows of thousands of positions.
        """
        chunk_rows = self.score_chunk_rows
        inputs, spans = [], []
        for _, ctx, cont in batch:
            inp = (ctx + cont)[-(self.max_length + 1) :][:-1]
            inputs.append(inp)
            spans.append((len(inp) - len(cont), len(inp)))  # positions predicting cont
        padded = torch.zeros(len(inputs), max(len(x) for x in inputs), dtype=torch.long)
        for i, inp in enumerate(inputs):
            padded[i, : len(inp)] = torch.tensor(inp, dtype=torch.long)
        targets = torch.tensor([t for _, _, cont in batch for t in cont], dtype=torch.long)
        sizes = [b - a for a, b in spans]
        is_last = torch.zeros(len(targets), dtype=torch.bool)
        is_last[torch.tensor(sizes).cumsum(0) - 1] = True  # each request's last scored position
        head = self.model.lm_head
        padded = padded.to(self.device)
        hidden = self.model.hidden_states(padded, **self.documents.model_inputs(padded))
        picked = torch.cat([hidden[i, a:b] for i, (a, b) in enumerate(spans)])
        del hidden
        target_dev = targets.to(self.device)
        tok_lp, tok_greedy, last_rows = [], [], []
        for start in range(0, len(picked), chunk_rows):
            lp = F.log_softmax(head(picked[start : start + chunk_rows]).float(), dim=-1)
            tgt = target_dev[start : start + chunk_rows]
            tok_lp.append(lp.gather(-1, tgt[:, None])[:, 0])
            tok_greedy.append(lp.argmax(-1) == tgt)
            last_rows.append(lp[is_last[start : start + chunk_rows].to(self.device)])
        tok_lp_all = torch.cat(tok_lp).double().cpu()
        greedy_all = torch.cat(tok_greedy).cpu()
        last = torch.cat(last_rows)
        last_argmax = last.argmax(-1).cpu()
        last = last.cpu()
        return list(
            zip(
                tok_lp_all.split(sizes),
                greedy_all.split(sizes),
                last,
                last_argmax.tolist(),
                strict=True,
            )
        )

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        disable_tqdm = disable_tqdm or not self.progress
        windows: list[Request] = []
        counts = []
        for (text,) in tqdm(
            [r.args for r in requests], disable=disable_tqdm, desc="rolling windows"
        ):
            ws = [
                lm_utils.make_disjoint_window(w)
                for w in lm_utils.get_rolling_token_windows(
                    token_list=self.tok_encode(text),
                    prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length,
                    context_len=1,
                )
            ]
            windows.extend((None, ctx, cont) for ctx, cont in ws)
            counts.append(len(ws))
        scores = self._loglikelihood_tokens(windows, disable_tqdm=disable_tqdm)
        out, i = [], 0
        for req, n in zip(requests, counts, strict=True):
            total = sum(s for s, _ in scores[i : i + n])
            i += n
            out.append(total)
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return out

    # ------------------------------------------------------------------ generation
    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        collator = Collator(
            [r.args for r in requests],
            sort_fn=lambda a: (-len(self.tok_encode(a[0])), a[0]),
            group_by="gen_kwargs",
            group_fn=lambda a: a[1],
        )
        results: list[str] = []
        pbar = tqdm(total=len(requests), disable=disable_tqdm, desc="generate_until requests")
        for chunk in collator.get_batched(n=self.batch_size):
            gen_kwargs = dict(chunk[0][1])
            until = gen_kwargs.pop("until", None) or []
            until = [until] if isinstance(until, str) else list(until)
            max_new = int(gen_kwargs.pop("max_gen_toks", 256))
            do_sample = bool(gen_kwargs.pop("do_sample", False))
            temperature = float(gen_kwargs.pop("temperature", 0.0)) if do_sample else 0.0
            budget = self.max_length - max_new
            if budget < 1:
                raise ValueError(
                    f"max_gen_toks={max_new} leaves no room for a prompt in "
                    f"max_length={self.max_length}"
                )
            prompts = [self.tok_encode(ctx)[-budget:] or [self.prefix_token_id] for ctx, _ in chunk]
            # Equal-length prompts share a forward; the chunk is sorted by length already.
            start = 0
            while start < len(prompts):
                end = start + 1
                while end < len(prompts) and len(prompts[end]) == len(prompts[start]):
                    end += 1
                for (ctx, _), text in zip(
                    chunk[start:end],
                    self._generate(prompts[start:end], max_new, until, temperature),
                    strict=True,
                ):
                    results.append(text)
                    self.cache_hook.add_partial("generate_until", (ctx, chunk[0][1]), text)
                    pbar.update(1)
                start = end
        pbar.close()
        return collator.get_original(results)

    @torch.no_grad()
    def _generate(
        self, prompts: list[list[int]], max_new: int, until: list[str], temperature: float
    ) -> list[str]:
        """Continue equal-length prompts until a stop string, end of document or max_new."""
        eod = self.tok.eod_id
        cfg = self.model.cfg
        B, T = len(prompts), len(prompts[0])
        p = next(self.model.parameters())
        cache = KVCache(cfg, B, T + max_new, device=self.device, dtype=p.dtype)
        x = torch.tensor(prompts, dtype=torch.long, device=self.device)
        logits = self.model.lm_head(self.model.hidden_states(x, kv_cache=cache)[:, -1])
        new: list[list[int]] = [[] for _ in range(B)]
        done = [False] * B
        stops = StopStrings(self.tok.decode, until)  # decodes a tail per token, not all
        for _ in range(max_new):
            logits = logits.float()
            logits[:, cfg.vocab_size :] = float("-inf")  # never the embedding's padding ids
            if temperature > 0:
                nxt = torch.multinomial(torch.softmax(logits / temperature, -1), 1)
            else:
                nxt = logits.argmax(-1, keepdim=True)
            for i, t in enumerate(nxt[:, 0].tolist()):
                if done[i]:
                    continue
                if t == eod:
                    done[i] = True
                    continue
                new[i].append(t)
                if stops.found(new[i]):
                    done[i] = True
            if all(done) or cache.pos >= cache.max_len:
                break
            logits = self.model(nxt, kv_cache=cache)[:, -1]
        out = []
        for ids in new:
            text = self.tok.decode(ids)
            for s in until:
                if s:
                    text = text.split(s)[0]
            out.append(text)
        return out
