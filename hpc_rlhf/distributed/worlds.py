"""Joining the job: the shared store, this rank's role world, the bridges, and the watchdog."""
from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .collectives import Bridge
from .env import rendezvous_env, store_host
from .process_group import device_for, open_store, pick_backend
from .placement import Component, PlacementPlan
from .watchdog import Watchdog


@dataclass
class RoleContext:
    plan: PlacementPlan
    global_rank: int
    component: Component
    control: Bridge          # every rank: sample exchange and step-boundary agreement (gloo)
    trainers: Bridge | None  # ranks with a role besides rollout (all of control when none is rollout-only):
                             # the mid-step exchanges, which rollout-only ranks skip; None on those ranks
    weights: Bridge | None   # actor leader (index 0) + rollout ranks (1..N); None elsewhere or when colocated
    watchdog: Watchdog
    backend: str

    @property
    def roles(self) -> tuple[str, ...]:
        return self.component.roles

    @property
    def rank_in_world(self) -> int:
        return self.global_rank - self.component.first_rank

    @property
    def world_size(self) -> int:
        return self.component.size

    def has(self, role: str) -> bool:
        return role in self.component.roles

    def role_rank(self, role: str) -> int:
        """This rank's index among the ranks of ``role`` (-1 when it does not run that role)."""
        ranks = self.plan.ranks_of(role)
        return ranks.index(self.global_rank) if self.global_rank in ranks else -1


def describe_rank(plan: PlacementPlan, rank: int) -> str:
    return "roles " + "+".join(plan.roles_of(rank))


def join(plan: PlacementPlan, backend: str = "auto", timeout_s: float = 1800.0,
         dead_after_s: float = 20.0, urgent=lambda: False) -> RoleContext:
    """Collective over every launched rank: returns once all worlds and bridges are built."""
    de = rendezvous_env()
    if de.world_size != plan.world_size:
        raise RuntimeError(f"the placement plan needs {plan.world_size} ranks but {de.world_size} were launched:\n"
                           f"{plan.describe()}")
    backend = pick_backend(backend)
    if backend == "nccl":
        torch.cuda.set_device(device_for(de))
    timeout = datetime.timedelta(seconds=timeout_s)
    store = open_store(de, timeout)
    comp = plan.component_of(de.rank)
    os.environ.update(RANK=str(de.rank - comp.first_rank), WORLD_SIZE=str(comp.size),
                      LOCAL_RANK=str(de.local_rank))
    dist.init_process_group(backend, store=dist.PrefixStore(f"world/{comp.name}", store),
                            rank=de.rank - comp.first_rank, world_size=comp.size, timeout=timeout)
    control = Bridge("control", list(range(plan.world_size)), de.rank, store, timeout_s, "gloo")
    trainers = [r for r in range(plan.world_size) if plan.roles_of(r) != ("rollout",)]
    if len(trainers) == plan.world_size:
        trainers_bridge = control
    else:
        trainers_bridge = (Bridge("trainers", trainers, de.rank, store, timeout_s, "gloo")
                           if de.rank in trainers else None)
    weights = None
    actor, rollout = plan.ranks_of("actor"), plan.ranks_of("rollout")
    if actor and rollout and plan.component_of(actor[0]) != plan.component_of(rollout[0]):
        members = [actor[0], *rollout]
        if de.rank in members:
            weights = Bridge("weights", members, de.rank, store, timeout_s, backend)
    watchdog = Watchdog(de.master_addr, de.master_port, de.rank, de.world_size,
                        lambda r: describe_rank(plan, r), dead_after_s=dead_after_s, urgent=urgent,
                        store_host=store_host(de)).start()
    return RoleContext(plan, de.rank, comp, control, trainers_bridge, weights, watchdog, backend)


def leave(ctx: RoleContext) -> None:
    """Collective: stop the watchdogs before anyone exits (rank 0 hosts the store), then tear down."""
    ctx.control.barrier()
    ctx.watchdog.stop()
    ctx.control.barrier()
    if dist.is_initialized():
        dist.destroy_process_group()
