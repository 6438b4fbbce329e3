"""The actor: the policy under training.  Old log-probs in the score phase, PPO-style updates in train."""
from __future__ import annotations

import torch

from ..algorithms.aggregation import aggregate
from ..algorithms.kl import compute_kl
from ..algorithms.mismatch import is_weights, mismatch_metrics
from ..algorithms.policy_loss import entropy_from_logits, policy_loss
from ..config.rl import RLConfig
from ..engines.deepspeed_strategy import build_engine
from ..models.loading import load_causal_lm
from .experience import Experience, RLBatch, gather_positions, padded, response_logprobs
from .training import optimizer_steps, per_sample, run_optimizer_step


class Actor:
    _mismatch_max = 0.0  # largest |trainer − engine| log-prob difference of the current train() call

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
            engine = engine_logprobs(samples, R).to(logp.device)
            token_loss, metrics = policy_loss(algo.policy_loss, logp, old, adv, batch.mask, eps_clip=algo.eps_clip,
                                              eps_clip_high=algo.eps_clip_high, dual_clip=algo.dual_clip)
            if algo.is_correction != "none":
                # the old policy is the trainer's policy at generation time; the engine's log-probs are at
                # temperature 1, so are the trainer's (RLConfig.validate)
                weights, is_metrics = is_weights(algo.is_correction, old, engine, batch.mask, low=algo.is_low,
                                                 high=algo.is_high)
                token_loss = token_loss * weights
                metrics.update(is_metrics)
            if self.temperature == 1.0:
                trainer = old
            else:  # the engine's log-probs are at temperature 1: compare with the current policy's at 1
                with torch.no_grad():
                    trainer = response_logprobs(logits.detach(), batch, 1.0)
            mm = mismatch_metrics(trainer, engine, batch.mask)
            self._mismatch_max = max(self._mismatch_max, float(mm["mismatch/max_abs_diff"]))
            metrics.update(mm)
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
        self._mismatch_max = 0.0
        for micro in optimizer_steps(samples, per_rank, t.micro_train_batch_size, t.max_epochs,
                                     t.seed + step, self.pad_id, self.device):
            history.append(run_optimizer_step(self.engine, micro, self._micro_loss(kl_coef, use_kl_loss, agg_mode),
                                              self.world_size, float(self.cfg.rollout.generate_max_len)))
        out = {f"actor/{k}": sum(h[k] for h in history) / len(history) for k in history[0]}
        out["actor/mismatch/max_abs_diff"] = self._mismatch_max  # a max over the call, not a mean of maxima
        out["actor/lr"] = self.engine.get_lr()[0]
        return out


def engine_logprobs(samples: list[Experience], width: int) -> torch.Tensor:
    """The samples' engine log-probs [B, width], zero padded; an error unless each has one per response token."""
    for s in samples:
        lp = s.engine_logprobs
        if lp is None or len(lp) != len(s.response_ids):
            raise ValueError(f"sample (prompt {s.prompt_index}, sample {s.sample_index}) has "
                             f"{'no' if lp is None else len(lp)} engine_logprobs for {len(s.response_ids)} "
                             f"response tokens: the rollout engine must return one log-prob per generated token")
    out = padded([s.engine_logprobs for s in samples], width)
    if torch.isnan(out).any():
        raise ValueError("a sample's engine_logprobs holds nan")
    return out
