"""How an environment's feedback text becomes the tokens appended to a trajectory (all with action mask 0).

- ``raw``: the text as the environment wrote it, tokenized on its own (OpenRLHF's behaviour: an environment
  written for it puts any chat markup into its feedback itself).
- ``user_turn``: the feedback becomes a user message of the tokenizer's chat template, followed by the
  assistant's generation prompt.  The template's text around a user message that follows an assistant message
  is found once by rendering a two-message and a three-message conversation with marker strings.  The text of
  the end-of-turn token the model sampled (e.g. ``<|im_end|>``) is not repeated; after an action cut by length
  the framework's text closes the turn (its end-of-turn token then has mask 0 like the rest).
"""
from __future__ import annotations

from typing import Literal

FeedbackStyle = Literal["raw", "user_turn"]

_ACTION = "hpc_rlhf_action_7f3a"
_FEEDBACK = "hpc_rlhf_feedback_7f3a"


class FeedbackFormat:
    def __init__(self, tokenizer, style: FeedbackStyle, stop_token_ids: list[int]):
        self.tokenizer, self.style, self.stop = tokenizer, style, set(stop_token_ids)
        self.before, self.after = "", ""
        if style == "user_turn":
            self.before, self.after = user_turn_text(tokenizer)

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"]) if text else []

    def tokens(self, feedback: str, last_action: list[int]) -> list[int]:
        """The ids appended after ``last_action`` (the turn's sampled tokens) for ``feedback``."""
        if self.style == "raw":
            return self.encode(feedback)
        before = self.before
        if last_action and last_action[-1] in self.stop:
            sampled = self.tokenizer.decode([last_action[-1]])
            if before.startswith(sampled):
                before = before[len(sampled):]
        return self.encode(before + feedback + self.after)


def user_turn_text(tokenizer) -> tuple[str, str]:
    """(text before, text after) the feedback when it is a user message after an assistant message, ending
    with the assistant's generation prompt, by the tokenizer's chat template."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("agent.feedback_template=user_turn needs a tokenizer with a chat template; this one has "
                         "none: use feedback_template=raw (the environment writes any markup itself)")
    convo = [{"role": "user", "content": "q"}, {"role": "assistant", "content": _ACTION}]
    text = tokenizer.apply_chat_template(convo + [{"role": "user", "content": _FEEDBACK}], tokenize=False,
                                         add_generation_prompt=True)
    if _ACTION not in text or _FEEDBACK not in text:
        raise ValueError("the tokenizer's chat template drops message contents; use agent.feedback_template=raw")
    tail = text[text.index(_ACTION) + len(_ACTION):]
    before, after = tail.split(_FEEDBACK, 1)
    return before, after
