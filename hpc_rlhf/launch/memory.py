"""Memory per rank of each role, estimated from the model config and the run's settings.

Counts (bytes per parameter; N parameters, D data-parallel ranks of the role):
- weights: 2 (bf16) or 4 (fp32); ZeRO-3 divides them by D.
- gradients of a trained model: the same dtype as the weights; ZeRO-2/3 divide them by D.
- AdamW: two fp32 moments (8) plus an fp32 master copy (4) when the weights are bf16; ZeRO-1/2/3
  divide them by D; with `adam_offload` they sit in CPU memory instead.
- LoRA: gradients and optimizer states of the adapters only (counted as zero here).
- activations of one micro-batch, without recomputation, about 34 · tokens · hidden bytes per layer
  in 16-bit (Korthikanti et al. 2022, without the attention-score term that fused attention avoids;
  doubled in fp32); with gradient checkpointing, 2 · tokens · hidden per layer plus one full layer.
- rollout: weights plus the key/value cache of the rank's sequences at full length.
An estimate for planning: allocator fragmentation, CUDA context (~0.5–1 GiB) and framework buffers
are not in it.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from ..models.loading import resolve_pretrained


@dataclass(frozen=True)
class ModelShape:
    params: int
    hidden: int
    layers: int
    kv_heads: int
    head_dim: int


def model_shape(pretrain: str) -> ModelShape:
    """Parameter count and dimensions from the model's config, on the meta device (no weights read)."""
    cfg = AutoConfig.from_pretrained(resolve_pretrained(pretrain))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    params = sum(p.numel() for p in model.parameters())
    heads = getattr(cfg, "num_attention_heads", 1)
    return ModelShape(params=params, hidden=cfg.hidden_size, layers=cfg.num_hidden_layers,
                      kv_heads=getattr(cfg, "num_key_value_heads", None) or heads,
                      head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // heads)


def _dtype_bytes(param_dtype: str) -> int:
    return 2 if param_dtype == "bf16" else 4


def trained(shape: ModelShape, param_dtype: str, zero_stage: int, ranks: int, lora: bool, offload: bool,
            micro_batch: int, seq_len: int, checkpointing: bool) -> dict[str, int]:
    b = _dtype_bytes(param_dtype)
    n = shape.params
    out = {"weights": n * b // (ranks if zero_stage == 3 else 1)}
    if not lora:
        out["gradients"] = n * b // (ranks if zero_stage >= 2 else 1)
        optim = n * (8 + (4 if b == 2 else 0)) // (ranks if zero_stage >= 1 else 1)
        out["optimizer (CPU)" if offload else "optimizer"] = optim
    tokens = micro_batch * seq_len
    act_bytes = 34 * (b // 2)
    if checkpointing:
        out["activations"] = 2 * tokens * shape.hidden * shape.layers * (b // 2) + act_bytes * tokens * shape.hidden
    else:
        out["activations"] = act_bytes * tokens * shape.hidden * shape.layers
    return out


def frozen(shape: ModelShape, param_dtype: str) -> dict[str, int]:
    return {"weights": shape.params * _dtype_bytes(param_dtype)}


def generating(shape: ModelShape, param_dtype: str, sequences: int, seq_len: int) -> dict[str, int]:
    b = _dtype_bytes(param_dtype)
    kv = 2 * shape.layers * shape.kv_heads * shape.head_dim * b * sequences * seq_len
    return {"weights": shape.params * b, "kv cache": kv}


def gib(n: int) -> str:
    return f"{n / 2 ** 30:.2f} GiB" if n >= 2 ** 24 else f"{n / 2 ** 20:.1f} MiB"
