"""The shape of a model, read from its ``config.json``: parameter count and the dimensions the memory plan and the
engines' memory models use.  The architectures counted here are read without torch (a login node's `hpc-rlhf
plan`); any other is built on the meta device by transformers (no weights read) and counted there."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from .paths import resolve_pretrained


@dataclass(frozen=True)
class ModelShape:
    params: int
    hidden: int
    layers: int
    kv_heads: int
    head_dim: int
    vocab: int = 0
    intermediate: int = 0     # MLP width (0: 4 x hidden)
    gated: bool = True        # a gated MLP (SwiGLU: gate and up projections)
    tied: bool = False        # input embedding and output head share their weights
    model_type: str = ""


def dtype_bytes(param_dtype: str) -> int:
    return 2 if param_dtype == "bf16" else 4


def _llama_family(c: dict) -> ModelShape:
    """llama, qwen2, mistral and mixtral: embeddings, per layer the attention (q, k, v, o; biases as the family has
    them), the MLP (gated; mixtral: a router and num_local_experts of them) and two RMS norms, a final norm, and an
    output head unless it is tied."""
    h, n, v, i = c["hidden_size"], c["num_hidden_layers"], c["vocab_size"], c["intermediate_size"]
    heads = c["num_attention_heads"]
    kv = c.get("num_key_value_heads") or heads
    hd = c.get("head_dim") or h // heads
    qkv_bias = c["model_type"] == "qwen2" or c.get("attention_bias", False)
    attn = h * heads * hd + 2 * h * kv * hd + heads * hd * h
    if qkv_bias:
        attn += heads * hd + 2 * kv * hd
    if c.get("attention_bias", False):
        attn += h  # o_proj's bias
    mlp = 3 * h * i + ((2 * i + h) if c.get("mlp_bias", False) else 0)
    if c["model_type"] == "mixtral":
        mlp = c["num_local_experts"] * 3 * h * i + h * c["num_local_experts"]
    tied = bool(c.get("tie_word_embeddings", False))
    params = v * h + n * (attn + mlp + 2 * h) + h + (0 if tied else v * h)
    return ModelShape(params=params, hidden=h, layers=n, kv_heads=kv, head_dim=hd, vocab=v, intermediate=i,
                      gated=True, tied=tied, model_type=c["model_type"])


def _gpt2(c: dict) -> ModelShape:
    """Token and position embeddings, per layer two layer norms (weight and bias), the fused qkv and output
    projections and the two-layer MLP (all with biases), a final layer norm; the head is the embedding's."""
    h, n, v, p = c["n_embd"], c["n_layer"], c["vocab_size"], c["n_positions"]
    i = c.get("n_inner") or 4 * h
    layer = 4 * h + (3 * h * h + 3 * h) + (h * h + h) + (h * i + i) + (i * h + h)
    tied = bool(c.get("tie_word_embeddings", True))
    params = v * h + p * h + n * layer + 2 * h + (0 if tied else v * h)
    return ModelShape(params=params, hidden=h, layers=n, kv_heads=c["n_head"], head_dim=h // c["n_head"], vocab=v,
                      intermediate=c.get("n_inner") or 0, gated=False, tied=tied, model_type="gpt2")


COUNTED = {"llama": _llama_family, "qwen2": _llama_family, "mistral": _llama_family, "mixtral": _llama_family,
           "gpt2": _gpt2}


def model_shape(pretrain: str) -> ModelShape:
    """The shape of the model ``pretrain`` names, from its config (no weights read)."""
    path = resolve_pretrained(pretrain)
    config = Path(path) / "config.json"
    if config.is_file():
        c = json.loads(config.read_text())
        if c.get("model_type") in COUNTED:
            return COUNTED[c["model_type"]](c)
    return built_shape(path)


def built_shape(path: str) -> ModelShape:
    """The shape of the model transformers builds from ``path``'s config on the meta device: any architecture."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(path)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    params = sum(p.numel() for p in model.parameters())
    heads = getattr(cfg, "num_attention_heads", 1)
    names = [n for n, _ in model.named_modules()]
    return ModelShape(params=params, hidden=cfg.hidden_size, layers=cfg.num_hidden_layers,
                      kv_heads=getattr(cfg, "num_key_value_heads", None) or heads,
                      head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // heads,
                      vocab=getattr(cfg, "vocab_size", 0) or 0,
                      intermediate=getattr(cfg, "intermediate_size", None) or getattr(cfg, "n_inner", None) or 0,
                      gated=any(n.endswith(("gate_proj", ".w3")) for n in names),
                      tied=bool(getattr(cfg, "tie_word_embeddings", False)), model_type=cfg.model_type)
