"""Errors about data rows, and the collector of rows that had to be skipped."""
from __future__ import annotations

from collections import Counter
from typing import Iterable, Iterator, TypeVar

T = TypeVar("T")
KINDS = ("missing_key", "empty", "wrong_type", "too_long", "identical")


class DataError(ValueError):
    """The data cannot be used; the message names the file and, for a row, its 1-based number."""


class BadRows:
    """Counts bad rows by kind; with policy "error" the first one raises DataError instead."""

    def __init__(self, policy: str = "skip", examples: int = 3):
        if policy not in ("skip", "error"):
            raise ValueError(f"bad-row policy must be 'skip' or 'error', not {policy!r}")
        self.policy = policy
        self.examples = examples
        self._counts: Counter[str] = Counter()
        self._examples: dict[str, list[str]] = {}

    def add(self, source: str, row: int, kind: str, detail: str) -> None:
        if kind not in KINDS:
            raise ValueError(f"unknown bad-row kind {kind!r}; use one of {', '.join(KINDS)}")
        where = f"{source} row {row}: {detail}"
        if self.policy == "error":
            raise DataError(f"{where} (set data.bad_rows=skip to skip such rows and report their counts)")
        self._counts[kind] += 1
        seen = self._examples.setdefault(kind, [])
        if len(seen) < self.examples:
            seen.append(where)

    def counts(self) -> dict[str, int]:
        return {k: self._counts[k] for k in KINDS if self._counts[k]}

    @property
    def total(self) -> int:
        return sum(self._counts.values())

    def summary(self, sep: str = "\n") -> str:
        """For each kind the count and the first examples, joined by ``sep``; empty when no row was bad."""
        parts = []
        for kind, n in self.counts().items():
            parts.append(f"{kind}: {n} row{'s' if n != 1 else ''} skipped, e.g. " + "; ".join(self._examples[kind]))
        return sep.join(parts)

    def __repr__(self) -> str:
        return f"BadRows(policy={self.policy!r}, counts={self.counts()})"


def missing_key(row: dict, key: str, option: str) -> str:
    """What a row without a value in column ``key`` (which ``option`` names) is told: the option and the keys it has
    (a null counts as no value: Arrow gives every row every column)."""
    have = ", ".join(str(k) for k, v in row.items() if v is not None) or "none"
    return f"missing key {key!r} ({option}); the row has keys: {have}"


def checked_template(template: str | None) -> str | None:
    """``data.input_template`` once it is known to format with one prompt (else a DataError naming it)."""
    if template is not None:
        try:
            template.format("x")
        except (IndexError, KeyError, ValueError) as e:
            raise DataError(f"data.input_template {template!r} is not a format string with one {{}} "
                            f"(write literal braces as {{{{ and }}}}): {e}") from e
    return template


TOKENIZE_ROWS = 512  # rows per call of the (Rust, multi-threaded) tokenizer


def in_chunks(items: Iterable[T], size: int = TOKENIZE_ROWS) -> Iterator[list[T]]:
    """Consecutive lists of ``size`` items (the last one shorter), pulled lazily from ``items``."""
    chunk: list[T] = []
    for item in items:
        chunk.append(item)
        if len(chunk) == size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk
