"""Losses that are means over the units of the whole step (tokens for KD, placeholder steps for PRM).

The shared loop back-propagates ``out.loss · out.count · W / N`` for a micro-batch of ``out.count`` items out
of the step's N items on W ranks (and data parallelism averages over the W ranks).  A unit whose loss is the
mean over the step's U units (not over its items) returns ``sum_u ℓ_u · N / (U · count)`` for the micro-batch:
the step's gradient is then that of ``Σ_u ℓ_u / U`` over all ranks and micro-batches, and the logged ``loss``
(an item-weighted mean of these values) is that same step mean, whatever the rank count and micro-batch size.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class StepUnits:
    """How many loss units (``units``) and items (``items``) the whole step (or eval set) holds."""
    units: int
    items: int


def as_item_mean(unit_sum: torch.Tensor, ctx: StepUnits, count: int) -> torch.Tensor:
    """The value a micro-batch of ``count`` items returns for a loss whose units sum to ``unit_sum``."""
    return unit_sum * (ctx.items / (max(ctx.units, 1) * count))
