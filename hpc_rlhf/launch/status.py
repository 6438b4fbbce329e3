"""`hpc-rlhf status RUN_DIR`: where a run stands, read from its files alone (no process attached).

RUN_DIR is the run's ``ckpt.save_path`` (where metrics.jsonl and the attempt record go); its ``ckpt_path``, a
parent folder holding one run, or a folder with the exported ``hpc_rlhf_config.yaml`` lead there too.  Read:

- ``attempts.jsonl`` (`logging/attempts.py`): each (re)start with its SLURM job id, restart count, host and
  pid, the step it started from, the run's total steps, and how it ended;
- ``metrics.jsonl``: the last logged step, and when it was logged (the file's modification time);
- ``ckpt_path``: the newest committed checkpoint, checked against its manifest (`checkpoint/manifest.py`);
- under SLURM, the rank logs ``LOG_DIR/JOBID/attempt-N/*.log`` and the batch output ``LOG_DIR/JOBID.out``
  (`launch/sbatch.py`): the last error line of each, and the attempts that died before writing a record;
- whether it runs: ``squeue`` for the job id where squeue exists; for a run without SLURM, whether the recorded
  process (pid and its start time) is alive when the record was written on this host; otherwise it says that
  it cannot tell.

``run_status`` returns a JSON-ready dict (``--json``); ``render`` turns it into the text block.
"""
from __future__ import annotations

import json
import math
import re
import shutil
import socket
import subprocess
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import yaml

from ..checkpoint.manifest import damage, has_manifest
from ..checkpoint.layout import COMMITTED, CONFIG, committed_steps
from ..logging.attempts import ATTEMPTS, process_start_ticks

METRICS = "metrics.jsonl"
EXPORTED_CONFIG = "hpc_rlhf_config.yaml"  # the run's config, beside the exported model in save_path
STEP_TIME_KEYS = ("time/step_s", "step_time_s")  # the RL loop's and the offline trainers' step time metric
LOG_TAIL_BYTES = 1 << 20  # the end of a log file that is searched for error lines
# squeue states of a job that holds its allocation (COMPLETING: its processes are ending)
RUNNING_STATES = {"RUNNING", "COMPLETING", "CONFIGURING", "STAGE_OUT", "SIGNALING", "RESIZING"}
FINAL_STATES = {"BOOT_FAIL", "CANCELLED", "COMPLETED", "DEADLINE", "FAILED", "NODE_FAIL", "OUT_OF_MEMORY",
                "PREEMPTED", "REVOKED", "TIMEOUT", "GONE"}  # GONE: squeue no longer knows the job

_ERROR_LINE = re.compile(
    r"\] (?:ERROR|CRITICAL) "  # the ranks' logging format (commands.setup_logging)
    r"|^(?:[A-Za-z_][\w.]*\.)?[A-Z]\w*(?:Error|Exception|Interrupt)\b(?::|$)"  # the last line of a traceback
    r"|^hpc-rlhf(?: launcher)?: "  # what the CLI, the watchdog and the batch script print (notes aside, below)
    r"|^(?:srun|slurmstepd|sbatch|salloc)(?:-[\w.-]+)?: error: ")  # SLURM's: killed tasks, time limit, requeue
_NOT_ERRORS = ("hpc-rlhf: job ", "hpc-rlhf: the ranks stopped on a signal",
               "hpc-rlhf launcher: the ranks stopped on a signal")
_BANNER = re.compile(r"^hpc-rlhf: job (\S+) attempt (\d+) ")  # the batch script's line at each (re)start


class StatusError(ValueError):
    """RUN_DIR is not a run folder; the message says what was looked for."""


@dataclass
class Attempt:
    number: int  # 1, 2, ... in the order of the record
    recorded: bool = True  # False: found only as a SLURM attempt folder of rank logs (it died before its start row)
    started: float | None = None
    job_id: str | None = None
    array_job_id: str | None = None
    array_task_id: str | None = None
    restart: int | None = None  # SLURM_RESTART_COUNT
    step_restart: int = 0  # K: the K-th new step inside that allocation (launch/steps.py)
    host: str | None = None
    pid: int | None = None
    pid_start: int | None = None
    world_size: int | None = None
    ckpt_path: str | None = None
    log_dir: str | None = None
    trainer: str | None = None
    start_step: int | None = None
    total_steps: int | None = None
    loop_started: float | None = None
    ended: float | None = None
    reason: str | None = None  # finished | stopped | error | None (no end row)
    step: int | None = None  # the step a stopped attempt checkpointed
    signal: str | None = None
    requeue: bool | None = None
    error: str | None = None
    log_error: dict | None = None  # {"file", "line"}: the last error line of its rank logs
    log_errors: list | None = None  # every log file's last error line

    @property
    def end_step(self) -> int | None:
        if self.reason == "finished":
            return self.total_steps
        return self.step if self.reason == "stopped" else None


# -- reading the files ------------------------------------------------------------------------------------------

def read_attempts(path: Path) -> tuple[list[Attempt], int]:
    """The attempts of an attempt record, and how many of its lines could not be read (a line cut by a crash)."""
    found: list[Attempt] = []
    bad = 0
    for line in path.read_text(errors="replace").splitlines():
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            event = row["event"]
        except (ValueError, KeyError, TypeError):
            bad += 1
            continue
        if event == "start" or not found:
            found.append(Attempt(number=len(found) + 1, started=row.get("time")))
        a = found[-1]
        if event == "start":
            for key in ("job_id", "array_job_id", "array_task_id", "restart", "host", "pid", "pid_start",
                        "world_size", "ckpt_path", "log_dir"):
                setattr(a, key, row.get(key))
            a.step_restart = row.get("step_restart") or 0
        elif event == "steps":
            a.start_step, a.total_steps = row.get("start_step"), row.get("total_steps")
            a.trainer, a.loop_started = row.get("trainer"), row.get("time")
        elif event == "end":
            a.ended, a.reason = row.get("time"), row.get("reason")
            a.step, a.signal, a.requeue, a.error = row.get("step"), row.get("signal"), row.get("requeue"), \
                row.get("error")
    return found, bad


def read_rows(path: Path) -> tuple[list[dict], int]:
    """The rows of metrics.jsonl, and how many lines could not be read."""
    rows, bad = [], 0
    if not path.is_file():
        return rows, bad
    for line in path.read_text(errors="replace").splitlines():
        if line.strip():
            try:
                rows.append(json.loads(line))
            except ValueError:
                bad += 1
    return rows, bad


def _tail(path: Path, limit: int = LOG_TAIL_BYTES) -> str:
    with open(path, "rb") as f:
        size = f.seek(0, 2)
        f.seek(max(0, size - limit))
        return f.read().decode(errors="replace")


def is_error_line(line: str) -> bool:
    line = line.strip()
    return bool(_ERROR_LINE.search(line)) and not line.startswith(_NOT_ERRORS)


def last_error_line(text: str) -> str | None:
    """The last error line of a log's text (module docstring of what counts), None when there is none."""
    for line in reversed(text.splitlines()):
        if is_error_line(line):
            return line.strip()
    return None


def batch_output_by_attempt(text: str) -> dict[int, str]:
    """The batch script's output (LOG_DIR/JOBID.out, appended across restarts) split at its banner lines into
    restart count -> text (what comes before the first banner goes with attempt 0)."""
    parts: dict[int, list[str]] = {}
    current = 0
    for line in text.splitlines():
        m = _BANNER.match(line)
        if m:
            current = int(m.group(2))
        parts.setdefault(current, []).append(line)
    return {k: "\n".join(v) for k, v in parts.items()}


def step_folder(log_dir: Path, job_id: str, restart: int, step_restart: int = 0) -> Path:
    """The rank logs of a job's start ``restart`` and its new step ``step_restart`` (launch/steps.py)."""
    folder = Path(log_dir) / job_id / f"attempt-{restart}"
    return folder / f"restart-{step_restart}" if step_restart else folder


def attempt_log_errors(log_dir: Path, job_id: str, restart: int, step_restart: int = 0) -> list[dict]:
    """The last error line of each rank log of one SLURM attempt and of its part of the batch output, oldest
    file first (by modification time)."""
    found = []
    folder = step_folder(log_dir, job_id, restart, step_restart)
    files = sorted(folder.glob("*.log")) if folder.is_dir() else []
    for f in files:
        line = last_error_line(_tail(f))
        if line:
            found.append((f.stat().st_mtime, {"file": str(f), "line": line}))
    out = log_dir / f"{job_id}.out"
    if out.is_file():
        line = last_error_line(batch_output_by_attempt(_tail(out)).get(restart, ""))
        if line:
            found.append((out.stat().st_mtime, {"file": str(out), "line": line}))
    return [entry for _, entry in sorted(found, key=lambda x: x[0])]


def _unrecorded_attempts(attempts: list[Attempt]) -> list[Attempt]:
    """SLURM attempt folders of the recorded jobs that the record has no start row for."""
    known = {(a.job_id, a.restart, a.step_restart) for a in attempts}
    extra = []
    for job_id, log_dir in dict.fromkeys((a.job_id, a.log_dir) for a in attempts if a.job_id and a.log_dir):
        folder = Path(log_dir) / job_id
        for d in folder.glob("attempt-*") if folder.is_dir() else []:
            if not d.name[len("attempt-"):].isdigit():
                continue
            restart = int(d.name[len("attempt-"):])
            steps = [(0, d)] + [(int(s.name[len("restart-"):]), s) for s in d.glob("restart-*")
                                if s.name[len("restart-"):].isdigit()]
            for k, s in steps:
                if (job_id, restart, k) in known:
                    continue
                times = [p.stat().st_mtime for p in s.iterdir() if p.is_file()] or [s.stat().st_mtime]
                extra.append(Attempt(number=0, recorded=False, started=min(times), job_id=job_id, restart=restart,
                                     step_restart=k, log_dir=log_dir))
    return extra


def checkpoint_status(ckpt_path: Path) -> dict:
    """The committed checkpoints of ``ckpt_path``: the newest, whether its files match its manifest, the newest
    intact one when it does not, and the folders of saves not committed (one in progress, or cut short)."""
    steps = committed_steps(ckpt_path)
    out = {"path": str(ckpt_path), "exists": ckpt_path.is_dir(), "committed_steps": steps, "newest": None,
           "newest_intact_step": None,
           "unfinished": sorted(p.name for p in ckpt_path.glob(".tmp-global_step*")) if ckpt_path.is_dir() else []}
    for i, step in enumerate(reversed(steps)):
        folder = ckpt_path / f"global_step{step}"
        why = damage(folder)
        if i == 0:
            out["newest"] = {"step": step, "path": str(folder), "committed_at": (folder / COMMITTED).stat().st_mtime,
                             "verified": has_manifest(folder), "damage": why}
        if why is None:
            out["newest_intact_step"] = step
            break
    return out


# -- is it running ----------------------------------------------------------------------------------------------

def squeue_state(job_id: str, run: Callable = subprocess.run) -> tuple[str | None, str]:
    """The job's state as squeue reports it (GONE: squeue no longer knows it), or None with the reason why
    squeue could not tell.  A heterogeneous job has one line per component: RUNNING when any runs."""
    if shutil.which("squeue") is None:
        return None, "squeue is not installed here"
    try:
        proc = run(["squeue", "-h", "-j", job_id, "-o", "%T"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError) as e:
        return None, f"squeue failed: {e}"
    if proc.returncode != 0:
        err = (proc.stderr or "").strip()
        if "Invalid job id" in err:
            return "GONE", "squeue: no such job (ended)"
        return None, f"squeue failed: {err.splitlines()[0] if err else f'exit code {proc.returncode}'}"
    states = proc.stdout.split()
    if not states:
        return "GONE", "squeue: not in the queue"
    return next((s for s in states if s in RUNNING_STATES), states[0]), f"squeue: {states[0]}"


def process_alive(pid: int, pid_start: int | None) -> bool | None:
    """Whether the process ``pid`` of this host is the one recorded (same start time); None without /proc."""
    if not Path("/proc/self/stat").exists():
        return None
    ticks = process_start_ticks(pid)
    return ticks is not None and (pid_start is None or ticks == pid_start)


def liveness(last: Attempt, squeue: Callable[[str], tuple[str | None, str]], hostname: str) -> dict:
    """{"running": True / False / None (cannot tell), "queue_state": squeue's state or None, "how": why}."""
    if last.job_id:
        state, note = squeue(last.job_id)
        if state is None:
            return {"running": None, "queue_state": None, "how": f"SLURM job {last.job_id}: {note}"}
        running = state in RUNNING_STATES
        text = "no longer in the queue" if state == "GONE" else f"{state} (squeue)"
        return {"running": running, "queue_state": state, "how": f"SLURM job {last.job_id}: {text}"}
    if last.ended is not None:
        return {"running": False, "queue_state": None, "how": "the last attempt recorded its end"}
    if last.pid and last.host == hostname:
        alive = process_alive(last.pid, last.pid_start)
        if alive is not None:
            return {"running": alive, "queue_state": None,
                    "how": f"process {last.pid} on this host {'runs' if alive else 'is gone'}"}
    where = f"pid {last.pid} on {last.host}" if last.host else "unknown host"
    return {"running": None, "queue_state": None,
            "how": f"no SLURM job id, and the process ({where}) is not on this host"}


# -- putting it together ----------------------------------------------------------------------------------------

def _ckpt_option(config: Path, key: str) -> str | None:
    """``ckpt.KEY`` of a run's config file (a checkpoint's config.yaml, an export's hpc_rlhf_config.yaml)."""
    try:
        return (yaml.safe_load(config.read_text()) or {}).get("ckpt", {}).get(key)
    except (OSError, yaml.YAMLError, AttributeError):
        return None


def _holds_run(d: Path) -> bool:
    return (d / ATTEMPTS).is_file() or (d / METRICS).is_file()


def find_run_dir(path: str | Path) -> Path:
    """The save_path of the run that ``path`` names (module docstring); StatusError when there is none."""
    root = Path(path).expanduser()
    if not root.is_dir():
        raise StatusError(f"{path}: no such folder")
    if _holds_run(root):
        return root
    for config in [*sorted(root.glob("global_step*/" + CONFIG), reverse=True), root / EXPORTED_CONFIG]:
        save = _ckpt_option(config, "save_path")
        if save and _holds_run(Path(save)):
            return Path(save)
    inside = sorted(d for d in root.iterdir() if d.is_dir() and _holds_run(d))
    if len(inside) == 1:
        return inside[0]
    if inside:
        raise StatusError(f"{path} holds several runs; name one: {', '.join(str(d) for d in inside)}")
    raise StatusError(f"{path}: no {ATTEMPTS} or {METRICS} here (RUN_DIR is the run's ckpt.save_path)")


def _speed(attempts: list[Attempt], rows: list[dict], rows_time: float | None) -> tuple[float | None, str]:
    """Seconds per step, and how it was measured: the wall clock of the newest attempt that did steps (from its
    loop's start to its end, or to the last metrics row while it runs: checkpoints and evals included), else
    the mean step time metric of the last logged rows."""
    last_row = rows[-1]["step"] if rows and isinstance(rows[-1].get("step"), int) else None
    for i in reversed(range(len(attempts))):
        a = attempts[i]
        next_start = attempts[i + 1].started if i + 1 < len(attempts) else None
        if a.loop_started is None or a.start_step is None:
            continue
        if a.ended is not None and a.end_step is not None:
            n, span, until = a.end_step - a.start_step, a.ended - a.loop_started, a.end_step
        elif a.ended is None and last_row is not None and rows_time is not None and rows_time >= a.loop_started \
                and (next_start is None or rows_time <= next_start):  # the last row is this attempt's
            n, span, until = last_row - a.start_step, rows_time - a.loop_started, last_row
        else:
            continue
        if n > 0 and span > 0:
            return span / n, f"wall clock of attempt {a.number}: steps {a.start_step}-{until} in {_duration(span)}"
    for key in STEP_TIME_KEYS:
        values = [r[key] for r in rows[-20:] if isinstance(r.get(key), (int, float)) and math.isfinite(r[key])]
        if values:
            return sum(values) / len(values), f"mean {key} of the last {len(values)} logged rows"
    return None, "no step timed yet"


def run_status(path: str | Path, ckpt_path: str | Path | None = None,
               squeue: Callable[[str], tuple[str | None, str]] = squeue_state, now: float | None = None,
               hostname: str | None = None) -> dict:
    """Everything `hpc-rlhf status` says about the run at ``path`` (module docstring), JSON-ready."""
    now = time.time() if now is None else now
    run_dir = find_run_dir(path)
    record = run_dir / ATTEMPTS
    attempts, bad_record = read_attempts(record) if record.is_file() else ([], 0)
    recorded = list(attempts)
    attempts = sorted(attempts + _unrecorded_attempts(attempts), key=lambda a: (a.started or 0))
    for i, a in enumerate(attempts, 1):
        a.number = i
        if a.job_id and a.log_dir and a.restart is not None:
            a.log_errors = attempt_log_errors(Path(a.log_dir), a.job_id, a.restart, a.step_restart)
            a.log_error = a.log_errors[-1] if a.log_errors else None
    rows, bad_rows = read_rows(run_dir / METRICS)
    rows_time = (run_dir / METRICS).stat().st_mtime if rows else None

    last = attempts[-1] if attempts else None
    total = next((a.total_steps for a in reversed(recorded) if a.total_steps is not None), None)
    trainer = next((a.trainer for a in reversed(recorded) if a.trainer), None)
    ckpt = ckpt_path or next((a.ckpt_path for a in reversed(recorded) if a.ckpt_path), None) \
        or _ckpt_option(run_dir / EXPORTED_CONFIG, "ckpt_path")
    checkpoint = checkpoint_status(Path(ckpt)) if ckpt else None

    steps = [rows[-1]["step"] if rows and isinstance(rows[-1].get("step"), int) else None]
    if checkpoint and checkpoint["newest"]:
        steps.append(checkpoint["newest"]["step"])
    if last is not None and last.recorded:
        steps.append(last.end_step)
    known = [s for s in steps if s is not None]
    last_step = max(known) if known else None

    live = (liveness(last, squeue, hostname or socket.gethostname()) if last is not None
            else {"running": None, "queue_state": None, "how": "no attempt recorded"})
    state = _state(last, live) if last is not None or not rows else "unknown"
    per_step, per_step_from = _speed(recorded, rows, rows_time)
    remaining = max(0, total - last_step) if total is not None and last_step is not None else None
    left_s = remaining * per_step if remaining is not None and per_step is not None else None
    eta = None
    if live["running"] and left_s is not None:
        eta = max(0.0, (rows_time or now) + left_s - now)
    errors = (last.log_errors or []) if last is not None else []  # earlier attempts': in their own entries
    notes = []
    if bad_record:
        notes.append(f"{bad_record} line(s) of {record} could not be read")
    if bad_rows:
        notes.append(f"{bad_rows} line(s) of {run_dir / METRICS} could not be read")
    if not record.is_file():
        notes.append(f"no {ATTEMPTS}: a run of an older version; job, attempts and state are unknown")
    if ckpt is None:
        notes.append("ckpt_path unknown (no attempt record, no exported config): pass --ckpt-path")
    if live["running"] and per_step is not None and rows_time is not None and now - rows_time > max(600, 10 * per_step):
        notes.append(f"no metrics row for {_duration(now - rows_time)} (about {per_step:.3g} s/step): hung?")
    return {"run_dir": str(run_dir), "trainer": trainer, "state": state, "running": live["running"],
            "queue_state": live["queue_state"], "running_how": live["how"],
            "job_id": last.job_id if last else None, "last_step": last_step, "total_steps": total,
            "last_row_time": rows_time, "now": now, "checkpoint": checkpoint,
            "time_per_step_s": per_step, "time_per_step_from": per_step_from,
            "remaining_steps": remaining, "remaining_compute_s": left_s, "eta_s": eta,
            "attempts": [dict(asdict(a), end_step=a.end_step, exit=_exit(a, a is last, live)) for a in attempts],
            "log_errors": errors, "notes": notes}


def _state(last: Attempt | None, live: dict) -> str:
    """One word for where the run stands: running, queued, finished, stopped, failed, died, unknown, or
    not started."""
    if last is None:
        return "not started"
    if last.reason == "finished":
        return "finished"
    if live["running"]:
        return "running"
    if live["queue_state"] and live["queue_state"] not in FINAL_STATES:
        return "queued"
    if last.reason == "stopped":
        return "stopped"
    if last.reason == "error" or not last.recorded:
        return "failed"
    return "died" if live["running"] is False else "unknown"


def _exit(a: Attempt, is_last: bool, live: dict) -> str:
    """How one attempt ended, in words."""
    if not a.recorded:
        if is_last and live["running"]:
            return "starting (no start recorded yet)"
        return "died before its start was recorded" + (f": {a.log_error['line']}" if a.log_error else "")
    if a.reason == "finished":
        return "finished"
    if a.reason == "stopped":
        who = f"SIG{a.signal}" if a.signal else "a signal (on another rank)"
        return (f"stopped by {who} after step {a.step} (checkpoint written)"
                + ("; rank 0 requeued the job" if a.requeue else ""))
    if a.reason == "error":
        return f"error: {a.error}"
    if is_last and live["running"] is not False:
        return "running" if live["running"] else "no end recorded (still running, or killed)"
    hint = f"; last error in the logs: {a.log_error['line']}" if a.log_error else ""
    return "ended without a record (killed: SIGKILL, out of memory, node failure?)" + hint


# -- the text block ---------------------------------------------------------------------------------------------

def _duration(s: float) -> str:
    s = max(0.0, s)
    if s < 60:
        return f"{s:.1f}s" if s < 10 else f"{s:.0f}s"
    m, sec = divmod(int(round(s)), 60)
    if m < 60:
        return f"{m}m{sec:02d}s"
    h, m = divmod(m, 60)
    return f"{h}h{m:02d}m" if h < 48 else f"{h // 24}d{h % 24:02d}h"


def _clock(t: float | None, now: float) -> str:
    if t is None:
        return "?"
    fmt = "%H:%M:%S" if time.strftime("%Y-%m-%d", time.localtime(t)) == time.strftime("%Y-%m-%d",
                                                                                       time.localtime(now)) \
        else "%Y-%m-%d %H:%M"
    return time.strftime(fmt, time.localtime(t))


def _where(a: dict) -> str:
    if a["job_id"]:
        array = f" ({a['array_job_id']}_{a['array_task_id']})" if a["array_task_id"] else ""
        again = f" (new step {a['step_restart']} in the allocation)" if a.get("step_restart") else ""
        return f"job {a['job_id']}{array} restart {a['restart']}{again}" + (f" on {a['host']}" if a["host"] else "")
    return f"pid {a['pid']} on {a['host']}" if a["pid"] else "?"


def render(st: dict) -> str:
    """The text block of ``hpc-rlhf status``."""
    now = st["now"]
    lines = []

    def put(label: str, text: str) -> None:
        lines.append(f"{label:<11} {text}")
    put("run", st["run_dir"] + (f"  ({st['trainer']})" if st["trainer"] else ""))
    state = st["state"]
    put("state", f"{state.upper()}  ({st['running_how']})" if state in ("running", "queued") else
        f"{state}  (running: {'yes' if st['running'] else 'no' if st['running'] is False else 'cannot tell'}; "
        f"{st['running_how']})")
    total, last = st["total_steps"], st["last_step"]
    if last is None:
        progress = "no step logged yet" + (f" of {total}" if total else "")
    else:
        progress = f"step {last} of {total} ({100 * last / total:.0f}%)" if total else f"step {last} of ?"
    if st["last_row_time"] is not None:
        progress += f"; last metrics row at {_clock(st['last_row_time'], now)} " \
                    f"({_duration(now - st['last_row_time'])} ago)"
    put("progress", progress)
    if st["time_per_step_s"] is not None:
        speed = f"{st['time_per_step_s']:.3g} s/step ({st['time_per_step_from']})"
        if st["eta_s"]:
            speed += f"; ETA {_duration(st['eta_s'])} (about {_clock(now + st['eta_s'], now)})"
        elif st["eta_s"] == 0 and st["remaining_steps"]:
            speed += f"; {st['remaining_steps']} steps left: at this speed they would be done by now"
        elif st["remaining_compute_s"] and state not in ("finished",):
            speed += f"; {st['remaining_steps']} steps left, about {_duration(st['remaining_compute_s'])} of running"
        put("speed", speed)
    else:
        put("speed", st["time_per_step_from"])
    ck = st["checkpoint"]
    if ck is None:
        put("checkpoint", "unknown ckpt_path")
    elif ck["newest"] is None:
        put("checkpoint", f"none committed in {ck['path']}" + ("" if ck["exists"] else " (no such folder)"))
    else:
        n = ck["newest"]
        check = ("manifest intact" if n["verified"] else "no manifest: not verified") if n["damage"] is None else \
            f"DAMAGED: {n['damage']}; newest intact: " + (f"global_step{ck['newest_intact_step']}"
                                                           if ck["newest_intact_step"] else "none")
        kept = len(ck["committed_steps"])
        put("checkpoint", f"global_step{n['step']} committed at {_clock(n['committed_at'], now)}, {check}; "
                          f"{kept} kept in {ck['path']}")
    if ck and ck["unfinished"]:
        put("", f"uncommitted: {', '.join(ck['unfinished'])} (a save in progress, or cut short)")
    put("job", f"SLURM job {st['job_id']}" if st["job_id"] else "no SLURM job recorded (a local run)")
    put("attempts", str(len(st["attempts"])) if st["attempts"] else "none recorded")
    for a in st["attempts"]:
        ended = a["ended"] if a["ended"] is not None else (now if a is st["attempts"][-1] and st["running"] else None)
        span = f"{_clock(a['started'], now)} +{_duration(ended - a['started'])}" if ended and a["started"] \
            else _clock(a["started"], now)
        end = a["end_step"]
        if end is None and a is st["attempts"][-1] and st["running"]:
            end = st["last_step"]
        steps = f"steps {a['start_step']}->{end if end is not None else '?'}" if a["start_step"] is not None \
            else "no step loop"
        lines.append(f"  #{a['number']:<2} {_where(a):<34} {span:<20} {steps:<15} {a['exit']}")
    for e in st["log_errors"][-3:]:
        put("log error", f"{Path(e['file']).name}: {e['line']}")
    for note in st["notes"]:
        put("note", note)
    return "\n".join(lines) + "\n"
