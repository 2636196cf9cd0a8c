"""Hugging Face transformers export and import of the toolkit's models.

    from pretrain.hf import export_hf, read_hf_folder, check_parity
    export = export_hf(model, "exports/x", tokenizer=tok)     # native class or RopeLM remote code
    model, tok, record = read_hf_folder("exports/x")          # back, exactly
    check_parity(model, "exports/x")                          # logits vs transformers

Modules: targets/ (one module per transformers class an export can be written as: llama,
neox, smollm3, remote; each says which models it holds, its config, its weight names and
layouts), convert (the dispatch over targets: choice, configs, state dicts), folder (writing and
reading folders, sharded safetensors; in-memory to_hf / from_hf), files (a folder's JSON files,
a damaged one refused in one line), tokenizer (our tokenizers as tokenizer.json), card
(README.md), check (parity), remote_code/ (RopeLM: the configuration and modeling files
copied into exports). The programs are
pretrain/cli/export_hf.py and import_hf.py (tools/export_hf.py, tools/import_hf.py).
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
