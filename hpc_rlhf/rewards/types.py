"""The value every reward source returns (:class:`RewardBatch`; the error it raises is in errors.py).

Failed samples are never given a made-up reward: their ``valid`` entry is False and their reward is NaN, so a
caller that forgets to look at ``valid`` gets NaN losses instead of silently training on a 0.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

# Keys of ``RewardBatch.extra`` ending with these names are counts: merging sums them; other keys are means
# and merging averages them, weighted by the number of valid samples behind each value.
COUNT_SUFFIXES = ("/failures", "/failed_batches", "/retries", "/timeouts")


@dataclass
class RewardBatch:
    """Rewards of B samples.

    rewards: float32 [B]; NaN where ``valid`` is False.
    valid:   bool [B]; False marks samples whose reward failed: drop them from training and count them.
    extra:   scalar logs (counts such as ``reward/func/failures`` and means of the function's extra logs).
    scores:  optional float32 [B] secondary score a reward function returned (e.g. for dynamic filtering);
             None when the source has none.
    errors:  messages of the failures behind the invalid samples (also logged where they happened).
    predictions: optional list of B answers the source extracted (str, or None where it found none or the
             sample failed), e.g. the math verifier's normalised final answer, for maj@k; None when the
             source gives none (reward models).
    """

    rewards: torch.Tensor
    valid: torch.Tensor
    extra: dict[str, float] = field(default_factory=dict)
    scores: torch.Tensor | None = None
    errors: list[str] = field(default_factory=list)
    predictions: list[str | None] | None = None

    def __post_init__(self):
        self.rewards = torch.as_tensor(self.rewards, dtype=torch.float32).reshape(-1)
        self.valid = torch.as_tensor(self.valid, dtype=torch.bool).reshape(-1)
        if self.rewards.shape != self.valid.shape:
            raise ValueError(f"rewards has {self.rewards.numel()} entries but valid has {self.valid.numel()}")
        if self.scores is not None:
            self.scores = torch.as_tensor(self.scores, dtype=torch.float32).reshape(-1)
            if self.scores.shape != self.rewards.shape:
                raise ValueError(f"scores has {self.scores.numel()} entries, rewards {self.rewards.numel()}")
        if self.predictions is not None:
            self.predictions = list(self.predictions)
            if len(self.predictions) != self.rewards.numel():
                raise ValueError(f"predictions has {len(self.predictions)} entries, rewards "
                                 f"{self.rewards.numel()}")
            bad = [i for i, p in enumerate(self.predictions) if p is not None and not isinstance(p, str)]
            if bad:
                raise ValueError(f"predictions[{bad[0]}] is a {type(self.predictions[bad[0]]).__name__}; "
                                 f"expected a string or None")

    def __len__(self) -> int:
        return self.rewards.numel()

    @property
    def num_failed(self) -> int:
        return int((~self.valid).sum())


def is_count_key(key: str) -> bool:
    return key.endswith(COUNT_SUFFIXES)


def merge_extras(parts: list[tuple[dict[str, float], float]]) -> dict[str, float]:
    """Merge ``(extra, weight)`` pairs: count keys are summed, the rest averaged with the given weights.

    A mean key whose total weight is 0 falls back to the plain average of its values.
    """
    sums: dict[str, float] = {}
    weights: dict[str, float] = {}
    plain: dict[str, list[float]] = {}
    for extra, w in parts:
        for k, v in extra.items():
            if v is None or not math.isfinite(float(v)):
                continue
            v = float(v)
            if is_count_key(k):
                sums[k] = sums.get(k, 0.0) + v
                weights.setdefault(k, 0.0)
            else:
                sums[k] = sums.get(k, 0.0) + v * w
                weights[k] = weights.get(k, 0.0) + w
                plain.setdefault(k, []).append(v)
    out = {}
    for k, s in sums.items():
        if is_count_key(k):
            out[k] = s
        elif weights[k] > 0:
            out[k] = s / weights[k]
        else:
            out[k] = sum(plain[k]) / len(plain[k])
    return out


def check_inputs(queries: list[str], prompts: list[str], labels: list[str] | None) -> list:
    """The labels list (None -> Nones), after checking the three lists have one entry per sample."""
    n = len(queries)
    if labels is None:
        labels = [None] * n
    if len(prompts) != n or len(labels) != n:
        raise ValueError(f"queries, prompts and labels differ in length: {n}, {len(prompts)}, {len(labels)}")
    return labels
