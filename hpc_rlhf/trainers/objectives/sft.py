"""Supervised fine-tuning: the next-token NLL of the response tokens, a mean over every response token of the
step (all ranks, all micro-batches), so rank count, accumulation and packing do not change the gradient.

Samples are right-padded or packed into one row (``data.packing_samples``; flash-attention reads the sample
boundaries from the restarted position_ids, the other attentions get a block-diagonal mask), in micro-batches
of ``micro_train_batch_size`` samples or of at most ``data.micro_batch_tokens`` tokens.
"""
from __future__ import annotations

import torch

from ...algorithms.sft_loss import token_nll_sum
from ...data.batching import split_micro_batches
from ...data.packing import Batch, collate_packed, collate_padded, packed_attention_mask
from ...data.sft import Sample, load_sft_data
from ...distributed.collectives import max_over_ranks
from ...models.loading import check_packing
from .common import OFFLINE_OBJECTIVES, LossOut, PolicyObjective, StepView
from .per_unit_mean import StepUnits, as_item_mean


class ResponseTokenMean(PolicyObjective):
    """Trains on SFT samples with a loss that is a mean over the response tokens of the step (sft, kd)."""

    def load_data(self):
        return load_sft_data(self.cfg.data, self.tokenizer, self.cfg.train.seed)

    def step_context(self, engine, view: StepView) -> StepUnits:
        return StepUnits(sum(s.num_loss_tokens for s in view.items), len(view.items))


@OFFLINE_OBJECTIVES.register("sft")
class SFT(ResponseTokenMean):
    def __init__(self, cfg, de, device, tokenizer):
        super().__init__(cfg, de, device, tokenizer)
        self.packing, self.budget = cfg.data.packing_samples, cfg.data.micro_batch_tokens
        self.flash = cfg.model.attn_implementation == "flash_attention_2"
        self.dtype = torch.bfloat16 if cfg.model.param_dtype == "bf16" else torch.float32

    def build_model(self) -> torch.nn.Module:
        model = super().build_model()
        if self.packing:
            check_packing(model)
        return model

    def micro_batches(self, items: list[Sample]) -> list[list[Sample]]:
        """Groups of micro_train_batch_size samples or of at most micro_batch_tokens tokens, split further
        to as many as the rank with the most has (ZeRO-3 gathers parameters inside every forward)."""
        size = None if self.budget else self.micro
        groups = split_micro_batches(items, size, self.budget)
        most = max_over_ranks(len(groups))
        if len(groups) < most:
            groups = split_micro_batches(items, size, self.budget, min_count=min(most, len(items)))
        return groups

    def collate(self, samples: list[Sample]) -> Batch:
        if not self.packing:
            return collate_padded(samples, self.pad_id).to(self.device)
        batch = collate_packed(samples).to(self.device)
        if not self.flash:
            batch.attention_mask = packed_attention_mask(batch.seq_lens, self.dtype).to(self.device)
        return batch

    def loss(self, engine, samples: list[Sample], ctx: StepUnits) -> LossOut:
        batch = self.collate(samples)
        logits = engine(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                        position_ids=batch.position_ids, use_cache=False).logits
        nll_sum, _ = token_nll_sum(logits, batch.labels)
        return LossOut(as_item_mean(nll_sum, ctx, len(samples)), len(samples), {})

    def step_metrics(self, ctx: StepUnits) -> dict[str, float]:
        return {"tokens": ctx.units}
