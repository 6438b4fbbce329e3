"""The placement plan: which global ranks run which roles.

Roles that share ranks form one *component*; each component is one torch.distributed world (the
default group of its processes), because DeepSpeed and generation engines each assume they own
their world.  Components are laid out in a fixed order, so every rank derives the same plan from
the same config, and learns its own roles from its global rank alone.
"""
from __future__ import annotations

from dataclasses import dataclass

ROLES = ("actor", "reference", "critic", "reward", "rollout")


@dataclass(frozen=True)
class Component:
    name: str
    roles: tuple[str, ...]
    first_rank: int
    size: int

    @property
    def ranks(self) -> range:
        return range(self.first_rank, self.first_rank + self.size)


@dataclass(frozen=True)
class PlacementPlan:
    components: tuple[Component, ...]

    @property
    def world_size(self) -> int:
        return sum(c.size for c in self.components)

    def component_of(self, rank: int) -> Component:
        for c in self.components:
            if rank in c.ranks:
                return c
        raise ValueError(f"rank {rank} is outside the plan's {self.world_size} ranks")

    def roles_of(self, rank: int) -> tuple[str, ...]:
        return self.component_of(rank).roles

    def has(self, role: str) -> bool:
        return any(role in c.roles for c in self.components)

    def ranks_of(self, role: str) -> range:
        for c in self.components:
            if role in c.roles:
                return c.ranks
        return range(0)

    def describe(self) -> str:
        lines = [f"placement: {self.world_size} ranks"]
        for c in self.components:
            last = c.first_rank + c.size - 1
            lines.append(f"  ranks {c.first_rank}-{last}  world '{c.name}'  roles: {', '.join(c.roles)}")
        return "\n".join(lines)


def make_plan(sizes: dict[str, int], colocate_actor_ref: bool = False, colocate_critic_reward: bool = False,
              colocate_all: bool = False, colocate_actor_reward: bool = False) -> PlacementPlan:
    """Build the plan from per-role rank counts (0 or absent: the role is not used).  Every RL run has an
    actor; a plan without one (rollout and reward only) is `hpc-rlhf eval`'s.

    ``colocate_all`` puts every used role on the actor's ranks; ``colocate_actor_ref`` puts the
    reference on the actor's ranks; ``colocate_actor_reward`` the reward role (a reward function
    needs no rank of its own); ``colocate_critic_reward`` puts the reward model on the critic's
    ranks.  Colocated roles run on the ranks of the role they join.
    """
    used = [r for r in ROLES if sizes.get(r, 0) > 0]
    if not used:
        raise ValueError("the placement has no ranks: give at least one role a rank count")
    if colocate_actor_reward and colocate_critic_reward and "critic" in used:
        raise ValueError("the reward role joins either the actor's ranks or the critic's: set only one of "
                         "colocate_actor_reward and colocate_critic_reward")
    if colocate_all:
        groups = [tuple(used)]
    else:
        groups = []
        taken: set[str] = set()
        for role in used:
            if role in taken:
                continue
            group = [role]
            if role == "actor" and colocate_actor_ref and "reference" in used:
                group.append("reference")
            if role == "actor" and colocate_actor_reward and "reward" in used:
                group.append("reward")
            if role == "critic" and colocate_critic_reward and "reward" in used:
                group.append("reward")
            taken.update(group)
            groups.append(tuple(group))
    components, first = [], 0
    for group in groups:
        size = sizes[group[0]]
        components.append(Component(name="+".join(group), roles=group, first_rank=first, size=size))
        first += size
    return PlacementPlan(tuple(components))
