"""Statistics over the groups of samples of one prompt: ``group_ids`` [B] (any integers, any order, groups
of any size), taken over the samples of the call in float64.  Samples arriving in contiguous groups of n get
their ids from ``contiguous_group_ids(B, n)``.
"""
from __future__ import annotations

from typing import Optional

import torch

Tensor = torch.Tensor


def contiguous_group_ids(batch_size: int, n_samples_per_prompt: int,
                         device: Optional[torch.device] = None) -> Tensor:
    """Group ids [B] for samples that arrive in contiguous groups of ``n_samples_per_prompt``."""
    if n_samples_per_prompt < 1 or batch_size % n_samples_per_prompt:
        raise ValueError(f"batch size {batch_size} is not a multiple of n_samples_per_prompt="
                         f"{n_samples_per_prompt}")
    return torch.arange(batch_size, device=device) // n_samples_per_prompt


def _group_index(group_ids: Tensor) -> tuple[Tensor, int]:
    inv = torch.unique(group_ids, return_inverse=True)[1]
    return inv, int(inv.max().item()) + 1 if inv.numel() else 0


def group_sum_count(x: Tensor, group_ids: Tensor) -> tuple[Tensor, Tensor]:
    """For each sample: the sum of ``x`` [B] over its group and the group's size (both [B], float64)."""
    inv, n = _group_index(group_ids)
    xd = x.double()
    sums = torch.zeros(n, dtype=xd.dtype, device=x.device).index_add_(0, inv, xd)
    counts = torch.bincount(inv, minlength=n).to(xd.dtype)
    return sums[inv], counts[inv]


def group_tied(x: Tensor, group_ids: Tensor) -> Tensor:
    """[B] bool: True for every sample of a group whose values of ``x`` [B] are all exactly equal."""
    inv, n = _group_index(group_ids)
    lo = x.new_zeros(n).scatter_reduce(0, inv, x, "amin", include_self=False)
    hi = x.new_zeros(n).scatter_reduce(0, inv, x, "amax", include_self=False)
    return (lo == hi)[inv]


def group_centered(x: Tensor, group_ids: Tensor) -> Tensor:
    """x − mean_g(x) [B] in float64, exactly 0 for every sample of a group of equal values (a
    float32 mean of n copies of 0.7 lands an ulp away from them)."""
    s, c = group_sum_count(x, group_ids)
    return torch.where(group_tied(x, group_ids), 0.0, x.double() - s / c)


def group_mean_std(x: Tensor, group_ids: Tensor, unbiased: bool = True) -> tuple[Tensor, Tensor]:
    """Per-sample group mean and group standard deviation of ``x`` [B] (both [B], float64).

    ``unbiased=True``: sample std sqrt(Σ (x − mean)² / (n − 1)); a group of one sample has std 0.
    ``unbiased=False``: population std sqrt(Σ (x − mean)² / n).  A group of equal values has std 0.
    """
    s, c = group_sum_count(x, group_ids)
    sq, _ = group_sum_count(group_centered(x, group_ids) ** 2, group_ids)
    denom = (c - 1.0).clamp(min=1.0) if unbiased else c
    return s / c, torch.sqrt(sq / denom)
