"""Per-source items -> a training list and an eval list: eval split, mixing, caps.

Works on any item type (SFT samples, preference pairs, labelled completions).  The rules are those of
`hpc-rlhf train sft`: the eval rows come from the eval sources, or else a seeded fraction of the
distinct training items is held out *before* mixing (so no item is in both); the training items are
then mixed by the sources' probabilities and cut to ``max_samples``.
"""
from __future__ import annotations

import math
from typing import Callable, Sequence, TypeVar

import numpy as np

from .mixing import mix
from .rows import BadRows, DataError

T = TypeVar("T")


def rows_needed(max_samples: int | None, eval_ratio: float) -> int | None:
    """How many rows one source must read at most to fill ``max_samples`` after the eval hold-out."""
    if max_samples is None:
        return None
    extra = int(math.ceil(max_samples * eval_ratio / (1 - eval_ratio))) + 1 if eval_ratio else 0
    return max_samples + extra


def subset(items: list[T], n: int, rng: np.random.Generator) -> list[T]:
    """``n`` items picked at random, kept in their order (all of them when there are no more)."""
    if n >= len(items):
        return items
    keep = np.sort(rng.choice(len(items), size=n, replace=False))
    return [items[j] for j in keep.tolist()]


def assemble(sources: Sequence[str], read: Callable[[str, int | None], tuple[list[T], int]],
             bad: BadRows, *, probs: Sequence[float] | None, eval_sources: Sequence[str] | None,
             eval_ratio: float, max_samples: int | None, max_eval_samples: int | None,
             seed: int, keys_hint: str = "the data keys") -> tuple[list[T], list[T]]:
    """Train and eval items.  ``read(spec, row_limit)`` returns one source's items and its row count;
    ``keys_hint`` names the options to check when a source yields nothing."""
    ratio = eval_ratio if not eval_sources else 0.0
    limit = rows_needed(max_samples, ratio)
    per_source: list[list[T]] = []
    rows_read = 0
    for spec in sources:
        items, n_rows = read(spec, limit)
        rows_read += n_rows
        per_source.append(items)
    total = sum(len(s) for s in per_source)
    if total == 0:
        raise DataError(f"no training samples: read {rows_read} rows from {', '.join(sources)}, "
                        f"{bad.total} of them bad: {bad.summary(' | ')}")
    for k, (spec, items) in enumerate(zip(sources, per_source)):
        if not items and (probs is None or probs[k] > 0):
            raise DataError(f"{spec}: no usable rows (check {keys_hint} for this source): {bad.summary(' | ')}")

    eval_items: list[T] = []
    if eval_sources:
        for spec in eval_sources:
            eval_items += read(spec, None)[0]
        if not eval_items:
            raise DataError(f"no eval samples in {', '.join(eval_sources)}: {bad.summary(' | ')}")
        if max_eval_samples is not None:
            eval_items = subset(eval_items, max_eval_samples, np.random.default_rng([seed, 2]))
    elif ratio > 0 and total > 1:
        n_eval = min(max(1, round(ratio * total)), total - 1)
        if max_eval_samples is not None:
            n_eval = min(n_eval, max_eval_samples)
        held = np.zeros(total, dtype=bool)
        held[np.random.default_rng([seed, 1]).permutation(total)[:n_eval]] = True
        pos, kept = 0, []
        for items in per_source:
            flags = held[pos:pos + len(items)].tolist()
            eval_items += [s for s, h in zip(items, flags) if h]
            kept.append([s for s, h in zip(items, flags) if not h])
            pos += len(items)
        per_source = kept
    try:
        train = mix(per_source, probs, seed, max_samples)
    except ValueError as e:
        raise DataError(f"cannot mix {', '.join(sources)}: {e}") from e
    return train, eval_items
