"""RopeLM: the decoder-only transformer trained by the `pretrain` toolkit, for transformers.

This file is copied into every exported model folder that needs it and is loaded by
`AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)`. It imports only
torch and transformers, and computes exactly what the toolkit's model computes:

    x = embed_tokens(ids) (+ embed_positions(positions) with learned_pos_emb)
    each layer, sequential:  x = x + attn(norm1(x));  x = x + mlp(norm2(x))
                or parallel: x = x + attn(norm1(x)) + mlp(norm2(x))
    logits = lm_head(norm(x))        (lm_head tied to embed_tokens with tie_word_embeddings)

attn: q, k, v projections; grouped-query when num_key_value_heads < num_attention_heads
(query head h reads key/value head h // (heads / kv_heads)); optional QK-Norm of each head
over head_dim (one weight for q and one for k, shared by heads); then RoPE on the first
`rotary_dims` dims of each head, GPT-NeoX "rotate_half" convention, inverse frequencies
theta^(-2i/rotary_dims) ("neox") or theta^(-2i/head_dim) ("p_rope"), cos/sin and the
rotation in fp32; causal softmax attention (SDPA). RMSNorm normalizes in fp32 and casts back
before the weight, as Llama does.

Per layer (`layer_settings`, the toolkit's pretrain/model/position.py): NoPE layers
(`nope_layers`) rotate nothing; a pair selection (`rope_pairs`) rotates, of each key/value
head and its query heads, only the pairs j it lists (dims j and j + head_dim/2 at
theta^(-2j/head_dim)) and passes the other dims through (a layer that lists none is NoPE); a "sliding_attention" layer (`layer_types`) lets a query see
itself and the `sliding_window` - 1 tokens before it; the full-attention layers of a model
with sliding ones use `global_rope_theta` when set; `alibi` adds -slope_h x (i - j) to the
scaled logits (Press et al.'s slopes), i - j the distance between cache slots.

The vocabulary is padded (vocab_size is the embedding's row count); generation_config.json
suppresses the padded ids. Keys and values are cached after RoPE through transformers'
Cache classes (DynamicCache by default), so `generate()` works as for any causal LM.

The cache is read under both of its names: `past_key_values` (transformers 5.0 to 5.23) and
`cache` (5.24 and later, which hand it to the model under that name), and returned in the
output field the installed version declares, so one exported folder works in every 5.x.
"""

import math

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.cache_utils import Cache, DynamicCache
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast

from .configuration_rope_lm import RopeLMConfig

# The output field that holds the cache: `cache` from transformers 5.24, `past_key_values` before.
CACHE_FIELD = (
    "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"
)


def pick_cache(cache: Cache | None, past_key_values: Cache | None) -> Cache | None:
    """The KV cache, whichever name the caller used (generate() uses `cache` from 5.24)."""
    if cache is not None and past_key_values is not None and cache is not past_key_values:
        raise ValueError("pass the KV cache once, as `cache` or as `past_key_values`")
    return cache if cache is not None else past_key_values


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def make_norm(config: RopeLMConfig, dim: int) -> nn.Module:
    if config.norm == "rmsnorm":
        return RMSNorm(dim, config.norm_eps)
    return nn.LayerNorm(dim, eps=config.norm_eps, bias=config.norm_bias)


# ----------------------------------------------------------------------------- RoPE


def _frequencies(rotary_dims: int, theta: float, spectrum_dims: int | None = None) -> torch.Tensor:
    i = torch.arange(0, rotary_dims, 2, dtype=torch.float64)  # inverse frequencies in fp64
    return 1.0 / theta ** (i / (spectrum_dims or rotary_dims))


def layer_settings(config: RopeLMConfig) -> list[tuple[int, float, int | None, int | None]]:
    """Per layer (rotary_dims, theta, spectrum_dims, window): rotary_dims 0 = NoPE;
    spectrum_dims = head_dim for p_rope (None: the rotary dims); window None = full."""
    n = config.num_hidden_layers
    types = getattr(config, "layer_types", None) or ["full_attention"] * n
    sliding_anywhere = "sliding_attention" in types
    nope = set(getattr(config, "nope_layers", None) or ())
    global_theta = getattr(config, "global_rope_theta", None)
    p_rope = getattr(config, "rope_spectrum", "neox") == "p_rope"
    out = []
    pairs = getattr(config, "rope_pairs", None)
    for i in range(n):
        sliding = types[i] == "sliding_attention"
        theta = config.rope_theta
        if sliding_anywhere and not sliding and global_theta is not None:
            theta = global_theta
        r = 0 if i in nope or (pairs is not None and not any(pairs[i])) else config.rotary_dims
        window = config.sliding_window if sliding else None
        out.append((r, theta, config.head_dim if p_rope else None, window))
    return out


def kept_dims(config: RopeLMConfig, layer: int) -> torch.Tensor | None:
    """The dims that rotate under a pair selection: (kv_heads, 1, head_dim) bool on the CPU
    (a meta build must hold it), None without one."""
    pairs = getattr(config, "rope_pairs", None)
    if pairs is None:
        return None
    D = config.head_dim
    keep = torch.zeros(config.num_key_value_heads, 1, D, dtype=torch.bool, device="cpu")
    for g, kept in enumerate(pairs[layer]):
        for j in kept:
            keep[g, 0, j] = keep[g, 0, j + D // 2] = True
    return keep


def alibi_slopes(n_heads: int) -> torch.Tensor:
    """Press et al. (2022): 2^(-8h/n), h = 1..n, for n a power of 2; otherwise those of the
    nearest smaller power of 2, m, then every other one of the 2m-head sequence. fp32 (H,)."""

    def power_of_2(n: int) -> list[float]:
        return [2 ** (-8 * h / n) for h in range(1, n + 1)]

    m = 2 ** math.floor(math.log2(n_heads))
    slopes = power_of_2(m)
    if m != n_heads:
        slopes += power_of_2(2 * m)[0::2][: n_heads - m]
    return torch.tensor(slopes, dtype=torch.float32)


def scaled_frequencies(
    rotary_dims: int,
    theta: float,
    scaling: dict | None,
    original: int,
    seq_len: int,
    spectrum_dims: int | None = None,
) -> tuple[torch.Tensor, float]:
    """(fp64 inverse frequencies, cos/sin factor) under `rotary_scaling` (linear, ntk, yarn,
    dynamic_ntk, llama3; transformers' formulas with dim = rotary_dims). The exporter's
    pretrain/model/rope.py computes the same in the training code."""
    r = rotary_dims
    if not scaling or float(scaling.get("factor", 1.0)) == 1.0 or r == 0:
        return _frequencies(r, theta, spectrum_dims), 1.0
    if spectrum_dims not in (None, r):
        raise ValueError("rotary_scaling of a p_rope spectrum is not supported")
    f, kind = float(scaling["factor"]), scaling["type"]
    original = int(scaling.get("original_max_seq_len") or original)
    if kind == "linear":
        return _frequencies(r, theta) / f, 1.0
    if kind == "ntk":
        return _frequencies(r, theta * f ** (r / (r - 2))), 1.0
    if kind == "dynamic_ntk":
        if seq_len <= original:
            return _frequencies(r, theta), 1.0
        return _frequencies(r, theta * ((f * seq_len / original) - (f - 1)) ** (r / (r - 2))), 1.0
    if kind == "llama3":
        inv = _frequencies(r, theta)
        wavelength = 2 * math.pi / inv
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        smooth = (original / wavelength - low) / (high - low)
        out = torch.where(wavelength > original / low, inv / f, inv)
        middle = (wavelength >= original / high) & (wavelength <= original / low)
        return torch.where(middle, (1 - smooth) * inv / f + smooth * inv, out), 1.0
    if kind != "yarn":
        raise ValueError(f"rotary_scaling type {kind!r} is unknown")

    def correction_dim(rotations: float) -> float:
        return (r * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low = correction_dim(float(scaling.get("beta_fast", 32.0)))
    high = correction_dim(float(scaling.get("beta_slow", 1.0)))
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, r - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(r // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp
    base = _frequencies(r, theta)
    factor = scaling.get("attention_factor")
    factor = float(factor) if factor is not None else 0.1 * math.log(f) + 1.0
    return base / f * (1 - keep) + base * keep, factor


def rotary_cos_sin(
    position_ids: torch.Tensor,
    rotary_dims: int,
    theta: float,
    scaling: dict | None = None,
    original: int = 0,
    spectrum_dims: int | None = None,
):
    """cos, sin of shape (B, 1, T, rotary_dims), fp32, for positions (B, T)."""
    seq_len = int(position_ids.max()) + 1 if position_ids.numel() else 0
    inv, factor = scaled_frequencies(rotary_dims, theta, scaling, original, seq_len, spectrum_dims)
    inv_freq = inv.to(position_ids.device, torch.float32)
    freqs = position_ids[..., None].float() * inv_freq  # (B, T, rotary_dims / 2)
    emb = torch.cat((freqs, freqs), dim=-1)
    if factor != 1.0:
        return (emb.cos() * factor)[:, None], (emb.sin() * factor)[:, None]
    return emb.cos()[:, None], emb.sin()[:, None]


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, keep=None) -> torch.Tensor:
    """Rotate the first cos.shape[-1] dims of x (B, H, T, head_dim) in fp32; the rest pass.
    `keep` (H, 1, head_dim) bool: a pair selection, the dims it does not keep pass too."""
    r = cos.shape[-1]
    if r == 0:
        return x
    x_rot = x[..., :r].float()
    out = (x_rot * cos + rotate_half(x_rot) * sin).to(x.dtype)
    if keep is not None:
        return torch.where(keep, out, x)
    return out if r == x.shape[-1] else torch.cat((out, x[..., r:]), dim=-1)


# ----------------------------------------------------------------------------- layers


class RopeLMAttention(nn.Module):
    def __init__(self, config: RopeLMConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.n_heads, self.n_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = config.head_dim
        d, bias = config.hidden_size, config.attention_bias
        self.q_proj = nn.Linear(d, self.n_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(d, self.n_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(d, self.n_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, d, bias=bias)
        self.q_norm = make_norm(config, self.head_dim) if config.qk_norm else None
        self.k_norm = make_norm(config, self.head_dim) if config.qk_norm else None
        self.dropout = config.dropout
        self.softcap = getattr(config, "attn_logit_softcap", 0.0)
        self.window = layer_settings(config)[layer_idx][3]
        self.alibi = bool(getattr(config, "alibi", False))
        self.keep_k = kept_dims(config, layer_idx)  # a pair selection's dims, or None
        self.keep_q = (
            None
            if self.keep_k is None
            else self.keep_k.repeat_interleave(self.n_heads // self.n_kv_heads, dim=0)
        )

    def forward(self, x, cos, sin, padding_mask, past_key_values: Cache | None = None):
        B, T, _ = x.shape
        H, KV, D = self.n_heads, self.n_kv_heads, self.head_dim
        q = self.q_proj(x).view(B, T, H, D).transpose(1, 2)  # (B, H, T, D)
        k = self.k_proj(x).view(B, T, KV, D).transpose(1, 2)
        v = self.v_proj(x).view(B, T, KV, D).transpose(1, 2)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.keep_k is None:
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        else:
            keep_q, keep_k = self.keep_q.to(x.device), self.keep_k.to(x.device)
            q, k = apply_rope(q, cos, sin, keep_q), apply_rope(k, cos, sin, keep_k)
        past = 0
        if past_key_values is not None:
            past = past_key_values.get_seq_length(self.layer_idx)
            k, v = past_key_values.update(k, v, self.layer_idx)
        if KV != H:
            k, v = k.repeat_interleave(H // KV, dim=1), v.repeat_interleave(H // KV, dim=1)
        slopes = alibi_slopes(H).to(x.device) if self.alibi else None
        mask, is_causal = causal_mask(
            padding_mask, past, T, k.shape[2], x.device, self.window, slopes, q.dtype
        )
        if self.softcap:
            if is_causal:
                mask = torch.ones(T, k.shape[2], dtype=torch.bool, device=x.device).tril()
            scores = (q @ k.transpose(-2, -1)).float() * D**-0.5
            scores = torch.tanh(scores / self.softcap) * self.softcap
            if mask is not None and mask.dtype == torch.bool:
                scores = scores.masked_fill(~mask, float("-inf"))
            elif mask is not None:  # a float bias (ALiBi), -inf where masked
                scores = scores + mask.float()
            p = torch.softmax(scores, dim=-1).to(v.dtype)
            if self.training and self.dropout:
                p = F.dropout(p, self.dropout)
            return self.o_proj((p @ v).transpose(1, 2).reshape(B, T, H * D))
        y = F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=mask,
            is_causal=is_causal,
            dropout_p=self.dropout if self.training else 0.0,
        )
        return self.o_proj(y.transpose(1, 2).reshape(B, T, H * D))


class RopeLMMLP(nn.Module):
    def __init__(self, config: RopeLMConfig):
        super().__init__()
        d, ff, bias = config.hidden_size, config.intermediate_size, config.mlp_bias
        self.gate_proj = nn.Linear(d, ff, bias=bias) if config.mlp == "swiglu" else None
        self.up_proj = nn.Linear(d, ff, bias=bias)
        self.down_proj = nn.Linear(ff, d, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_proj is not None:  # SwiGLU
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        return self.down_proj(F.gelu(self.up_proj(x)))


class RopeLMBlock(GradientCheckpointingLayer):  # model.gradient_checkpointing_enable() works
    def __init__(self, config: RopeLMConfig, layer_idx: int):
        super().__init__()
        self.parallel = config.block == "parallel"
        self.input_layernorm = make_norm(config, config.hidden_size)
        self.self_attn = RopeLMAttention(config, layer_idx)
        self.post_attention_layernorm = make_norm(config, config.hidden_size)
        self.mlp = RopeLMMLP(config)
        self.drop = nn.Dropout(config.dropout)

    def forward(self, x, cos, sin, padding_mask, past_key_values=None):
        a = self.drop(
            self.self_attn(self.input_layernorm(x), cos, sin, padding_mask, past_key_values)
        )
        if self.parallel:
            return x + a + self.drop(self.mlp(self.post_attention_layernorm(x)))
        x = x + a
        return x + self.drop(self.mlp(self.post_attention_layernorm(x)))


def causal_mask(
    padding_mask,
    past: int,
    T: int,
    kv_len: int,
    device,
    window: int | None = None,
    slopes: torch.Tensor | None = None,
    dtype: torch.dtype = torch.float32,
):
    """(attn_mask, is_causal) for SDPA: its own causal mask when that is right (no cache,
    no padding, no window, no ALiBi), no mask for one new token, else a boolean (B or 1, 1, T,
    kv_len) mask, True = attend, or with ALiBi `slopes` (H,) a float bias (B or 1, H, T,
    kv_len) of -slope x (i - j) where attended and -inf elsewhere (the toolkit's
    dense_position_mask: computed in fp32, cast to the queries' dtype).

    The T queries are cache slots past .. past+T-1 and see the slots up to their own, and with
    a `window` W only those past their own - W. The kv_len keys are the last kv_len slots
    (a dynamic cache: all of them, or a sliding layer's last W - 1 and the new ones), or
    slots 0 .. kv_len - 1 when there are more (a static cache, masked by a 4D mask).
    padding_mask (B, >= past+T), 0 = padding, hides padded slots (a 4D mask is taken as
    is). A padding query that would see nothing sees everything instead: its output is never
    used, and this keeps NaNs out.
    """
    plain = window is None and slopes is None
    if padding_mask is not None and padding_mask.ndim == 4 and plain:
        return padding_mask, False  # a ready mask (generate() builds one for static caches)
    if plain and padding_mask is None and kv_len == past + T:
        if T == 1:
            return None, False
        if past == 0:
            return None, True
    first = past + T - kv_len if kv_len <= past + T else 0  # the slot of the first key
    q_slot = torch.arange(past, past + T, device=device)[:, None]
    k_slot = torch.arange(first, first + kv_len, device=device)[None, :]
    mask = (k_slot <= q_slot)[None, None]
    if window is not None:
        mask = mask & (k_slot > q_slot - window)
    if padding_mask is not None and padding_mask.ndim == 4:
        ready = padding_mask if padding_mask.dtype == torch.bool else padding_mask == 0
        mask = mask & ready
    elif padding_mask is not None:
        keep = padding_mask.bool()
        if keep.shape[-1] < first + kv_len:
            keep = F.pad(keep, (0, first + kv_len - keep.shape[-1]))
        mask = mask & keep[:, None, None, first : first + kv_len]
    if padding_mask is not None:
        mask = mask | ~mask.any(-1, keepdim=True)
    if slopes is None:
        return mask, False
    bias = -slopes.to(device=device, dtype=torch.float32)[:, None, None] * (q_slot - k_slot).float()
    return bias.masked_fill(~mask, float("-inf")).to(dtype), False


# ----------------------------------------------------------------------------- models


class RopeLMPreTrainedModel(PreTrainedModel):
    config_class = RopeLMConfig
    base_model_prefix = "model"
    _no_split_modules = ["RopeLMBlock"]
    supports_gradient_checkpointing = True
    _skip_keys_device_placement = ["past_key_values", "cache"]
    _supports_sdpa = True


class RopeLMModel(RopeLMPreTrainedModel):
    def __init__(self, config: RopeLMConfig):
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.embed_positions = (
            nn.Embedding(config.max_position_embeddings, config.hidden_size)
            if config.learned_pos_emb
            else None
        )
        self.drop = nn.Dropout(config.dropout)
        self.layers = nn.ModuleList(RopeLMBlock(config, i) for i in range(config.num_hidden_layers))
        self.norm = make_norm(config, config.hidden_size)
        self.post_init()

    def get_input_embeddings(self):
        return self.embed_tokens

    def set_input_embeddings(self, value):
        self.embed_tokens = value

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
        cache: Cache | None = None,
        **kwargs,
    ) -> BaseModelOutputWithPast:
        past_key_values = pick_cache(cache, past_key_values)
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of input_ids and inputs_embeds")
        x = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        B, T = x.shape[:2]
        use_cache = self.config.use_cache if use_cache is None else use_cache
        if use_cache and past_key_values is None:
            past_key_values = DynamicCache(config=self.config)
        past = past_key_values.get_seq_length() if past_key_values is not None else 0
        c = self.config
        types = getattr(c, "layer_types", None) or ["full_attention"] * c.num_hidden_layers
        if isinstance(attention_mask, dict):  # generate() with a static cache: 4D per layer type
            masks, attention_mask = [attention_mask[t] for t in types], None
        else:
            masks = None
        padded = attention_mask is not None and attention_mask.ndim == 2
        if padded and bool(attention_mask.all()):
            attention_mask, padded = None, False  # no padding: plain causal attention
        if position_ids is None and padded:  # count only real tokens
            position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)[:, -T:]
        elif position_ids is None:
            position_ids = torch.arange(past, past + T, device=x.device)[None].expand(B, T)
        if self.embed_positions is not None:
            if int(position_ids.max()) >= self.config.max_position_embeddings:
                raise ValueError(
                    f"position {int(position_ids.max())} is past the {self.config.max_position_embeddings} "
                    f"learned positions of this model"
                )
            x = x + self.embed_positions(position_ids)
        x = self.drop(x)
        tables = {}  # one cos/sin per distinct (rotary_dims, theta, spectrum) of the layers
        for i, (layer, (r, theta, spectrum_dims, _)) in enumerate(
            zip(self.layers, layer_settings(c), strict=True)
        ):
            key = (r, theta, spectrum_dims)
            if key not in tables:
                tables[key] = rotary_cos_sin(
                    position_ids,
                    r,
                    theta,
                    c.rotary_scaling,
                    c.max_position_embeddings,
                    spectrum_dims,
                )
            mask = attention_mask if masks is None else masks[i]
            x = layer(x, *tables[key], mask, past_key_values)
        return BaseModelOutputWithPast(
            last_hidden_state=self.norm(x), **{CACHE_FIELD: past_key_values}
        )


class RopeLMForCausalLM(RopeLMPreTrainedModel, GenerationMixin):
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, config: RopeLMConfig):
        super().__init__(config)
        self.model = RopeLMModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self):
        return self.model.embed_tokens

    def set_input_embeddings(self, value):
        self.model.embed_tokens = value

    def get_output_embeddings(self):
        return self.lm_head

    def set_output_embeddings(self, value):
        self.lm_head = value

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int = 0,
        cache: Cache | None = None,
        **kwargs,
    ) -> CausalLMOutputWithPast:
        """Logits (B, T, vocab_size); with labels (= input_ids, shifted inside, -100 ignored)
        also the mean cross-entropy in fp32."""
        out = self.model(
            input_ids,
            attention_mask,
            position_ids,
            pick_cache(cache, past_key_values),
            inputs_embeds,
            use_cache,
        )
        h = out.last_hidden_state
        logits = self.lm_head(h[:, -logits_to_keep:] if logits_to_keep else h)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(
                logits[:, :-1].float().reshape(-1, logits.shape[-1]),
                labels[:, 1:].reshape(-1).to(logits.device),
                ignore_index=-100,
            )
        return CausalLMOutputWithPast(
            loss=loss, logits=logits, **{CACHE_FIELD: getattr(out, CACHE_FIELD)}
        )
