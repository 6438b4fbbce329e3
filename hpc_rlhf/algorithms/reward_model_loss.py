"""Reward-model losses: pairwise (outcome) reward models and process reward models (PRM).

Both return ``(loss, metrics)``: ``loss`` is a 0-dim mean over the pairs (steps) of the call,
``metrics`` detached tensors.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.nn.functional as F

Tensor = torch.Tensor


def pairwise_reward_loss(chosen_rewards: Tensor, rejected_rewards: Tensor,
                         margin: Optional[Tensor] = None, *,
                         loss_type: str = "sigmoid") -> tuple[Tensor, dict[str, Tensor]]:
    """Bradley–Terry loss of a reward model on B (chosen, rejected) pairs of scalar rewards:

        sigmoid:  ℓ_i = −log σ(r_c,i − r_r,i − m_i)
        log_exp:  ℓ_i = log(1 + exp(r_r,i − r_c,i + m_i))

    mean over the B pairs; ``margin`` m [B] (or a scalar) is optional (0).  The two types are equal
    in value, with or without a margin, since −log σ(x) = log(1 + e^{−x}); log_exp is the same
    function written as a softplus, kept as its own name for configs that ask for it.  Both are
    computed stably (logsigmoid / softplus).  Metrics: ``accuracy`` (fraction of pairs with
    r_c > r_r, margin ignored), ``chosen_rewards``/``rejected_rewards``/``margins`` [B]."""
    rc, rr = chosen_rewards.float(), rejected_rewards.float()
    diff = rc - rr
    if margin is not None:
        diff = diff - torch.as_tensor(margin, dtype=diff.dtype, device=diff.device).detach()
    if loss_type == "sigmoid":
        per_pair = -F.logsigmoid(diff)
    elif loss_type == "log_exp":
        per_pair = F.softplus(-diff)
    else:
        raise ValueError(f"unknown reward loss_type {loss_type!r}; known: log_exp, sigmoid")
    c, r = rc.detach(), rr.detach()
    metrics = {"accuracy": (c > r).float().mean(), "chosen_rewards": c, "rejected_rewards": r,
               "margins": c - r}
    return per_pair.mean(), metrics


def process_reward_loss(logits: Tensor, targets: Tensor, mask: Tensor,
                        reward_token_ids: Sequence[int]) -> tuple[Tensor, dict[str, Tensor]]:
    """PRM loss at the step placeholder positions, over the K reward tokens only.

    ``logits`` [..., V] (e.g. [N, V] or [B, T, V]); ``mask`` [...] marks the placeholder positions
    (the others, whatever their logits or targets, are left out); ``reward_token_ids`` the K
    vocabulary ids the PRM answers with.  q_k = softmax over the K selected logits.

    hard labels (integer ``targets`` [...], an index into ``reward_token_ids``):
        ℓ_n = −log q_{target_n}
    soft labels (floating ``targets`` [...], K = 2, reward_token_ids = (negative, positive)):
        ℓ_n = −(s_n log q_1 + (1 − s_n) log q_0)        s_n = target probability of the positive
                                                          token; = BCE on the logit difference
    With ids ordered (negative, positive), hard 1 / 0 and soft 1.0 / 0.0 are the same loss.

    loss = mean over the placeholder positions of the call (0 when there are none).  Metrics:
    ``accuracy`` = fraction of steps whose argmax_k q_k is the label (soft: is q_1 > 0.5 the same
    as s > 0.5), ``steps`` = number of placeholder positions."""
    ids = torch.as_tensor(list(reward_token_ids), dtype=torch.long, device=logits.device)
    valid = mask.bool().reshape(-1)
    # select the valid rows before any arithmetic: garbage (nan) elsewhere gets no gradient
    z = logits.reshape(-1, logits.shape[-1])[valid].index_select(-1, ids).float()
    logq = F.log_softmax(z, dim=-1)
    tgt = targets.reshape(-1)[valid]
    n = z.shape[0]
    if tgt.is_floating_point():
        if ids.numel() != 2:
            raise ValueError("soft PRM labels need exactly 2 reward tokens (negative, positive)")
        s = tgt.detach().float()
        per_step = -(s * logq[:, 1] + (1.0 - s) * logq[:, 0])
        correct = (logq[:, 1] > logq[:, 0]) == (s > 0.5)
    else:
        t = tgt.long()
        if n and (int(t.min()) < 0 or int(t.max()) >= ids.numel()):
            raise ValueError(f"hard PRM targets must be in [0, {ids.numel()}) at placeholders")
        per_step = -logq.gather(-1, t[:, None]).squeeze(-1)
        correct = logq.argmax(-1) == t
    loss = per_step.sum() / max(n, 1)
    acc = correct.float().sum().detach() / max(n, 1)
    return loss, {"accuracy": acc, "steps": torch.tensor(float(n))}
