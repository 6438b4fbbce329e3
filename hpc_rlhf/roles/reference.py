"""The reference policy: frozen, log-probs of the generated responses for the KL term, or the teacher's for on-policy
distillation (the same pass with model.teacher_pretrain)."""
from __future__ import annotations

from ..config.rl import RLTrainConfig
from ..config.sections import ModelConfig
from ..models.loading import load_causal_lm
from .experience import Experience
from .shared_prompts import logprobs_per_sample, sharing


class Reference:
    def __init__(self, model: ModelConfig, train: RLTrainConfig, temperature: float, pad_id: int, device):
        """``model``: the reference's (its ``pretrain``, the actor's dtype); ``temperature``: the rollout's."""
        self.model = load_causal_lm(model, trainable=False).to(device)
        self.train_cfg, self.pad_id, self.device = train, pad_id, device
        self.temperature = temperature or 1.0
        self.share_prompts = sharing(self.model, train.share_prompts, "reference")

    def logprobs(self, samples: list[Experience]) -> list[list[float]]:
        t = self.train_cfg
        return logprobs_per_sample(self.model, samples, t.micro_train_batch_size, self.pad_id, self.device,
                                   self.temperature, self.share_prompts, t.share_prompts_min_positions)
