"""Models layer: byte-level tokenizer, tiny test models, loading (LoRA / QLoRA), adapter merging."""
from .loading import HubOfflineError, check_packing, load_causal_lm, load_tokenizer, resolve_pretrained
from .lora import merge_lora, save_lora_adapter
from .tiny import build_tiny_model
from .tokenizer import build_tokenizer

__all__ = ["build_tokenizer", "build_tiny_model", "resolve_pretrained", "load_tokenizer", "load_causal_lm",
           "check_packing", "HubOfflineError", "save_lora_adapter", "merge_lora"]
