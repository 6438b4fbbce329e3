"""The critic: a value head on a transformer (loadable as AutoModelForSequenceClassification)."""
from __future__ import annotations

from types import SimpleNamespace

import torch
from transformers import AutoModelForSequenceClassification

from ..algorithms.rl_algorithm import RLAlgorithm
from ..config.rl import RLTrainConfig
from ..config.sections import ModelConfig
from ..engines.deepspeed_strategy import build_engine
from ..models.paths import resolve_pretrained
from .experience import Experience, RLBatch, padded, response_logits
from .shared_prompts import SharedPrompts, outputs_per_sample, sharing, train_steps


def load_value_model(path: str, dtype: str, gradient_checkpointing: bool = False) -> torch.nn.Module:
    model = AutoModelForSequenceClassification.from_pretrained(
        resolve_pretrained(path), num_labels=1, dtype=torch.bfloat16 if dtype == "bf16" else torch.float32)
    if model.config.pad_token_id is None:
        model.config.pad_token_id = model.config.eos_token_id
    if gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


class ValueHeadModel(torch.nn.Module):
    """A value model seen as a causal LM whose output head is its score head: ``response_logits`` and
    ``SharedPrompts`` run it as they run the actor, so the score head sees only the picked positions and a step's
    distinct prompts can run once for all of their samples."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model
        self.config = model.config
        self.train(model.training)

    @property
    def is_activation_checkpointing(self) -> bool:
        m = self.model
        return (m.is_activation_checkpointing if hasattr(m, "is_activation_checkpointing")
                else getattr(m, "is_gradient_checkpointing", False))

    def get_output_embeddings(self) -> torch.nn.Module:
        return getattr(self.model, "score", None) or getattr(self.model, "classifier")

    def forward(self, input_ids, attention_mask, position_ids, past_key_values=None, use_cache=False):
        out = self.model.base_model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                                    past_key_values=past_key_values, use_cache=use_cache)
        return SimpleNamespace(logits=self.get_output_embeddings()(out.last_hidden_state),
                               past_key_values=out.past_key_values)


def spread_values(out: torch.Tensor, batch: RLBatch) -> torch.Tensor:
    """The score head's outputs at the picked positions [N, 1] -> V at each response position [B, R]."""
    return batch.spread(out.squeeze(-1).float()) * batch.mask


def token_values(model: ValueHeadModel, batch: RLBatch) -> torch.Tensor:
    """V at each response position [B, R]: the score head applied to the hidden states that predict the
    response tokens."""
    return spread_values(response_logits(model, batch), batch)


class Critic:
    def __init__(self, model: ModelConfig, train: RLTrainConfig, algo: RLAlgorithm, total_optimizer_steps: int,
                 world_size: int, pad_id: int, device):
        """``model``: the critic's initialisation (its ``pretrain``), dtype and checkpointing."""
        self.train_cfg, self.algo, self.pad_id, self.device, self.world_size = train, algo, pad_id, device, world_size
        value_model = load_value_model(model.pretrain, model.param_dtype, model.gradient_checkpointing)
        self.engine = build_engine(value_model, train, train.critic_learning_rate, model.param_dtype,
                                   total_optimizer_steps, world_size)
        self.value_model = ValueHeadModel(self.engine.module)
        self.share_prompts = sharing(self.value_model, train.share_prompts, "critic", train.zero_stage)

    def values(self, samples: list[Experience]) -> list[list[float]]:
        t = self.train_cfg
        return outputs_per_sample(self.value_model, samples, t.micro_train_batch_size, self.pad_id, self.device,
                                  self.share_prompts, t.share_prompts_min_positions, spread_values)

    def _micro_loss(self, samples: list[Experience], batch: RLBatch, norm, shared: SharedPrompts | None = None):
        v = spread_values(shared.logits(samples, batch), batch) if shared else token_values(self.value_model, batch)
        R = batch.mask.size(1)
        old = padded([s.values for s in samples], R).to(v.device)
        ret = padded([s.returns for s in samples], R).to(v.device)
        loss, metrics = self.algo.critic_loss(v, old, ret, batch.mask, norm)
        return (loss + shared.closing() if shared else loss), metrics

    def train(self, samples: list[Experience], step: int) -> dict[str, float]:
        metrics, positions = train_steps(self.engine, self.value_model, samples, self.train_cfg, self.world_size,
                                         self.train_cfg.seed + step + 7, self.pad_id, self.device, self.share_prompts,
                                         self._micro_loss, None)
        return {f"critic/{k}": v for k, v in metrics.items()} | {"critic/positions_trained": positions}
