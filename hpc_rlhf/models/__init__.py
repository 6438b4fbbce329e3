"""Models layer: byte-level tokenizer, tiny test models, loading (LoRA / QLoRA), adapter merging.

Names are imported lazily so ``import hpc_rlhf.models`` does not pull in transformers.
"""
from __future__ import annotations

import importlib

_EXPORTS = {
    "build_tokenizer": "tokenizer",
    "build_tiny_model": "tiny",
    "resolve_pretrained": "loading",
    "load_tokenizer": "loading",
    "load_causal_lm": "loading",
    "check_packing": "loading",
    "HubOfflineError": "loading",
    "save_lora_adapter": "lora",
    "merge_lora": "lora",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
