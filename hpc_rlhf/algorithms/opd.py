"""On-policy distillation (OPD): the student samples, a teacher scores each sampled token.

The per-token advantage of token t of sample i (the student's log-probs at sampling, log π_s, the teacher's on the
same tokens, log π_T; m the response mask) is

    A_i,t = −c · (log π_s(y_t) − log π_T(y_t)) · m_t  +  w · (R_i − mean_g(R)) · m_t

The first term is the negative of the single-sample estimate of the reverse KL(π_s ‖ π_T) at that token: 0 where the
teacher gives the token the student's own probability, negative where the student is surer than the teacher,
positive where it is less sure.  It stays on its own token: no discount, no sum over the later tokens (Lu et al.
2025, "On-Policy Distillation", Thinking Machines: discount factor zero), no whitening.  The second term is the
optional task reward: the sample's reward R_i (its scalar reward plus its token rewards, ``returns.sequence_reward``)
centred on its group's mean, weighted by w; w = 0 (the default) is pure distillation.  Source and conventions:
docs/algorithms.md, "On-policy distillation".
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from .advantages import AdvantageEstimator, _check, _need_groups, _valid_only
from .groups import group_centered
from .kl import compute_kl
from .registry import ADVANTAGE_ESTIMATORS
from .returns import sequence_reward


@ADVANTAGE_ESTIMATORS.register("opd")
@dataclass
class OnPolicyDistillation(AdvantageEstimator):
    """``teacher_kl_coef`` is c, ``task_reward_weight`` w of the module doc (w > 0 needs ``group_ids``).
    ``compute`` takes ``logprobs``, the student's log-probs of its sampled tokens (the old policy's), and
    ``teacher_logprobs`` [B, R], the teacher's.  ``uses_groups`` stays False: the teacher's term gives a lone
    sample of its prompt an advantage, so the loop's count of groups whose advantages are all 0 does not apply."""

    name: ClassVar[str] = "opd"
    needs_teacher: ClassVar[bool] = True
    teacher_kl_coef: float = 1.0
    task_reward_weight: float = 0.0

    def compute(self, rewards, token_rewards, mask, values=None, group_ids=None, gamma=1.0, lambd=1.0,
                all_reduce=None, valid=None, logprobs=None, teacher_logprobs=None):
        _check(rewards, token_rewards, mask)
        rewards, mask = _valid_only(rewards, mask, valid)
        for name, x in (("logprobs", logprobs), ("teacher_logprobs", teacher_logprobs)):
            if x is None or x.shape != mask.shape:
                raise ValueError(f"advantage_estimator 'opd' needs {name} [B, R]={tuple(mask.shape)}, got "
                                 f"{None if x is None else tuple(x.shape)}")
        adv = -self.teacher_kl_coef * compute_kl(logprobs, teacher_logprobs, "k1", mask)
        if self.task_reward_weight:
            gid = _need_groups(self.name, group_ids, rewards)
            centred = group_centered(sequence_reward(rewards, token_rewards, mask), gid, valid)
            adv = adv + self.task_reward_weight * centred.float()[:, None] * mask
        return adv.float() * mask, None
