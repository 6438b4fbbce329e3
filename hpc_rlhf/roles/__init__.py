"""The roles of an RL run (actor, critic, reference, reward, rollout) and the one that builds them for a rank."""
from __future__ import annotations

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
    """The roles of this rank's component, each on ``device``; trainable ones sized for its world."""
    pad = tokenizer.pad_token_id
    return Roles(
        actor=Actor(cfg, algo, total_optimizer_steps, ctx.world_size, pad, device) if ctx.has("actor") else None,
        critic=Critic(cfg, algo, total_optimizer_steps, ctx.world_size, pad, device) if ctx.has("critic") else None,
        reference=Reference(cfg, pad, device) if ctx.has("reference") else None,
        reward=RewardRole(cfg, device) if ctx.has("reward") else None,
        rollout=Rollout(cfg, tokenizer, device) if ctx.has("rollout") else None)
