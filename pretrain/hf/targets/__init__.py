"""The Hugging Face classes an export can be written as, one module each.

    llama     LlamaForCausalLM:   sequential block, RMSNorm, SwiGLU, RoPE on the whole head,
                                  no QK-Norm, no learned positions, no dropout
    gpt_neox  GPTNeoXForCausalLM: LayerNorm, GeLU, MHA, RoPE on >= 2 dims (partial is fine),
                                  no QK-Norm, no learned positions; parallel or sequential
    smollm3   SmolLM3ForCausalLM: Llama's layers plus NoPE layers and sliding-window layers
                                  (chosen for models whose layers differ so)
    rope_lm   RopeLMForCausalLM:  everything `ModelConfig` can express (remote code)

Each module holds one `Target` (base.py): which models it holds exactly, its transformers
config, our config read back from it, and where each of our tensors goes. A new class is a new
module here and one entry in NATIVE_TARGETS; `pretrain/hf/convert.py` dispatches over them.
"""

from __future__ import annotations

from pretrain.hf.targets.base import HFConversionError, Target, TensorMap
from pretrain.hf.targets.llama import Llama
from pretrain.hf.targets.neox import GPTNeoX
from pretrain.hf.targets.remote import RopeLM
from pretrain.hf.targets.smollm3 import SmolLM3

# The native classes in the order `choose_target` tries them; the first that holds a model
# exactly is its export. The remote code holds every model.
NATIVE_TARGETS: tuple[Target, ...] = (Llama(), GPTNeoX(), SmolLM3())
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
