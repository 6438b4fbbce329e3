"""Rows -> process-reward (PRM) samples: token ids, the positions of the step placeholders, one label per step.

A row holds a text in which every reasoning step is followed by the placeholder string (``data.placeholder``,
e.g. ``ки``) and a list with one label per placeholder.  The text is split at the placeholders; every piece is
tokenized on its own (no special tokens) and the placeholder's single token id goes between them, with the
tokenizer's BOS (when it has one) in front.  So the placeholder is always exactly one token, wherever it
stands, and the positions the PRM is scored at are known without searching.  `encode_steps` builds the same
ids at inference time.

Labels, hard (default): ``"+"`` / ``"-"``, ``true`` / ``false``, ``1`` / ``0`` (also the strings
``"true"``/``"false"``/``"1"``/``"0"``), stored as 1 (correct) / 0 (incorrect).  Soft (``soft_labels``):
numbers in [0, 1], the probability that the step is correct (``true``/``false`` and ``"+"``/``"-"`` read as
1.0 / 0.0).  A row whose label count differs from its placeholder count, with no placeholder, with an unknown
label or longer than ``max_len`` is a bad row (skipped and counted with file and row, or an error, per
``data.bad_rows``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Iterator

from ..config.preference import ProcessDataConfig
from .assemble import assemble
from .rows import BadRows, DataError, in_chunks
from .sft import _Bad, _get_str, _value
from .sources import load_source, only_columns


@dataclass
class ProcessSample:
    """One PRM row: ``positions[k]`` is the index in ``input_ids`` of step k's placeholder, ``labels[k]``
    its label (int 0/1, or a float in [0, 1] with soft labels)."""
    input_ids: list[int]
    positions: list[int]
    labels: list[Any]
    source: str

    def __len__(self) -> int:
        return len(self.input_ids)


def single_token_id(tokenizer, text: str, what: str) -> int:
    """The id of ``text`` when it tokenizes to exactly one token (else a DataError naming ``what``)."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if len(ids) != 1:
        raise DataError(f"{what} {text!r} tokenizes to {len(ids)} tokens {ids}, not one: pick a string that is "
                        f"one token of this tokenizer, or add it to the tokenizer (tokenizer.add_tokens) and "
                        f"resize the model's embeddings before training")
    return ids[0]


def _join(tokenizer, pieces_ids: list[list[int]], placeholder_id: int) -> tuple[list[int], list[int]]:
    ids = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    positions = []
    for k, piece in enumerate(pieces_ids):
        if k:
            positions.append(len(ids))
            ids.append(placeholder_id)
        ids.extend(piece)
    return ids, positions


def encode_steps(tokenizer, text: str, placeholder: str) -> tuple[list[int], list[int]]:
    """Token ids of ``text`` as the PRM trainer builds them, and the indices of its placeholder tokens
    (one per step): read the step scores from the logits at these indices."""
    pid = single_token_id(tokenizer, placeholder, "data.placeholder")
    pieces = text.split(placeholder)
    return _join(tokenizer, tokenizer(pieces, add_special_tokens=False)["input_ids"], pid)


_POS, _NEG = ("+", "true", "1"), ("-", "false", "0")


def parse_step_label(value: Any, soft: bool) -> int | float:
    """One step label: 1 / 0 (hard) or a float in [0, 1] (soft); raises _Bad for an unknown one."""
    if isinstance(value, bool):
        return float(value) if soft else int(value)
    if isinstance(value, str):
        v = value.strip().lower()
        if v in _POS or v in _NEG:
            return (1.0 if v in _POS else 0.0) if soft else int(v in _POS)
        if soft:
            try:
                value = float(v)
            except ValueError:
                raise _Bad("wrong_type", f"unknown step label {value!r}") from None
        else:
            raise _Bad("wrong_type", f"unknown step label {value!r} (hard labels: '+'/'-', true/false, 1/0)")
    if isinstance(value, (int, float)):
        if soft:
            if not 0.0 <= float(value) <= 1.0:
                raise _Bad("wrong_type", f"soft step label {value!r} is outside [0, 1]")
            return float(value)
        if value in (0, 1):
            return int(value)
        raise _Bad("wrong_type", f"step label {value!r} is not 0 or 1 (set data.soft_labels=true for "
                                 f"probabilities)")
    raise _Bad("wrong_type", f"unknown step label {value!r}")


def _labels(row: dict, key: str, soft: bool) -> list:
    value = _value(row, key, "data.label_key")
    if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
        raise _Bad("wrong_type", f"{key!r} is {type(value).__name__}, expected a list of step labels")
    return [parse_step_label(v, soft) for v in value]


def build_process_samples(rows: Iterable[dict], name: str, tokenizer, cfg: ProcessDataConfig,
                          bad: BadRows) -> list[ProcessSample]:
    """Tokenize rows into PRM samples; bad rows go to ``bad`` (skipped, or raised under policy "error")."""
    if not getattr(tokenizer, "is_fast", False):
        raise DataError("the tokenizer is not a fast (tokenizers-backed) tokenizer: load the model's tokenizer.json")
    pid = single_token_id(tokenizer, cfg.placeholder, "data.placeholder")
    out: list[ProcessSample] = []

    def flush(chunk: list[tuple[int, list[str], list]]) -> None:
        flat = tokenizer([p for _, pieces, _ in chunk for p in pieces], add_special_tokens=False)["input_ids"]
        pos = 0
        for r, pieces, labels in chunk:
            ids, positions = _join(tokenizer, flat[pos:pos + len(pieces)], pid)
            pos += len(pieces)
            if len(ids) > cfg.max_len:
                bad.add(name, r, "too_long", f"{len(ids)} tokens, more than max_len {cfg.max_len}")
                continue
            out.append(ProcessSample(ids, positions, labels, f"{name} row {r}"))

    def parsed() -> Iterator[tuple[int, list[str], list]]:
        for r, row in enumerate(rows, start=1):
            try:
                text = _get_str(row, cfg.input_key, "data.input_key")
                labels = _labels(row, cfg.label_key, cfg.soft_labels)
                pieces = text.split(cfg.placeholder)
                steps = len(pieces) - 1
                if steps == 0:
                    raise _Bad("empty", f"no step placeholder {cfg.placeholder!r} in {cfg.input_key!r}")
                if len(labels) != steps:
                    raise _Bad("wrong_type", f"{len(labels)} labels in {cfg.label_key!r} for {steps} step "
                                             f"placeholders {cfg.placeholder!r}")
            except _Bad as b:
                bad.add(name, r, b.kind, b.detail)
                continue
            yield r, pieces, labels

    for chunk in in_chunks(parsed()):
        flush(chunk)
    return out


def load_process_data(cfg: ProcessDataConfig, tokenizer,
                      seed: int) -> tuple[list[ProcessSample], list[ProcessSample], BadRows]:
    """Train and eval PRM samples plus the bad rows met (log ``bad.summary()`` when ``bad.total``)."""
    bad = BadRows(cfg.bad_rows)

    def read(spec: str, limit: int | None) -> tuple[list[ProcessSample], int]:
        rows, name = load_source(spec, cfg.dataset_split)
        if limit is not None and len(rows) > limit:
            rows = rows.select(range(limit))
        samples = build_process_samples(only_columns(rows, [cfg.input_key, cfg.label_key]), name, tokenizer, cfg, bad)
        return samples, len(rows)

    train, evals = assemble(cfg.dataset, read, bad, probs=cfg.dataset_probs, eval_sources=cfg.eval_dataset,
                            eval_ratio=cfg.eval_split_ratio, max_samples=cfg.max_samples,
                            max_eval_samples=cfg.max_eval_samples, seed=seed)
    return train, evals, bad
