"""Tiny randomly initialised causal LMs (with the byte-level tokenizer) for tests and smoke runs."""
from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open
from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

from .files import follow_umask
from .tokenizer import IM_END, build_tokenizer

ARCHS = ("llama", "qwen2", "mistral", "gpt2", "mixtral")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _model_config(arch: str, vocab: int, hidden: int, layers: int, heads: int, kv_heads: int,
                  inter: int, max_pos: int, ids: dict):
    if arch == "gpt2":
        if kv_heads != heads:
            raise ValueError("gpt2 has no grouped-query attention: leave num_kv_heads unset")
        return AutoConfig.for_model("gpt2", vocab_size=vocab, n_embd=hidden, n_layer=layers, n_head=heads,
                                    n_inner=inter, n_positions=max_pos, resid_pdrop=0.0, embd_pdrop=0.0,
                                    attn_pdrop=0.0, **ids)  # no dropout, like the llama family
    extra = {"num_local_experts": 4, "num_experts_per_tok": 2} if arch == "mixtral" else {}
    if arch in ("mistral", "mixtral"):
        extra["sliding_window"] = None
    return AutoConfig.for_model(arch, vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers,
                                num_attention_heads=heads, num_key_value_heads=kv_heads,
                                intermediate_size=inter, max_position_embeddings=max_pos,
                                tie_word_embeddings=False, **ids, **extra)


def build_tiny_model(out_dir, arch: str = "llama", hidden_size: int = 64, num_layers: int = 2,
                     num_heads: int = 4, num_kv_heads: int | None = None,
                     intermediate_size: int | None = None, max_position_embeddings: int = 512, seed: int = 0,
                     dtype: str = "fp32") -> Path:
    """Write a seeded random ``arch`` model plus the byte-level tokenizer to ``out_dir``; return the path."""
    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}: choose one of {', '.join(ARCHS)}")
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}: choose fp32 or bf16")
    if hidden_size % num_heads:
        raise ValueError(f"hidden_size {hidden_size} is not divisible by num_heads {num_heads}")
    kv_heads = num_kv_heads or num_heads
    if num_heads % kv_heads:
        raise ValueError(f"num_heads {num_heads} is not divisible by num_kv_heads {kv_heads}")
    tok = build_tokenizer(model_max_length=max_position_embeddings)
    im_end = tok.convert_tokens_to_ids(IM_END)
    # The tokenizer has no BOS token, so the model config has none either.
    ids = {"bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id,
           "pad_token_id": tok.pad_token_id}
    config = _model_config(arch, len(tok), hidden_size, num_layers, num_heads, kv_heads,
                           intermediate_size or 4 * hidden_size, max_position_embeddings, ids)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=DTYPES[dtype])
    model.generation_config = GenerationConfig(eos_token_id=[tok.eos_token_id, im_end],
                                               pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    follow_umask(out)
    return out


def count_parameters(model_dir) -> int:
    """Number of weights stored in the safetensors files of ``model_dir`` (without loading them)."""
    n = 0
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            for key in st.keys():
                numel = 1
                for d in st.get_slice(key).get_shape():
                    numel *= d
                n += numel
    return n
