"""What a SLURM job of a trainer consists of: its components (role groups) with tasks and resources.

A trainer with a placement plan (RL) has one component per role group of the plan: its tasks are
the group's ranks, in plan order, so global rank r of the srun step is rank r of the plan.  Other
trainers (sft, dpo, ...) are one component of `launch.nproc` tasks.  Resources come from
`slurm.resources`, overridden per role by `slurm.roles.<role>` (a group takes the overrides of its
first role: the role whose ranks the others join).
"""
from __future__ import annotations

from dataclasses import dataclass

from ..config.slurm import SlurmConfig
from ..distributed.placement import Component


@dataclass(frozen=True)
class Resources:
    nodes: int | None
    gpus_per_task: int
    cpus_per_task: int
    mem_per_cpu: str
    partition: str
    constraint: str

    def sbatch_options(self) -> list[str]:
        opts = [f"--cpus-per-task={self.cpus_per_task}"]
        if self.nodes:
            opts.insert(0, f"--nodes={self.nodes}")
        if self.gpus_per_task:
            opts.append(f"--gpus-per-task={self.gpus_per_task}")
        if self.mem_per_cpu:
            opts.append(f"--mem-per-cpu={self.mem_per_cpu}")
        if self.partition:
            opts.append(f"--partition={self.partition}")
        if self.constraint:
            opts.append(f"--constraint={self.constraint}")
        return opts


@dataclass(frozen=True)
class JobComponent:
    """One component of the job: a role group of the placement (its ranks are the tasks) and its resources."""
    placement: Component
    resources: Resources

    @property
    def name(self) -> str:
        return self.placement.name

    @property
    def first_rank(self) -> int:
        return self.placement.first_rank

    @property
    def ntasks(self) -> int:
        return self.placement.size


def resources_for(slurm: SlurmConfig, role: str) -> Resources:
    base, over = slurm.resources, getattr(slurm.roles, role)

    def pick(value, default):
        return default if value is None else value
    return Resources(nodes=over.nodes, gpus_per_task=pick(over.gpus_per_task, base.gpus_per_task),
                     cpus_per_task=pick(over.cpus_per_task, base.cpus_per_task),
                     mem_per_cpu=pick(over.mem_per_cpu, base.mem_per_cpu),
                     partition=pick(over.partition, slurm.partition), constraint=pick(over.constraint, base.constraint))


def components(cfg, plan=None) -> list[JobComponent]:
    """The job's components for a trainer config; ``plan``: its placement plan when it has one."""
    groups = plan.components if plan is not None else (Component("train", ("actor",), 0, cfg.launch.nproc),)
    return [JobComponent(c, resources_for(cfg.slurm, c.roles[0])) for c in groups]


def is_hetjob(comps: list[JobComponent], mode: str) -> bool:
    if mode == "always":
        return True
    if mode == "never" or len(comps) == 1:
        return False
    return len({c.resources for c in comps}) > 1
