"""The value every reward source returns (:class:`RewardBatch`; the error it raises is in errors.py).

Failed samples are never given a made-up reward: their ``valid`` entry is False and their reward is NaN, so a
caller that forgets to look at ``valid`` gets NaN losses instead of silently training on a 0.
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field

import torch

from .errors import RewardError

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
    components: optional float32 [B, K], the named parts of each reward (``component_names``), whose sum is
             the reward; NaN where ``valid`` is False; None when the source returned plain numbers.
    """

    rewards: torch.Tensor
    valid: torch.Tensor
    extra: dict[str, float] = field(default_factory=dict)
    scores: torch.Tensor | None = None
    errors: list[str] = field(default_factory=list)
    predictions: list[str | None] | None = None
    components: torch.Tensor | None = None
    component_names: tuple[str, ...] = ()

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
        self.component_names = tuple(self.component_names)
        if self.components is not None:
            self.components = torch.as_tensor(self.components, dtype=torch.float32)
            if self.components.shape != (self.rewards.numel(), len(self.component_names)):
                raise ValueError(f"components has shape {tuple(self.components.shape)}; expected "
                                 f"({self.rewards.numel()}, {len(self.component_names)}), one column per name")
        elif self.component_names:
            raise ValueError("component_names without components")

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


# keys the RL loop logs as reward/<key> itself
RESERVED_COMPONENTS = ("mean", "invalid", "invalid_groups", "groups_few_valid")


def component_rows(values: list, source: str, first: int = 0) -> tuple[tuple[str, ...], torch.Tensor]:
    """Rewards given as one dict of named numbers per sample (``values``: samples ``first``, ``first + 1``...; a
    None entry is a sample without reward): their names, sorted, and a float64 [n, K] table (NaN rows for None).
    A value that is not a number is a ValueError completing "returned ..." (that sample fails); a dict whose names
    differ from the first one's, or a name that cannot be a metric, is a RewardError naming ``source``."""
    names: tuple[str, ...] | None = None
    rows = []
    for i, v in enumerate(values):
        if v is None:
            rows.append(None)
            continue
        if not isinstance(v, dict):
            raise RewardError(f"{source} returned {repr(v)[:40]} for sample {first + i} where other samples have a "
                              f"dict of named reward components")
        keys = tuple(sorted(v, key=str))
        if names is None:
            names, where = keys, first + i
            bad = [k for k in names if not isinstance(k, str) or not k or "/" in k or k in RESERVED_COMPONENTS]
            if bad or not names:
                raise RewardError(f"{source} returned reward components {list(names)} for sample {where}: names must "
                                  f"be non-empty strings without '/', not {', '.join(RESERVED_COMPONENTS)}")
        else:
            same_components(keys, names, source, first + i, where)
        row = []
        for k in keys:
            x = v[k]
            if isinstance(x, torch.Tensor) and x.numel() == 1:
                x = x.item()
            if not isinstance(x, numbers.Real):
                raise ValueError(f"a list whose value {i} has component {k!r} = {repr(x)[:40]} "
                                 f"({type(x).__name__}); expected numbers")
            row.append(float(x))
        rows.append(row)
    width = len(names or ())
    table = torch.tensor([r if r is not None else [math.nan] * width for r in rows], dtype=torch.float64)
    return names or (), table.reshape(len(rows), width)


def same_components(names: tuple[str, ...], expected: tuple[str, ...], source: str, sample: int,
                    expected_sample: int) -> None:
    """RewardError unless sample ``sample`` has the component names of sample ``expected_sample`` (() for a plain
    number)."""
    if names != expected:
        def shown(x):
            return list(x) if x else "a plain number"
        raise RewardError(f"{source} returned reward components {shown(names)} for sample {sample} but "
                          f"{shown(expected)} for sample {expected_sample}: every sample needs the same names")


def check_inputs(queries: list[str], prompts: list[str], labels: list[str] | None) -> list:
    """The labels list (None -> Nones), after checking the three lists have one entry per sample."""
    n = len(queries)
    if labels is None:
        labels = [None] * n
    if len(prompts) != n or len(labels) != n:
        raise ValueError(f"queries, prompts and labels differ in length: {n}, {len(prompts)}, {len(labels)}")
    return labels
