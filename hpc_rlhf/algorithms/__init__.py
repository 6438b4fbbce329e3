"""Algorithm math: losses, advantage estimators, KL terms, loss aggregation, whitening, and the
rollout/trainer mismatch metrics and importance-sampling corrections.

Also the preference (DPO family, KTO, SimPO, ORPO), reward-model and distillation losses.

Everything here is a pure function of tensors (the KL controllers are the only state), so it can be
tested on CPU without a model or a process group.  See docs/algorithms.md.
"""
from .advantages import AdvantageEstimator, estimator_from_config, make_advantage_estimator
from .aggregation import LOSS_AGGREGATIONS, StepNorm, aggregate
from .distill import distill_loss
from .groups import contiguous_group_ids, group_mean_std
from .kl import (KL_ESTIMATORS, AdaptiveKLController, FixedKLController, compute_kl,
                 kl_penalty_rewards, make_kl_controller)
from .mismatch import is_weights, mismatch_metrics
from .policy_loss import entropy_from_logits, policy_loss
from .preference import (dpo_loss, kto_loss, kto_reference_point, orpo_loss, sequence_logprobs,
                         simpo_loss)
from .registry import ADVANTAGE_ESTIMATORS, IS_CORRECTIONS, POLICY_LOSSES, Registry
from .returns import discounted_returns, gae_advantages, outcome_token_rewards
from .reward_model_loss import pairwise_reward_loss, process_reward_loss
from .value_loss import value_loss
from .whiten import masked_mean, masked_mean_var, masked_whiten

__all__ = [
    "ADVANTAGE_ESTIMATORS", "POLICY_LOSSES", "KL_ESTIMATORS", "LOSS_AGGREGATIONS", "IS_CORRECTIONS", "Registry",
    "AdvantageEstimator", "make_advantage_estimator", "estimator_from_config", "contiguous_group_ids",
    "discounted_returns", "gae_advantages", "group_mean_std", "outcome_token_rewards",
    "StepNorm", "aggregate",
    "AdaptiveKLController", "FixedKLController", "compute_kl", "kl_penalty_rewards",
    "make_kl_controller",
    "entropy_from_logits", "policy_loss", "value_loss", "is_weights", "mismatch_metrics",
    "masked_mean", "masked_mean_var", "masked_whiten",
    "sequence_logprobs", "dpo_loss", "simpo_loss", "orpo_loss", "kto_loss", "kto_reference_point",
    "pairwise_reward_loss", "process_reward_loss", "distill_loss",
]
