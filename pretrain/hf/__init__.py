"""Hugging Face transformers export and import of the toolkit's models.

    from pretrain.hf import export_hf, read_hf_folder, check_parity
    export = export_hf(model, "exports/x", tokenizer=tok)     # native class or RopeLM remote code
    model, tok, record = read_hf_folder("exports/x")          # back, exactly
    check_parity(model, "exports/x")                          # logits vs transformers

Modules: convert (target choice, configs, state-dict mapping), folder (writing and reading
folders, sharded safetensors; in-memory to_hf / from_hf), tokenizer (our tokenizers as
tokenizer.json), card (README.md), check (parity), cli (tools/export_hf.py,
tools/import_hf.py), remote_code/ (RopeLM: the configuration and modeling files copied
into exports).
"""

from pretrain.hf.check import check_parity
from pretrain.hf.convert import (
    TARGETS,
    HFConversionError,
    choose_target,
    config_from_hf,
    hf_config,
    unsupported_features,
)
from pretrain.hf.folder import (
    Export,
    export_hf,
    from_hf,
    read_hf_folder,
    to_hf,
)

__all__ = [
    "TARGETS",
    "Export",
    "HFConversionError",
    "check_parity",
    "choose_target",
    "config_from_hf",
    "export_hf",
    "from_hf",
    "hf_config",
    "read_hf_folder",
    "to_hf",
    "unsupported_features",
]
