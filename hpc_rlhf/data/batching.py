"""Which samples each rank takes at each step, and how a rank's share splits into micro-batches."""
from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from .sft import Sample


class EpochSampler:
    """Seeded per-epoch order of sample indices (``shuffle=False``: the given order), cut into global batches
    and dealt out to ranks.

    The last step of an epoch wraps to the start of the same permutation to fill its batch, so
    every sample is used at least once per epoch and none is dropped.
    """

    def __init__(self, num_samples: int, train_batch_size: int, world_size: int, rank: int, seed: int,
                 shuffle: bool = True):
        if num_samples < 1:
            raise ValueError(f"EpochSampler needs at least one sample, got num_samples={num_samples}")
        if train_batch_size < 1 or world_size < 1:
            raise ValueError(f"train_batch_size ({train_batch_size}) and world_size ({world_size}) must be >= 1")
        if train_batch_size % world_size:
            raise ValueError(f"train_batch_size {train_batch_size} is not divisible by the number of ranks "
                             f"{world_size}: every rank must take the same number of samples per step")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside 0..{world_size - 1}")
        self.num_samples, self.batch_size = num_samples, train_batch_size
        self.world_size, self.rank, self.seed, self.shuffle = world_size, rank, seed, shuffle
        self._epoch: int | None = None
        self._perm: np.ndarray | None = None

    @property
    def steps_per_epoch(self) -> int:
        return math.ceil(self.num_samples / self.batch_size)

    @property
    def padded_in_last_step(self) -> int:
        """Samples repeated (from the epoch's start) to fill the last step of each epoch."""
        return self.steps_per_epoch * self.batch_size - self.num_samples

    def padded_steps(self, start: int, end: int) -> int:
        """How many of the steps start .. end - 1 (0-based, counted across epochs) repeat samples: the last step of
        each epoch they reach, when it has samples to repeat."""
        return end // self.steps_per_epoch - start // self.steps_per_epoch if self.padded_in_last_step else 0

    def permutation(self, epoch: int) -> np.ndarray:
        if epoch != self._epoch:
            self._perm = (np.random.default_rng([self.seed, epoch]).permutation(self.num_samples) if self.shuffle
                          else np.arange(self.num_samples))
            self._epoch = epoch
        return self._perm

    def step_indices(self, epoch: int, step: int) -> list[int]:
        """This rank's sample indices for `step` (0-based, within the epoch)."""
        if not 0 <= step < self.steps_per_epoch:
            raise IndexError(f"step {step} is outside 0..{self.steps_per_epoch - 1} of an epoch")
        perm = self.permutation(epoch)
        positions = np.arange(step * self.batch_size, (step + 1) * self.batch_size) % self.num_samples
        return perm[positions[self.rank::self.world_size]].tolist()


def chunks(items: Sequence, size: int) -> list[list]:
    """``items`` cut into consecutive lists of ``size`` (the last may be shorter)."""
    return [list(items[i:i + size]) for i in range(0, len(items), size)]


def cut_longest_first(lengths: Sequence[int], max_rows: int, overhead: float, runs: int | None = None) -> list[int]:
    """Sizes of the consecutive runs that cut ``lengths`` (sorted longest first) into micro-batches of at most
    ``max_rows`` rows at the least cost, a run costing its padded positions (rows × its first length) plus
    ``overhead`` positions (what a micro-batch costs beyond its positions: its gradient accumulation, its
    per-layer calls).  ``runs``: exactly that many runs (ranks that must make the same number of backward
    passes).  Of equal costs: the fewest runs, then the longer last run.  Exact, by dynamic programming."""
    if any(a < b for a, b in zip(lengths, lengths[1:])):
        raise ValueError(f"cut_longest_first needs lengths sorted longest first, got {list(lengths)}")
    if max_rows < 1:
        raise ValueError(f"max_rows must be >= 1, got {max_rows}")
    n = len(lengths)
    if runs is not None and not -(-n // max_rows) <= runs <= n:
        raise ValueError(f"{n} rows cannot be cut into {runs} runs of at most {max_rows}")

    def relax(prev: list, best: list, size: list[int]) -> None:
        """best[j]: the least (cost, runs) of the first j rows with one run more than ``prev`` counts;
        size[j]: that last run's rows."""
        for j in range(1, n + 1):
            for i in range(max(0, j - max_rows), j):  # the last run is rows i..j-1
                cost = (prev[i][0] + (j - i) * lengths[i] + overhead, prev[i][1] + 1)
                if cost < best[j]:
                    best[j], size[j] = cost, j - i

    first = [(0.0, 0)] + [(math.inf, 0)] * n
    if runs is None:  # one table (row j reads the rows before it, already final): O(rows × max_rows)
        tables = [[0] * (n + 1)]
        relax(first, first, tables[0])
    else:  # a table per run: O(rows × max_rows × runs)
        tables, prev = [], first
        for _ in range(runs):
            best = [(math.inf, 0)] * (n + 1)
            tables.append([0] * (n + 1))
            relax(prev, best, tables[-1])
            prev = best
    sizes, j = [], n
    while j:
        size = tables[0] if runs is None else tables[runs - 1 - len(sizes)]
        sizes.append(size[j])
        j -= size[j]
    return sizes[::-1]


def _split_largest(groups: list[list[Sample]]) -> None:
    """Split the group with the most tokens (of those with 2+ samples) where the halves balance best."""
    candidates = [i for i, g in enumerate(groups) if len(g) > 1]
    i = max(candidates, key=lambda j: (sum(len(s) for s in groups[j]), len(groups[j])))
    g = groups[i]
    sizes = [len(s) for s in g]
    total, acc, best, cut = sum(sizes), 0, None, 1
    for k in range(1, len(g)):
        acc += sizes[k - 1]
        diff = abs(total - 2 * acc)
        if best is None or diff < best:
            best, cut = diff, k
    groups[i:i + 1] = [g[:cut], g[cut:]]


def split_micro_batches(samples: Sequence[Sample], micro_batch_size: int | None = None,
                        token_budget: int | None = None, min_count: int = 0) -> list[list[Sample]]:
    """In-order micro-batches of `micro_batch_size` samples, or greedy groups of at most
    `token_budget` tokens (a longer sample goes alone). Groups are split further until there are
    at least `min_count` of them (ranks must run equal numbers of micro-batches)."""
    if (micro_batch_size is None) == (token_budget is None):
        raise ValueError("give exactly one of micro_batch_size and token_budget")
    if min_count > len(samples):
        raise ValueError(f"cannot make {min_count} micro-batches out of {len(samples)} samples")
    groups: list[list[Sample]] = []
    if micro_batch_size is not None:
        if micro_batch_size < 1:
            raise ValueError(f"micro_batch_size must be >= 1, got {micro_batch_size}")
        groups = [list(samples[i:i + micro_batch_size]) for i in range(0, len(samples), micro_batch_size)]
    else:
        if token_budget < 1:
            raise ValueError(f"token_budget must be >= 1, got {token_budget}")
        used = 0
        for s in samples:
            if groups and used + len(s) <= token_budget:
                groups[-1].append(s)
                used += len(s)
            else:
                groups.append([s])
                used = len(s)
    while len(groups) < min_count:
        _split_largest(groups)
    return groups
