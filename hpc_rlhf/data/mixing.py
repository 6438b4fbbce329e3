"""Mix several sources into one list by sampling probabilities."""
from __future__ import annotations

from typing import Sequence, TypeVar

import numpy as np

T = TypeVar("T")


def mix(sources: Sequence[Sequence[T]], probs: Sequence[float] | None, seed: int,
        total: int | None = None) -> list[T]:
    """Without probs: the sources concatenated in order (cut to `total`).

    With probs: each item comes from source k with probability probs[k] / sum(probs). A source
    that runs out starts again from its beginning in a new seeded order, so small sources are
    oversampled and nothing is dropped. `total` defaults to the sum of the source sizes.
    """
    sizes = [len(s) for s in sources]
    if total is None:
        total = sum(sizes)
    if total < 0:
        raise ValueError(f"total must be >= 0, got {total}")
    if probs is None:
        return [x for s in sources for x in s][:total]
    if len(probs) != len(sources):
        raise ValueError(f"{len(probs)} probabilities for {len(sources)} sources: give one per source")
    p = np.asarray(probs, dtype=np.float64)
    if (p < 0).any() or p.sum() <= 0:
        raise ValueError(f"probabilities must be non-negative and not all zero, got {list(probs)}")
    for k, (n, pk) in enumerate(zip(sizes, p)):
        if n == 0 and pk > 0:
            raise ValueError(f"source {k} is empty but has probability {pk}")
    rng = np.random.default_rng(seed)
    picks = rng.choice(len(sources), size=total, p=p / p.sum())
    orders = [np.arange(n) for n in sizes]
    cursors = [0] * len(sources)
    out: list[T] = []
    for k in picks.tolist():
        if cursors[k] == sizes[k]:
            orders[k] = rng.permutation(sizes[k])
            cursors[k] = 0
        out.append(sources[k][int(orders[k][cursors[k]])])
        cursors[k] += 1
    return out
