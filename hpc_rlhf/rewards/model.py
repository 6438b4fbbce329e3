"""Score token sequences with a sequence-classification reward model (one output per sequence).

The score of a sequence is the head's output at its last real token.  Sequences are right-padded with an
attention mask, and the pooling index comes from that mask (``lengths - 1``), not from comparing ids with
the pad id: Hugging Face's own ``*ForSequenceClassification`` pooling takes the rightmost token that differs
from ``pad_token_id``, which is wrong when the pad id equals the eos id and the sequence ends with eos (it
would pool the token before the eos).  So the scorer runs the backbone and the head itself.
"""
from __future__ import annotations

import math
from typing import Callable

import torch
from transformers import AutoModelForSequenceClassification

from ..distributed.collectives import max_over_ranks
from ..models.paths import resolve_pretrained

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_HEAD_NAMES = ("score", "classifier", "v_head")


class _LastTokenScores(torch.nn.Module):
    """The backbone and the score head of ``model`` as one module: the head's output at each row's last real token.
    (One module, so that a ZeRO-3 engine wrapping it sees each forward begin and end.)"""

    def __init__(self, model: torch.nn.Module, head: str):
        super().__init__()
        self.model, self.head = model, head

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        out = getattr(self.model, self.model.base_model_prefix)(input_ids=ids, attention_mask=mask, use_cache=False)
        values = getattr(self.model, self.head)(out.last_hidden_state)[..., 0]  # [b, T]
        return values[torch.arange(ids.size(0), device=ids.device), mask.sum(-1) - 1]


class RewardModelScorer:
    """Load ``AutoModelForSequenceClassification`` (``num_labels=1``) from ``path`` and score token lists.

    With ``normalize`` (default) scores become ``(score - reward_mean) / reward_std`` when the model config
    has ``reward_mean`` and ``reward_std``.  ``shard`` (e.g. ``build_frozen_engine``) wraps the scoring module in
    a ZeRO-3 engine over the rank's world instead of moving it to ``device``: every rank of that world then scores
    together (``score_tokens`` on each, with any number of sequences, none included).
    """

    def __init__(self, path, dtype: str = "fp32", device: str = "cpu", batch_size: int = 16,
                 normalize: bool = True, shard: Callable[[torch.nn.Module], torch.nn.Module] | None = None):
        if dtype not in _DTYPES:
            raise ValueError(f"unknown dtype {dtype!r}: choose one of {', '.join(_DTYPES)}")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.path = str(path)
        self.device = torch.device(device)
        self.batch_size = batch_size
        model = AutoModelForSequenceClassification.from_pretrained(resolve_pretrained(self.path), num_labels=1,
                                                                   dtype=_DTYPES[dtype])
        self.model = model.eval()
        for p in self.model.parameters():
            p.requires_grad_(False)
        head = next((n for n in _HEAD_NAMES if isinstance(getattr(self.model, n, None), torch.nn.Module)), None)
        if head is None:
            raise ValueError(f"{type(self.model).__name__} from {self.path} has no score head "
                             f"(looked for {', '.join(_HEAD_NAMES)})")
        self.sharded = shard is not None
        scores = _LastTokenScores(self.model, head)
        self.scores = shard(scores) if self.sharded else scores.to(self.device)
        cfg = self.model.config
        text_cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
        pad = getattr(text_cfg, "pad_token_id", None)
        if pad is None:
            pad = getattr(text_cfg, "eos_token_id", None)
            pad = pad[0] if isinstance(pad, (list, tuple)) else pad
        self.pad_id = int(pad) if pad is not None else 0  # only fills masked positions, value irrelevant
        self.max_length = getattr(text_cfg, "max_position_embeddings", None)
        mean, std = getattr(cfg, "reward_mean", None), getattr(cfg, "reward_std", None)
        self.mean, self.std = None, None
        if normalize and mean is not None and std is not None:
            if not (math.isfinite(float(std)) and float(std) > 0):
                raise ValueError(f"config.reward_std of {self.path} is {std}; expected a positive number")
            self.mean, self.std = float(mean), float(std)

    @torch.no_grad()
    def _forward(self, seqs: list[list[int]]) -> torch.Tensor:
        lengths = torch.tensor([len(s) for s in seqs])
        width = int(lengths.max())
        ids = torch.full((len(seqs), width), self.pad_id, dtype=torch.long)
        for i, s in enumerate(seqs):
            ids[i, :len(s)] = torch.as_tensor(s, dtype=torch.long)
        mask = (torch.arange(width)[None, :] < lengths[:, None]).long()
        return self.scores(ids.to(self.device), mask.to(self.device)).float().cpu()

    def score_tokens(self, sequences: list[list[int]]) -> torch.Tensor:
        """Scores float32 [B] of the sequences (batched by length to limit padding)."""
        seqs = [list(s) for s in sequences]
        for i, s in enumerate(seqs):
            if not s:
                raise ValueError(f"sequence {i} is empty")
            if self.max_length is not None and len(s) > self.max_length:
                raise ValueError(f"sequence {i} has {len(s)} tokens; the model takes at most {self.max_length}")
        out = torch.empty(len(seqs), dtype=torch.float32)
        order = sorted(range(len(seqs)), key=lambda i: len(seqs[i]))
        starts = range(0, len(order), self.batch_size)
        # sharded: as many forwards as the rank with the most batches (each gathers the parameters), agreed first
        extra = max_over_ranks(len(starts)) - len(starts) if self.sharded else 0
        for lo in starts:
            idx = order[lo:lo + self.batch_size]
            out[torch.tensor(idx)] = self._forward([seqs[i] for i in idx])
        for _ in range(extra):
            self._forward([[self.pad_id]])
        if self.mean is not None:
            out = (out - self.mean) / self.std
        return out

    __call__ = score_tokens
