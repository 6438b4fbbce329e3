"""What the ranks of an srun step leave for the job's step runner (`launch/steps.py`), in the folder
``$HPC_RLHF_STEP_DIR`` the runner gives each step (nothing is written without it):

- ``ranks/R.host``: global rank R started on this node (SLURM's node name);
- ``ranks/R.exit``: the exit code rank R's own code chose (2 a user error, 3 stopped on a signal after a
  checkpoint, 1 any other failure); a rank killed outright (SIGKILL, a node lost) leaves none;
- ``verdict``: ``RANK HOST WHY``, the rank that brought the step down, as the watchdogs agreed on it
  (`distributed/watchdog.py`).

The first write of a file stands (``O_EXCL``), so a rank's first word is the one read.  A failed write is
ignored: the runner then knows less, and says so.  This module imports nothing that imports torch.
"""
from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field
from pathlib import Path

STEP_DIR = "HPC_RLHF_STEP_DIR"        # the step's folder, set by the step runner
STEP_RESTART = "HPC_RLHF_STEP_RESTART"  # 0 for the job's first step, k for its k-th restart inside the allocation
VERDICT = "verdict"


def step_restart(env=None) -> int:
    env = os.environ if env is None else env
    return int(env.get(STEP_RESTART, "0") or 0)


def node_name(env=None) -> str:
    env = os.environ if env is None else env
    return env.get("SLURMD_NODENAME") or socket.gethostname()


def _write_once(path: Path, text: str) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    except OSError:  # written already, or no folder to write in
        return
    with os.fdopen(fd, "w") as f:
        f.write(text)


def _folder(env=None) -> Path | None:
    env = os.environ if env is None else env
    return Path(env[STEP_DIR]) if env.get(STEP_DIR) else None


def _rank(env) -> str | None:
    """The global rank: SLURM's task id in the step (RANK is rewritten when a rank joins its role's world)."""
    return env.get("SLURM_PROCID") or env.get("RANK")


def note_start(env=None) -> None:
    env = os.environ if env is None else env
    folder, rank = _folder(env), _rank(env)
    if folder is not None and rank is not None:
        _write_once(folder / "ranks" / f"{rank}.host", node_name(env))


def note_exit(code: int, env=None) -> None:
    env = os.environ if env is None else env
    folder, rank = _folder(env), _rank(env)
    if folder is not None and rank is not None:
        _write_once(folder / "ranks" / f"{rank}.exit", str(int(code)))


def note_verdict(culprit: int, host: str, why: str, env=None) -> None:
    folder = _folder(env)
    if folder is not None:
        _write_once(folder / VERDICT, f"{culprit} {host} {why}")


@dataclass
class StepRecord:
    hosts: dict[int, str] = field(default_factory=dict)   # rank -> node, for every rank that started
    exits: dict[int, int] = field(default_factory=dict)   # rank -> exit code its own code chose
    verdict: tuple[int, str, str] | None = None           # (culprit rank, its node, why)

    @property
    def killed(self) -> list[int]:
        """Ranks that started and left no exit code: killed outright."""
        return sorted(set(self.hosts) - set(self.exits))


def read(folder: str | Path) -> StepRecord:
    folder, rec = Path(folder), StepRecord()
    for f in sorted((folder / "ranks").glob("*.*")) if (folder / "ranks").is_dir() else []:
        rank, kind = f.stem, f.suffix
        try:
            text = f.read_text().strip()
            if kind == ".host":
                rec.hosts[int(rank)] = text
            elif kind == ".exit":
                rec.exits[int(rank)] = int(text)
        except (OSError, ValueError):
            continue
    try:
        culprit, host, why = (folder / VERDICT).read_text().split(" ", 2)
        rec.verdict = (int(culprit), host, why.strip())
    except (OSError, ValueError):
        pass
    return rec
