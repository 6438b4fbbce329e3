"""Evaluation metrics over n samples per prompt, as papers report them (pure functions, no torch).

A sample is *correct* when its reward is at least a threshold (1.0 by default: verifier rewards are 1 for a
right answer and 0 otherwise).  Samples are grouped by prompt id, never by prompt text (two eval rows with the
same text are two prompts).  Invalid samples (the reward failed) are dropped from their group before anything
is computed; n_g and c_g below count the valid and the correct samples of group g.

- pass@k (Chen et al. 2021, unbiased): 1 - C(n_g - c_g, k) / C(n_g, k), the chance that k samples drawn
  without replacement from the group hold at least one correct one; averaged over the groups with n_g >= k
  (the others are left out and counted).  Computed as 1 - prod_{i = n_g - c_g + 1}^{n_g} (1 - k / i), which
  needs no large binomials.
- avg@n: each group's mean reward, averaged over the groups with a valid sample.
- maj@k: the first k valid samples of a group (in sample order) vote with their predictions (None does not
  vote); the prediction with most votes wins, a tie goes to the prediction seen first.  The group scores the
  fraction of the winner's samples that are correct (1 or 0 whenever a prediction decides correctness, as
  with a verifier); no vote at all scores 0.  Averaged over the groups with n_g >= k.
- OpenRLHF's pair: pass1 = the mean reward over every valid sample, pass{n} = the mean over groups of the
  group's highest reward.
"""
from __future__ import annotations

import re
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import PurePosixPath

import numpy as np


@dataclass(frozen=True)
class EvalSample:
    prompt_id: Hashable        # the prompt's id (its index in the eval set), never its text
    index: int                 # the sample's index among the prompt's samples (the order maj@k reads)
    valid: bool                # False: the reward failed; the sample is dropped
    reward: float
    prediction: str | None = None  # the answer the verifier extracted (None: none)
    dataset: str = ""          # the eval source the prompt came from


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one group with ``n`` samples, ``c`` of them correct."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:  # every choice of k samples holds a correct one
        return 1.0
    prod = 1.0
    for i in range(n - c + 1, n + 1):
        prod *= 1.0 - k / i
    return 1.0 - prod


def ks_up_to(n: int) -> list[int]:
    """1, 2, 4, ... up to n, and n itself when it is not a power of two."""
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    ks, k = [], 1
    while k <= n:
        ks.append(k)
        k *= 2
    return ks if ks[-1] == n else [*ks, n]


def majority_vote(predictions: Sequence[str | None]) -> str | None:
    """The most frequent prediction (None does not vote); a tie goes to the one that occurs first."""
    counts: dict[str, int] = {}
    for p in predictions:
        if p is not None:
            counts[p] = counts.get(p, 0) + 1  # dicts keep first-occurrence order: max() keeps the first best
    return max(counts, key=counts.__getitem__) if counts else None


def maj_at_k(group: Sequence[EvalSample], k: int, threshold: float) -> float:
    """maj@k of one group of valid samples in sample order (at least k of them)."""
    first = group[:k]
    winner = majority_vote([s.prediction for s in first])
    if winner is None:
        return 0.0
    voters = [s for s in first if s.prediction == winner]
    return sum(s.reward >= threshold for s in voters) / len(voters)


def _mean(xs: list[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def group_metrics(samples: Iterable[EvalSample], n: int, threshold: float = 1.0) -> dict[str, float]:
    """The metrics of a set of samples (n: the samples drawn per prompt), keys without a prefix:
    pass@k and maj@k for k in ks_up_to(n) (maj@k only when some sample has a prediction), avg@n, reward_mean
    and max_reward_mean (OpenRLHF's pass1 and pass{n}); and counts: prompts (groups), prompts_no_valid (groups
    whose every sample failed), invalid_samples, left_out@k (groups with fewer than k valid samples, left out
    of pass@k and maj@k).  A metric no group enters is absent (an empty eval set gives the counts only)."""
    groups: dict[Hashable, list[EvalSample]] = {}
    invalid = 0
    for s in samples:
        groups.setdefault(s.prompt_id, [])
        if s.valid:
            groups[s.prompt_id].append(s)
        else:
            invalid += 1
    valid_groups = [sorted(g, key=lambda s: s.index) for g in groups.values() if g]
    out: dict[str, float] = {"prompts": float(len(groups)), "prompts_no_valid": float(len(groups) - len(valid_groups)),
                             "invalid_samples": float(invalid)}
    votes = any(s.prediction is not None for g in valid_groups for s in g)
    for k in ks_up_to(n):
        entered = [g for g in valid_groups if len(g) >= k]
        out[f"left_out@{k}"] = float(len(groups) - len(entered))
        if entered:
            out[f"pass@{k}"] = sum(pass_at_k(len(g), sum(s.reward >= threshold for s in g), k)
                                   for g in entered) / len(entered)
            if votes:
                out[f"maj@{k}"] = sum(maj_at_k(g, k, threshold) for g in entered) / len(entered)
    for key, value in ((f"avg@{n}", _mean([sum(s.reward for s in g) / len(g) for g in valid_groups])),
                       ("reward_mean", _mean([s.reward for g in valid_groups for s in g])),
                       ("max_reward_mean", _mean([max(s.reward for s in g) for g in valid_groups]))):
        if value is not None:
            out[key] = value
    return out


def _ours(metrics: dict[str, float]) -> dict[str, float]:
    return {k: v for k, v in metrics.items() if k not in ("reward_mean", "max_reward_mean")}


def eval_report(samples: Sequence[EvalSample], n: int, threshold: float = 1.0) -> dict[str, float]:
    """The logged eval metrics: ours over the whole eval set as ``eval/<metric>`` (see ``group_metrics``),
    ``eval/reward_mean``; per dataset ``eval_{dataset}_pass1`` and ``eval_{dataset}_pass{n}`` (OpenRLHF's
    keys); and, with several datasets, ours per dataset as ``eval/{dataset}/<metric>``."""
    every = group_metrics(samples, n, threshold)
    out = {f"eval/{k}": v for k, v in _ours(every).items()}
    if "reward_mean" in every:
        out["eval/reward_mean"] = every["reward_mean"]
    names = sorted({s.dataset for s in samples})
    for name in names:
        part = group_metrics([s for s in samples if s.dataset == name], n, threshold) if len(names) > 1 else every
        if "reward_mean" in part:
            out[f"eval_{name}_pass1"] = part["reward_mean"]
            out[f"eval_{name}_pass{n}"] = part["max_reward_mean"]
        if len(names) > 1:
            out.update({f"eval/{name}/{k}": v for k, v in _ours(part).items()})
    return out


def dataset_names(specs: Sequence[str]) -> list[str]:
    """A short name per eval source, for metric keys: the file or folder stem without '@split' (characters
    other than letters, digits, '.', '-' and '_' become '_'); a name taken by an earlier source gets _2, _3..."""
    out: list[str] = []
    for spec in specs:
        stem = PurePosixPath(spec.strip().rstrip("/").split("@")[0]).stem
        name = re.sub(r"[^A-Za-z0-9._-]", "_", stem) or "data"
        candidate, i = name, 2
        while candidate in out:
            candidate, i = f"{name}_{i}", i + 1
        out.append(candidate)
    return out


def pass_rates(rows: Iterable[dict]) -> dict[Hashable, float]:
    """Each prompt's fraction of correct samples among its valid ones, from rows with ``prompt_id``, ``valid`` and
    ``correct`` (``eval.save_samples``); a prompt without a valid sample is left out."""
    counts: dict[Hashable, list[int]] = {}
    for r in rows:
        c = counts.setdefault(r["prompt_id"], [0, 0])
        if r.get("valid", True):
            c[0] += bool(r["correct"])
            c[1] += 1
    return {p: c / n for p, (c, n) in counts.items() if n}


def paired_bootstrap(before: Sequence[float], after: Sequence[float], n_boot: int = 10000, seed: int = 0,
                     level: float = 0.95) -> dict[str, float | list[float]]:
    """The mean gain ``after - before`` of paired per-problem values (the same problems, in the same order) and its
    percentile bootstrap interval: ``n_boot`` resamples of the problems with replacement (seeded), the
    (1 - level) / 2 and (1 + level) / 2 quantiles of the resampled mean gains.  {"gain", "ci"}."""
    if len(before) != len(after):
        raise ValueError(f"paired_bootstrap: {len(before)} values before, {len(after)} after: pair the same problems")
    if not before:
        raise ValueError("paired_bootstrap: no problems")
    if n_boot < 1 or not 0 < level < 1:
        raise ValueError(f"paired_bootstrap: n_boot must be >= 1 and level in (0, 1), got {n_boot}, {level}")
    diff = np.asarray(after, dtype=np.float64) - np.asarray(before, dtype=np.float64)
    rng = np.random.default_rng(seed)
    means = diff[rng.integers(0, len(diff), size=(n_boot, len(diff)))].mean(axis=1)
    lo, hi = np.quantile(means, [(1 - level) / 2, (1 + level) / 2])
    return {"gain": float(diff.mean()), "ci": [float(lo), float(hi)]}
