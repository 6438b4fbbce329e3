"""The `slurm` section: resources per role, the job script's environment, preemption and requeue.

Read by `hpc-rlhf plan` and `hpc-rlhf submit` (which render the sbatch script) and by the ranks
themselves (which signals stop the run at the next step boundary, whether one rank requeues).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from .base import ConfigError, field

SIGNALS = ("TERM", "USR1", "USR2", "INT")


@dataclass
class RoleResources:
    nodes: int | None = field(None, ge=1, help="nodes for this role's tasks (null: as few as fit, decided by SLURM)")
    gpus_per_task: int | None = field(None, ge=0, help="GPUs per task (null: inherit slurm.resources)")
    cpus_per_task: int | None = field(None, ge=1, help="CPUs per task (null: inherit slurm.resources)")
    mem_per_cpu: str | None = field(None, help="memory per CPU, e.g. 4G (null: inherit; empty: cluster default)")
    partition: str | None = field(None, help="partition for this role (null: slurm.partition)")
    constraint: str | None = field(None, help="node features, e.g. a100 (null: inherit)")


@dataclass
class DefaultResources:
    gpus_per_task: int = field(0, ge=0, help="GPUs per task (0 on CPU clusters)")
    cpus_per_task: int = field(1, ge=1, help="CPUs per task (also OMP_NUM_THREADS of each rank)")
    mem_per_cpu: str = field("", help="memory per CPU, e.g. 4G (empty: the cluster's default)")
    constraint: str = field("", help="node features required (empty: any node)")


@dataclass
class RoleOverrides:
    actor: RoleResources = field(default_factory=RoleResources, help="actor ranks (or the only role: sft, dpo, ...)")
    critic: RoleResources = field(default_factory=RoleResources, help="critic ranks")
    reference: RoleResources = field(default_factory=RoleResources, help="reference-model ranks")
    reward: RoleResources = field(default_factory=RoleResources, help="reward-model ranks")
    rollout: RoleResources = field(default_factory=RoleResources, help="generation ranks")


@dataclass
class SlurmConfig:
    job_name: str = field("hpc-rlhf", help="SLURM job name")
    partition: str = field("", help="partition (empty: the cluster's default)")
    account: str = field("", help="account to charge (empty: your default)")
    qos: str = field("", help="quality of service (empty: default)")
    time: str = field("01:00:00", help="time limit, as sbatch takes it (minutes, HH:MM:SS or D-HH:MM:SS)")
    log_dir: str = field("./slurm_logs", help="job logs: LOG_DIR/JOBID.out for the batch script and "
                                             "LOG_DIR/JOBID/attempt-N/ for the ranks of each (re)start")
    setup: list[str] = field(default_factory=list, help="shell lines run before the ranks start: module load ..., "
                                                        "source venv/bin/activate, apptainer exec set-up")
    hetjob: Literal["auto", "always", "never"] = field(
        "auto", help="heterogeneous job (one component per role group with its own resources): auto = when "
                     "the role groups ask for different resources")
    resources: DefaultResources = field(default_factory=DefaultResources, help="resources of every task")
    roles: RoleOverrides = field(default_factory=RoleOverrides, help="per-role resources (override `resources`)")
    stop_signals: list[str] = field(default_factory=lambda: ["TERM", "USR1", "USR2"],
                                    help="signals that stop the run at the next step boundary after a checkpoint")
    requeue_signals: list[str] = field(default_factory=lambda: ["USR1", "USR2"],
                                       help="of those, the ones after which rank 0 requeues the job (time-limit "
                                            "warnings); SLURM requeues preempted jobs (TERM) itself")
    signal_before_end_s: int = field(300, ge=0, help="sbatch --signal: USR1 this many seconds before the time limit")
    requeue: bool = field(True, help="sbatch --requeue, and rank 0 runs `scontrol requeue` after a requeue signal")
    hf_offline: bool = field(True, help="HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 in the job "
                                        "(compute nodes without internet): exported by the script, and set by "
                                        "every rank where unset")
    spare_nodes: int = field(0, ge=0, help="nodes requested on top of the ranks' (homogeneous jobs with "
                                         "slurm.roles.actor.nodes set), used only to replace a node that was lost "
                                         "or failed twice")
    on_node_loss: Literal["requeue", "end"] = field("requeue", help="a node lost with no spare left: requeue the "
                                                                    "job (it resumes from the last checkpoint), or "
                                                                    "end it")
    python: str = field("", help="the command that runs Python in the job, after `setup` (e.g. python, or "
                                 "apptainer exec --nv image.sif python); empty: the interpreter running "
                                 "plan/submit, by its absolute path")

    def validate(self) -> None:
        for name in (*self.stop_signals, *self.requeue_signals):
            if name not in SIGNALS:
                raise ConfigError(f"slurm signals: {name!r} is not one of {', '.join(SIGNALS)}")
        missing = set(self.requeue_signals) - set(self.stop_signals)
        if missing:
            raise ConfigError(f"slurm.requeue_signals {sorted(missing)} must also be in slurm.stop_signals")
