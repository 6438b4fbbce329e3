"""The placement plans of `train rl` and `hpc-rlhf eval`: which roles run and on how many ranks, from the config
alone (the launcher and `hpc-rlhf plan` read them before any rank starts)."""
from __future__ import annotations

from ..algorithms.registry import ADVANTAGE_ESTIMATORS
from ..config import ConfigError
from ..config.evaluation import EvalRunConfig
from ..config.rl import RLConfig
from ..distributed.placement import PlacementPlan, make_plan


def plan_from_config(cfg: RLConfig) -> PlacementPlan:
    p, B = cfg.placement, cfg.rollout.rollout_batch_size
    # an estimator that reads the critic section needs a critic (tests/unit/config/test_config.py: exactly those do)
    needs_critic = "critic" in ADVANTAGE_ESTIMATORS.declared[cfg.algo.advantage_estimator]
    sizes = {"actor": p.actor_num_ranks, "rollout": p.rollout_num_ranks, "reward": p.reward_num_ranks,
             "critic": p.critic_num_ranks if needs_critic else 0,
             "reference": p.ref_num_ranks if cfg.algo.kl.init_kl_coef > 0 or cfg.algo.needs_teacher() else 0}
    plan = make_plan(sizes, p.colocate_actor_ref, p.colocate_critic_reward, p.colocate_all,
                     p.colocate_actor_reward)
    for c in plan.components:
        if B % c.size:
            raise ConfigError(f"rollout_batch_size={B} prompts are dealt to the {c.size} ranks of '{c.name}' by "
                              f"whole groups: make it a multiple of {c.size}")
    actors = len(plan.ranks_of("actor"))
    per_rank = B * cfg.rollout.n_samples_per_prompt // actors
    if cfg.train.train_batch_size % actors or per_rank % (cfg.train.train_batch_size // actors):
        raise ConfigError(f"train_batch_size={cfg.train.train_batch_size} must split evenly over the "
                          f"{actors} actor ranks and divide each rank's {per_rank} samples per step")
    return plan


def eval_plan(cfg: EvalRunConfig) -> PlacementPlan:
    """`hpc-rlhf eval`: rollout ranks, and the reward role on them or on ranks of its own; no actor."""
    p = cfg.placement
    sizes = {"rollout": p.rollout_num_ranks,
             "reward": p.rollout_num_ranks if p.colocate_reward else p.reward_num_ranks}
    return make_plan(sizes, colocate_all=p.colocate_reward)
