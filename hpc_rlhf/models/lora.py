"""Save LoRA adapters and merge them into their base model (``hpc-rlhf lora-merge``)."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from .files import follow_umask
from .paths import resolve_pretrained

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def save_lora_adapter(peft_model, out_dir, tokenizer=None) -> Path:
    """Write the adapter (adapter_config.json + safetensors) and, if given, the tokenizer to ``out_dir``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    peft_model.save_pretrained(out, safe_serialization=True)
    if tokenizer is not None:
        tokenizer.save_pretrained(out)
    follow_umask(out)
    return out


def _adapter_base(adapter_dir: Path) -> str | None:
    cfg_file = adapter_dir / "adapter_config.json"
    if not cfg_file.is_file():
        full_model = (adapter_dir / "config.json").is_file()
        hint = " (it holds a full model: there is nothing to merge)" if full_model else ""
        raise FileNotFoundError(f"{adapter_dir} has no adapter_config.json{hint}: pass the folder written by "
                                "a LoRA run (lora_rank > 0)")
    return json.loads(cfg_file.read_text()).get("base_model_name_or_path")


def merge_lora(adapter_dir, out_dir, base: str | None = None, dtype: str = "fp32") -> Path:
    """Load the base model, apply the adapter in ``adapter_dir``, merge it and save a plain HF model."""
    from peft import PeftModel
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}: choose fp32 or bf16")
    adapter_dir = Path(adapter_dir)
    if not adapter_dir.is_dir():
        raise FileNotFoundError(f"adapter folder {adapter_dir} does not exist")
    base = base or _adapter_base(adapter_dir)
    if not base:
        raise ValueError(f"{adapter_dir}/adapter_config.json names no base model: pass --base PATH")
    _adapter_base(adapter_dir)  # fails clearly when adapter_config.json is missing, even with --base
    base = resolve_pretrained(base)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=DTYPES[dtype])
    merged = PeftModel.from_pretrained(model, str(adapter_dir)).merge_and_unload()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    merged.save_pretrained(out, safe_serialization=True)
    tok_src = adapter_dir if (adapter_dir / "tokenizer_config.json").is_file() else base
    AutoTokenizer.from_pretrained(str(tok_src)).save_pretrained(out)
    follow_umask(out)
    return out
