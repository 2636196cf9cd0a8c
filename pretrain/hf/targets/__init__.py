"""The Hugging Face classes an export can be written as, one module each.

    phi3      Phi3ForCausalLM:    Llama's layers without biases, fused projections, partial
                                  RoPE with NeoX's spectrum (chosen for those)
    llama     LlamaForCausalLM:   sequential block, RMSNorm, SwiGLU, no QK-Norm, no learned
                                  positions, no dropout; RoPE on the whole head, or partial
                                  RoPE, p-RoPE and NoPE as the proportional rope_type
    mistral   MistralForCausalLM: Llama's layers without biases, one sliding window for every
                                  layer (chosen for those)
    qwen3     Qwen3ForCausalLM:   Llama's layers with QK-Norm, no MLP biases, windows by layer
    gpt_neox  GPTNeoXForCausalLM: LayerNorm, GeLU, MHA, RoPE on >= 2 dims (partial is fine),
                                  no QK-Norm, no learned positions; parallel or sequential
    smollm3   SmolLM3ForCausalLM: Llama's layers plus NoPE layers and sliding-window layers
                                  (chosen for models whose layers differ so)
    qwen2     Qwen2ForCausalLM:   Llama's layers, q/k/v biases only (imports; exports only
                                  when asked for)
    rope_lm   RopeLMForCausalLM:  everything `ModelConfig` can express (remote code)

Each module holds one `Target` (base.py): which models it holds exactly, its transformers
config, our config read back from it, and where each of our tensors goes. A new class is a new
module here and one entry in NATIVE_TARGETS; `pretrain/hf/convert.py` dispatches over them.
"""

from __future__ import annotations

from pretrain.hf.targets.base import HFConversionError, Target, TensorMap
from pretrain.hf.targets.llama import Llama
from pretrain.hf.targets.mistral import Mistral
from pretrain.hf.targets.neox import GPTNeoX
from pretrain.hf.targets.phi3 import Phi3
from pretrain.hf.targets.qwen2 import Qwen2
from pretrain.hf.targets.qwen3 import Qwen3
from pretrain.hf.targets.remote import RopeLM
from pretrain.hf.targets.smollm3 import SmolLM3

# The native classes in the order `choose_target` tries them; the first that takes a model
# (`auto`) and holds it exactly is its export. The remote code holds every model.
NATIVE_TARGETS: tuple[Target, ...] = (
    Phi3(),
    Llama(),
    Mistral(),
    Qwen3(),
    GPTNeoX(),
    SmolLM3(),
    Qwen2(),
)
REMOTE_TARGET: Target = RopeLM()
BY_NAME: dict[str, Target] = {t.name: t for t in (*NATIVE_TARGETS, REMOTE_TARGET)}


def get_target(name: str) -> Target:
    """The target called `name` (a model_type), or HFConversionError naming the ones there are."""
    if name not in BY_NAME:
        raise HFConversionError(
            f"unknown Hugging Face target {name!r}; use one of {', '.join(BY_NAME)}"
        )
    return BY_NAME[name]


__all__ = [
    "BY_NAME",
    "NATIVE_TARGETS",
    "REMOTE_TARGET",
    "HFConversionError",
    "Target",
    "TensorMap",
    "get_target",
]
