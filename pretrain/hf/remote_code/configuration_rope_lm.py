"""Configuration of RopeLM, the decoder-only transformer trained by the `pretrain` toolkit.

This file is copied into every exported model folder that needs it and is loaded by
`AutoConfig.from_pretrained(folder, trust_remote_code=True)`. It imports only transformers.

One config describes Llama-style and Pythia-style models and everything between:

    block        "sequential": x + attn(norm1(x)), then + mlp(norm2(.))   (Llama)
                 "parallel":   x + attn(norm1(x)) + mlp(norm2(x))          (GPT-J / Pythia)
    norm         "rmsnorm" or "layernorm" (norm_bias: LayerNorm with a bias)
    mlp          "swiglu" (down(silu(gate(x)) * up(x))) or "gelu" (down(gelu(up(x))))
    rotary_dims  RoPE on the first `rotary_dims` dims of each head (0 = NoPE), base rope_theta
    rotary_scaling  RoPE scaling of those dims (linear, ntk, yarn, dynamic_ntk) or None
    rope_spectrum  "neox": inverse frequencies theta^(-2j/rotary_dims) (GPT-NeoX's rotary_pct);
                 "p_rope": theta^(-2j/head_dim), full RoPE's highest rotary_dims/2 (p-RoPE)
    nope_layers  0-based layers without RoPE (NoPE layers among RoPE ones), or None
    rope_pairs   a pair selection, or None: per layer, per key/value head, the pairs j that
                 rotate (dims j and j + head_dim/2 at theta^(-2j/head_dim), full RoPE's
                 layout; query heads follow their group); the other dims pass through
    sliding_window, layer_types  a "sliding_attention" layer's query sees itself and the
                 sliding_window - 1 tokens before it; "full_attention" every earlier token
                 (transformers' names: its DynamicCache keeps W - 1 keys of a sliding layer)
    global_rope_theta  RoPE theta of the full-attention layers when some slide (else rope_theta)
    alibi        ALiBi: -slope_h x (i - j) on the attention logits (Press et al. slopes)
    qk_norm      normalize each head's query and key over head_dim, before RoPE
    attn_logit_softcap  attention logits -> cap * tanh(logits / cap); 0 = off
    learned_pos_emb  learned absolute positions added to the token embeddings
"""

from transformers import PretrainedConfig


class RopeLMConfig(PretrainedConfig):
    model_type = "rope_lm"
    keys_to_ignore_at_inference = ["past_key_values"]

    def __init__(
        self,
        vocab_size: int = 50304,
        hidden_size: int = 2048,
        intermediate_size: int = 8192,
        num_hidden_layers: int = 16,
        num_attention_heads: int = 32,
        num_key_value_heads: int | None = None,
        head_dim: int | None = None,
        max_position_embeddings: int = 2048,
        block: str = "sequential",
        norm: str = "rmsnorm",
        norm_eps: float = 1e-5,
        norm_bias: bool = False,
        mlp: str = "swiglu",
        mlp_bias: bool = False,
        attention_bias: bool = False,
        rotary_dims: int | None = None,
        rope_theta: float = 10000.0,
        rotary_scaling: dict | None = None,
        rope_spectrum: str = "neox",
        nope_layers: list | None = None,
        rope_pairs: list | None = None,
        sliding_window: int | None = None,
        layer_types: list | None = None,
        global_rope_theta: float | None = None,
        alibi: bool = False,
        learned_pos_emb: bool = False,
        qk_norm: bool = False,
        attn_logit_softcap: float = 0.0,
        dropout: float = 0.0,
        initializer_range: float = 0.02,
        tie_word_embeddings: bool = False,
        use_cache: bool = True,
        **kwargs,
    ):
        if head_dim is None and hidden_size % num_attention_heads:
            raise ValueError(
                f"hidden_size {hidden_size} is not divisible by num_attention_heads {num_attention_heads}; set head_dim"
            )
        num_key_value_heads = num_key_value_heads or num_attention_heads
        if num_attention_heads % num_key_value_heads:
            raise ValueError(
                f"num_attention_heads {num_attention_heads} is not divisible by num_key_value_heads {num_key_value_heads}"
            )
        # head_dim apart from hidden_size / heads (Qwen3's): q, k, v are heads x head_dim wide.
        head_dim = hidden_size // num_attention_heads if head_dim is None else head_dim
        if head_dim <= 0:
            raise ValueError(f"head_dim {head_dim} must be positive")
        rotary_dims = head_dim if rotary_dims is None else rotary_dims
        if not (0 <= rotary_dims <= head_dim and rotary_dims % 2 == 0):
            raise ValueError(
                f"rotary_dims {rotary_dims} must be even and in [0, head_dim={head_dim}]"
            )
        for name, value, allowed in (
            ("block", block, ("sequential", "parallel")),
            ("norm", norm, ("rmsnorm", "layernorm")),
            ("mlp", mlp, ("swiglu", "gelu")),
            ("rope_spectrum", rope_spectrum, ("neox", "p_rope")),
        ):
            if value not in allowed:
                raise ValueError(f"{name}={value!r}; use one of {allowed}")
        nope_layers = sorted(int(i) for i in nope_layers or ())
        if any(not 0 <= i < num_hidden_layers for i in nope_layers):
            raise ValueError(f"nope_layers {nope_layers} must be in [0, {num_hidden_layers})")
        if rope_pairs is not None:
            rope_pairs = [[sorted(int(j) for j in kept) for kept in layer] for layer in rope_pairs]
            shape_ok = len(rope_pairs) == num_hidden_layers and all(
                len(layer) == num_key_value_heads for layer in rope_pairs
            )
            if not shape_ok or rotary_dims != head_dim or rope_spectrum != "neox":
                raise ValueError(
                    f"rope_pairs: one list per key/value head ({num_key_value_heads}) for each "
                    f"of the {num_hidden_layers} layers, with rotary_dims = head_dim and the "
                    f"neox spectrum"
                )
            if any(not 0 <= j < head_dim // 2 for layer in rope_pairs for k in layer for j in k):
                raise ValueError(f"rope_pairs: a pair index outside [0, {head_dim // 2})")
        # Always a list: transformers' masks for generate() and its caches read it when the
        # attribute exists. No sliding_window: every layer full; no list: every layer slides.
        if layer_types is None:
            kind = "full_attention" if sliding_window is None else "sliding_attention"
            layer_types = [kind] * num_hidden_layers
        layer_types = list(layer_types)
        kinds = ("full_attention", "sliding_attention")
        if len(layer_types) != num_hidden_layers or set(layer_types) - set(kinds):
            raise ValueError(
                f"layer_types {layer_types}: one of {kinds} per layer ({num_hidden_layers})"
            )
        if "sliding_attention" in layer_types and not sliding_window:
            raise ValueError("layer_types has sliding_attention layers; set sliding_window")
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_key_value_heads
        self.head_dim = head_dim
        self.max_position_embeddings = max_position_embeddings
        self.block = block
        self.norm = norm
        self.norm_eps = norm_eps
        self.norm_bias = norm_bias
        self.mlp = mlp
        self.mlp_bias = mlp_bias
        self.attention_bias = attention_bias
        self.rotary_dims = rotary_dims
        self.rope_theta = float(rope_theta)
        # RoPE scaling of the rotary dims: {type: linear|ntk|yarn|dynamic_ntk, factor,
        # original_max_seq_len, beta_fast, beta_slow, attention_factor, truncate} or None.
        # Not transformers' `rope_scaling`, which its configs rewrite into rope_parameters.
        self.rotary_scaling = dict(rotary_scaling) if rotary_scaling else None
        if self.rotary_scaling and rope_spectrum == "p_rope":
            raise ValueError("rotary_scaling of a p_rope spectrum is not supported")
        self.rope_spectrum = rope_spectrum
        self.nope_layers = nope_layers or None
        self.rope_pairs = rope_pairs
        self.sliding_window = sliding_window
        self.layer_types = layer_types
        self.global_rope_theta = None if global_rope_theta is None else float(global_rope_theta)
        self.alibi = bool(alibi)
        self.learned_pos_emb = learned_pos_emb
        self.qk_norm = qk_norm
        self.attn_logit_softcap = float(attn_logit_softcap)
        self.dropout = dropout
        self.initializer_range = initializer_range
        self.use_cache = use_cache
        super().__init__(tie_word_embeddings=tie_word_embeddings, **kwargs)
