"""The transformer: sequential (Llama) or parallel (GPT-J/Pythia) blocks, one class.

Parameter names (used by checkpoints and the Hugging Face converters):
    wte, wpe, blocks.{i}.norm1, blocks.{i}.attn.{qkv,proj,q_norm,k_norm},
    blocks.{i}.norm2, blocks.{i}.mlp.{w_in,w_out}, norm_f, lm_head
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from pretrain.model.attention import Attention, AttentionFn, KVCache, choose_kernel
from pretrain.model.config import ModelConfig, RopeScalingConfig
from pretrain.model.document_attention import DocumentMask
from pretrain.model.loss import IGNORE_INDEX, linear_cross_entropy
from pretrain.model.norm import make_norm
from pretrain.model.pairs import resolve_pairs
from pretrain.model.position import LayerPosition, Positions, attended_pairs


class LossOutput(NamedTuple):
    """What the model returns with targets."""

    loss: torch.Tensor  # mean cross-entropy plus the z term: what the backward differentiates
    z_loss: torch.Tensor  # the z term alone, detached, for logging (0 without z-loss)


# (hidden, output weight, targets, ignore_index, z_loss) -> (loss, detached z term)
LossFn = Callable[..., tuple[torch.Tensor, torch.Tensor]]


class MLP(nn.Module):
    """SwiGLU (w_in holds gate and up, fused) or GeLU."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.swiglu = cfg.mlp == "swiglu"
        width = 2 * cfg.d_ff if self.swiglu else cfg.d_ff
        self.w_in = nn.Linear(cfg.d_model, width, bias=cfg.mlp_bias)
        self.w_out = nn.Linear(cfg.d_ff, cfg.d_model, bias=cfg.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.w_in(x)
        if self.swiglu:
            gate, up = h.chunk(2, dim=-1)
            h = F.silu(gate) * up
        else:
            h = F.gelu(h)
        return self.w_out(h)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, position: LayerPosition | None = None):
        super().__init__()
        self.parallel = cfg.block == "parallel"
        self.norm1 = make_norm(cfg.norm, cfg.d_model, cfg.norm_eps, cfg.norm_bias)
        self.attn = Attention(cfg, position)
        self.norm2 = make_norm(cfg.norm, cfg.d_model, cfg.norm_eps, cfg.norm_bias)
        self.mlp = MLP(cfg)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(
        self,
        x,
        cos,
        sin,
        kv_cache: KVCache | None = None,
        layer: int = 0,
        documents: DocumentMask | None = None,
    ):
        if self.parallel:
            a = self.attn(self.norm1(x), cos, sin, kv_cache, layer, documents)
            return x + self.drop(a) + self.drop(self.mlp(self.norm2(x)))
        x = x + self.drop(self.attn(self.norm1(x), cos, sin, kv_cache, layer, documents))
        return x + self.drop(self.mlp(self.norm2(x)))


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        cfg.check()
        cfg = resolve_pairs(cfg)  # a usage selection reads its map now (model/pairs.py)
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.padded_vocab_size, cfg.d_model)
        self.wpe = nn.Embedding(cfg.max_seq_len, cfg.d_model) if cfg.learned_pos_emb else None
        self.drop = nn.Dropout(cfg.dropout)
        # Every layer's positions (pretrain/model/position.py): one RoPE cache per distinct
        # setting; `rope` keeps the name (and the interface) of the model's one cache.
        self.rope = Positions.from_config(cfg)
        self.blocks = nn.ModuleList(Block(cfg, p) for p in self.rope.layers)
        self.norm_f = make_norm(cfg.norm, cfg.d_model, cfg.norm_eps, cfg.norm_bias)
        self.lm_head = nn.Linear(cfg.d_model, cfg.padded_vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.wte.weight
        # Recompute blocks in the backward to save memory: False/0 none, True all, or an int N
        # = the first N blocks (pretrain/model/recompute.py).
        self.gradient_checkpointing: bool | int = False
        # Injection points: the loss of the output layer (the engine picks the backend, the
        # planner traces the whole-logits loss) and the attention kernel of every block.
        self.loss_fn: LossFn = linear_cross_entropy
        self.reset_parameters()

    # ------------------------------------------------------------------ initialisation
    def init_stds(self) -> tuple[float, float]:
        """(std of every weight, std of the output projections attn.proj and mlp.w_out)."""
        c = self.cfg
        if c.init == "small_init":  # GPT-NeoX: small_init and wang_init
            return math.sqrt(2 / (5 * c.d_model)), 2 / (c.n_layers * math.sqrt(c.d_model))
        if c.init == "scaled_normal":  # GPT-2 / nanoGPT / Megatron output scaling
            return c.init_std, c.init_std / math.sqrt(2 * c.n_layers)
        return c.init_std, c.init_std

    @torch.no_grad()
    def reset_parameters(self) -> None:
        if self.wte.weight.is_meta:
            return  # built on the meta device to load weights into: nothing to initialise
        std, out_std = self.init_stds()
        for name, module in self.named_modules():
            if isinstance(module, nn.Linear):
                is_out = name.endswith("attn.proj") or name.endswith("mlp.w_out")
                nn.init.normal_(module.weight, 0.0, out_std if is_out else std)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, 0.0, std)
            elif hasattr(module, "weight") and isinstance(module.weight, nn.Parameter):
                nn.init.ones_(module.weight)  # norms
                if getattr(module, "bias", None) is not None:
                    nn.init.zeros_(module.bias)

    # ------------------------------------------------------------------ forward
    def hidden_states(
        self,
        input_ids: torch.Tensor,
        kv_cache: KVCache | None = None,
        *,
        document_ids: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        max_position: int | None = None,
    ) -> torch.Tensor:
        """Final normed hidden states (B, T, d_model), before the output layer.

        Scoring a few positions of long inputs (evaluation) applies `lm_head` to those alone
        instead of materialising (B, T, vocab) logits. Packed documents (data/documents.py):
        `document_ids` (B, T) keeps each token's attention inside its document, and
        `position_ids` (B, T) gives each token its position (RoPE and learned positions).
        `max_position`: their largest, from a caller that knows it without reading the tensor
        (the data pipeline computes it on the host, pretrain/data/documents.py); otherwise
        the positions are read back once, a synchronisation where they live on a GPU.
        """
        B, T = input_ids.shape
        start = kv_cache.pos if kv_cache is not None else 0
        documents = self._document_mask(input_ids, kv_cache, document_ids, position_ids)
        if position_ids is None:
            self.check_length(start + T)
            ropes = self.rope.per_layer(start, T)
            positions = torch.arange(start, start + T, device=input_ids.device)
        else:
            if max_position is None:
                bounds = torch.stack(torch.aminmax(position_ids)).cpu()  # one read of both
                low, max_position = int(bounds[0]), int(bounds[1])
                if low < 0:
                    raise ValueError("position_ids holds a negative position; positions start at 0")
            self.check_length(max_position + 1)
            ropes = self.rope.per_layer_at(position_ids, max_position)
            positions = position_ids
        x = self.wte(input_ids)
        if self.wpe is not None:
            x = x + self.wpe(positions)
        x = self.drop(x)
        recompute = self.checkpointed_layers() if self.training and kv_cache is None else 0
        for i, block in enumerate(self.blocks):
            cos, sin = ropes[i]
            if i < recompute:
                x = checkpoint(block, x, cos, sin, None, i, documents, use_reentrant=False)
            else:
                x = block(x, cos, sin, kv_cache, i, documents)
        if kv_cache is not None:
            kv_cache.pos += T
        return self.norm_f(x)

    def _document_mask(
        self,
        input_ids: torch.Tensor,
        kv_cache: KVCache | None,
        document_ids: torch.Tensor | None,
        position_ids: torch.Tensor | None,
    ) -> DocumentMask | None:
        for name, t in (("document_ids", document_ids), ("position_ids", position_ids)):
            if t is not None and t.shape != input_ids.shape:
                raise ValueError(
                    f"{name} has shape {tuple(t.shape)}; it must be (batch, tokens) = "
                    f"{tuple(input_ids.shape)}, as input_ids"
                )
            if t is not None and kv_cache is not None:
                raise ValueError(
                    f"{name} with a kv_cache: incremental decoding runs one document, "
                    f"from position kv_cache.pos on"
                )
        if document_ids is None:
            return None
        # The blocks choose the same kernel from the same facts (Attention.forward); this
        # choice only says which form of the mask to build once for all of them.
        kernel = choose_kernel(
            input_ids.device,
            head_dim=self.cfg.head_dim,
            documents=True,
            dropout=self.cfg.dropout if self.training else 0.0,
            soft_cap=self.cfg.attn_logit_softcap,
            injected=any(block.attn.attention_fn is not None for block in self.blocks),
        )
        return DocumentMask.build(document_ids, "flex" if kernel == "flex" else "sdpa_mask")

    @property
    def max_positions(self) -> int | None:
        """The longest sequence the model can run: the learned position table's rows, or None
        (unbounded) for RoPE, partial RoPE and NoPE, whose cache grows on demand."""
        return self.cfg.max_seq_len if self.wpe is not None else None

    def check_length(self, length: int) -> None:
        limit = self.max_positions
        if limit is not None and length > limit:
            raise ValueError(
                f"a sequence of {length} tokens is longer than the learned position table "
                f"(model.learned_pos_emb, {limit} rows = model.max_seq_len): learned positions "
                f"cannot run past the length they were trained at"
            )

    def checkpointed_layers(self) -> int:
        """How many blocks (the first ones) recompute their activations in the backward."""
        n, g = len(self.blocks), self.gradient_checkpointing
        if isinstance(g, bool):
            return n if g else 0
        return max(0, min(int(g), n))

    def forward(
        self,
        input_ids: torch.Tensor,
        targets: torch.Tensor | None = None,
        kv_cache: KVCache | None = None,
        z_loss: float = 0.0,
        *,
        document_ids: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        max_position: int | None = None,
    ) -> torch.Tensor | LossOutput:
        """Logits (B, T, padded_vocab) or, with `targets`, a LossOutput (fp32 scalars).

        Targets equal to -100 are ignored. With a `kv_cache`, input_ids continue the cached
        sequence at position kv_cache.pos, and the cache advances. The loss never holds the
        logits of the whole batch: the output layer and cross-entropy run a chunk of tokens
        at a time (pretrain/model/loss.py), with the same result as
        `F.cross_entropy(logits.float(), targets, ignore_index=-100)`.

        `document_ids`, `position_ids` and `max_position`: packed documents, see
        `hidden_states`.

        `z_loss` > 0 adds z_loss x mean(logsumexp(logits)^2) to the loss (PaLM's z-loss) and
        returns the added term, detached, beside it.
        """
        hidden = self.hidden_states(
            input_ids,
            kv_cache,
            document_ids=document_ids,
            position_ids=position_ids,
            max_position=max_position,
        )
        if targets is None:
            return self.lm_head(hidden)
        loss, z_term = self.loss_fn(
            hidden, self.lm_head.weight, targets, IGNORE_INDEX, z_loss=z_loss
        )
        return LossOutput(loss, z_term)

    def set_rope_scaling(self, scaling: RopeScalingConfig | None) -> None:
        """Evaluate with another RoPE scaling (or none): the config and the cos/sin cache
        change, the weights do not."""
        cfg = self.cfg.replace(rope_scaling=scaling)  # validates
        self.cfg = cfg
        self.rope = Positions.from_config(cfg).to(self.rope.cos.device)

    def layer_positions(self) -> list[LayerPosition]:
        """Every layer's position settings (rotary dims, theta, spectrum, window, ALiBi): what
        readers (planner, RoPE cache tool, model_info) ask instead of the config's fields."""
        return list(self.rope.layers)

    def set_attention_fn(self, fn: AttentionFn | None) -> None:
        """Every block's attention kernel, with the signature of
        F.scaled_dot_product_attention; None = the kernel attention.choose_kernel picks (the
        planner traces FlashAttention's memory through this). It gets is_causal or a dense
        boolean mask, packed documents included; a model it cannot serve (a soft cap) is
        refused here, in one line, rather than at the first forward."""
        if fn is not None:
            choose_kernel(
                self.wte.weight.device,
                head_dim=self.cfg.head_dim,
                documents=False,
                dropout=0.0,
                soft_cap=self.cfg.attn_logit_softcap,
                injected=True,
            )
        for block in self.blocks:
            block.attn.attention_fn = fn

    # ------------------------------------------------------------------ generation
    @torch.no_grad()
    def generate(
        self,
        input_ids: torch.Tensor,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_k: int | None = None,
        eos_id: int | None = None,
        generator: torch.Generator | None = None,
    ) -> torch.Tensor:
        """Sample continuations with a KV cache. temperature 0 = greedy. Returns prompt + new."""
        B, T = input_ids.shape
        total = T + max_new_tokens
        self.check_length(total)
        was_training = self.training
        self.eval()
        p = next(self.parameters())
        cache = KVCache(self.cfg, B, total, device=p.device, dtype=p.dtype)
        out = input_ids
        # The prompt's last position alone goes through the output layer: (B, vocab), not
        # (B, T, vocab) logits of a long prompt.
        logits = self.lm_head(self.hidden_states(input_ids, kv_cache=cache)[:, -1])
        done = torch.zeros(B, dtype=torch.bool, device=input_ids.device)
        for _ in range(max_new_tokens):
            logits = logits.float()
            logits[:, self.cfg.vocab_size :] = float("-inf")  # never sample padding ids
            if temperature == 0:
                nxt = logits.argmax(-1, keepdim=True)
            else:
                logits = logits / temperature
                if top_k is not None:
                    kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, -1:]
                    logits = logits.masked_fill(logits < kth, float("-inf"))
                probs = torch.softmax(logits, dim=-1)
                nxt = torch.multinomial(probs, 1, generator=generator)
            if eos_id is not None:
                nxt = torch.where(done[:, None], torch.full_like(nxt, eos_id), nxt)
                done |= nxt[:, 0] == eos_id
            out = torch.cat([out, nxt], dim=1)
            if eos_id is not None and bool(done.all()):
                break
            if out.shape[1] < total:
                logits = self(nxt, kv_cache=cache)[:, -1]
        self.train(was_training)
        return out

    # ------------------------------------------------------------------ accounting
    def embedding_params(self) -> list[nn.Parameter]:
        """Token and position embeddings, and the output matrix when it is not tied."""
        params = [self.wte.weight]
        if self.wpe is not None:
            params.append(self.wpe.weight)
        if not self.cfg.tie_embeddings:
            params.append(self.lm_head.weight)
        return params

    def num_params(self, exclude_embeddings: bool = False) -> int:
        """Unique parameters (a tied matrix counts once); optionally without embeddings."""
        total = sum(p.numel() for p in self.parameters())
        if exclude_embeddings:
            total -= sum(p.numel() for p in self.embedding_params())
        return total

    def matmul_params(self) -> int:
        """Weights that multiply activations per token: every Linear, lm_head included."""
        return sum(m.weight.numel() for m in self.modules() if isinstance(m, nn.Linear))

    def flops_per_token(self, seq_len: int | None = None) -> float:
        """Training FLOPs per token (forward + backward).

        6 * N_matmul + 12 * n_heads * head_dim * seq_len * sum(attention_shares), where
        N_matmul counts the weights of every linear layer (lm_head included, embedding
        lookups excluded) and the second term is attention's QK^T and AV (PaLM, Appendix B;
        not halved for the causal mask, the usual MFU convention). A full layer's share is 1;
        a sliding-window layer's is its attended pairs over the causal ones, so it counts the
        pairs it attends. Norms, RoPE, ALiBi and softmax are ignored.
        """
        c = self.cfg
        T = seq_len or c.max_seq_len
        attention = 12 * c.n_heads * c.head_dim * T * sum(self.attention_shares(T))
        return 6 * self.matmul_params() + attention

    def attention_shares(self, seq_len: int) -> list[float]:
        """Per layer, the share of a causal attention's (query, key) pairs it attends over
        seq_len tokens: 1 for full attention, attended_pairs(T, W) / attended_pairs(T) for
        a sliding window W."""
        causal = attended_pairs(seq_len, None)
        return [attended_pairs(seq_len, p.window) / causal for p in self.rope.layers]
