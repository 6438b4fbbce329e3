"""Samples -> model inputs: right-padded rows, or all samples packed into one row."""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Sequence

import torch

from .sft import Sample

IGNORE_INDEX = -100


@dataclass
class Batch:
    """Model inputs. labels are NOT shifted: labels[b, t] = input_ids[b, t] where token t is a target."""
    input_ids: torch.Tensor                 # LongTensor [B, T]
    labels: torch.Tensor                    # LongTensor [B, T], -100 where not a target
    attention_mask: torch.Tensor | None     # LongTensor [B, T] of 1/0 (padded); None when packed
    position_ids: torch.Tensor              # LongTensor [B, T]
    seq_lens: list[int] | None              # lengths of the packed samples; None when padded
    num_loss_tokens: int

    def to(self, device, non_blocking: bool = False) -> "Batch":
        def move(t):
            return None if t is None else t.to(device, non_blocking=non_blocking)
        return replace(self, input_ids=move(self.input_ids), labels=move(self.labels),
                       attention_mask=move(self.attention_mask), position_ids=move(self.position_ids))


def _labels(sample: Sample) -> list[int]:
    return [tok if m else IGNORE_INDEX for tok, m in zip(sample.input_ids, sample.loss_mask)]


def collate_padded(samples: Sequence[Sample], pad_id: int) -> Batch:
    """Right-padded [B, max_len] batch; position_ids count 0, 1, ... along every row."""
    if not samples:
        raise ValueError("collate_padded got no samples")
    width = max(len(s) for s in samples)
    ids = torch.full((len(samples), width), pad_id, dtype=torch.long)
    labels = torch.full((len(samples), width), IGNORE_INDEX, dtype=torch.long)
    attn = torch.zeros((len(samples), width), dtype=torch.long)
    for b, s in enumerate(samples):
        n = len(s)
        ids[b, :n] = torch.tensor(s.input_ids, dtype=torch.long)
        labels[b, :n] = torch.tensor(_labels(s), dtype=torch.long)
        attn[b, :n] = 1
    pos = torch.arange(width, dtype=torch.long).expand(len(samples), width).clone()
    return Batch(ids, labels, attn, pos, None, sum(s.num_loss_tokens for s in samples))


def collate_packed(samples: Sequence[Sample]) -> Batch:
    """All samples in one [1, sum_len] row; position_ids restart at 0 for each sample.

    Attention must stay inside each sample: pass `packed_attention_mask(batch.seq_lens, dtype)`
    (sdpa/eager), or rely on the restarted position_ids (flash_attention_2).
    """
    if not samples:
        raise ValueError("collate_packed got no samples")
    for s in samples:
        if s.loss_mask and s.loss_mask[0]:
            raise ValueError(f"{s.source}: loss_mask[0] is 1, so packing would train one sample's first token "
                             f"on the previous sample's last one")
    ids = torch.tensor([t for s in samples for t in s.input_ids], dtype=torch.long)[None]
    labels = torch.tensor([t for s in samples for t in _labels(s)], dtype=torch.long)[None]
    pos = torch.cat([torch.arange(len(s), dtype=torch.long) for s in samples])[None]
    return Batch(ids, labels, None, pos, [len(s) for s in samples], sum(s.num_loss_tokens for s in samples))


def packed_attention_mask(seq_lens: Sequence[int], dtype: torch.dtype = torch.float32,
                          device: torch.device | str | None = None) -> torch.Tensor:
    """Additive [1, 1, T, T] mask: 0 where key and query are in one sample and key <= query, else min."""
    seg = torch.repeat_interleave(torch.arange(len(seq_lens), device=device),
                                  torch.as_tensor(list(seq_lens), device=device))
    total = seg.numel()
    causal = torch.ones((total, total), dtype=torch.bool, device=device).tril()
    allowed = causal & (seg[:, None] == seg[None, :])
    mask = torch.zeros((total, total), dtype=dtype, device=device)
    mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask[None, None]
