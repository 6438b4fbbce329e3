"""The roles of an RL run (actor, critic, reference, reward, rollout) and the one that builds them for a rank."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from .actor import Actor
from .critic import Critic
from .reference import Reference
from .reward import RewardRole
from .rollout import Rollout


@dataclass
class Roles:
    """The roles this rank runs; None for the others."""
    actor: Actor | None = None
    critic: Critic | None = None
    reference: Reference | None = None
    reward: RewardRole | None = None
    rollout: Rollout | None = None

    def engines(self) -> dict:
        """The DeepSpeed engines this rank holds, by role (what a checkpoint saves)."""
        return {name: role.engine for name, role in (("actor", self.actor), ("critic", self.critic)) if role}


def build_roles(cfg, ctx, algo, total_optimizer_steps: int, tokenizer, device) -> Roles:
    """The roles of this rank's component, each on ``device``, each given the config sections it reads (``cfg``: the
    run's RLConfig, read here only); trainable ones sized for its world, the frozen models (reference, reward model)
    sharded over it under ZeRO-3."""
    pad, m, t, r = tokenizer.pad_token_id, cfg.model, cfg.train, cfg.rollout
    steps, world = total_optimizer_steps, ctx.world_size
    critic_model = dataclasses.replace(m, pretrain=cfg.critic_pretrain or cfg.reward.reward_pretrain or m.pretrain)
    ref_model = dataclasses.replace(m, pretrain=cfg.reference_pretrain(), gradient_checkpointing=False)
    return Roles(
        actor=Actor(m, t, r.temperature, cfg.max_action_tokens(), algo, steps, world, pad, device)
        if ctx.has("actor") else None,
        critic=Critic(critic_model, t, algo, steps, world, pad, device) if ctx.has("critic") else None,
        reference=Reference(ref_model, t, r.temperature, pad, device, world) if ctx.has("reference") else None,
        reward=RewardRole(cfg.reward, cfg.agent, m.param_dtype, r.generate_max_len, device, t.zero_stage, world)
        if ctx.has("reward") else None,
        rollout=Rollout(r, m, cfg.agent, t.seed, cfg.log.check_weight_sync, tokenizer, device)
        if ctx.has("rollout") else None)
