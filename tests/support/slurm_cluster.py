"""pytest plugin: a real Slurm cluster on this machine, for the launch tests (no mocks).

Loaded by ``pytest_plugins`` in tests/conftest.py.  Fixtures:

``slurm_cluster`` (session)
    Runs scripts/slurm/start_cluster.sh once per session (it reuses a cluster that is already
    up) and yields a :class:`SlurmCluster`, whose environment gives the jobs one ``TORCH_EXTENSIONS_DIR``
    ($DIR/torch_extensions, unless the session sets one).  A cluster that a developer started stays up; one
    that a pytest session started is stopped when the last session using it ends (several
    sessions may share it), unless ``HPC_RLHF_SLURM_KEEP=1``.  When the cluster cannot start
    (not root, no apt, a daemon that dies) the test fails with the daemon logs in the message;
    it is never skipped.
``slurm_env`` (function)
    The same cluster, with ``os.environ`` pointed at it for the test (SLURM_CONF set, the
    SLURM_* variables of an enclosing job removed), for in-process clients such as submitit.

Needs root; the first start installs Debian's slurm, munge and mariadb packages.
"""
from __future__ import annotations

import contextlib
import fcntl
import os
import re
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import pytest

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts" / "slurm"
# job states after which nothing more happens (sacct prints "CANCELLED by 0": first word)
FINAL_STATES = {"BOOT_FAIL", "CANCELLED", "COMPLETED", "DEADLINE", "FAILED", "NODE_FAIL",
                "OUT_OF_MEMORY", "PREEMPTED", "REVOKED", "TIMEOUT"}


def _state_dir() -> Path:
    return Path(os.environ.get("HPC_RLHF_SLURM_DIR", "/tmp/hpc-rlhf-slurm"))


def _clean_environ() -> dict[str, str]:
    """os.environ without the SLURM_* variables of a job this process may run inside."""
    return {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SLURMD_"))}


def _log_tails(state_dir: Path, apt: bool = False, lines: int = 25) -> str:
    files = sorted(state_dir.glob("log/*.log")) + sorted(state_dir.glob("db/*.err"))
    if apt:
        files.append(Path(f"{state_dir}.apt.log"))
    out = []
    for f in files:
        try:
            text = f.read_text(errors="replace").splitlines()
        except OSError:
            continue
        if text:
            out.append(f"--- {f} (last {lines} lines)\n" + "\n".join(text[-lines:]))
    return "\n".join(out) or f"(no logs under {state_dir})"


@dataclass
class SlurmCluster:
    dir: Path
    conf: Path
    env: dict[str, str]                 # merge into a subprocess's environment
    nodes: list[str] = field(default_factory=list)
    started_here: bool = False          # this pytest session started it

    def environ(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        """A full environment for a subprocess that talks to this cluster."""
        return {**_clean_environ(), **self.env, **(extra or {})}

    def run(self, cmd: str | Sequence[str], *, timeout: float = 60, check: bool = True,
            env: dict[str, str] | None = None, **kw) -> subprocess.CompletedProcess:
        """Run a command (a string goes through bash) against the cluster; text output captured.

        With check=True a non-zero exit raises AssertionError showing stdout and stderr.
        """
        shell = isinstance(cmd, str)
        args = ["bash", "-c", cmd] if shell else [str(c) for c in cmd]
        if "stdout" not in kw and "stderr" not in kw:
            kw.setdefault("capture_output", True)
        proc = subprocess.run(args, env=self.environ(env), text=True, timeout=timeout, **kw)
        if check and proc.returncode != 0:
            raise AssertionError(f"{cmd!r} exited {proc.returncode}\n"
                                 f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}")
        return proc

    def sbatch(self, script: str | Path, *options: str, script_args: Sequence[str] = (),
               cwd: str | Path | None = None) -> str:
        """Submit a batch script (sbatch OPTIONS... SCRIPT SCRIPT_ARGS...); returns the job id.

        The job's working directory is the script's folder unless cwd is given.
        """
        script = Path(script)
        out = self.run(["sbatch", "--parsable", *options, script, *script_args],
                       cwd=cwd or script.parent).stdout
        return out.strip().split(";")[0]  # "<id>" or "<id>;<cluster>"

    def sacct(self, job_id: str | int, fields: Sequence[str] = ("JobID", "JobName", "State", "ExitCode",
                                                                "NodeList"),
              allocations_only: bool = False) -> list[dict[str, str]]:
        """Accounting rows of a job: one per het component (JobID 12+0, 12+1) and, unless
        allocations_only, one per step (12.batch, 12.0, ...)."""
        cmd = ["sacct", "-n", "-P", "-j", str(job_id), "-o", ",".join(fields)]
        if allocations_only:
            cmd.append("-X")
        lines = self.run(cmd).stdout.splitlines()
        return [dict(zip(fields, line.split("|"))) for line in lines if line]

    def wait_done(self, job_id: str | int, timeout: float = 60) -> str:
        """Wait until the job has ended; return its final state from sacct (e.g. COMPLETED,
        FAILED, CANCELLED).  For a het job the components' states, comma-joined if they differ."""
        deadline = time.monotonic() + timeout
        while True:
            # slurmctld knows at once (one line per het component; the record is kept for
            # MinJobAge = 10 min); sacct lags behind it, a het job's 2nd component included
            ctl = self.run(["scontrol", "-o", "show", "job", str(job_id)], check=False).stdout
            ctl_states = re.findall(r"\bJobState=(\S+)", ctl)
            if all(s in FINAL_STATES for s in ctl_states):
                rows = self.run(["sacct", "-X", "-n", "-P", "-j", str(job_id), "-o", "JobID,State"]).stdout.split("\n")
                # a job that lost a node under --no-kill has a RESIZING record before its last one: the last counts
                last = dict(r.split("|", 1) for r in rows if r.strip())
                states = [v.split()[0] for v in last.values()]
                if states and len(states) >= len(ctl_states) and all(s in FINAL_STATES for s in states):
                    return ",".join(dict.fromkeys(states))
            if time.monotonic() > deadline:
                raise TimeoutError(f"job {job_id} not done after {timeout}s:\n{ctl}")
            time.sleep(0.3)

    @staticmethod
    def wait_output(path: str | Path, text: str, timeout: float = 30) -> str:
        """Wait until file `path` contains `text`; return the file's content."""
        deadline, path, content = time.monotonic() + timeout, Path(path), ""
        while time.monotonic() < deadline:
            content = path.read_text() if path.exists() else ""
            if text in content:
                return content
            time.sleep(0.1)
        raise TimeoutError(f"{text!r} not in {path} after {timeout}s; it holds:\n{content}")


def pytest_configure(config):
    if not any(str(m).startswith("slurm:") for m in config.getini("markers")):
        config.addinivalue_line("markers", "slurm: runs against the local Slurm test cluster")


@contextlib.contextmanager
def _cluster_lock(state_dir: Path):
    """The lock that start_cluster.sh and stop_cluster.sh take: one start, stop or join at a time."""
    state_dir.parent.mkdir(parents=True, exist_ok=True)
    with open(f"{state_dir}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _live_sessions(sessions: Path) -> list[int]:
    """PIDs of the pytest sessions that use the cluster now (files of dead ones are removed)."""
    pids = []
    for f in sessions.glob("pid-*"):
        pid = int(f.name[4:])
        if Path(f"/proc/{pid}").exists():
            pids.append(pid)
        else:
            f.unlink(missing_ok=True)
    return pids


@pytest.fixture(scope="session")
def slurm_cluster():
    """The local Slurm cluster, started if it is not running.

    Sessions that use it register under $DIR/sessions.  A cluster that a pytest session
    started (flag file started-by-pytest) is stopped by the last session that leaves it; one
    started by hand (bash scripts/slurm/start_cluster.sh) is never stopped here.
    """
    state_dir = _state_dir()
    sessions, me = state_dir / "sessions", f"pid-{os.getpid()}"
    with _cluster_lock(state_dir):
        try:
            proc = subprocess.run(["bash", str(SCRIPTS / "start_cluster.sh")], capture_output=True, text=True,
                                  env={**_clean_environ(), "HPC_RLHF_SLURM_LOCKED": "1"}, timeout=900)
            failed = proc.returncode != 0
            said = [line for line in proc.stderr.splitlines() if line.startswith("[hpc-rlhf-slurm]")]
            report = "\n".join([f"exit code {proc.returncode}", proc.stdout, *said])
        except (OSError, subprocess.TimeoutExpired) as exc:
            proc, failed, report = None, True, repr(exc)
        if failed:
            pytest.fail(f"the Slurm test cluster did not start (scripts/slurm/start_cluster.sh): {report}\n"
                        f"daemon logs:\n{_log_tails(state_dir, apt='apt-get' in report)}", pytrace=False)
        started = "already running" not in proc.stdout
        sessions.mkdir(exist_ok=True)
        (sessions / me).touch()
        if started:
            (sessions / "started-by-pytest").touch()

    env = dict(re.findall(r"^export (\w+)=(.*)$", (state_dir / "env.sh").read_text(), re.M))
    # one folder of torch extensions for every job of the cluster (the lean engine's few-row kernel takes 40-100 s
    # to build here), as a site keeps a build for its jobs (docs/hpc.md); unset, each job would build its own in
    # its scratch folder (hpc_rlhf/distributed/scratch.py)
    if "TORCH_EXTENSIONS_DIR" not in os.environ:
        env["TORCH_EXTENSIONS_DIR"] = str(state_dir / "torch_extensions")
    cluster = SlurmCluster(dir=state_dir, conf=Path(env["SLURM_CONF"]), env=env, started_here=started)
    listed = cluster.run(["sinfo", "-h", "-N", "-p", "debug", "-o", "%N"]).stdout.split()
    cluster.nodes = sorted(set(listed), key=lambda n: int(re.sub(r"\D", "", n) or 0))
    try:
        yield cluster
    finally:
        with _cluster_lock(state_dir):
            (sessions / me).unlink(missing_ok=True)
            flag = sessions / "started-by-pytest"
            if flag.exists() and not _live_sessions(sessions):
                flag.unlink()
                if os.environ.get("HPC_RLHF_SLURM_KEEP") != "1":
                    subprocess.run(["bash", str(SCRIPTS / "stop_cluster.sh")], capture_output=True,
                                   env={**_clean_environ(), "HPC_RLHF_SLURM_LOCKED": "1"}, timeout=300)


@pytest.fixture
def slurm_env(slurm_cluster, monkeypatch):
    for key in list(os.environ):
        if key.startswith(("SLURM_", "SLURMD_")):
            monkeypatch.delenv(key)
    for key, value in slurm_cluster.env.items():
        monkeypatch.setenv(key, value)
    return slurm_cluster
