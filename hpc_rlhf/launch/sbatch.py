"""The sbatch script of a job: allocation, environment set-up, one srun step running every rank.

Homogeneous: one allocation of all tasks, one srun.  Heterogeneous: one `#SBATCH hetjob` block per
component with its own resources, and one srun with a `--het-group` part per component (colon
syntax), so a single step spans all roles: SLURM_PROCID then counts over all components, which is
exactly the global rank of the placement plan.

The script runs the step through `hpc-rlhf steps` (launch/steps.py), which starts it again inside the
allocation when it fails (``launch.max_restarts``), leaving out lost nodes and, with ``slurm.spare_nodes``,
a node that failed twice; ``--no-kill`` keeps the allocation when a node goes down.  The ranks of each step
log into LOG_DIR/JOBID/attempt-N/<component>-<task>.log (N: the job's (re)start; a restart inside the
allocation: attempt-N/restart-K/; the task number is SLURM's within the component); the batch script's
own output goes to LOG_DIR/JOBID.out, appended across restarts.

A job array (`hpc-rlhf sweep`, ``array=``) is always homogeneous (SLURM refuses ``--array`` on a
heterogeneous job): ``#SBATCH --array=...`` joins the header, ``prelude`` lines (picking the element's
config from SLURM_ARRAY_TASK_ID) come before the command, and a ``Raw`` argument of the command is written
as it is (a shell variable) instead of quoted.
"""
from __future__ import annotations

import shlex
import sys

from ..config import ConfigError
from ..config.slurm import SlurmConfig
from .job import JobComponent, is_hetjob


class Raw(str):
    """A command argument written into the script unquoted (a shell expansion such as "$POINT_CONFIG")."""


def python_command(slurm) -> list[str]:
    return shlex.split(slurm.python) if slurm.python.strip() else [sys.executable]


def _header(slurm: SlurmConfig, log_dir: str, array: str | None = None) -> list[str]:
    lines = [f"--job-name={slurm.job_name}", *([f"--array={array}"] if array else []), f"--time={slurm.time}",
             f"--output={log_dir}/%j.out",
             "--open-mode=append", "--requeue" if slurm.requeue else "--no-requeue", "--no-kill"]
    if slurm.signal_before_end_s:
        lines.append(f"--signal=USR1@{slurm.signal_before_end_s}")
    for key in ("account", "qos"):
        if getattr(slurm, key):
            lines.append(f"--{key}={getattr(slurm, key)}")
    return lines


def _allocation(comps: list[JobComponent], slurm: SlurmConfig, log_dir: str, het: bool,
                array: str | None = None) -> list[str]:
    out: list[str] = []
    if het:
        per_component = [f"--time={slurm.time}"]
        if slurm.signal_before_end_s:
            per_component.append(f"--signal=USR1@{slurm.signal_before_end_s}")
        for i, c in enumerate(comps):
            if i:
                out.append("#SBATCH hetjob")
            opts = (_header(slurm, log_dir) if i == 0 else per_component) + [f"--ntasks={c.ntasks}"]
            out.append(f"#SBATCH {' '.join(opts + c.resources.sbatch_options())}   # {c.name}")
        return out
    total = sum(c.ntasks for c in comps)
    res = comps[0].resources
    nodes = [c.resources.nodes for c in comps]
    opts = [o for o in res.sbatch_options() if not o.startswith("--nodes")]
    if all(nodes):
        opts.insert(0, f"--nodes={sum(nodes) + slurm.spare_nodes}")
    # a spare node holds as many task slots as a node of the ranks, so that it can take over one's ranks
    tasks = f"--ntasks-per-node={-(-total // sum(nodes))}" if slurm.spare_nodes else f"--ntasks={total}"
    out.append(f"#SBATCH {' '.join(_header(slurm, log_dir, array))}")
    out.append(f"#SBATCH {tasks} {' '.join(opts)}")
    return out


def _task_cpus(n: int) -> str:
    """srun does not take --cpus-per-task from the allocation (Slurm >= 22.05), and inside a het step
    SLURM_CPUS_PER_TASK is not the component's: give both explicitly to every part of the step."""
    return f"--cpus-per-task={n} --export=ALL,OMP_NUM_THREADS={n}"


def check_spare_nodes(comps: list[JobComponent], slurm: SlurmConfig) -> None:
    """Spare nodes need a homogeneous job whose ranks' node count is given (the spares come on top of it)."""
    if not slurm.spare_nodes:
        return
    if is_hetjob(comps, slurm.hetjob):
        raise ConfigError(f"slurm.spare_nodes={slurm.spare_nodes}: spare nodes are for homogeneous jobs; this one "
                          "is heterogeneous (its role groups ask for different resources, or slurm.hetjob=always)")
    if not all(c.resources.nodes for c in comps):
        raise ConfigError(f"slurm.spare_nodes={slurm.spare_nodes} needs the ranks' node count: set "
                          "slurm.roles.<role>.nodes (e.g. slurm.roles.actor.nodes=2) so the spares come on top")


def render(comps: list[JobComponent], slurm: SlurmConfig, command: list[str], log_dir: str,
           array: str | None = None, prelude: list[str] | None = None, max_restarts: int = 2) -> str:
    """The job script; ``command`` is what every task runs (argv, quoted here but for ``Raw`` parts).
    ``array``: sbatch's --array value (a job array, homogeneous); ``prelude``: shell lines before the command;
    ``max_restarts``: launch.max_restarts (new steps after a failed one)."""
    het = is_hetjob(comps, slurm.hetjob)
    if het and array:
        raise ValueError("SLURM has no heterogeneous job arrays: a job array's allocation is homogeneous")
    check_spare_nodes(comps, slurm)
    cmd = " ".join(a if isinstance(a, Raw) else shlex.quote(a) for a in command)
    lines = ["#!/bin/bash",
             f"# Written by hpc-rlhf ({'heterogeneous' if het else 'homogeneous'} {'job array' if array else 'job'}: "
             + ", ".join(f"{c.name} x{c.ntasks}" for c in comps) + ").",
             f"# The log folder must exist before sbatch: mkdir -p {log_dir}",
             *_allocation(comps, slurm, log_dir, het, array),
             "set -euo pipefail",
             "",
             "# ---- environment: module load ..., source .venv/bin/activate, container set-up ----",
             *(slurm.setup or ["# (none: slurm.setup in the config adds lines here)"]),
             "# -------------------------------------------------------------------------------------",
             ""]
    if slurm.hf_offline:
        lines.append("export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1")
    lines += list(prelude or [])
    lines.append(f"CMD=({cmd})")
    # the step, started again inside the allocation when it fails; {step_dir}: each step's log folder
    steps = shlex.join([*python_command(slurm), "-m", "hpc_rlhf.cli", "steps", "--log-dir", log_dir,
                        "--ntasks", str(sum(c.ntasks for c in comps)), "--max-restarts", str(max_restarts),
                        "--spare-nodes", str(slurm.spare_nodes),
                        "--on-node-loss", slurm.on_node_loss, "--"])
    common = "srun --kill-on-bad-exit=1 --unbuffered"
    if het:
        parts = [f'--het-group={i} {_task_cpus(c.resources.cpus_per_task)} --output="{{step_dir}}/{c.name}-%t.log" '
                 '"${CMD[@]}"' for i, c in enumerate(comps)]
        lines.append(f"{steps} {common} " + " \\\n  : ".join(parts) + " || rc=$?")
    else:
        lines.append(f'{steps} {common} {_task_cpus(comps[0].resources.cpus_per_task)} '
                     '--output="{step_dir}/rank-%t.log" "${CMD[@]}" || rc=$?')
    lines.append('exit "${rc:-0}"')
    return "\n".join(lines) + "\n"
