"""Rows -> tokenized SFT samples with a loss mask (plain prompt/response, pre-training, chat)."""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any, Iterable

import numpy as np

from ..config.sections import DataConfig
from .assemble import assemble
from .rows import BadRows, DataError, checked_template, in_chunks, missing_key
from .sources import load_source, only_columns


@dataclass
class Sample:
    """One tokenized sample. loss_mask[i] == 1: token i is a target (predicted at position i-1)."""
    input_ids: list[int]
    loss_mask: list[int]
    source: str  # e.g. "train.jsonl row 5"

    def __len__(self) -> int:
        return len(self.input_ids)

    @property
    def num_loss_tokens(self) -> int:
        return sum(self.loss_mask)


@dataclass
class _Text:
    """A row rendered to text; spans are the [start, end) character ranges trained on (None: all)."""
    row: int
    text: str
    spans: list[tuple[int, int]] | None


class _Bad(Exception):
    def __init__(self, kind: str, detail: str):
        super().__init__(detail)
        self.kind, self.detail = kind, detail


def _value(row: dict, key: str, option: str) -> Any:
    """The row's value in column ``key``, which ``option`` names (a missing_key bad row when it has none)."""
    value = row.get(key)
    if value is None:
        raise _Bad("missing_key", missing_key(row, key, option))
    return value


def _get_str(row: dict, key: str, option: str) -> str:
    value = _value(row, key, option)
    if not isinstance(value, str):
        raise _Bad("wrong_type", f"{key!r} is {type(value).__name__}, expected a string")
    if not value.strip():
        raise _Bad("empty", f"empty {key!r}")
    return value


def _check_messages(messages: Any, key: str) -> list[dict]:
    if not isinstance(messages, (list, tuple)):
        raise _Bad("wrong_type", f"{key!r} is {type(messages).__name__}, expected a list of "
                                 f"{{role, content}} messages")
    for j, m in enumerate(messages, 1):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise _Bad("wrong_type", f"{key!r} message {j} is not a {{role: str, content: str}} dict")
    # rows read through Arrow give keys missing from a message as None: drop them for the template
    return [{k: v for k, v in m.items() if v is not None} for m in messages]


class _ChatRenderer:
    """Renders messages with the chat template and finds the character spans of assistant turns."""

    def __init__(self, tokenizer, template: str | None, name: str):
        self.tokenizer, self.template, self.name = tokenizer, template, name
        if template is None and not getattr(tokenizer, "chat_template", None):
            raise DataError(f"{name}: data.apply_chat_template is set but the tokenizer has no chat template; "
                            f"set data.tokenizer_chat_template")

    def render(self, messages: list[dict], generation_prompt: bool) -> str:
        try:
            out = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt,
                                                     chat_template=self.template)
        except Exception as e:  # noqa: BLE001 - jinja raise_exception() and friends
            raise _Bad("wrong_type", f"the chat template rejected the messages: {type(e).__name__}: {e}") from e
        if not isinstance(out, str):
            raise DataError(f"{self.name}: apply_chat_template(tokenize=False) returned {type(out).__name__}, "
                            f"not a string")
        return out

    def __call__(self, messages: list[dict], row: int) -> tuple[str, list[tuple[int, int]]]:
        full = self.render(messages, False)
        spans = []
        for i, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            before = self.render(messages[:i], True)
            through = self.render(messages[:i + 1], False)
            for part, n, what in ((before, i, " with add_generation_prompt=True"), (through, i + 1, "")):
                if not full.startswith(part):
                    raise DataError(
                        f"{self.name} row {row}: the chat template renders the first {n} message(s)"
                        f"{what} as text that is not a prefix of the whole conversation's text, so the assistant "
                        f"turns cannot be located (templates that rewrite earlier turns, e.g. drop past reasoning, "
                        f"are not supported; pass a simpler data.tokenizer_chat_template)")
            start, end = len(before), len(through)
            end = start + len(full[start:end].rstrip())  # the newline after the end-of-turn token is not a target
            if end > start:
                spans.append((start, end))
        return full, spans


def _render_rows(rows: Iterable[dict], name: str, tokenizer, cfg: DataConfig, bad: BadRows) -> Iterable[_Text]:
    eos = tokenizer.eos_token
    if not cfg.apply_chat_template and not eos:
        raise DataError(f"{name}: the tokenizer has no eos_token, so responses cannot be ended; set one")
    chat = _ChatRenderer(tokenizer, cfg.tokenizer_chat_template, name) if cfg.apply_chat_template else None
    if chat is None and not cfg.pretrain_mode and cfg.output_key is None:
        raise DataError("data.output_key is null: set it, or use apply_chat_template or pretrain_mode")
    template = checked_template(cfg.input_template)
    for i, row in enumerate(rows):
        r = i + 1
        try:
            if chat is not None:
                messages = _value(row, cfg.input_key, "data.input_key")
                # a plain string is the user's turn (as the RL prompts take it)
                messages = ([{"role": "user", "content": _get_str(row, cfg.input_key, "data.input_key")}]
                            if isinstance(messages, str)
                            else _check_messages(messages, cfg.input_key))
                extra = row.get(cfg.output_key) if cfg.output_key else None
                if isinstance(extra, str):
                    messages.append({"role": "assistant", "content": extra})
                elif extra is not None:
                    messages += _check_messages(extra, cfg.output_key)
                if not messages:
                    raise _Bad("empty", f"no messages in {cfg.input_key!r}")
                if not any(m["role"] == "assistant" for m in messages):
                    raise _Bad("empty", "no assistant message to train on")
                text, spans = chat(messages, r)
                yield _Text(r, text, spans)
            elif cfg.pretrain_mode:
                yield _Text(r, _get_str(row, cfg.input_key, "data.input_key") + eos, None)
            else:
                prompt = _get_str(row, cfg.input_key, "data.input_key")
                response = _get_str(row, cfg.output_key, "data.output_key")
                if template is not None:
                    prompt = template.format(prompt)
                text = prompt + response + eos
                yield _Text(r, text, [(len(prompt), len(text))])
        except _Bad as b:
            bad.add(name, r, b.kind, b.detail)


def _mask_from_offsets(offsets: list[tuple[int, int]], spans: list[tuple[int, int]]) -> list[int]:
    """1 for a token whose first character lies in a span, or that straddles a span's start."""
    if not offsets:
        return []
    flat = np.fromiter(itertools.chain.from_iterable(offsets), dtype=np.int64, count=2 * len(offsets))
    start, end = flat[0::2], flat[1::2]
    mask = np.zeros(len(offsets), dtype=bool)
    for a, b in spans:
        mask |= ((start >= a) & (start < b)) | ((start < a) & (end > a))
    return mask.astype(np.int64).tolist()


def build_sft_samples(rows: Iterable[dict], name: str, tokenizer, cfg: DataConfig, bad: BadRows) -> list[Sample]:
    """Tokenize rows into samples; bad rows go to `bad` (skipped, or raised under policy "error")."""
    if not getattr(tokenizer, "is_fast", False):
        raise DataError("the tokenizer is not a fast (tokenizers-backed) tokenizer; loss masks need its "
                        "character offsets: load the model's tokenizer.json")
    add_special = not cfg.apply_chat_template  # chat templates write their own special tokens
    out: list[Sample] = []

    def flush(chunk: list[_Text]) -> None:
        enc = tokenizer([t.text for t in chunk], add_special_tokens=add_special, return_offsets_mapping=True)
        for t, ids, offsets in zip(chunk, enc["input_ids"], enc["offset_mapping"]):
            if len(ids) > cfg.max_len:
                bad.add(name, t.row, "too_long", f"{len(ids)} tokens, more than max_len {cfg.max_len}")
                continue
            mask = [1] * len(ids) if t.spans is None else _mask_from_offsets(offsets, t.spans)
            if mask:
                mask[0] = 0  # nothing predicts the first token
            if not any(mask):
                bad.add(name, t.row, "empty", "no tokens to train on after tokenization")
                continue
            out.append(Sample(list(ids), mask, f"{name} row {t.row}"))

    for chunk in in_chunks(_render_rows(rows, name, tokenizer, cfg, bad)):
        flush(chunk)
    return out


def _keys(cfg: DataConfig) -> list[str]:
    return [k for k in (cfg.input_key, None if cfg.pretrain_mode else cfg.output_key) if k]


def _read(spec: str, cfg: DataConfig, tokenizer, bad: BadRows, limit: int | None) -> tuple[list[Sample], int, str]:
    rows, name = load_source(spec, cfg.dataset_split)
    if limit is not None and len(rows) > limit:
        rows = rows.select(range(limit))
    return build_sft_samples(only_columns(rows, _keys(cfg)), name, tokenizer, cfg, bad), len(rows), name


def load_sft_data(cfg: DataConfig, tokenizer, seed: int) -> tuple[list[Sample], list[Sample], BadRows]:
    """Train and eval samples, plus the bad rows met on the way (log `bad.summary()` when `bad.total`).

    Train: every source of cfg.dataset, mixed by dataset_probs, cut to max_samples (each source
    reads only the rows it can need). Eval: cfg.eval_dataset, or else eval_split_ratio of the
    distinct training samples, held out before mixing so no sample is in both; capped by
    max_eval_samples.
    """
    bad = BadRows(cfg.bad_rows)
    train, eval_samples = assemble(
        cfg.dataset, lambda spec, limit: _read(spec, cfg, tokenizer, bad, limit)[:2], bad,
        probs=cfg.dataset_probs, eval_sources=cfg.eval_dataset, eval_ratio=cfg.eval_split_ratio,
        max_samples=cfg.max_samples, max_eval_samples=cfg.max_eval_samples, seed=seed,
        keys_hint="data.input_key/output_key")
    return train, eval_samples, bad
