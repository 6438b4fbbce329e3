"""The attempt record: ``attempts.jsonl`` in a run's save_path, one JSON object per line, appended by the
main rank (global rank 0) and never rewritten.  `hpc-rlhf status` reads it (`launch/status.py`).

Each (re)start of a run appends, in this order:

- ``{"event": "start", ...}`` when the rank enters its trainer (`trainers/lifecycle.py`): the SLURM job id,
  array job and task ids and restart count (null outside SLURM), the new step inside the allocation
  (``step_restart``: 0, or K for the K-th restart by `launch/steps.py`), host, pid and the pid's start time (so that a
  reader on the same host can tell whether that very process still runs), world size, the resolved
  ``ckpt_path`` and, under SLURM, the resolved ``slurm.log_dir`` (where the rank logs of the attempt are);
- ``{"event": "steps", "start_step": S, "total_steps": T, "trainer": NAME}`` when the step loop begins
  (`trainers/loop.py`): S > 0 is a resumed run;
- ``{"event": "end", "reason": ...}`` when the trainer returns or raises: ``finished``; ``stopped`` (a stop
  signal at a step boundary: ``step``, ``signal`` as this rank received it, or null when another rank got it,
  ``requeue``: whether rank 0 asked SLURM to requeue); ``error`` (``error``: the exception's type and first
  line, or the watchdog's verdict when a peer brought the job down).

Every row has ``time`` (seconds since the epoch).  An attempt killed outright (SIGKILL, out of memory, a node
lost) has no ``end`` row: the reader says so and looks for the cause in the rank logs.  Writing the record
never stops a run: a failed write is logged as a warning.
"""
from __future__ import annotations

import json
import logging
import os
import socket
import time
from pathlib import Path

from ..distributed.steprecord import step_restart

log = logging.getLogger("hpc_rlhf.attempts")

ATTEMPTS = "attempts.jsonl"


def append(run_dir: str | Path, event: str, **fields) -> None:
    """Append one row ``{"time", "event", **fields}`` to ``run_dir/attempts.jsonl``."""
    row = {"time": round(time.time(), 3), "event": event, **fields}
    try:
        Path(run_dir).mkdir(parents=True, exist_ok=True)
        with open(Path(run_dir) / ATTEMPTS, "a") as f:
            f.write(json.dumps(row) + "\n")
    except OSError as e:
        log.warning("could not append to the attempt record %s: %s", Path(run_dir) / ATTEMPTS, e)


def process_start_ticks(pid: int) -> int | None:
    """When process ``pid`` started, in clock ticks since boot (Linux /proc), None when unknown: with the pid it
    names one process, since pids are reused."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # the command name (2nd field) is in parentheses and may hold spaces: split after its closing one
    fields = stat[stat.rfind(")") + 2:].split()
    return int(fields[19])  # field 22 of proc(5), the 20th after the name


def identity(environ: dict | None = None) -> dict:
    """The start row's fields that say which job, attempt and process this is."""
    env = os.environ if environ is None else environ

    def slurm(name: str) -> str | None:
        return env.get(name) or None
    restart = slurm("SLURM_RESTART_COUNT")
    job = slurm("SLURM_JOB_ID")
    return {"job_id": job, "array_job_id": slurm("SLURM_ARRAY_JOB_ID"), "array_task_id": slurm("SLURM_ARRAY_TASK_ID"),
            "restart": int(restart) if restart else (0 if job else None),
            "step_restart": step_restart(env),
            "host": env.get("SLURMD_NODENAME") or socket.gethostname(), "pid": os.getpid(),
            "pid_start": process_start_ticks(os.getpid()), "world_size": int(env.get("WORLD_SIZE", "1"))}


def error_text(error: BaseException) -> str:
    """``Type: first line of the message`` (the type alone when there is no message)."""
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0]}" if lines else type(error).__name__
