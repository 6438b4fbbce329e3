"""Rows -> tokenized preference data: (prompt, chosen, rejected) pairs, or labelled completions (KTO).

A sequence is the prompt's tokens followed by one response's tokens; the loss mask covers the response
tokens only.  Prompt and response are tokenized separately and concatenated, the way a model sees them
when it generates (prompt ids, then response ids):

- plain: the prompt is ``prompt_key`` (formatted by ``input_template``) tokenized with the tokenizer's
  special tokens (BOS); a response is its column's text without special tokens, then the EOS token.
- chat (``apply_chat_template``): the prompt is a list of messages (or a string: one user message)
  rendered with the generation prompt; a response is a string (one assistant message) or a list of
  messages appended to the prompt, and its text is what the rendered conversation adds after the
  rendered prompt (trailing whitespace after the end-of-turn token dropped).  Without a prompt column
  (``prompt_key: null`` or a null value) the responses are whole conversations: every message before
  the last one is the prompt, which must be the same in chosen and rejected.

A pair whose chosen and rejected responses are the same text teaches nothing: a bad row (``identical``).

Length policy: a sequence longer than ``max_len`` is a bad row (skipped and counted, or an error,
per ``bad_rows``), unless ``truncate_responses``: then the response is cut to fit (the prompt is kept
whole; a prompt that leaves no room for one response token is still a bad row, and so is a pair whose
two responses become identical when cut).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, TypeVar

from ..config.preference import PairDataConfig, PreferenceDataConfig, UnpairedDataConfig
from .assemble import assemble
from .preference_texts import _Texts
from .rows import BadRows, DataError, in_chunks
from .sft import Sample, _Bad, _value
from .sources import load_source, only_columns

T = TypeVar("T")


@dataclass
class PairSample:
    """A prompt with a preferred and a dispreferred response, each as a full sequence."""
    chosen: Sample
    rejected: Sample
    margin: float | None
    source: str  # e.g. "pairs.jsonl row 5"

    def __len__(self) -> int:
        return len(self.chosen) + len(self.rejected)


@dataclass
class LabelledSample:
    """KTO: one completion of a prompt, labelled desirable (True) or undesirable (False)."""
    prompt_ids: list[int]
    completion_ids: list[int]
    desirable: bool
    source: str

    def __len__(self) -> int:
        return len(self.prompt_ids) + len(self.completion_ids)

    def sequence(self, completion_ids: list[int] | None = None, max_len: int | None = None) -> Sample:
        """The prompt followed by its own completion, or by ``completion_ids`` (cut to ``max_len``)."""
        completion = self.completion_ids if completion_ids is None else completion_ids
        if max_len is not None:
            completion = completion[:max(max_len - len(self.prompt_ids), 1)]
        return make_sample(self.prompt_ids, completion, self.source)


def make_sample(prompt_ids: list[int], response_ids: list[int], source: str) -> Sample:
    """prompt + response with the loss mask on the response tokens (never on token 0: nothing predicts it)."""
    mask = [0] * len(prompt_ids) + [1] * len(response_ids)
    mask[0] = 0
    return Sample(list(prompt_ids) + list(response_ids), mask, source)


# ---------------------------------------------------------------------------------------------------
# row values besides the texts


def parse_margin(row: dict, key: str) -> float:
    value = _value(row, key, "objective.margin_key")
    if isinstance(value, bool):
        raise _Bad("wrong_type", f"{key!r} is a boolean, expected a number")
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            pass
    raise _Bad("wrong_type", f"{key!r} is {value!r}, expected a number")


_TRUE, _FALSE = ("true", "1", "yes", "desirable"), ("false", "0", "no", "undesirable")


def parse_label(row: dict, key: str) -> bool:
    value = _value(row, key, "data.label_key")
    if isinstance(value, bool):
        return value
    if isinstance(value, (int, float)) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in _TRUE + _FALSE:
        return value.strip().lower() in _TRUE
    raise _Bad("wrong_type", f"{key!r} is {value!r}, expected true/false (or 1/0)")


# ---------------------------------------------------------------------------------------------------
# tokenization


@dataclass
class _Rendered:
    row: int
    prompt: str
    responses: list[str]
    extra: Any


def _fit(prompt: list[int], response: list[int], max_len: int, truncate: bool, key: str) -> list[int]:
    if len(prompt) + len(response) <= max_len:
        return response
    if truncate and len(prompt) < max_len:
        return response[:max_len - len(prompt)]
    raise _Bad("too_long", f"prompt + {key!r} is {len(prompt) + len(response)} tokens, more than max_len {max_len}"
               + (f" (the prompt alone is {len(prompt)})" if truncate else ""))


def _tokenize(rows: Iterable[dict], name: str, tokenizer, cfg: PreferenceDataConfig, bad: BadRows,
              options: tuple[str, ...], extra: Callable[[dict], Any],
              make: Callable[[_Rendered, list[int], list[list[int]]], T]) -> list[T]:
    if not getattr(tokenizer, "is_fast", False):
        raise DataError("the tokenizer is not a fast (tokenizers-backed) tokenizer: load the model's tokenizer.json")
    eos = tokenizer.eos_token_id
    if not cfg.apply_chat_template and eos is None:
        raise DataError(f"{name}: the tokenizer has no eos_token, so responses cannot be ended; set one")
    texts = _Texts(cfg, tokenizer, name, options)
    keys = texts.keys
    ending = [] if cfg.apply_chat_template else [eos]
    out: list[T] = []

    def flush(chunk: list[_Rendered]) -> None:
        prompts = tokenizer([c.prompt for c in chunk], add_special_tokens=not cfg.apply_chat_template)["input_ids"]
        flat = tokenizer([t for c in chunk for t in c.responses], add_special_tokens=False)["input_ids"]
        pos = 0
        for c, prompt in zip(chunk, prompts):
            responses = [list(ids) + ending for ids in flat[pos:pos + len(keys)]]
            pos += len(keys)
            try:
                if not prompt and not all(len(x) > 1 for x in responses):
                    raise _Bad("empty", "no tokens to train on (no prompt and a one-token response)")
                fitted = [_fit(prompt, x, cfg.max_len, cfg.truncate_responses, k) for x, k in zip(responses, keys)]
                if len(fitted) > 1 and fitted != responses and all(f == fitted[0] for f in fitted[1:]):
                    raise _Bad("too_long", f"the responses are identical within max_len {cfg.max_len}")
                out.append(make(c, list(prompt), fitted))
            except _Bad as b:
                bad.add(name, c.row, b.kind, b.detail)

    def rendered() -> Iterator[_Rendered]:
        for r, row in enumerate(rows, start=1):
            try:
                prompt, responses = texts(row, r)
                if len(responses) > 1 and responses[0] == responses[1]:
                    raise _Bad("identical", f"{keys[0]!r} and {keys[1]!r} are the same response: the pair "
                                            f"prefers nothing")
                yield _Rendered(r, prompt, responses, extra(row))
            except _Bad as b:
                bad.add(name, r, b.kind, b.detail)

    for chunk in in_chunks(rendered()):
        flush(chunk)
    return out


def build_pairs(rows: Iterable[dict], name: str, tokenizer, cfg: PairDataConfig, bad: BadRows,
                margin_key: str | None = None) -> list[PairSample]:
    """Tokenize rows into pairs; bad rows go to ``bad`` (skipped, or raised under policy "error")."""
    def make(c: _Rendered, prompt: list[int], fitted: list[list[int]]) -> PairSample:
        where = f"{name} row {c.row}"
        return PairSample(make_sample(prompt, fitted[0], where), make_sample(prompt, fitted[1], where), c.extra,
                          where)
    extra = (lambda row: parse_margin(row, margin_key)) if margin_key else (lambda row: None)
    return _tokenize(rows, name, tokenizer, cfg, bad, ("chosen_key", "rejected_key"), extra, make)


def build_labelled(rows: Iterable[dict], name: str, tokenizer, cfg: UnpairedDataConfig,
                   bad: BadRows) -> list[LabelledSample]:
    """Tokenize rows into labelled completions (KTO)."""
    def make(c: _Rendered, prompt: list[int], fitted: list[list[int]]) -> LabelledSample:
        return LabelledSample(prompt, fitted[0], c.extra, f"{name} row {c.row}")
    return _tokenize(rows, name, tokenizer, cfg, bad, ("completion_key",),
                     lambda row: parse_label(row, cfg.label_key), make)


# ---------------------------------------------------------------------------------------------------
# loading


def _columns(cfg: PreferenceDataConfig, extra_keys: tuple[str | None, ...]) -> list[str]:
    keys = [cfg.prompt_key, *extra_keys]
    if isinstance(cfg, PairDataConfig):
        keys += [cfg.chosen_key, cfg.rejected_key]
    if isinstance(cfg, UnpairedDataConfig):
        keys += [cfg.completion_key, cfg.label_key]
    return [k for k in dict.fromkeys(keys) if k]


def _load(cfg: PreferenceDataConfig, seed: int, build: Callable[[Any, str, BadRows], list[T]],
          columns: list[str]) -> tuple[list[T], list[T], BadRows]:
    bad = BadRows(cfg.bad_rows)

    def read(spec: str, limit: int | None) -> tuple[list[T], int]:
        rows, name = load_source(spec, cfg.dataset_split)
        if limit is not None and len(rows) > limit:
            rows = rows.select(range(limit))
        return build(only_columns(rows, columns), name, bad), len(rows)

    train, evals = assemble(cfg.dataset, read, bad, probs=cfg.dataset_probs, eval_sources=cfg.eval_dataset,
                            eval_ratio=cfg.eval_split_ratio, max_samples=cfg.max_samples,
                            max_eval_samples=cfg.max_eval_samples, seed=seed)
    return train, evals, bad


def load_pairs(cfg: PairDataConfig, tokenizer, seed: int,
               margin_key: str | None = None) -> tuple[list[PairSample], list[PairSample], BadRows]:
    """Train and eval pairs plus the bad rows met (log ``bad.summary()`` when ``bad.total``)."""
    return _load(cfg, seed, lambda rows, name, bad: build_pairs(rows, name, tokenizer, cfg, bad, margin_key),
                 _columns(cfg, (margin_key,)))


def load_labelled(cfg: UnpairedDataConfig, tokenizer,
                  seed: int) -> tuple[list[LabelledSample], list[LabelledSample], BadRows]:
    """Train and eval labelled completions (KTO) plus the bad rows met."""
    return _load(cfg, seed, lambda rows, name, bad: build_labelled(rows, name, tokenizer, cfg, bad),
                 _columns(cfg, ()))
