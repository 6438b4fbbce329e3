"""Advantage estimators: PPO's GAE and the critic-free REINFORCE / GRPO family.

Shapes.  ``rewards`` [B] is the scalar (outcome) reward of each sample; ``token_rewards`` [B, R]
holds per-token rewards over the response positions (the KL penalty −β·kl_t when the KL is in the
reward, zeros otherwise); ``mask`` [B, R] is 1.0 on real response tokens and 0 after the end;
``values`` [B, R] are the critic's values V_t of the state before token t.

Groups.  Samples of the same prompt share a ``group_ids`` value ([B] int tensor, any integers, any
order, groups may differ in size).  Samples arriving in contiguous groups of n get their ids from
``contiguous_group_ids(B, n)``.  Group statistics are taken over the samples present in this call:
every group must be complete on one rank (the rank that generated it keeps it), so group
statistics need no communication.  Whitening, where an estimator uses it, is global: masked
mean/variance over every valid token of every data-parallel rank, via ``all_reduce``.  Group and
whitening statistics are taken in float64, and a group whose rewards are all equal gets exactly
zero advantage (in float32 a group mean of eight rewards of 5.3 lands an ulp off them, and dividing
by a std just as small gave the whole group an advantage of +0.32); the advantages are float32.

Invalid samples.  ``valid`` [B] bool (None: all valid) marks the samples whose reward exists.  An invalid
sample (its reward function failed; its reward is a placeholder) enters no statistic (group mean and std,
leave-one-out baselines, global whitening) and gets advantage 0 on every token; a group with fewer than two
valid samples gets advantage 0 throughout.

Per-token reward.  Where an estimator works with token rewards it uses
    r_t = token_rewards_t + [t = last valid token] · (scalar reward of the sample)
so the outcome reward sits on the last real response token (a sample with no valid token gets
none) and padded positions are 0.

Reward components.  ``components`` [B, K] (``compute`` of an estimator whose ``uses_components`` is set) are
the named parts of each sample's reward, whose sum is its scalar reward (rewards/types.py); None when the reward
has none, for which such an estimator takes the sequence reward as its one component.

Every estimator is a small dataclass registered in ``ADVANTAGE_ESTIMATORS``.  Trainers read its
attributes (``needs_critic``, ``kl_in_reward``, ``default_loss_agg``, ``uses_groups``,
``uses_components``) and call ``compute``; they never branch on its name.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Optional

import torch

from .groups import group_centered, group_mean_std, group_sum_count
from .registry import ADVANTAGE_ESTIMATORS
from .returns import discounted_returns, gae_advantages, outcome_token_rewards, sequence_reward
from .whiten import AllReduce, masked_mean_var, masked_sum, masked_whiten

Tensor = torch.Tensor


def _check(rewards: Tensor, token_rewards: Optional[Tensor], mask: Tensor) -> None:
    if mask.dim() != 2:
        raise ValueError(f"mask must be [B, R], got {tuple(mask.shape)}")
    if rewards.shape != mask.shape[:1]:
        raise ValueError(f"rewards must be [B]={tuple(mask.shape[:1])}, got {tuple(rewards.shape)}")
    if token_rewards is not None and token_rewards.shape != mask.shape:
        raise ValueError(f"token_rewards must be [B, R]={tuple(mask.shape)}, "
                         f"got {tuple(token_rewards.shape)}")


def _valid_only(rewards: Tensor, mask: Tensor, valid: Optional[Tensor]) -> tuple[Tensor, Tensor]:
    """``rewards`` with the placeholder of each invalid sample set to 0 (it may be NaN) and ``mask`` with
    the rows of invalid samples zeroed."""
    if valid is None:
        return rewards, mask
    if valid.shape != rewards.shape:
        raise ValueError(f"valid must be [B]={tuple(rewards.shape)}, got {tuple(valid.shape)}")
    v = valid.to(torch.bool)
    return torch.where(v, rewards, torch.zeros_like(rewards)), mask * v.to(mask.dtype)[:, None]


def _need_groups(name: str, group_ids: Optional[Tensor], rewards: Tensor) -> Tensor:
    if group_ids is None:
        raise ValueError(f"advantage_estimator {name!r} needs group_ids (samples of the same prompt)")
    if group_ids.shape != rewards.shape:
        raise ValueError(f"group_ids must be [B]={tuple(rewards.shape)}, got {tuple(group_ids.shape)}")
    return group_ids


# ---------------------------------------------------------------------------------------------
# estimators
# ---------------------------------------------------------------------------------------------

@dataclass
class AdvantageEstimator:
    """Base of the registered estimator units.

    Class attributes a trainer reads:
      needs_critic      the estimator uses ``values`` (a critic must be trained)
      kl_in_reward      default place of the KL term: True = penalty in ``token_rewards``,
                        False = KL loss term in the policy loss (the config's use_kl_loss overrides)
      default_loss_agg  the loss_agg_mode used when the config does not set one
      uses_groups       the estimator needs ``group_ids``
      uses_components   ``compute`` takes ``components`` [B, K] (the reward's named parts, or None)
      needs_teacher     the estimator scores the samples against a teacher: the reference role runs the teacher
                        (model.teacher_pretrain) and ``compute`` takes ``logprobs`` and ``teacher_logprobs``
    """

    name: ClassVar[str] = ""
    needs_critic: ClassVar[bool] = False
    kl_in_reward: ClassVar[bool] = True
    default_loss_agg: ClassVar[str] = "token_mean"
    uses_groups: ClassVar[bool] = False
    uses_components: ClassVar[bool] = False
    needs_teacher: ClassVar[bool] = False

    def compute(self, rewards: Tensor, token_rewards: Optional[Tensor], mask: Tensor,
                values: Optional[Tensor] = None, group_ids: Optional[Tensor] = None,
                gamma: float = 1.0, lambd: float = 1.0, all_reduce: AllReduce = None,
                valid: Optional[Tensor] = None) -> tuple[Tensor, Optional[Tensor]]:
        """(advantages [B, R], returns [B, R] or None); both float32 and 0 on padding and on invalid samples."""
        raise NotImplementedError

    def _grouped(self, rewards, token_rewards, mask, group_ids, valid):
        """The checked inputs of a group estimator: (rewards and mask with the invalid samples zeroed, group ids)."""
        _check(rewards, token_rewards, mask)
        rewards, mask = _valid_only(rewards, mask, valid)
        return rewards, mask, _need_groups(self.name, group_ids, rewards)


@ADVANTAGE_ESTIMATORS.register("gae")
@dataclass
class GAE(AdvantageEstimator):
    """PPO with a critic.  r_t as in the module doc; δ_t = r_t + γ V_{t+1} − V_t (V = 0 past the
    last valid token); A_t = Σ_k (γλ)^k δ_{t+k}; returns = A + V (un-whitened, the critic's
    target).  The advantages are then whitened over all valid tokens of all ranks."""

    name: ClassVar[str] = "gae"
    needs_critic: ClassVar[bool] = True
    kl_in_reward: ClassVar[bool] = True
    whiten: bool = True
    eps: float = 1e-8

    def compute(self, rewards, token_rewards, mask, values=None, group_ids=None, gamma=1.0,
                lambd=1.0, all_reduce=None, valid=None):
        _check(rewards, token_rewards, mask)
        rewards, mask = _valid_only(rewards, mask, valid)
        if values is None:
            raise ValueError("advantage_estimator 'gae' needs critic values [B, R]")
        if values.shape != mask.shape:
            raise ValueError(f"values must be [B, R]={tuple(mask.shape)}, got {tuple(values.shape)}")
        r = outcome_token_rewards(rewards, token_rewards, mask)
        adv, ret = gae_advantages(r, values, mask, gamma, lambd)
        if self.whiten:
            adv = masked_whiten(adv, mask, all_reduce, eps=self.eps)
        return adv, ret


@ADVANTAGE_ESTIMATORS.register("reinforce")
@dataclass
class Reinforce(AdvantageEstimator):
    """REINFORCE++ (Hu 2025): G_t = Σ_{k ≥ t} γ^(k−t) r_k, advantages = G whitened over all valid
    tokens of all ranks; returns = G.  KL in the reward by default."""

    name: ClassVar[str] = "reinforce"
    kl_in_reward: ClassVar[bool] = True
    whiten: bool = True
    eps: float = 1e-8

    def _returns(self, scalar: Tensor, token_rewards: Optional[Tensor], mask: Tensor, gamma: float,
                 all_reduce: AllReduce) -> tuple[Tensor, Tensor]:
        """Token returns G of the (shaped) scalar reward plus the token rewards; advantages = G,
        whitened globally when ``self.whiten``.  Shared by the REINFORCE family."""
        g = discounted_returns(outcome_token_rewards(scalar, token_rewards, mask), mask, gamma)
        return (masked_whiten(g, mask, all_reduce, eps=self.eps) if self.whiten else g), g

    def compute(self, rewards, token_rewards, mask, values=None, group_ids=None, gamma=1.0,
                lambd=1.0, all_reduce=None, valid=None):
        _check(rewards, token_rewards, mask)
        rewards, mask = _valid_only(rewards, mask, valid)
        return self._returns(rewards, token_rewards, mask, gamma, all_reduce)


@ADVANTAGE_ESTIMATORS.register("reinforce_baseline")
@dataclass
class ReinforceBaseline(Reinforce):
    """REINFORCE++-baseline: the scalar reward minus its group mean, r̃_i = r_i − mean_g(r), then
    the token returns of ``reinforce`` built from r̃ (token rewards unchanged), then global
    whitening.  Returns = those token returns."""

    name: ClassVar[str] = "reinforce_baseline"
    uses_groups: ClassVar[bool] = True

    def compute(self, rewards, token_rewards, mask, values=None, group_ids=None, gamma=1.0,
                lambd=1.0, all_reduce=None, valid=None):
        rewards, mask, gid = self._grouped(rewards, token_rewards, mask, group_ids, valid)
        shaped = group_centered(rewards.float(), gid, valid).float()
        return self._returns(shaped, token_rewards, mask, gamma, all_reduce)


@ADVANTAGE_ESTIMATORS.register("rloo")
@dataclass
class RLOO(Reinforce):
    """REINFORCE leave-one-out (Ahmadian et al. 2024): r̃_i = r_i − (Σ_{j∈g, j≠i} r_j)/(n_g − 1),
    i.e. n_g/(n_g − 1)·(r_i − mean_g); then the token returns of ``reinforce`` from r̃ (KL stays in
    the token rewards).  No whitening.  A group of one sample has no baseline: r̃ = 0."""

    name: ClassVar[str] = "rloo"
    uses_groups: ClassVar[bool] = True
    whiten: bool = False

    def compute(self, rewards, token_rewards, mask, values=None, group_ids=None, gamma=1.0,
                lambd=1.0, all_reduce=None, valid=None):
        rewards, mask, gid = self._grouped(rewards, token_rewards, mask, group_ids, valid)
        r = rewards.float()
        _, c = group_sum_count(r, gid, valid)
        shaped = group_centered(r, gid, valid) * c / (c - 1.0).clamp(min=1.0)   # a lone valid sample: 0
        return self._returns(shaped.float(), token_rewards, mask, gamma, all_reduce)


@ADVANTAGE_ESTIMATORS.register("group_norm")
@dataclass
class GroupNorm(AdvantageEstimator):
    """GRPO (Shao et al. 2024, outcome supervision): A_i = (R_i − mean_g(R)) / (std_g(R) + eps),
    broadcast to every valid token of sample i.  std_g is the SAMPLE standard deviation
    (Bessel-corrected, n_g − 1) over the group; a group of one sample gets A = 0.  KL goes in the
    loss by default.  Default aggregation is ``seq_mean`` as in the paper's objective
    (1/G Σ_i 1/|o_i| Σ_t)."""

    name: ClassVar[str] = "group_norm"
    kl_in_reward: ClassVar[bool] = False
    default_loss_agg: ClassVar[str] = "seq_mean"
    uses_groups: ClassVar[bool] = True
    eps: float = 1e-6

    def compute(self, rewards, token_rewards, mask, values=None, group_ids=None, gamma=1.0,
                lambd=1.0, all_reduce=None, valid=None):
        rewards, mask, gid = self._grouped(rewards, token_rewards, mask, group_ids, valid)
        R = sequence_reward(rewards, token_rewards, mask)
        _, std = group_mean_std(R, gid, unbiased=True, valid=valid)
        a = group_centered(R, gid, valid) / (std + self.eps)
        return a.float()[:, None] * mask.float(), None


@ADVANTAGE_ESTIMATORS.register("dr_grpo")
@dataclass
class DrGRPO(AdvantageEstimator):
    """Dr. GRPO (Liu et al. 2025): A_i = R_i − mean_g(R) (no std division), broadcast to every
    valid token, AND ``default_loss_agg = "constant"``: the step's loss is Σ token losses divided
    by (number of sequences × a constant, the maximum generation length), not by each sequence's
    length.  KL goes in the loss by default."""

    name: ClassVar[str] = "dr_grpo"
    kl_in_reward: ClassVar[bool] = False
    default_loss_agg: ClassVar[str] = "constant"
    uses_groups: ClassVar[bool] = True

    def compute(self, rewards, token_rewards, mask, values=None, group_ids=None, gamma=1.0,
                lambd=1.0, all_reduce=None, valid=None):
        rewards, mask, gid = self._grouped(rewards, token_rewards, mask, group_ids, valid)
        R = sequence_reward(rewards, token_rewards, mask)
        return group_centered(R, gid, valid).float()[:, None] * mask.float(), None


@ADVANTAGE_ESTIMATORS.register("maxrl")
@dataclass
class MaxRL(AdvantageEstimator):
    """MaxRL (Tajwar et al. 2026, "Maximum Likelihood Reinforcement Learning"): A_i = (R_i − mean_g R) /
    (mean_g R + eps), the group's reward centred and divided by its MEAN (the pass rate of a 0/1 reward), broadcast
    to every valid token; R as in group_norm.  A group whose mean is <= 0 (no success; a negative mean would flip
    the signs) gets A = 0, as prime-rl's; so does a group of equal rewards or of fewer than two valid samples."""

    name: ClassVar[str] = "maxrl"
    kl_in_reward: ClassVar[bool] = False
    uses_groups: ClassVar[bool] = True
    eps: float = 1e-6

    def compute(self, rewards, token_rewards, mask, values=None, group_ids=None, gamma=1.0,
                lambd=1.0, all_reduce=None, valid=None):
        rewards, mask, gid = self._grouped(rewards, token_rewards, mask, group_ids, valid)
        R = sequence_reward(rewards, token_rewards, mask)
        total, count = group_sum_count(R, gid, valid)
        mean = total / count.clamp(min=1.0)
        a = torch.where(mean > 0, group_centered(R, gid, valid) / (mean + self.eps), 0.0)
        return a.float()[:, None] * mask.float(), None


@ADVANTAGE_ESTIMATORS.register("gdpo")
@dataclass
class GDPO(AdvantageEstimator):
    """GDPO (Liu et al. 2026, "Group reward-Decoupled Normalization Policy Optimization"): each reward component k
    z-scored in its group as group_norm does, A_ik = (c_ik − mean_g c_k) / (std_g c_k + eps) (sample std; 0 for
    a tied component and a group of fewer than two valid samples), summed, S_i = Σ_k A_ik, then divided by the
    sample std of S over the valid samples of every rank: A_i = S_i / (std(S) + eps), on every valid token.  The
    batch mean of S is 0 by construction (each group's A_k sum to 0), so it is not subtracted.  Without
    ``components`` the sequence reward is the one component."""

    name: ClassVar[str] = "gdpo"
    kl_in_reward: ClassVar[bool] = False
    uses_groups: ClassVar[bool] = True
    uses_components: ClassVar[bool] = True
    eps: float = 1e-6

    def compute(self, rewards, token_rewards, mask, values=None, group_ids=None, gamma=1.0,
                lambd=1.0, all_reduce=None, valid=None, components=None):
        rewards, mask, gid = self._grouped(rewards, token_rewards, mask, group_ids, valid)
        if components is None:
            components = sequence_reward(rewards, token_rewards, mask)[:, None]
        if components.dim() != 2 or components.shape[0] != rewards.shape[0]:
            raise ValueError(f"components must be [B, K] with B={rewards.shape[0]}, got {tuple(components.shape)}")
        total = torch.zeros_like(rewards, dtype=torch.float64)
        for c in components.double().unbind(1):
            _, std = group_mean_std(c, gid, unbiased=True, valid=valid)
            total = total + group_centered(c, gid, valid) / (std + self.eps)
        v = (torch.ones_like(rewards) if valid is None else valid.to(rewards.dtype))[:, None]
        _, var = masked_mean_var(total[:, None], v, all_reduce)
        n = masked_sum(torch.ones_like(v), v, all_reduce).double()
        std = torch.sqrt(var * n / (n - 1.0)) if n > 1 else torch.zeros_like(var)
        return (total / (std + self.eps)).float()[:, None] * mask.float(), None


def make_advantage_estimator(name: str, **kwargs) -> AdvantageEstimator:
    """The registered estimator ``name`` built with ``kwargs`` (e.g. ``eps``, ``whiten``)."""
    return ADVANTAGE_ESTIMATORS.get(name)(**kwargs)


# algo option -> the estimator field it sets (null options keep the estimator's default)
CONFIG_FIELDS = {"whiten_advantages": "whiten", "advantage_eps": "eps", "teacher_kl_coef": "teacher_kl_coef",
                 "task_reward_weight": "task_reward_weight"}


def estimator_from_config(algo: Any) -> AdvantageEstimator:
    """The estimator ``algo.advantage_estimator`` with the fields set by the options it reads (its declaration in
    ``registry.py``; the config refuses an option set for an estimator that does not read it)."""
    options = ADVANTAGE_ESTIMATORS.options(algo.advantage_estimator, algo)
    return ADVANTAGE_ESTIMATORS.get(algo.advantage_estimator)(
        **{name: options[option] for option, name in CONFIG_FIELDS.items() if options.get(option) is not None})
