"""How a rank's OpenMP threads wait between parallel regions, chosen before torch loads its OpenMP runtime.

libgomp (torch's OpenMP on Linux) reads ``OMP_WAIT_POLICY`` once, as it loads.  Unset, a worker thread that
finds no work spins a short while and then sleeps on a futex, and the next parallel region waits for it to wake.
A decode step is thousands of small parallel regions with Python between them.  In the RL loop, after the first
training step, those stretches of Python (allocations in the heap the training step left behind) outlast the
spin: during the second step's generation about a quarter of the CPU time was idle, and the benchmark's
hpc_rlhf side (SmolLM2-135M, 8 x 8 samples, 2 threads on 2 cores) generated in 44.7 s a step with libgomp's
default against 34.0 s with ``ACTIVE`` (single runs: docs/runs/perf/grpo_real_fp32_hpc_alone_zen4_omp_*.json).

With ``ACTIVE`` an idle worker spins until the next region.  That costs nothing when each thread has a core
of its own, and takes cores from other processes when ranks share them.  So ``load_torch`` sets it only when
the user did not set ``OMP_WAIT_POLICY`` or ``GOMP_SPINCOUNT`` (``GOMP_SPINCOUNT=300000`` keeps libgomp's
default), the rank runs more than one thread, and the threads of the ranks that share this process's CPUs fit
on them (the local launcher's and SLURM's defaults).  The variable is set for the import only: processes this
one starts (a reward server, the launcher's ranks, which choose for themselves) do not inherit it.

The policy holds only while libgomp manages no more threads than the CPUs it may use.  Past that, every worker
spins 1,000 rounds and sleeps, whatever the policy: a second OpenMP team in the process, such as a gloo thread
running a large copy of a collective, does that (``collectives.Bridge`` builds no gloo group for one rank).

Only training ranks choose: ``cli.py`` calls ``load_torch`` for ``hpc-rlhf train`` (what the local launcher,
srun and the demo start) and ``launch/submit.py`` in a submitit task, each before its other imports.  Other
commands (a reward server beside the trainers, the pipelines) keep libgomp's default.  This module imports
nothing that imports torch.
"""
from __future__ import annotations

import os
import sys

ACTIVE = "ACTIVE"


def wait_policy(threads: int, ranks_sharing: int, cpus: int) -> str | None:
    """``ACTIVE`` when a rank of ``threads`` OpenMP threads and the ``ranks_sharing`` ranks (itself
    included) that share its ``cpus`` CPUs all fit, one thread a CPU, and it has worker threads at all
    (``threads`` > 1); otherwise None: libgomp's default (pure)."""
    if threads < 1 or ranks_sharing < 1 or cpus < 1:
        raise ValueError(f"wait_policy: threads, ranks_sharing and cpus must be >= 1, got {threads}, "
                         f"{ranks_sharing}, {cpus}")
    return ACTIVE if threads > 1 and threads * ranks_sharing <= cpus else None


def user_chose(env) -> bool:
    """Whether ``env`` sets how libgomp waits: ``OMP_WAIT_POLICY``, or ``GOMP_SPINCOUNT`` (libgomp's default
    is ``GOMP_SPINCOUNT=300000``: set it to keep that)."""
    return "OMP_WAIT_POLICY" in env or "GOMP_SPINCOUNT" in env


def rank_threads(env, cpus: int) -> tuple[int, int]:
    """(OpenMP threads of this rank, ranks sharing its CPUs) from ``env``: ``OMP_NUM_THREADS`` (else torch's
    default, one a CPU) and ``LOCAL_WORLD_SIZE`` (set by the local launcher and torchrun, whose ranks share the
    machine's CPUs; else 1: alone, or an srun task bound to its own CPUs)."""
    def number(name: str, default: int) -> int:
        raw = env.get(name) or ""
        try:
            return int(raw) if raw else default
        except ValueError:
            raise ValueError(f"{name}={raw!r} is not a whole number") from None
    return number("OMP_NUM_THREADS", cpus), number("LOCAL_WORLD_SIZE", 1)


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity: an srun task's own CPUs)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def policy_for(env, cpus: int) -> str | None:
    """``wait_policy`` for the rank ``env`` describes on ``cpus`` CPUs; None when the user chose
    (``user_chose``) or ``OMP_NUM_THREADS`` is one of libgomp's other forms ("4,2"): theirs to handle."""
    if user_chose(env):
        return None
    try:
        return wait_policy(*rank_threads(env, cpus), cpus)
    except ValueError:
        return None


def alone_policy(env=None) -> dict:
    """The environment that gives a process of torch's default threads started alone on these CPUs (another
    framework's, beside a rank in a benchmark) the wait policy a rank here would get: {"OMP_WAIT_POLICY": ...},
    or {} when that is libgomp's default or the user chose (the child inherits their setting)."""
    env = os.environ if env is None else env
    policy = policy_for({k: v for k, v in env.items() if k != "LOCAL_WORLD_SIZE"}, usable_cpus())
    return {"OMP_WAIT_POLICY": policy} if policy else {}


def load_torch() -> str | None:
    """Import torch with the wait policy ``policy_for`` picks for this rank (from the process's environment,
    the only one libgomp reads); returns the policy set, None when OpenMP was left alone (the user's choice,
    threads that share cores, or torch already loaded: then it is too late to choose)."""
    if "torch" in sys.modules:
        return None
    policy = policy_for(os.environ, usable_cpus())
    if policy is not None:
        os.environ["OMP_WAIT_POLICY"] = policy
    try:
        import torch  # noqa: F401  (libgomp reads the variable as it loads)
    finally:
        if policy is not None:
            del os.environ["OMP_WAIT_POLICY"]
    return policy
