"""The critic: a value head on a transformer (loadable as AutoModelForSequenceClassification)."""
from __future__ import annotations

import torch
from transformers import AutoModelForSequenceClassification

from ..algorithms.rl_algorithm import RLAlgorithm
from ..config.rl import RLConfig
from ..engines.deepspeed_strategy import build_engine
from ..models.loading import resolve_pretrained
from .experience import Experience, RLBatch, gather_positions, padded
from .training import combine, optimizer_steps, per_sample, positions_trained, run_optimizer_step, summed_positions


def load_value_model(path: str, dtype: str, gradient_checkpointing: bool = False) -> torch.nn.Module:
    model = AutoModelForSequenceClassification.from_pretrained(
        resolve_pretrained(path), num_labels=1, dtype=torch.bfloat16 if dtype == "bf16" else torch.float32)
    if model.config.pad_token_id is None:
        model.config.pad_token_id = model.config.eos_token_id
    if gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def token_values(model: torch.nn.Module, batch: RLBatch) -> torch.Tensor:
    """V at each response position [B, R]: the score head applied to every hidden state."""
    hidden = model.base_model(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                              position_ids=batch.position_ids, use_cache=False).last_hidden_state
    head = getattr(model, "score", None) or getattr(model, "classifier")
    values = head(hidden).squeeze(-1).float()
    return gather_positions(values, batch) * batch.mask


class Critic:
    def __init__(self, cfg: RLConfig, algo: RLAlgorithm, total_optimizer_steps: int, world_size: int, pad_id: int,
                 device):
        self.cfg, self.algo, self.pad_id, self.device, self.world_size = cfg, algo, pad_id, device, world_size
        path = cfg.critic_pretrain or cfg.reward.reward_pretrain or cfg.model.pretrain
        model = load_value_model(path, cfg.model.param_dtype, cfg.model.gradient_checkpointing)
        self.engine = build_engine(model, cfg.train, cfg.train.critic_learning_rate,
                                   cfg.model.param_dtype, total_optimizer_steps, world_size)

    def values(self, samples: list[Experience]) -> list[list[float]]:
        return per_sample(self.engine, samples, self.cfg.train.micro_train_batch_size, self.pad_id, self.device,
                          lambda _part, batch: token_values(self.engine.module, batch))

    def _micro_loss(self, samples: list[Experience], batch: RLBatch, norm):
        v = token_values(self.engine.module, batch)
        R = batch.mask.size(1)
        old = padded([s.values for s in samples], R).to(v.device)
        ret = padded([s.returns for s in samples], R).to(v.device)
        return self.algo.critic_loss(v, old, ret, batch.mask, norm)

    def train(self, samples: list[Experience], step: int) -> dict[str, float]:
        t = self.cfg.train
        steps = optimizer_steps(samples, t.train_batch_size // self.world_size, t.micro_train_batch_size,
                                t.max_epochs, t.seed + step + 7, self.pad_id, self.device,
                                t.micro_batch_overhead_tokens)
        history = [run_optimizer_step(self.engine, micro, self._micro_loss, self.world_size, None) for micro in steps]
        positions = sum(positions_trained([s for part, _ in micro for s in part]) for micro in steps)
        return {f"critic/{k}": v for k, v in combine(history).items()} | {
            "critic/positions_trained": summed_positions(positions)}
