"""The reference policy: frozen, log-probs of the generated responses for the KL term."""
from __future__ import annotations

import dataclasses


from ..config.rl import RLConfig
from ..models.loading import load_causal_lm
from .experience import Experience
from .shared_prompts import logprobs_per_sample, sharing


class Reference:
    def __init__(self, cfg: RLConfig, pad_id: int, device):
        model_cfg = dataclasses.replace(cfg.model, pretrain=cfg.ref_pretrain or cfg.model.pretrain,
                                        gradient_checkpointing=False)
        self.model = load_causal_lm(model_cfg, trainable=False).to(device)
        self.cfg, self.pad_id, self.device = cfg, pad_id, device
        self.temperature = cfg.rollout.temperature or 1.0
        self.share_prompts = sharing(self.model, cfg.train.share_prompts, "reference")

    def logprobs(self, samples: list[Experience]) -> list[list[float]]:
        t = self.cfg.train
        return logprobs_per_sample(self.model, samples, t.micro_train_batch_size, self.pad_id, self.device,
                                   self.temperature, self.share_prompts, t.share_prompts_min_positions)
