"""`hpc-rlhf steps [options] -- srun ...`: the job's srun step, started again inside the allocation when it fails.

A job script (``slurm/*.sbatch``, the script `hpc-rlhf plan` writes and the one `hpc-rlhf submit` gives submitit)
runs this where it ran srun: it is part of the batch script and ends with it.  No process outlives the steps.

Each step gets a log folder: ``LOG_DIR/JOBID/attempt-R`` (R: SLURM_RESTART_COUNT, the job's R-th start) and
``attempt-R/restart-K`` for its K-th restart inside the allocation; ``{step_dir}`` in the srun arguments is
replaced by it.  The ranks get it as ``HPC_RLHF_STEP_DIR`` with ``HPC_RLHF_STEP_RESTART=K``: a restarted rank
resumes from the newest intact checkpoint as a requeued one does, and leaves in the folder its node, its exit
code and the verdict naming the rank that brought the step down (`distributed/steprecord.py`).  When srun
returns, that record and the job's node list decide the next step (``decide``):

- exit 0: done;
- a user error (a rank exited 2: bad data, a bad option): the job ends with exit 2, never retried;
- every rank stopped on a signal after writing its checkpoint (exit 3): the job ends with exit 3 (rank 0 has
  requeued it, or SLURM will);
- any other failure (a rank raised, was killed, hung past the watchdog, or went with its node): a new step,
  up to ``max_restarts`` times.  Nodes the job lost (``--no-kill`` keeps the job alive without them) are left
  out, and so is a node where the culprit failed twice, when a spare can take its place.  The spares (the last
  ``spare_nodes`` nodes of the allocation) run nothing until then.  With fewer good nodes than the ranks need,
  the job requeues itself (``on_node_loss=requeue``: the queue gives it healthy nodes, and it resumes from its
  last checkpoint) or ends.

Each decision is one line in the batch output (``LOG_DIR/JOBID.out``).
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from .. import commands
from ..distributed import steprecord
from ..distributed.rendezvous import expand_hostlist, restart_count
from ..distributed.steprecord import StepRecord


@dataclass(frozen=True)
class Policy:
    max_restarts: int = 2
    spare_nodes: int = 0
    on_node_loss: str = "requeue"  # or "end"


@dataclass
class Placement:
    """The allocation's nodes (in SLURM's order), how many the ranks need, the ones found bad and each node's
    failures so far."""
    nodes: list[str]
    needed: int
    bad: set[str] = field(default_factory=set)
    failures: Counter = field(default_factory=Counter)

    def usable(self) -> list[str]:
        return [n for n in self.nodes if n not in self.bad]

    def step_nodes(self) -> list[str] | None:
        """The nodes of the next step; None (as SLURM places it) while every node of the allocation is wanted."""
        if self.needed == len(self.nodes) and not self.bad:
            return None
        return self.usable()[:self.needed]


@dataclass(frozen=True)
class Next:
    action: str  # "done", "end", "restart" or "requeue"
    rc: int
    why: str


def culprit(record: StepRecord) -> tuple[str, str | None]:
    """What brought the step down, and on which node (None: unknown)."""
    if record.verdict is not None:
        rank, host, why = record.verdict
        return why, host
    if len(record.killed) == 1:
        r = record.killed[0]
        return f"rank {r} was killed (it left no exit code)", record.hosts[r]
    if record.killed:  # SLURM killed the survivors before any watchdog named the first to die: blame no node
        ranks = ", ".join(map(str, record.killed))
        return f"ranks {ranks} were killed (none left an exit code, no watchdog named the first)", None
    failed = sorted(r for r, c in record.exits.items() if c not in (0, 3))
    if failed:
        return f"rank {failed[0]} exited {record.exits[failed[0]]}", record.hosts.get(failed[0])
    return "no rank said why", None


def decide(policy: Policy, rc: int, record: StepRecord, placement: Placement, lost: list[str],
           restarts_done: int) -> Next:
    """What follows a step that ended with srun's exit code ``rc``; updates ``placement`` (bad nodes, failures).
    ``lost``: allocation nodes the job no longer holds."""
    if rc == 0:
        return Next("done", 0, "the step finished")
    users = sorted(r for r, c in record.exits.items() if c == 2)
    if users or (rc == 2 and not record.exits):
        who = f"rank {users[0]}" if users else "a rank"
        return Next("end", 2, f"{who} stopped on a user error (exit 2): not retried; the rank logs say which")
    if (record.exits and not record.killed and set(record.exits.values()) == {3}) or (rc == 3 and not record.exits):
        return Next("end", 3, "the ranks stopped on a signal after writing a checkpoint")
    if not record.hosts and not lost:
        return Next("end", rc or 1, f"srun started no rank (exit {rc}): a step that cannot start is not retried; "
                                    "srun's lines above say why")
    why, host = culprit(record)
    if lost:  # the ranks there died with it; the others were killed by SLURM: no node is to blame but these
        placement.bad |= set(lost)
        why = f"lost node{'s' if len(lost) > 1 else ''} {', '.join(lost)}"
    elif host is not None:
        placement.failures[host] += 1
        if placement.failures[host] >= 2 and len(placement.usable()) > placement.needed:
            placement.bad.add(host)
            why += f"; {host} failed twice and a spare replaces it"
    if restarts_done >= policy.max_restarts:
        return Next("end", rc or 1, f"the step failed (exit {rc}): {why}; restarts spent "
                                    f"(launch.max_restarts={policy.max_restarts})")
    if len(placement.usable()) < placement.needed:
        short = (f"{len(placement.usable())} good nodes of the {placement.needed} the ranks need, no spare left "
                 "(slurm.spare_nodes)")
        if policy.on_node_loss == "requeue":
            return Next("requeue", rc or 1, f"the step failed (exit {rc}): {why}; {short}: requeueing the job")
        return Next("end", rc or 1, f"the step failed (exit {rc}): {why}; {short}: ending (slurm.on_node_loss=end)")
    return Next("restart", rc, f"the step failed (exit {rc}): {why}; restart {restarts_done + 1} of "
                               f"{policy.max_restarts} from the last checkpoint")


def step_command(srun: list[str], step_dir: Path, nodes: list[str] | None, ntasks: int | None = None) -> list[str]:
    """``srun`` with ``{step_dir}`` filled in; on ``nodes`` when given, with ``ntasks`` tasks (an allocation with
    spare nodes holds more task slots than the ranks)."""
    cmd = [a.replace("{step_dir}", str(step_dir)) for a in srun]
    if nodes is not None:
        cmd[1:1] = [f"--nodes={len(nodes)}", f"--nodelist={','.join(nodes)}"]
        if ntasks:
            cmd.insert(3, f"--ntasks={ntasks}")
    return cmd


def job_nodes(job: str) -> list[str] | None:
    """The nodes job ``job`` holds now (``scontrol show job``), None when SLURM does not say."""
    try:
        out = subprocess.run(["scontrol", "show", "job", "-o", job], capture_output=True, text=True,
                             timeout=60).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    lists = re.findall(r"(?:^|\s)NodeList=(\S+)", out)
    return [n for spec in lists if spec != "(null)" for n in expand_hostlist(spec)] if lists else None


def allocation_nodes(env) -> list[str]:
    """The job's nodes in SLURM's order: every component's, in a heterogeneous job."""
    het = sorted((int(k.rsplit("_", 1)[1]), v) for k, v in env.items() if k.startswith("SLURM_JOB_NODELIST_HET_GROUP_"))
    specs = [v for _, v in het] or [env["SLURM_JOB_NODELIST"]]
    return list(dict.fromkeys(n for spec in specs for n in expand_hostlist(spec)))


def policy_of_command(srun: list[str], given: dict) -> Policy:
    """The policy: the options given on the command line, else those of the `hpc-rlhf train` config the step
    runs (its --config file and overrides), else the defaults."""
    found: dict = {}
    try:
        i = srun.index("hpc_rlhf.cli")
    except ValueError:
        i = -1
    if i >= 0 and srun[i + 1:i + 2] == ["train"] and len(srun) > i + 2:
        rest = srun[i + 3:]
        path = rest[rest.index("--config") + 1] if "--config" in rest[:-1] else None
        overrides = [a for a in rest if "=" in a and not a.startswith("-")]
        try:
            cfg = commands.load_config(commands.TRAIN + srun[i + 2], path, overrides)
            found = {"max_restarts": cfg.launch.max_restarts, "spare_nodes": cfg.slurm.spare_nodes,
                     "on_node_loss": cfg.slurm.on_node_loss}
        except Exception as e:  # noqa: BLE001 - the ranks report a bad config themselves
            print(f"hpc-rlhf steps: could not read the restart options from the step's config ({e}): using "
                  "the defaults", flush=True)
    return Policy(**{**found, **{k: v for k, v in given.items() if v is not None}})


def run(srun: list[str], policy: Policy, log_dir: Path, env=None, ntasks: int | None = None) -> int:
    env = dict(os.environ if env is None else env)
    job, attempt = env["SLURM_JOB_ID"], restart_count(env)
    nodes = allocation_nodes(env)
    if policy.spare_nodes >= len(nodes):
        print(f"hpc-rlhf steps: slurm.spare_nodes={policy.spare_nodes} leaves none of the job's {len(nodes)} nodes "
              "for the ranks", flush=True)
        return 2
    placement = Placement(nodes, len(nodes) - policy.spare_nodes)
    for k in range(policy.max_restarts + 1):
        step_dir = log_dir / job / f"attempt-{attempt}" / (f"restart-{k}" if k else "")
        step_dir.mkdir(parents=True, exist_ok=True)
        on = placement.step_nodes()
        print(f"hpc-rlhf: job {job} attempt {attempt}" + (f" restart {k}" if k else "") +
              f" on {','.join(on or nodes)}, rank logs in {step_dir}", flush=True)
        rc = subprocess.call(step_command(srun, step_dir, on, ntasks),
                             env={**env, steprecord.STEP_DIR: str(step_dir), steprecord.STEP_RESTART: str(k)})
        now = job_nodes(job) if rc else None
        lost = [n for n in nodes if now is not None and n not in now and n not in placement.bad]
        nxt = decide(policy, rc, steprecord.read(step_dir), placement, lost, k)
        print(f"hpc-rlhf: {nxt.why}", flush=True)
        if nxt.action == "requeue":
            subprocess.call(["scontrol", "requeue", job])
        if nxt.action != "restart":
            return nxt.rc
    raise AssertionError("unreachable: decide ends the job once restarts are spent")


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--log-dir", required=True, help="where the rank logs go: LOG_DIR/JOBID/attempt-R[/restart-K]/")
    p.add_argument("--ntasks", type=int, default=None, help="the ranks (with spare nodes the allocation holds more "
                   "task slots: the script `hpc-rlhf plan` writes gives it)")
    p.add_argument("--max-restarts", type=int, default=None, help="default: launch.max_restarts of the step's "
                   "config (2)")
    p.add_argument("--spare-nodes", type=int, default=None, help="default: slurm.spare_nodes of the step's config (0)")
    p.add_argument("--on-node-loss", choices=("requeue", "end"), default=None,
                   help="default: slurm.on_node_loss of the step's config (requeue)")


def main(args, rest: list[str]) -> int:
    srun = rest[1:] if rest[:1] == ["--"] else rest
    if not srun or Path(srun[0]).name != "srun":
        print("hpc-rlhf steps: give the step after --: hpc-rlhf steps --log-dir DIR -- srun ...", file=sys.stderr)
        return 2
    if "SLURM_JOB_ID" not in os.environ:
        print("hpc-rlhf steps: runs inside a SLURM job (its batch script): SLURM_JOB_ID is not set", file=sys.stderr)
        return 2
    given = {"max_restarts": args.max_restarts, "spare_nodes": args.spare_nodes, "on_node_loss": args.on_node_loss}
    policy = policy_of_command(srun, given)
    if policy.spare_nodes and not args.ntasks:
        print(f"hpc-rlhf steps: slurm.spare_nodes={policy.spare_nodes} needs --ntasks (the ranks of a step)",
              file=sys.stderr)
        return 2
    return run(srun, policy, Path(args.log_dir), ntasks=args.ntasks)
