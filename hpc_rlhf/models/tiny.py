"""Tiny randomly initialised causal LMs (with the byte-level tokenizer) for tests and smoke runs."""
from __future__ import annotations

import argparse
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

from .tokenizer import IM_END, build_tokenizer

ARCHS = ("llama", "qwen2", "mistral", "gpt2", "mixtral")
_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


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
    if dtype not in _DTYPES:
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
    model = AutoModelForCausalLM.from_config(config, dtype=_DTYPES[dtype])
    model.generation_config = GenerationConfig(eos_token_id=[tok.eos_token_id, im_end],
                                               pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    return out


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``hpc-rlhf tiny-model OUT ...``."""
    parser.add_argument("out", help="folder to write the model and tokenizer to")
    parser.add_argument("--arch", choices=ARCHS, default="llama", help="model architecture")
    parser.add_argument("--hidden-size", type=int, default=64, help="hidden size")
    parser.add_argument("--layers", type=int, default=2, help="number of transformer layers")
    parser.add_argument("--heads", type=int, default=4, help="attention heads")
    parser.add_argument("--kv-heads", type=int, default=None, help="key/value heads (default: --heads)")
    parser.add_argument("--intermediate-size", type=int, default=None, help="MLP size (default: 4 x hidden)")
    parser.add_argument("--max-position", type=int, default=512, help="maximum sequence length")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    parser.add_argument("--dtype", choices=tuple(_DTYPES), default="fp32", help="dtype of the saved weights")


def run_cli(args: argparse.Namespace) -> None:
    """Build the model described by ``args``; print its path and parameter count."""
    out = build_tiny_model(args.out, arch=args.arch, hidden_size=args.hidden_size, num_layers=args.layers,
                           num_heads=args.heads, num_kv_heads=args.kv_heads,
                           intermediate_size=args.intermediate_size,
                           max_position_embeddings=args.max_position, seed=args.seed, dtype=args.dtype)
    print(f"wrote {args.arch} model to {out} ({count_parameters(out):,} parameters)")


def count_parameters(model_dir) -> int:
    """Number of weights stored in the safetensors files of ``model_dir`` (without loading them)."""
    from safetensors import safe_open
    n = 0
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            for key in st.keys():
                numel = 1
                for d in st.get_slice(key).get_shape():
                    numel *= d
                n += numel
    return n
