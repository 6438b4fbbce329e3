"""The actor: the policy under training.  Old log-probs in the score phase, PPO-style updates in train."""
from __future__ import annotations

import torch

from ..algorithms.mismatch import mismatch_metrics
from ..algorithms.policy_loss import entropy_from_logits
from ..algorithms.rl_algorithm import RLAlgorithm
from ..config.rl import RLTrainConfig
from ..config.sections import ModelConfig
from ..engines.deepspeed_strategy import build_engine
from ..models.loading import load_causal_lm
from .experience import Experience, RLBatch, padded, response_logits, response_logprobs
from .shared_prompts import SharedPrompts, logprobs_per_sample, sharing, train_steps


class Actor:
    _mismatch_max = 0.0  # largest |trainer − engine| log-prob difference of the current train() call

    def __init__(self, model: ModelConfig, train: RLTrainConfig, temperature: float, max_action_tokens: int,
                 algo: RLAlgorithm, total_optimizer_steps: int, world_size: int, pad_id: int, device):
        """``temperature``: the rollout's (log-probs at the temperature the samples were drawn at);
        ``max_action_tokens``: sampled tokens of one sample at most (``RLConfig.max_action_tokens``)."""
        self.train_cfg, self.algo, self.pad_id, self.device, self.world_size = train, algo, pad_id, device, world_size
        self.max_action_tokens = max_action_tokens
        self.engine = build_engine(load_causal_lm(model), train, train.actor_learning_rate, model.param_dtype,
                                   total_optimizer_steps, world_size)
        self.temperature = temperature or 1.0
        self.share_prompts = sharing(self.engine, train.share_prompts, "actor", train.zero_stage)

    @property
    def module(self) -> torch.nn.Module:
        return self.engine.module

    def _logits(self, batch: RLBatch) -> torch.Tensor:
        return response_logits(self.engine, batch)

    def logprobs(self, samples: list[Experience]) -> list[list[float]]:
        t = self.train_cfg
        return logprobs_per_sample(self.engine, samples, t.micro_train_batch_size, self.pad_id, self.device,
                                   self.temperature, self.share_prompts, t.share_prompts_min_positions)

    def probe_logprobs(self, prompt_ids: list[int], response_ids: list[int]) -> list[float]:
        """The response's log-probs at temperature 1, as the rollout engine reports them (``RolloutEngine.
        probe_logprobs``); collective over the actor's world under ZeRO-3."""
        probe = Experience(0, 0, list(prompt_ids), list(response_ids), [], "length", "", "", None)
        return logprobs_per_sample(self.engine, [probe], 1, self.pad_id, self.device, 1.0, False)[0]

    def _micro_loss(self, samples: list[Experience], batch: RLBatch, norm, shared: SharedPrompts | None = None):
        logits = shared.logits(samples, batch) if shared else self._logits(batch)
        logp = response_logprobs(logits, batch, self.temperature)
        R = batch.mask.size(1)
        # without an old-policy pass the samples come from exactly these weights (one update per step)
        old = (logp.detach() if samples[0].old_logprobs is None
               else padded([s.old_logprobs for s in samples], R).to(logp.device))
        adv = padded([s.advantages for s in samples], R).to(logp.device)
        engine = engine_logprobs(samples, R).to(logp.device)
        ref = (padded([s.ref_logprobs for s in samples], R).to(logp.device)
               if samples[0].ref_logprobs is not None else None)
        token_loss, metrics = self.algo.actor_token_loss(
            logp, old, engine, ref, adv, batch.mask, lambda: batch.spread(entropy_from_logits(logits)))
        if self.temperature == 1.0:
            trainer = old
        else:  # the engine's log-probs are at temperature 1: compare with the current policy's at 1
            with torch.no_grad():
                trainer = response_logprobs(logits.detach(), batch, 1.0)
        mm = mismatch_metrics(trainer, engine, batch.mask)
        self._mismatch_max = max(self._mismatch_max, float(mm["mismatch/max_abs_diff"]))
        metrics.update(mm)
        loss = self.algo.actor_loss(token_loss, batch.mask, norm)
        return (loss + shared.closing() if shared else loss), metrics

    def train(self, samples: list[Experience], step: int) -> dict[str, float]:
        self._mismatch_max = 0.0
        metrics, positions = train_steps(self.engine, self.engine, samples, self.train_cfg, self.world_size,
                                         self.train_cfg.seed + step, self.pad_id, self.device, self.share_prompts,
                                         self._micro_loss, float(self.max_action_tokens))
        out = {f"actor/{k}": v for k, v in metrics.items()}
        out["actor/positions_trained"] = positions
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
