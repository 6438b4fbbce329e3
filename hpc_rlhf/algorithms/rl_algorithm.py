"""The RL algorithm as one object, built once from the ``algo`` config section and the registries.

It holds every decision that depends on the algorithm: which roles the run needs (critic, reference or teacher),
where the KL goes (a penalty in the reward, or a term of the loss), the loss aggregation, whether the
actor needs an old-policy pass, the KL controller, the advantages of a shard of samples, and the token
losses of the actor and the critic.  The RL loop (trainers/rl.py) and the roles read its attributes and
call its methods; none of them reads an ``algo.*`` option.  Everything here works on tensors: [B, R]
response-token tensors with a 0/1 ``mask``, as in docs/algorithms.md "Conventions".
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import Tensor

from . import opd  # noqa: F401  (registers the advantage estimator "opd")
from .advantages import estimator_from_config
from .aggregation import StepNorm, aggregate
from .kl import compute_kl, kl_penalty_rewards, make_kl_controller
from .mismatch import is_weights, token_mask
from .policy_loss import policy_loss
from .registry import POLICY_LOSSES, TOKEN_MASKS
from .returns import action_positions, compact, expand, has_gaps
from .value_loss import value_loss
from .whiten import AllReduce


def _token_mean(x: Tensor, mask: Tensor) -> Tensor:
    return (x.sum() / mask.sum().clamp(min=1)).detach()


class RLAlgorithm:
    def __init__(self, algo, single_update: bool):
        """``algo``: the config's ``algo`` section; ``single_update``: each RL step makes exactly one optimizer
        step on fresh samples (one epoch, one train batch per rollout batch)."""
        self.cfg = algo
        self.estimator = estimator_from_config(algo)
        self.needs_critic: bool = self.estimator.needs_critic
        kl = algo.kl
        # an estimator that needs a teacher gets it in the reference role (model.teacher_pretrain)
        self.needs_reference: bool = kl.init_kl_coef > 0 or self.estimator.needs_teacher
        self.use_kl_loss: bool = kl.use_kl_loss if kl.use_kl_loss is not None else not self.estimator.kl_in_reward
        self.agg_mode: str = algo.loss_agg_mode or self.estimator.default_loss_agg
        self.kl_ctl = make_kl_controller(kl.init_kl_coef, kl.kl_target, kl.kl_horizon)
        # With one optimizer step on fresh samples the policy that generated them is the one being trained,
        # so the old log-probs equal the training forward's (detached) and need no extra pass, unless the KL
        # penalty goes into the reward or a teacher scores the samples (both need them before the advantages), or a
        # token mask reads them there.
        self.needs_old_logprobs: bool = (not single_update or (self.needs_reference and not self.use_kl_loss)
                                         or self.estimator.needs_teacher or algo.token_mask != "none")
        self.token_mask_metrics: dict[str, float] = {}  # the token mask's, from the last advantages() call

    # ---- advantages ---------------------------------------------------------------------------------------
    def advantages(self, rewards: Tensor, mask: Tensor, group_ids: Tensor, old: Optional[Tensor],
                   ref: Optional[Tensor], values: Optional[Tensor], all_reduce: AllReduce,
                   valid: Optional[Tensor] = None, turn_rewards: Optional[Tensor] = None,
                   engine: Optional[Tensor] = None, components: Optional[Tensor] = None
                   ) -> tuple[Tensor, Optional[Tensor], Tensor]:
        """(advantages, returns or None, per-token KL of the samples) for one shard.  The KL (old policy
        against the reference) is measured when both log-probs are there; with the KL in the reward it
        enters the token rewards at the controller's current coefficient.  ``valid`` [B]: the samples whose
        reward exists (the others enter no statistic and get advantage 0).  ``turn_rewards`` [B, R] (multi-turn):
        rewards on given tokens, added to the token rewards (group estimators see them in the sequence reward,
        GAE and REINFORCE in the returns).  ``components`` [B, K]: the reward's named parts, for an estimator
        that normalises them (``uses_components``).  A mask with gaps (feedback tokens between turns) is computed on
        the compacted action tokens (``returns.action_positions``) and expanded back, 0 on the gaps.
        ``engine`` [B, R]: the rollout engine's log-probs of the tokens, which a token mask (``algo.token_mask``)
        reads with ``old``: a dropped token gets advantage 0, and ``token_mask_metrics`` its metrics.  An estimator
        that needs a teacher gets ``old`` as the student's log-probs and ``ref``, the reference role's, as the
        teacher's; the KL measured is then the student's to the teacher."""
        if has_gaps(mask):
            idx, cmask = action_positions(mask)

            def pack(x):
                return None if x is None else compact(x, idx, cmask)
            adv, ret, kl = self.advantages(rewards, cmask, group_ids, pack(old), pack(ref), pack(values), all_reduce,
                                           valid, pack(turn_rewards), pack(engine), components)
            R = mask.shape[1]
            return (expand(adv, idx, cmask, R), None if ret is None else expand(ret, idx, cmask, R),
                    expand(kl, idx, cmask, R))
        token_rewards = torch.zeros_like(mask) if turn_rewards is None else turn_rewards.to(mask.dtype) * mask
        kl = torch.zeros_like(mask)
        if old is not None and ref is not None:
            kl = compute_kl(old, ref, self.cfg.kl.kl_estimator, mask)
            if not self.use_kl_loss:
                token_rewards = token_rewards + kl_penalty_rewards(kl, self.kl_ctl.value, mask)
        parts = {"components": components} if self.estimator.uses_components else {}
        if self.estimator.needs_teacher:
            parts |= {"logprobs": old, "teacher_logprobs": ref}
        adv, ret = self.estimator.compute(rewards, token_rewards, mask, values=values, group_ids=group_ids,
                                          gamma=self.cfg.advantage.gamma, lambd=self.cfg.gae.lambd,
                                          all_reduce=all_reduce, valid=valid, **parts)
        name = self.cfg.token_mask
        if name != "none":
            if old is None or engine is None:
                raise ValueError(f"algo.token_mask {name!r} needs the old policy's and the engine's log-probs")
            keep, m = token_mask(name, old, engine, mask if valid is None else mask * valid[:, None].to(mask.dtype),
                                 all_reduce=all_reduce, **TOKEN_MASKS.options(name, self.cfg))
            adv = adv * keep
            self.token_mask_metrics = {k: float(v) for k, v in m.items()}
        return adv, ret, kl

    # ---- losses -------------------------------------------------------------------------------------------
    def actor_token_loss(self, logp: Tensor, old: Tensor, engine: Tensor, ref: Optional[Tensor], adv: Tensor,
                         mask: Tensor, entropy: Callable[[], Tensor]) -> tuple[Tensor, dict]:
        """The actor's per-token loss [B, R] and its metrics: the policy loss, times the importance weights
        of the rollout engine's log-probs when a correction is set, plus the KL term when the KL is in the
        loss, minus the entropy bonus (``entropy()`` [B, R] is computed only when its coefficient is set)."""
        a = self.cfg
        token_loss, metrics = policy_loss(a.policy_loss, logp, old, adv, mask,
                                          **POLICY_LOSSES.options(a.policy_loss, a))
        if a.is_correction != "none":
            # the old policy is the trainer's policy at generation time; the engine's log-probs are at
            # temperature 1, so are the trainer's (RLConfig.validate)
            weights, is_metrics = is_weights(a.is_correction, old, engine, mask, low=a.is_bounds.is_low,
                                             high=a.is_bounds.is_high)
            token_loss = token_loss * weights
            metrics.update(is_metrics)
        if self.use_kl_loss and self.kl_ctl.value > 0:
            kl = compute_kl(logp, ref, a.kl.kl_estimator, mask)
            token_loss = token_loss + self.kl_ctl.value * kl
            metrics["kl_loss"] = _token_mean(kl, mask)
        if a.entropy_loss_coef:
            ent = entropy() * mask
            token_loss = token_loss - a.entropy_loss_coef * ent
            metrics["entropy"] = _token_mean(ent, mask)
        elif a.log_entropy:
            with torch.no_grad():
                metrics["entropy"] = _token_mean(entropy() * mask, mask)
        return token_loss, metrics

    def actor_loss(self, token_loss: Tensor, mask: Tensor, norm: StepNorm) -> Tensor:
        return aggregate(token_loss, mask, self.agg_mode, norm)

    def critic_loss(self, v: Tensor, old: Tensor, ret: Tensor, mask: Tensor, norm: StepNorm) -> tuple[Tensor, dict]:
        token_loss, metrics = value_loss(v, old, ret, mask, self.cfg.critic.value_clip)
        return aggregate(token_loss, mask, "token_mean", norm), metrics

    # ---- after the step -----------------------------------------------------------------------------------
    def update_kl(self, metrics: dict[str, float], n_samples: int) -> None:
        """The KL of the step's samples, measured in the loss when it is there, else before the advantages."""
        self.kl_ctl.update(metrics.get("actor/kl_loss", metrics.get("kl", 0.0)), n_samples)

    def state_dict(self) -> dict:
        return {"kl_ctl": self.kl_ctl.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.kl_ctl.load_state_dict(state["kl_ctl"])
