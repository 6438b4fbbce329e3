"""Preference rows -> the prompt text and one text per response column (plain or chat rendering; the
rules are in `data/preference.py`)."""
from __future__ import annotations

from typing import Any

from ..config.preference import PreferenceDataConfig
from .rows import DataError, checked_template
from .sft import _Bad, _ChatRenderer, _check_messages, _get_str, _value


def _as_messages(value: Any, key: str, role: str) -> list[dict]:
    if isinstance(value, str):
        if not value.strip():
            raise _Bad("empty", f"empty {key!r}")
        return [{"role": role, "content": value}]
    return _check_messages(value, key)


class _Texts:
    """Turns a row into (prompt text, [response text per key]); ``response_options`` name the data options that
    hold the response columns (chosen_key, rejected_key; completion_key)."""

    def __init__(self, cfg: PreferenceDataConfig, tokenizer, name: str, response_options: tuple[str, ...]):
        self.cfg = cfg
        self.keys = tuple(getattr(cfg, o) for o in response_options)
        self.options = tuple(f"data.{o}" for o in response_options)
        self.chat = _ChatRenderer(tokenizer, cfg.tokenizer_chat_template, name) if cfg.apply_chat_template else None
        self.name = name
        checked_template(cfg.input_template)

    def __call__(self, row: dict, r: int) -> tuple[str, list[str]]:
        return self._chat(row, r) if self.chat is not None else self._plain(row)

    def _plain(self, row: dict) -> tuple[str, list[str]]:
        prompt = _get_str(row, self.cfg.prompt_key, "data.prompt_key") if self.cfg.prompt_key else ""
        if self.cfg.input_template is not None:
            prompt = self.cfg.input_template.format(prompt)
        return prompt, [_get_str(row, k, o) for k, o in zip(self.keys, self.options)]

    def _chat(self, row: dict, r: int) -> tuple[str, list[str]]:
        values = [_value(row, k, o) for k, o in zip(self.keys, self.options)]
        prompt_value = row.get(self.cfg.prompt_key) if self.cfg.prompt_key else None
        if prompt_value is None:  # whole conversations: the last message is the response
            convs = []
            for k, v in zip(self.keys, values):
                if not isinstance(v, (list, tuple)) or not v:
                    raise _Bad("wrong_type", f"{k!r} must be a non-empty list of messages when there is no "
                                             f"prompt column (the last message is the response)")
                convs.append(_check_messages(v, k))
            prompt = convs[0][:-1]
            if any(c[:-1] != prompt for c in convs[1:]):
                raise _Bad("wrong_type", f"{' and '.join(map(repr, self.keys))} differ before their last "
                                         f"message: they must share the prompt")
            responses = [c[-1:] for c in convs]
        else:
            prompt = _as_messages(prompt_value, self.cfg.prompt_key, "user")
            responses = [_as_messages(v, k, "assistant") for k, v in zip(self.keys, values)]
        for k, msgs in zip(self.keys, responses):
            if not msgs or msgs[-1]["role"] != "assistant":
                raise _Bad("wrong_type", f"the response in {k!r} must end with an assistant message")
            if not msgs[-1]["content"].strip():
                raise _Bad("empty", f"empty assistant message in {k!r}")
        prompt_text = self.chat.render(prompt, True)
        texts = []
        for k, msgs in zip(self.keys, responses):
            full = self.chat.render(prompt + msgs, False)
            if not full.startswith(prompt_text):
                raise DataError(f"{self.name} row {r}: the chat template renders the prompt with "
                                f"add_generation_prompt=True as text that is not a prefix of the conversation "
                                f"with the response in {k!r}, so the response cannot be located; pass a "
                                f"simpler data.tokenizer_chat_template")
            text = full[len(prompt_text):].rstrip()
            if not text:
                raise _Bad("empty", f"the response in {k!r} renders as no text")
            texts.append(text)
        return prompt_text, texts
