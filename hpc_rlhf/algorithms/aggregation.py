"""From a per-token loss [B, R] to the scalar one micro-batch back-propagates.

Normalisation is over the WHOLE optimizer step (every micro-batch of every data-parallel rank),
as for SFT (``sft_loss.step_token_mean``): each micro-batch returns its share multiplied by the
data-parallel world size W, so that summing gradients over the accumulation micro-batches and then
averaging over ranks (what DeepSpeed/DDP do) gives the gradient of the step's loss, whatever the
number of ranks, micro-batches or their sizes.

Modes (``loss_agg_mode``), with T = valid tokens, S = sequences, over the whole step:

* ``token_mean``: L = Σ_{i,t} ℓ_{i,t} / T
* ``seq_mean``:   L = Σ_i ( Σ_t ℓ_{i,t} / |y_i| ) / S         (|y_i| = valid tokens of sequence i)
* ``constant``:   L = Σ_{i,t} ℓ_{i,t} / (S · constant)        (Dr. GRPO; constant = max generation
                                                               length)
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Optional

import torch

from .registry import LOSS_AGGREGATIONS
from .whiten import AllReduce

Tensor = torch.Tensor


def _masked(token_loss: Tensor, mask: Tensor) -> Tensor:
    return torch.where(mask.bool(), token_loss, torch.zeros_like(token_loss))


@dataclass
class StepNorm:
    """Counts of the whole optimizer step over all ranks and accumulation micro-batches.

    tokens: valid (mask 1) tokens;  seqs: sequences (samples);  dp_world_size: data-parallel
    ranks whose gradients are averaged;  constant: the ``constant`` mode's per-sequence divisor
    (maximum generation length), None when that mode is not used.
    """

    tokens: float
    seqs: float
    dp_world_size: int = 1
    constant: Optional[float] = None

    @classmethod
    def from_masks(cls, masks: Iterable[Tensor], dp_world_size: int = 1,
                   all_reduce: AllReduce = None, constant: Optional[float] = None) -> "StepNorm":
        """Counts of a step from this rank's micro-batch masks, summed over ranks by
        ``all_reduce`` (one collective; every rank must call it)."""
        tok = 0.0
        seq = 0.0
        device = None
        for m in masks:
            tok += float(m.float().sum())
            seq += float(m.shape[0])
            device = m.device
        t = torch.tensor([tok, seq], dtype=torch.float64, device=device)
        if all_reduce is not None:
            t = all_reduce(t)
        return cls(tokens=float(t[0]), seqs=float(t[1]), dp_world_size=int(dp_world_size),
                   constant=constant)


@LOSS_AGGREGATIONS.register("token_mean")
def _token_mean(token_loss: Tensor, mask: Tensor, norm: StepNorm) -> Tensor:
    return _masked(token_loss, mask).sum() * (norm.dp_world_size / max(norm.tokens, 1.0))


@LOSS_AGGREGATIONS.register("seq_mean")
def _seq_mean(token_loss: Tensor, mask: Tensor, norm: StepNorm) -> Tensor:
    m = mask.float()
    per_seq = _masked(token_loss, mask).sum(-1) / m.sum(-1).clamp(min=1.0)
    return per_seq.sum() * (norm.dp_world_size / max(norm.seqs, 1.0))


@LOSS_AGGREGATIONS.register("constant")
def _constant(token_loss: Tensor, mask: Tensor, norm: StepNorm) -> Tensor:
    if norm.constant is None or norm.constant <= 0:
        raise ValueError("loss_agg_mode 'constant' needs StepNorm.constant > 0 "
                         "(the maximum generation length)")
    return _masked(token_loss, mask).sum() * (
        norm.dp_world_size / (max(norm.seqs, 1.0) * float(norm.constant)))


def aggregate(token_loss: Tensor, mask: Tensor, mode: str, norm: StepNorm) -> Tensor:
    """This micro-batch's share of the step loss in mode ``mode`` (token_mean, seq_mean, constant).

    Summed over the step's micro-batches on a rank and averaged over the W ranks, the shares give
    exactly the step loss L of the module doc (and so its gradient).  On one rank with one
    micro-batch it is L itself.  Padded positions never contribute.
    """
    return LOSS_AGGREGATIONS.get(mode)(token_loss, mask, norm)
