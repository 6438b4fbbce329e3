"""Local launcher: start N copies of the same command on this machine, as SLURM would start N tasks.

Each child gets RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT and runs exactly the code path
it runs under srun, except that the launcher, not global rank 0, hosts the job's TCPStore: it outlives
every rank, so the launcher reads there which rank brought the job down (``distributed.watchdog``).

- When a rank fails, the launcher prints the culprit: the verdict a rank published, else the rank it saw
  fail first (it publishes that as the verdict, and the ranks repeat it).  It lets the ranks end on their
  own for ``settle_s``, kills the culprit if it is still there (hung, or stopped), stops the others (TERM,
  then KILL after ``grace_s``), and exits with the culprit's exit code: its own code, 128+N when signal N
  killed it, or, when the culprit hung, the code of the first rank to fail (1: a watchdog's verdict).
- TERM, USR1 and USR2 sent to the launcher are passed on to every child (they stop at the next step
  boundary after a checkpoint and exit with code 3, like under SLURM); the launcher then exits with code 3.
- The ranks die with the launcher, even a SIGKILLed one (Linux): each child asks the kernel for SIGKILL
  when the thread that started it ends, and that thread supervises the ranks until they have all exited.
"""
from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import threading
import time

import torch.distributed as dist

from ..distributed.env import LAUNCHER_STORE
from ..distributed.preemption import EXIT_STOPPED
from ..distributed.rendezvous import in_slurm_step
from ..distributed.watchdog import publish_verdict

SETTLE_S = 5.0  # after a failure, how long the ranks may take to read the verdict and exit on their own
_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def already_launched() -> bool:
    """True when this process is one rank of a launched group (ours, torchrun's or an srun step's)."""
    return "RANK" in os.environ or in_slurm_step()


def launch_local(argv: list[str], nproc: int, grace_s: float = 10.0, describe=None) -> int:
    """Run ``python -m hpc_rlhf.cli *argv`` as ``nproc`` ranks; return the job's exit code."""
    return run_ranks([sys.executable, "-m", "hpc_rlhf.cli", *argv], nproc, grace_s, describe)


def run_ranks(cmd: list[str], nproc: int, grace_s: float = 10.0, describe=None, settle_s: float = SETTLE_S) -> int:
    """Run ``cmd`` as ``nproc`` ranks (``describe(rank)``, when given, names a rank's roles); return the
    job's exit code (module docstring)."""
    store = dist.TCPStore("127.0.0.1", 0, nproc, True, wait_for_workers=False)
    # Like torchrun: share the cores between the ranks unless told otherwise (oversubscribed OpenMP
    # threads spin against each other and slow every rank down many times over).
    threads = os.environ.get("OMP_NUM_THREADS") or str(max(1, (os.cpu_count() or 1) // nproc))
    env = dict(os.environ, WORLD_SIZE=str(nproc), LOCAL_WORLD_SIZE=str(nproc), MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(store.port), OMP_NUM_THREADS=threads)
    env[LAUNCHER_STORE] = f"127.0.0.1:{store.port}"
    arm = _die_with_launcher(os.getpid()) if sys.platform == "linux" else None
    procs = [subprocess.Popen(cmd, env=dict(env, RANK=str(rank), LOCAL_RANK=str(rank)), preexec_fn=arm)
             for rank in range(nproc)]

    def forward(signum, frame):
        for p in procs:
            if p.poll() is None:
                p.send_signal(signum)
    main_thread = threading.current_thread() is threading.main_thread()  # only it may set handlers
    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2)
                if main_thread}
    try:
        return _supervise(procs, store, grace_s, settle_s,
                          lambda r: f"rank {r}" + (f" ({describe(r)})" if describe else ""))
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _die_with_launcher(launcher_pid: int):
    """A preexec_fn (it runs in the child between fork and exec): the kernel sends the child SIGKILL when
    the thread that forked it ends.  prctl is looked up here, before any fork."""
    prctl = ctypes.CDLL(None, use_errno=True).prctl

    def arm() -> None:
        prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL))
        if os.getppid() != launcher_pid:  # the launcher died before the prctl
            os._exit(1)
    return arm


def _supervise(procs: list[subprocess.Popen], store: dist.TCPStore, grace_s: float, settle_s: float, name) -> int:
    try:
        while True:
            codes = [p.poll() for p in procs]
            failed = [r for r, c in enumerate(codes) if c not in (None, 0)]
            if failed:
                break
            if all(c == 0 for c in codes):
                return 0
            time.sleep(0.2)
    except KeyboardInterrupt:
        _stop(procs, grace_s)
        return 130
    first = failed[0]
    code = procs[first].returncode
    if code == EXIT_STOPPED:  # a stop every rank agreed on: the others are on their way out too
        _wait(procs, grace_s)
        print("hpc-rlhf launcher: the ranks stopped on a signal after writing a checkpoint (exit code 3)",
              file=sys.stderr, flush=True)
        _stop(procs, grace_s)
        return code
    # a rank that failed on its own, or whose watchdog found a dead peer, published the verdict before
    # exiting; a rank killed by a signal could not: the launcher's finding becomes the verdict
    culprit, why = publish_verdict(store, first, f"{name(first)} {_how_it_ended(code)}")
    print(f"hpc-rlhf launcher: {why}; stopping the other ranks", file=sys.stderr, flush=True)
    _wait(procs, settle_s)
    hung = procs[culprit].poll() is None
    if hung:
        procs[culprit].kill()
    _stop(procs, grace_s)
    own = procs[culprit].returncode
    return _exit_code(code if hung or own == 0 else own)


def _exit_code(returncode: int) -> int:
    """A child's return code as a shell reports it: 128+N for a child killed by signal N."""
    return 128 - returncode if returncode < 0 else returncode


def _how_it_ended(code: int) -> str:
    if code > 0:
        return f"exited with code {code}"
    try:
        return f"was killed by {signal.Signals(-code).name}"
    except ValueError:
        return f"was killed by signal {-code}"


def _wait(procs: list[subprocess.Popen], timeout_s: float) -> None:
    deadline = time.time() + timeout_s
    while time.time() < deadline and any(p.poll() is None for p in procs):
        time.sleep(0.1)


def _stop(procs: list[subprocess.Popen], grace_s: float) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.time() + grace_s
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.time()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
