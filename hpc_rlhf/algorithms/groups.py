"""Statistics over the groups of samples of one prompt: ``group_ids`` [B] (any integers, any order, groups
of any size), taken over the samples of the call in float64.  Samples arriving in contiguous groups of n get
their ids from ``contiguous_group_ids(B, n)``.

``valid`` [B] bool (None: all) marks the samples whose reward exists: an invalid sample (its reward function
failed) enters no statistic of its group, and its own centred value is 0.
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


def _valid(x: Tensor, valid: Optional[Tensor]) -> Tensor:
    return torch.ones_like(x, dtype=torch.bool) if valid is None else valid.to(torch.bool)


def group_sum_count(x: Tensor, group_ids: Tensor, valid: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    """For each sample: the sum of ``x`` [B] over the valid samples of its group and their number (both
    [B], float64; a group without valid samples: 0 and 0)."""
    inv, n = _group_index(group_ids)
    v = _valid(x, valid)
    xd = torch.where(v, x.double(), 0.0)
    sums = torch.zeros(n, dtype=xd.dtype, device=x.device).index_add_(0, inv, xd)
    counts = torch.zeros(n, dtype=xd.dtype, device=x.device).index_add_(0, inv, v.double())
    return sums[inv], counts[inv]


def group_tied(x: Tensor, group_ids: Tensor, valid: Optional[Tensor] = None) -> Tensor:
    """[B] bool: True for every sample of a group whose valid values of ``x`` [B] are all exactly equal
    (a group with fewer than two valid samples counts as tied)."""
    inv, n = _group_index(group_ids)
    v = _valid(x, valid)
    lo = x.new_full((n,), torch.inf).scatter_reduce(0, inv, torch.where(v, x, torch.inf), "amin")
    hi = x.new_full((n,), -torch.inf).scatter_reduce(0, inv, torch.where(v, x, -torch.inf), "amax")
    return ((lo == hi) | (lo > hi))[inv]


def group_centered(x: Tensor, group_ids: Tensor, valid: Optional[Tensor] = None) -> Tensor:
    """x − mean_g(x) [B] in float64 over the valid samples of each group; exactly 0 for every sample of a
    group of equal values or of fewer than two valid samples (a float32 mean of n copies of 0.7 lands an
    ulp away from them), and for the invalid samples."""
    s, c = group_sum_count(x, group_ids, valid)
    zero = group_tied(x, group_ids, valid) | ~_valid(x, valid)
    return torch.where(zero, 0.0, x.double() - s / c.clamp(min=1.0))


def group_mean_std(x: Tensor, group_ids: Tensor, unbiased: bool = True,
                   valid: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    """Per-sample group mean and group standard deviation of ``x`` [B] over the valid samples of each
    group (both [B], float64).

    ``unbiased=True``: sample std sqrt(Σ (x − mean)² / (n − 1)); a group of one sample has std 0.
    ``unbiased=False``: population std sqrt(Σ (x − mean)² / n).  A group of equal values has std 0, a group
    without valid samples mean 0 and std 0.
    """
    s, c = group_sum_count(x, group_ids, valid)
    sq, _ = group_sum_count(group_centered(x, group_ids, valid) ** 2, group_ids, valid)
    denom = (c - 1.0).clamp(min=1.0) if unbiased else c.clamp(min=1.0)
    return s / c.clamp(min=1.0), torch.sqrt(sq / denom)
