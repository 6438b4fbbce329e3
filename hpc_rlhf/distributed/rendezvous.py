"""Rendezvous from the SLURM environment of an srun step: rank, world, master host and port.

Facts this relies on (checked on Slurm 22.05, heterogeneous steps included):
- Inside an srun step every task has SLURM_STEP_ID; the batch script itself does not.  A process
  counts as a launched rank only inside a step, so `hpc-rlhf train` typed into the batch script
  still starts its own local ranks instead of mistaking itself for rank 0 of the allocation.
- In a heterogeneous step SLURM_PROCID and SLURM_NTASKS count over all components, and every task
  sees the leader's SLURM_JOB_ID plus SLURM_JOB_NODELIST_HET_GROUP_0; rank 0 runs on the first node
  of component 0 (of the step's node list in a homogeneous step).
- Each (re)start of a requeued job has SLURM_RESTART_COUNT = 0, 1, 2, ...  The port is derived from
  the job id, the step id and the restart count, so every task computes the same one without
  talking, and a restarted job does not meet the sockets of its previous attempt.
"""
from __future__ import annotations

import os
import re
import sys

from .steprecord import note_start, step_restart

# 20000-32767: below Linux's default ephemeral range (32768-60999), from which the kernel takes the local port
# of every outgoing connection; a rendezvous port there can be held by any client socket on the node
# (EADDRINUSE, seen on the local test cluster at 35838)
PORT_BASE, PORT_SPAN = 20000, 12768


def expand_hostlist(spec: str) -> list[str]:
    """SLURM's compressed host list -> host names: "gpu[01-03,7],cpu5" -> gpu01 gpu02 gpu03 gpu7 cpu5."""
    hosts: list[str] = []
    for m in re.finditer(r"([^,\[]+)(?:\[([^\]]+)\])?([^,\[]*)", spec):
        prefix, ranges, suffix = m.group(1), m.group(2), m.group(3)
        if ranges is None:
            hosts.append(prefix + suffix)
            continue
        for part in ranges.split(","):
            lo, _, hi = part.partition("-")
            for i in range(int(lo), int(hi or lo) + 1):
                hosts.append(f"{prefix}{str(i).zfill(len(lo))}{suffix}")
    return hosts


def in_slurm_step(env=None) -> bool:
    env = os.environ if env is None else env
    return "SLURM_STEP_ID" in env and "SLURM_PROCID" in env and "SLURM_NTASKS" in env


def restart_count(env=None) -> int:
    env = os.environ if env is None else env
    return int(env.get("SLURM_RESTART_COUNT", "0") or 0)


def restarted(env=None) -> bool:
    """Whether this run starts again after its job was requeued or its step failed: it resumes from the newest
    intact checkpoint, whatever config wrote it (checkpoint/existing.py:choose)."""
    return restart_count(env) > 0 or step_restart(env) > 0


def rendezvous_port(job: int, step: int, restart: int) -> int:
    return PORT_BASE + (job * 7919 + step * 104729 + restart * 131) % PORT_SPAN


def master_host(env) -> str:
    nodes = env.get("SLURM_JOB_NODELIST_HET_GROUP_0") or env.get("SLURM_STEP_NODELIST") or env["SLURM_JOB_NODELIST"]
    return expand_hostlist(nodes)[0]


def slurm_rendezvous(env=None) -> dict[str, str]:
    """RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT for this task of an srun step.

    MASTER_ADDR or MASTER_PORT already in the environment win (a site may route the rendezvous over
    a particular network).  OMP_NUM_THREADS defaults to the task's CPUs.
    """
    env = os.environ if env is None else env
    out = {"RANK": env["SLURM_PROCID"], "WORLD_SIZE": env["SLURM_NTASKS"],
           "LOCAL_RANK": env.get("SLURM_LOCALID", "0"),
           "MASTER_ADDR": env.get("MASTER_ADDR") or master_host(env),
           "MASTER_PORT": env.get("MASTER_PORT") or str(rendezvous_port(
               int(env["SLURM_JOB_ID"]), int(env.get("SLURM_STEP_ID", "0")), restart_count(env)))}
    if "OMP_NUM_THREADS" not in env and env.get("SLURM_CPUS_PER_TASK"):
        out["OMP_NUM_THREADS"] = env["SLURM_CPUS_PER_TASK"]
    return out


def adopt_slurm_rendezvous() -> bool:
    """Inside an srun step (and not already given a rank by torchrun or our launcher): export the
    rendezvous variables.  Returns whether it did."""
    if "RANK" in os.environ or not in_slurm_step():
        return False
    values = slurm_rendezvous()
    os.environ.update(values)
    note_start()  # for the job's step runner (launch/steps.py), when it runs this step
    if "OMP_NUM_THREADS" in values and "torch" in sys.modules:  # else torch reads the variable as it loads
        sys.modules["torch"].set_num_threads(int(values["OMP_NUM_THREADS"]))
    return True
