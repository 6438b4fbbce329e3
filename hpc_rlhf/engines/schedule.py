"""Learning-rate schedules as pure functions of the step, wrapped as a torch LambdaLR."""
from __future__ import annotations

import math

import torch


def lr_factor(step: int, total_steps: int, warmup_steps: int, kind: str, min_ratio: float) -> float:
    """Multiplier of the peak lr at optimizer step ``step`` (0-based: the lr used by update step+1).

    Linear warm-up from 1/(warmup+1) to 1 over ``warmup_steps`` steps, then
    ``cosine_with_min_lr``: min_ratio + (1 - min_ratio) * (1 + cos(pi * progress)) / 2, with
    progress going 0 -> 1 over the remaining steps; ``constant_with_warmup``: 1.
    """
    if step < warmup_steps:
        return (step + 1) / (warmup_steps + 1)
    if kind == "constant_with_warmup":
        return 1.0
    if kind != "cosine_with_min_lr":
        raise ValueError(f"unknown lr_scheduler {kind!r}")
    decay_steps = max(1, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / decay_steps)
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def make_scheduler(optimizer: torch.optim.Optimizer, total_steps: int, warmup_ratio: float, kind: str,
                   min_ratio: float) -> torch.optim.lr_scheduler.LambdaLR:
    warmup = math.ceil(total_steps * warmup_ratio)
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_factor(s, total_steps, warmup, kind, min_ratio))
