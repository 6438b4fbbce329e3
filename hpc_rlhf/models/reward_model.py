"""A reward model for training: ``AutoModelForSequenceClassification`` (one output) from a causal-LM folder.

The score of a sequence is the head's value at its last real token, located from the attention mask
(``lengths - 1``) as `rewards.model.RewardModelScorer` does.  Hugging Face's own pooling takes the
rightmost token that differs from ``pad_token_id``, which picks the token before the end when pad and
eos share an id and the sequence ends with eos; the two agree when the pad token is a token of its own.
``LastTokenScores`` reads the head's per-token output with a forward hook, so the model still runs
through its (DeepSpeed) engine in one call.
"""
from __future__ import annotations

import torch
from transformers import AutoModelForSequenceClassification

from ..config.sections import ModelConfig
from .loading import _enable_checkpointing
from .paths import resolve_pretrained

_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
HEAD_NAMES = ("score", "classifier", "v_head")


def load_reward_model(cfg: ModelConfig, pad_token_id: int):
    """Backbone from ``cfg.pretrain`` and a freshly initialised one-output score head, in train mode.

    The config's ``pad_token_id`` is set to the tokenizer's, so Hugging Face's pooling works on batches.
    """
    model = AutoModelForSequenceClassification.from_pretrained(
        resolve_pretrained(cfg.pretrain), num_labels=1, dtype=_DTYPES[cfg.param_dtype],
        attn_implementation=cfg.attn_implementation)
    model.config.pad_token_id = pad_token_id
    model.config.use_cache = False
    if cfg.gradient_checkpointing:
        _enable_checkpointing(model)
    return model.train()


def score_head(model: torch.nn.Module) -> torch.nn.Module:
    head = next((getattr(model, n) for n in HEAD_NAMES if isinstance(getattr(model, n, None), torch.nn.Module)),
                None)
    if head is None:
        raise ValueError(f"{type(model).__name__} has no score head (looked for {', '.join(HEAD_NAMES)})")
    return head


class LastTokenScores:
    """Calls a sequence-classification model (or its engine) and returns the score at each row's last real token."""

    def __init__(self, model: torch.nn.Module):
        self._values: torch.Tensor | None = None
        score_head(model).register_forward_hook(self._keep)

    def _keep(self, module, inputs, output) -> None:
        self._values = output

    def __call__(self, engine, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                 position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Scores float32 [B]; rows right-padded, ``attention_mask`` 1 on real tokens."""
        self._values = None
        engine(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False)
        values, self._values = self._values, None
        last = attention_mask.long().sum(-1) - 1
        return values[torch.arange(values.shape[0], device=values.device), last, 0].float()
