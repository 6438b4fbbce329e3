"""Critic loss, per token (before aggregation)."""
from __future__ import annotations

from typing import Optional

import torch

Tensor = torch.Tensor


def value_loss(values: Tensor, old_values: Tensor, returns: Tensor, mask: Tensor,
               value_clip: Optional[float] = None) -> tuple[Tensor, dict[str, Tensor]]:
    """Clipped value loss [B, R] (0 on padding) and metrics.

    Unclipped (``value_clip=None``):  ½ (v_t − R_t)²
    Clipped with c = value_clip:      v_clip = v_old + clip(v − v_old, −c, c)
                                      ½ max((v_t − R_t)², (v_clip_t − R_t)²)

    ``values`` are the critic's current values (with gradient), ``old_values`` the values at
    experience time, ``returns`` the targets (e.g. GAE's A + V).  Metrics (detached means over the
    valid tokens of this call): ``value_clip_frac`` (tokens where the clipped term is the larger),
    ``values_mean``.
    """
    m = mask.float()
    valid = mask.bool()
    zero = torch.zeros((), dtype=torch.float32, device=values.device)
    # padded positions are replaced before any arithmetic so garbage there (inf/nan) cannot leak
    # into the loss or the gradient
    v = torch.where(valid, values.float(), zero)
    ret = torch.where(valid, returns.detach().float(), zero)
    err = (v - ret) ** 2
    if value_clip is None:
        loss = 0.5 * err
        clipped = torch.zeros_like(err, dtype=torch.bool)
    else:
        if value_clip <= 0:
            raise ValueError(f"value_clip must be > 0 or None, got {value_clip}")
        old = torch.where(valid, old_values.detach().float(), zero)
        v_clip = old + (v - old).clamp(-value_clip, value_clip)
        err_clip = (v_clip - ret) ** 2
        loss = 0.5 * torch.maximum(err, err_clip)
        clipped = err_clip > err
    n = m.sum().clamp(min=1.0)
    metrics = {
        "value_clip_frac": (clipped.float() * m).sum() / n,
        "values_mean": (v.detach() * m).sum() / n,
    }
    return loss * m, metrics
