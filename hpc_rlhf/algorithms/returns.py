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


def has_gaps(mask: Tensor) -> bool:
    """Some row has a 0 before a 1 (multi-turn samples: feedback tokens between the turns' action tokens)."""
    return bool((mask[:, 1:] > mask[:, :-1]).any()) if mask.shape[1] > 1 else False


def action_positions(mask: Tensor) -> tuple[Tensor, Tensor]:
    """(index [B, A], compact mask [B, A]): row b's positions with mask 1, in order, left aligned (A = the
    largest count; padding entries index 0 with compact mask 0).  The MDP of a multi-turn sample steps over
    its action tokens only: returns and GAE run on the compacted rows, so no feedback token sits between
    one action token and the next."""
    m = mask.bool()
    counts = m.sum(-1)
    A = int(counts.max()) if m.numel() else 0
    cmask = (torch.arange(A, device=mask.device)[None, :] < counts[:, None]).to(mask.dtype)
    # a stable sort of "not an action" puts the action positions first, in order
    order = torch.sort((~m).to(torch.int8), dim=-1, stable=True).indices[:, :A]
    return torch.where(cmask.bool(), order, torch.zeros_like(order)), cmask


def compact(x: Tensor, index: Tensor, cmask: Tensor) -> Tensor:
    """x [B, R] at the action positions: [B, A] (0 on padding)."""
    return torch.gather(x.float(), 1, index) * cmask.to(torch.float32)


def expand(xc: Tensor, index: Tensor, cmask: Tensor, width: int) -> Tensor:
    """The inverse of :func:`compact`: [B, A] back to [B, width], 0 off the action positions."""
    out = torch.zeros((xc.shape[0], width), dtype=xc.dtype, device=xc.device)
    return out.scatter_add(1, index, xc * cmask.to(xc.dtype))
