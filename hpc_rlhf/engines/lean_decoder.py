"""A lean forward pass for llama-family decoders (llama, qwen2, mistral) during generation.

Generating from a small model is bound by the Python work of each forward call (module wrappers,
mask building, cache objects), not by arithmetic.  This decoder runs the same math as the
transformers forward with a fraction of the calls: it reads the weights of the Hugging Face module
in place (nothing is copied, so loading new weights into the module takes effect at once), keeps
a preallocated key/value cache, and builds one attention mask per call.  Tests compare its logits
with the transformers forward.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

SUPPORTED = ("llama", "qwen2", "mistral")


def lean_supported(model: torch.nn.Module) -> bool:
    cfg = getattr(model, "config", None)
    if cfg is None or getattr(cfg, "model_type", None) not in SUPPORTED:
        return False
    window = getattr(cfg, "sliding_window", None)
    if getattr(cfg, "use_sliding_window", True) and window is not None and window < cfg.max_position_embeddings:
        return False
    layer = model.model.layers[0]
    return (getattr(cfg, "hidden_act", "silu") == "silu" and getattr(cfg, "pretraining_tp", 1) == 1
            and hasattr(layer.mlp, "gate_proj") and hasattr(layer.self_attn, "q_proj"))


def _rms(x: torch.Tensor, norm: torch.nn.Module) -> torch.Tensor:
    var = x.float().pow(2).mean(-1, keepdim=True)
    return norm.weight * (x.float() * torch.rsqrt(var + norm.variance_epsilon)).to(x.dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class LeanDecoder:
    def __init__(self, model: torch.nn.Module):
        if not lean_supported(model):
            raise ValueError(f"the lean decoder does not support {type(model).__name__}")
        cfg = model.config
        self.model, self.body = model, model.model
        self.heads = cfg.num_attention_heads
        self.kv_heads = getattr(cfg, "num_key_value_heads", None) or self.heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.heads
        self.scale = self.head_dim ** -0.5

    def start(self, batch: int, capacity: int, dtype: torch.dtype, device: torch.device) -> None:
        """Allocate the cache for ``batch`` rows of up to ``capacity`` positions."""
        shape = (batch, self.kv_heads, capacity, self.head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in self.body.layers]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in self.body.layers]
        self.key_valid = torch.zeros((batch, capacity), dtype=torch.bool, device=device)
        self.length = 0

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """Append ``ids`` [B, T] (``valid`` False on padding) and return the last position's logits [B, V]."""
        B, T = ids.shape
        start, end = self.length, self.length + T
        self.key_valid[:, start:end] = valid
        slots = torch.arange(start, end, device=ids.device)
        keys = torch.arange(end, device=ids.device)
        allowed = (keys[None, :] <= slots[:, None])[None] & self.key_valid[:, None, :end]
        allowed |= keys[None, None, :] == slots[None, :, None]  # padded queries see themselves: no empty rows
        mask = allowed[:, None]
        h = self.body.embed_tokens(ids)
        cos, sin = self.body.rotary_emb(h, positions)
        cos, sin = cos[:, None], sin[:, None]
        for i, layer in enumerate(self.body.layers):
            attn = layer.self_attn
            x = _rms(h, layer.input_layernorm)
            q = F.linear(x, attn.q_proj.weight, attn.q_proj.bias).view(B, T, self.heads, self.head_dim).transpose(1, 2)
            k = F.linear(x, attn.k_proj.weight, attn.k_proj.bias).view(B, T, self.kv_heads, self.head_dim).transpose(1, 2)
            v = F.linear(x, attn.v_proj.weight, attn.v_proj.bias).view(B, T, self.kv_heads, self.head_dim).transpose(1, 2)
            q = q * cos + _rotate_half(q) * sin
            k = k * cos + _rotate_half(k) * sin
            self.keys[i][:, :, start:end] = k
            self.values[i][:, :, start:end] = v
            o = F.scaled_dot_product_attention(q, self.keys[i][:, :, :end], self.values[i][:, :, :end], attn_mask=mask,
                                               scale=self.scale, enable_gqa=self.kv_heads != self.heads)
            h = h + F.linear(o.transpose(1, 2).reshape(B, T, -1), attn.o_proj.weight, attn.o_proj.bias)
            x = _rms(h, layer.post_attention_layernorm)
            mlp = layer.mlp
            gate = F.linear(x, mlp.gate_proj.weight, mlp.gate_proj.bias)
            up = F.linear(x, mlp.up_proj.weight, mlp.up_proj.bias)
            h = h + F.linear(F.silu(gate) * up, mlp.down_proj.weight, mlp.down_proj.bias)
        self.length = end
        last = _rms(h[:, -1], self.body.norm)
        head = self.model.lm_head
        return F.linear(last, head.weight, head.bias)
