"""Masked statistics over every valid token of every data-parallel rank, and whitening.

``all_reduce`` sums a tensor over the data-parallel ranks and returns the sum (on every rank);
``None`` means a single process.  Every rank must call these functions the same number of times,
in the same order, even with an all-zero mask (a rank with no valid tokens still contributes 0).
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

AllReduce = Optional[Callable[[torch.Tensor], torch.Tensor]]


def _valid(x: torch.Tensor, mask: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    xf = x.to(dtype)
    return torch.where(mask.bool(), xf, torch.zeros_like(xf))


def _sum(t: torch.Tensor, all_reduce: AllReduce) -> torch.Tensor:
    return t if all_reduce is None else all_reduce(t)


def masked_sum(x: torch.Tensor, mask: torch.Tensor, all_reduce: AllReduce = None) -> torch.Tensor:
    """Σ x·mask over all elements (and all ranks)."""
    return _sum(_valid(x, mask).sum(), all_reduce)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, all_reduce: AllReduce = None) -> torch.Tensor:
    """Σ x·mask / Σ mask over all elements and all ranks (0 where there are no valid elements)."""
    m = mask.float()
    s = _sum(torch.stack([_valid(x, mask).sum(), m.sum()]), all_reduce)
    return s[0] / s[1].clamp(min=1.0)


def masked_mean_var(x: torch.Tensor, mask: torch.Tensor,
                    all_reduce: AllReduce = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Global masked mean μ = Σ x m / N and POPULATION variance σ² = Σ (x − μ)² m / N (float64).

    N = Σ m over all ranks.  Two reductions (sum/count, then the centred sum of squares) keep it
    numerically stable for large means.  N = 0 gives μ = σ² = 0.  ``x`` is rounded to float32 and
    the statistics are taken in float64, where the sum of up to 2^29 float32 values that are all
    equal is exact: N equal values get μ equal to each of them and σ² = 0 (in float32 the mean of
    N copies of 0.7 lands an ulp away, which whitening would blow up by 1/sqrt(eps)).
    """
    m = mask.double()
    xd = _valid(x.float(), mask, torch.float64)
    s = _sum(torch.stack([xd.sum(), m.sum()]), all_reduce)
    mean = s[0] / s[1].clamp(min=1.0)
    s = _sum(torch.stack([((xd - mean) ** 2 * m).sum(), m.sum()]), all_reduce)
    var = s[0] / s[1].clamp(min=1.0)
    return mean, var


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, all_reduce: AllReduce = None,
                  shift_mean: bool = True, eps: float = 1e-8) -> torch.Tensor:
    """(x − μ) / sqrt(σ² + eps) with the global masked μ, σ² of ``masked_mean_var``.

    ``shift_mean=False`` rescales without centring: μ + (x − μ)/sqrt(σ² + eps).  Invalid positions
    (mask 0) are 0 in the result.  Statistics in float64, the result in float32.
    """
    xd = _valid(x.float(), mask, torch.float64)
    mean, var = masked_mean_var(x, mask, all_reduce)
    out = (xd - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        out = out + mean
    return torch.where(mask.bool(), out, torch.zeros_like(out)).float()
