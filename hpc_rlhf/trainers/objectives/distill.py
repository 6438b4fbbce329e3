"""Knowledge distillation: an SFT-style student trained on CE mixed with KL(teacher ‖ student) per token.

The teacher is a frozen full copy on every rank.  The loss is `distill_loss` per response token, a mean over
every response token of the step (all ranks, all micro-batches), like `sft`.
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

import torch

from ...algorithms.distill import distill_loss
from ...data.packing import collate_padded
from ...models.loading import load_causal_lm
from .common import OFFLINE_OBJECTIVES, LossOut
from .per_unit_mean import StepUnits, as_item_mean
from .sft import ResponseTokenMean


@OFFLINE_OBJECTIVES.register("kd")
class Distill(ResponseTokenMean):
    def prepare(self, datasets: Sequence[list]) -> None:
        teacher_cfg = dataclasses.replace(self.cfg.model, pretrain=self.cfg.objective.teacher_pretrain,
                                          gradient_checkpointing=False, lora_rank=0, load_in_4bit=False)
        self.teacher = load_causal_lm(teacher_cfg, trainable=False).to(self.device)

    def loss(self, engine, samples: list, ctx: StepUnits) -> LossOut:
        o = self.cfg.objective
        batch = collate_padded(samples, self.pad_id).to(self.device)
        inputs = dict(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                      position_ids=batch.position_ids, use_cache=False)
        student = engine(**inputs).logits[:, :-1]
        with torch.no_grad():
            teacher = self.teacher(**inputs).logits[:, :-1]
        labels = batch.labels[:, 1:]
        mask = labels != -100
        mean, m = distill_loss(student, teacher, labels.clamp(min=0), mask, kd_coef=o.kd_coef,
                               temperature=o.temperature)
        n = float(m["tokens"])
        stats = {"ce": (float(m["ce"]) * n, n), "kl": (float(m["kl"]) * n, n),
                 "tokens_per_sample": (n, float(len(samples)))}
        return LossOut(as_item_mean(mean * n, ctx, len(samples)), len(samples), stats)
