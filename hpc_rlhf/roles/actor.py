"""The actor: the policy under training.  Old log-probs in the score phase, PPO-style updates in train."""
from __future__ import annotations

import torch

from ..algorithms.aggregation import aggregate
from ..algorithms.kl import compute_kl
from ..algorithms.policy_loss import entropy_from_logits, policy_loss
from ..config.rl import RLConfig
from ..engines.deepspeed_strategy import build_engine
from ..models.loading import load_causal_lm
from .experience import Experience, RLBatch, gather_positions, padded, response_logprobs
from .training import optimizer_steps, per_sample, run_optimizer_step


class Actor:
    def __init__(self, cfg: RLConfig, total_optimizer_steps: int, world_size: int, pad_id: int, device):
        self.cfg, self.pad_id, self.device, self.world_size = cfg, pad_id, device, world_size
        self.engine = build_engine(load_causal_lm(cfg.model), cfg.train, cfg.train.actor_learning_rate,
                                   cfg.model.param_dtype, total_optimizer_steps, world_size)
        self.temperature = cfg.rollout.temperature or 1.0

    @property
    def module(self) -> torch.nn.Module:
        return self.engine.module

    def _logits(self, batch: RLBatch) -> torch.Tensor:
        return self.engine(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                           position_ids=batch.position_ids, use_cache=False).logits

    def logprobs(self, samples: list[Experience]) -> list[list[float]]:
        return per_sample(self.engine, samples, self.cfg.train.micro_train_batch_size, self.pad_id, self.device,
                          lambda batch: response_logprobs(self._logits(batch), batch, self.temperature))

    def _micro_loss(self, kl_coef: float, use_kl_loss: bool, agg_mode: str):
        algo = self.cfg.algo

        def loss_fn(samples: list[Experience], batch: RLBatch, norm):
            logits = self._logits(batch)
            logp = response_logprobs(logits, batch, self.temperature)
            R = batch.mask.size(1)
            # without an old-policy pass the samples come from exactly these weights (one update per step)
            old = (logp.detach() if samples[0].old_logprobs is None
                   else padded([s.old_logprobs for s in samples], R).to(logp.device))
            adv = padded([s.advantages for s in samples], R).to(logp.device)
            token_loss, metrics = policy_loss(algo.policy_loss, logp, old, adv, batch.mask, eps_clip=algo.eps_clip,
                                              eps_clip_high=algo.eps_clip_high, dual_clip=algo.dual_clip)
            if use_kl_loss and kl_coef > 0:
                ref = padded([s.ref_logprobs for s in samples], R).to(logp.device)
                kl = compute_kl(logp, ref, algo.kl_estimator, batch.mask)
                token_loss = token_loss + kl_coef * kl
                metrics["kl_loss"] = (kl.sum() / batch.mask.sum().clamp(min=1)).detach()
            if algo.entropy_loss_coef:
                ent = entropy_from_logits(gather_positions(logits, batch)) * batch.mask
                token_loss = token_loss - algo.entropy_loss_coef * ent
                metrics["entropy"] = (ent.sum() / batch.mask.sum().clamp(min=1)).detach()
            return aggregate(token_loss, batch.mask, agg_mode, norm), metrics
        return loss_fn

    def train(self, samples: list[Experience], step: int, kl_coef: float, use_kl_loss: bool,
              agg_mode: str) -> dict[str, float]:
        t = self.cfg.train
        per_rank = t.train_batch_size // self.world_size
        history = []
        for micro in optimizer_steps(samples, per_rank, t.micro_train_batch_size, t.max_epochs,
                                     t.seed + step, self.pad_id, self.device):
            history.append(run_optimizer_step(self.engine, micro, self._micro_loss(kl_coef, use_kl_loss, agg_mode),
                                              self.world_size, float(self.cfg.rollout.generate_max_len)))
        out = {f"actor/{k}": sum(h[k] for h in history) / len(history) for k in history[0]}
        out["actor/lr"] = self.engine.get_lr()[0]
        return out
