"""The reference policy: frozen, log-probs of the generated responses for the KL term, or the teacher's for on-policy
distillation (the same pass with model.teacher_pretrain).  Under ZeRO-3 (``train.zero_stage`` 3) it is sharded
over the ranks of its world like the actor (``build_frozen_engine``)."""
from __future__ import annotations

from ..config.rl import RLTrainConfig
from ..config.sections import ModelConfig
from ..engines.deepspeed_strategy import build_frozen_engine
from ..models.loading import load_causal_lm
from .experience import Experience
from .shared_prompts import logprobs_per_sample, sharing


class Reference:
    def __init__(self, model: ModelConfig, train: RLTrainConfig, temperature: float, pad_id: int, device,
                 world_size: int = 1):
        """``model``: the reference's (its ``pretrain``, the actor's dtype); ``temperature``: the rollout's;
        ``world_size``: the ranks of its world (what ZeRO-3 shards over)."""
        lm = load_causal_lm(model, trainable=False)
        self.sharded = train.zero_stage == 3
        self.model = (build_frozen_engine(lm, model.param_dtype, world_size, "reference") if self.sharded
                      else lm.to(device))
        self.train_cfg, self.pad_id, self.device = train, pad_id, device
        self.temperature = temperature or 1.0
        self.share_prompts = sharing(self.model, train.share_prompts, "reference", train.zero_stage)

    def logprobs(self, samples: list[Experience]) -> list[list[float]]:
        """Collective over the reference's world when sharded: each rank its shard, however many samples."""
        t = self.train_cfg
        return logprobs_per_sample(self.model, samples, t.micro_train_batch_size, self.pad_id, self.device,
                                   self.temperature, self.share_prompts, t.share_prompts_min_positions,
                                   lockstep=self.sharded)
