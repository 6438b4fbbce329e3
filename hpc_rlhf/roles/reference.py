"""The reference policy: frozen, log-probs of the generated responses for the KL term."""
from __future__ import annotations

import dataclasses

import torch

from ..config.rl import RLConfig
from ..models.loading import load_causal_lm
from .experience import Experience, collate, response_logprobs, unpadded
from .training import chunks


class Reference:
    def __init__(self, cfg: RLConfig, pad_id: int, device):
        model_cfg = dataclasses.replace(cfg.model, pretrain=cfg.ref_pretrain or cfg.model.pretrain,
                                        gradient_checkpointing=False)
        self.model = load_causal_lm(model_cfg, trainable=False).to(device)
        self.cfg, self.pad_id, self.device = cfg, pad_id, device
        self.temperature = cfg.rollout.temperature or 1.0

    @torch.no_grad()
    def logprobs(self, samples: list[Experience]) -> list[list[float]]:
        out = []
        for part in chunks(samples, self.cfg.train.micro_train_batch_size):
            batch = collate(part, self.pad_id, self.device)
            logits = self.model(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                                position_ids=batch.position_ids, use_cache=False).logits
            out += unpadded(response_logprobs(logits, batch, self.temperature), part)
        return out
