"""Per-token rewards and returns of the advantage estimators (shapes as in ``advantages``): the outcome
reward on the last valid token, discounted returns, the GAE recursion, and a sample's sequence reward.
"""
from __future__ import annotations

from typing import Optional

import torch

Tensor = torch.Tensor


def _zero_pad(x: Tensor, mask: Tensor) -> Tensor:
    """x in float32 with padded positions set to 0 (robust to inf/nan garbage there)."""
    xf = x.float()
    return torch.where(mask.bool(), xf, torch.zeros_like(xf))


def outcome_token_rewards(rewards: Tensor, token_rewards: Optional[Tensor], mask: Tensor) -> Tensor:
    """r [B, R]: token rewards (masked) plus the scalar reward on each sample's last valid token."""
    m = mask.float()
    B, R = m.shape
    r = torch.zeros_like(m) if token_rewards is None else _zero_pad(token_rewards, mask)
    if R == 0:
        return r
    pos = torch.arange(1, R + 1, device=m.device, dtype=m.dtype)
    last = (pos * m).argmax(dim=-1, keepdim=True)          # index of the last position with mask 1
    has = (m.sum(-1, keepdim=True) > 0).to(m.dtype)         # samples with at least one token
    return r.scatter_add(1, last, rewards.float().reshape(B, 1) * has)


def discounted_returns(r: Tensor, mask: Tensor, gamma: float) -> Tensor:
    """G_t = Σ_{k ≥ t} γ^(k−t) r_k over the valid positions (0 on padding)."""
    m = mask.float()
    r = _zero_pad(r, mask)
    if gamma == 1.0:
        return torch.flip(torch.cumsum(torch.flip(r, [-1]), -1), [-1]) * m
    out = torch.zeros_like(r)
    running = torch.zeros_like(r[:, 0]) if r.shape[1] else None
    for t in range(r.shape[1] - 1, -1, -1):
        running = r[:, t] + gamma * running
        out[:, t] = running
    return out * m


def gae_advantages(r: Tensor, values: Tensor, mask: Tensor, gamma: float,
                   lambd: float) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation (Schulman et al. 2016), before any whitening.

    δ_t = r_t + γ V_{t+1} − V_t with V = 0 beyond the last valid token;
    A_t = Σ_{k ≥ 0} (γλ)^k δ_{t+k};  returns_t = A_t + V_t.  Both 0 on padding.
    """
    m = mask.float()
    v = _zero_pad(values.detach(), mask)
    r = _zero_pad(r, mask)
    next_v = torch.cat([v[:, 1:], torch.zeros_like(v[:, :1])], dim=1)
    delta = (r + gamma * next_v - v) * m
    gl = gamma * lambd
    if gl == 1.0:
        adv = torch.flip(torch.cumsum(torch.flip(delta, [-1]), -1), [-1])
    else:
        adv = torch.zeros_like(delta)
        running = torch.zeros_like(delta[:, 0]) if delta.shape[1] else None
        for t in range(delta.shape[1] - 1, -1, -1):
            running = delta[:, t] + gl * running
            adv[:, t] = running
    adv = adv * m
    return adv, (adv + v) * m


def sequence_reward(rewards: Tensor, token_rewards: Optional[Tensor], mask: Tensor) -> Tensor:
    """R_i = r_i + Σ_t token_rewards_{i,t} (the token rewards are 0 unless the config moves the KL
    penalty into the reward for a group estimator)."""
    r = rewards.float()
    if token_rewards is not None:
        r = r + _zero_pad(token_rewards, mask).sum(-1)
    return r
