"""Token-level negative log-likelihood and its normalisation over a whole optimizer step.

Targets are not shifted in the batch: ``labels[b, t]`` is predicted by ``logits[b, t-1]`` and
``-100`` marks positions that are not targets.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

IGNORE = -100


def token_nll_sum(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Sum of -log p(label) over every target token, and the number of targets."""
    pred = logits[:, :-1].float()
    tgt = labels[:, 1:]
    nll = F.cross_entropy(pred.reshape(-1, pred.size(-1)), tgt.reshape(-1), ignore_index=IGNORE,
                          reduction="sum")
    return nll, int((tgt != IGNORE).sum())


def step_token_mean(nll_sum: torch.Tensor, step_tokens: int, dp_world_size: int) -> torch.Tensor:
    """The loss one micro-batch back-propagates so that the step's gradient is the token mean.

    The optimizer step's loss is L = (sum of NLL over every target token of every micro-batch on
    every rank) / step_tokens.  Data-parallel gradient reduction averages over ranks (divides by
    the world size W), so each micro-batch contributes ``nll_sum * W / step_tokens``; the average
    of the ranks' summed gradients is then exactly dL.  Micro-batch count, accumulation and rank
    count do not change the result.
    """
    return nll_sum * (dp_world_size / max(step_tokens, 1))
