"""Reward shaping: combining sources, running normalisation, clipping and length penalties.

Everything here is a pure function of its inputs except :class:`RunningMoments`, whose state is three
numbers that go into checkpoints through ``state_dict`` / ``load_state_dict``.  Invalid samples (NaN
rewards, ``valid`` False) stay NaN through every function, so they cannot be trained on by mistake.
"""
from __future__ import annotations

import math
from typing import Callable, Sequence

import torch

from .errors import RewardError
from .types import RewardBatch, merge_extras


def combine(sources: list[RewardBatch], weights: list[float], names: list[str] | None = None) -> RewardBatch:
    """``sum_i weights[i] * sources[i].rewards``; a sample is valid only where every source is valid.

    ``extra`` merges the sources' extras (counts summed, means averaged); ``errors`` are concatenated.
    ``predictions``: per sample, the first source's (in order) that is not None; None when no source has any.
    ``components``, given the sources' ``names``, when there are several sources or one has components: each
    source's components, or its reward as one component named after it (unweighted; names must not repeat).
    """
    if not sources:
        raise ValueError("combine needs at least one reward source")
    if len(weights) != len(sources):
        raise ValueError(f"{len(sources)} reward sources but {len(weights)} weights")
    n = len(sources[0])
    for i, s in enumerate(sources):
        if len(s) != n:
            raise ValueError(f"reward source {i} has {len(s)} samples, source 0 has {n}")
    valid = torch.ones(n, dtype=torch.bool)
    total = torch.zeros(n, dtype=torch.float32)
    for s, w in zip(sources, weights):
        valid &= s.valid
        total = total + float(w) * torch.where(s.valid, s.rewards, torch.zeros_like(s.rewards))
    total = torch.where(valid, total, torch.nan)
    extra = merge_extras([(s.extra, float(s.valid.sum())) for s in sources])
    predictions = None
    with_predictions = [s.predictions for s in sources if s.predictions is not None]
    if with_predictions:
        predictions = [next((p[i] for p in with_predictions if p[i] is not None), None) for i in range(n)]
    components, component_names = None, ()
    if names is not None and (len(sources) > 1 or any(s.components is not None for s in sources)):
        parts = [(s.components, s.component_names) if s.components is not None else (s.rewards[:, None], (name,))
                 for s, name in zip(sources, names, strict=True)]
        component_names = tuple(c for _, part in parts for c in part)
        twice = sorted({c for c in component_names if component_names.count(c) > 1})
        if twice:
            raise RewardError(f"reward component {twice[0]!r} comes from two reward sources ({', '.join(names)}): "
                              f"rename it")
        components = torch.where(valid[:, None], torch.cat([c for c, _ in parts], 1), torch.nan)
    return RewardBatch(rewards=total, valid=valid, extra=extra, errors=[e for s in sources for e in s.errors],
                       predictions=predictions, components=components, component_names=component_names)


class RunningMoments:
    """Running mean and variance of everything passed to :meth:`update`.

    Batches are merged with Chan et al.'s parallel formula (count, mean, M2), in float64.  With
    ``all_reduce`` (a function that sums a tensor over ranks, in place or by returning the sum, e.g.
    ``torch.distributed.all_reduce``) each update first reduces the batch over all ranks, so every rank
    keeps identical moments: two sum-reductions, ``[n, sum x]`` and then ``sum (x - batch_mean)^2``.
    """

    def __init__(self, all_reduce: Callable[[torch.Tensor], object] | None = None):
        self.all_reduce = all_reduce
        self.count = 0.0
        self.mean = 0.0
        self.m2 = 0.0

    def _reduce(self, t: torch.Tensor) -> torch.Tensor:
        if self.all_reduce is None:
            return t
        out = self.all_reduce(t)
        return out if isinstance(out, torch.Tensor) else t

    def _merge(self, n: float, mean: float, m2: float) -> None:
        if n <= 0:
            return
        total = self.count + n
        delta = mean - self.mean
        self.mean += delta * n / total
        self.m2 += m2 + delta * delta * self.count * n / total
        self.count = total

    def update(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> None:
        """Add the (finite, and where ``mask`` is True) entries of ``x``."""
        x = torch.as_tensor(x).detach().reshape(-1).to("cpu", torch.float64)
        keep = torch.isfinite(x)
        if mask is not None:
            keep &= torch.as_tensor(mask, dtype=torch.bool).reshape(-1).cpu()
        x = x[keep]
        head = self._reduce(torch.tensor([float(x.numel()), float(x.sum())], dtype=torch.float64))
        n = float(head[0])
        if n <= 0:
            return
        mean = float(head[1]) / n
        m2 = float(self._reduce(torch.tensor([float(((x - mean) ** 2).sum())], dtype=torch.float64))[0])
        self._merge(n, mean, m2)

    def merge(self, other: "RunningMoments") -> None:
        """Fold another accumulator's moments into this one."""
        self._merge(other.count, other.mean, other.m2)

    @property
    def var(self) -> float:
        """Unbiased variance (like ``torch.var``); NaN before two values were seen."""
        return self.m2 / (self.count - 1) if self.count > 1 else math.nan

    @property
    def std(self) -> float:
        return math.sqrt(self.var) if self.count > 1 else math.nan

    def state_dict(self) -> dict[str, float]:
        return {"count": self.count, "mean": self.mean, "m2": self.m2}

    def load_state_dict(self, state: dict) -> None:
        self.count, self.mean, self.m2 = float(state["count"]), float(state["mean"]), float(state["m2"])


def normalize_rewards(r: torch.Tensor, moments: RunningMoments, valid: torch.Tensor | None = None,
                      update: bool = True, eps: float = 1e-8) -> torch.Tensor:
    """``(r - mean) / (std + eps)`` with running moments, updated first with the valid entries of ``r``.

    Before the moments have two values the std is taken as 1 (only the mean is removed).  Invalid / NaN
    entries are not counted and stay NaN.
    """
    r = torch.as_tensor(r)
    if update:
        moments.update(r, valid)
    if moments.count == 0:
        return r.clone()
    std = moments.std if moments.count > 1 else 1.0
    out = (r.to(torch.float64) - moments.mean) / (std + eps)
    if valid is not None:
        out = torch.where(torch.as_tensor(valid, dtype=torch.bool), out, torch.nan)
    return out.to(r.dtype if r.dtype.is_floating_point else torch.float32)


def clip_rewards(r: torch.Tensor, low: float | None, high: float | None) -> torch.Tensor:
    """Clamp rewards to ``[low, high]`` (None = unbounded on that side); NaN stays NaN."""
    if low is not None and high is not None and low > high:
        raise ValueError(f"clip_rewards: low {low} > high {high}")
    return torch.clamp(torch.as_tensor(r), min=low, max=high)


def overlong_penalty(lengths, max_len: int, buffer_len: int, factor: float = 1.0) -> torch.Tensor:
    """The soft overlong punishment of the DAPO paper (Yu et al. 2025), to add to the rewards.

    With ``L`` the response length and ``expected = max_len - buffer_len``::

        0                                   if L <= expected
        factor * (expected - L) / buffer_len   if expected < L <= max_len   (linear from 0 to -factor)
        -factor                             if L > max_len
    """
    if buffer_len <= 0 or buffer_len > max_len:
        raise ValueError(f"overlong_penalty needs 0 < buffer_len <= max_len, got {buffer_len}, {max_len}")
    L = torch.as_tensor(lengths, dtype=torch.float32)
    expected = max_len - buffer_len
    ramp = factor * (expected - L) / buffer_len
    return torch.where(L <= expected, torch.zeros_like(L),
                       torch.where(L <= max_len, ramp, torch.full_like(L, -float(factor))))


def truncation_penalty(finish_reasons: Sequence[str] | torch.Tensor, rewards: torch.Tensor, penalty: float,
                       truncated_reasons: Sequence[str] = ("length",)) -> torch.Tensor:
    """Give truncated samples the reward ``penalty`` instead of their score.

    A response cut off by the generation length limit has no final answer, so scoring it is noise; like
    OpenRLHF's truncation reward, such samples get a fixed (usually negative) reward instead.
    ``finish_reasons`` are the generator's reasons (vLLM / HF: ``"length"`` when the limit was hit,
    ``"stop"`` otherwise) or a bool tensor that is True for truncated samples.
    """
    rewards = torch.as_tensor(rewards)
    if isinstance(finish_reasons, torch.Tensor):
        truncated = finish_reasons.to(torch.bool).reshape(-1)
    else:
        truncated = torch.tensor([fr in truncated_reasons for fr in finish_reasons], dtype=torch.bool)
    if truncated.numel() != rewards.numel():
        raise ValueError(f"{truncated.numel()} finish reasons for {rewards.numel()} rewards")
    return torch.where(truncated.reshape(rewards.shape), torch.full_like(rewards, float(penalty)), rewards)
