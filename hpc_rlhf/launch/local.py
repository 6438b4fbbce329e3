"""Local launcher: start N copies of the same command on this machine, as SLURM would start N tasks.

Each child gets RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT and runs exactly the code
path it runs under srun.  If one child fails, the others are stopped and the launcher exits with
the failing child's code, naming its rank.  TERM, USR1 and USR2 sent to the launcher are passed on to
every child (they stop at the next step boundary after a checkpoint and exit with code 3, like
under SLURM); the launcher then exits with code 3 too.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

from ..distributed.env import free_port
from ..distributed.preemption import EXIT_STOPPED
from ..distributed.rendezvous import in_slurm_step


def already_launched() -> bool:
    """True when this process is one rank of a launched group (ours, torchrun's or an srun step's)."""
    return "RANK" in os.environ or in_slurm_step()


def launch_local(argv: list[str], nproc: int, grace_s: float = 10.0, describe=None) -> int:
    """Run ``python -m hpc_rlhf.cli *argv`` as ``nproc`` ranks; return the first non-zero exit code."""
    port = free_port()
    procs: list[subprocess.Popen] = []
    # Like torchrun: share the cores between the ranks unless told otherwise (oversubscribed OpenMP
    # threads spin against each other and slow every rank down many times over).
    threads = os.environ.get("OMP_NUM_THREADS") or str(max(1, (os.cpu_count() or 1) // nproc))
    for rank in range(nproc):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(nproc), LOCAL_RANK=str(rank),
                   LOCAL_WORLD_SIZE=str(nproc), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   OMP_NUM_THREADS=threads)
        procs.append(subprocess.Popen([sys.executable, "-m", "hpc_rlhf.cli", *argv], env=env))

    def forward(signum, frame):
        for p in procs:
            if p.poll() is None:
                p.send_signal(signum)
    main_thread = threading.current_thread() is threading.main_thread()  # only it may set handlers
    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2)
                if main_thread}
    try:
        return _supervise(procs, grace_s, describe)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _supervise(procs: list[subprocess.Popen], grace_s: float, describe) -> int:
    failed: tuple[int, int] | None = None
    try:
        while True:
            codes = [p.poll() for p in procs]
            bad = [(r, c) for r, c in enumerate(codes) if c not in (None, 0)]
            if bad:
                failed = bad[0]
                break
            if all(c == 0 for c in codes):
                return 0
            time.sleep(0.2)
    except KeyboardInterrupt:
        failed = (-1, 130)
    rank, code = failed
    if code == EXIT_STOPPED:  # a stop every rank agreed on: the others are on their way out too
        deadline = time.time() + grace_s
        while time.time() < deadline and any(p.poll() is None for p in procs):
            time.sleep(0.1)
        print("hpc-rlhf launcher: the ranks stopped on a signal after writing a checkpoint (exit code 3)",
              file=sys.stderr, flush=True)
    elif rank >= 0:
        what = f" ({describe(rank)})" if describe else ""
        print(f"hpc-rlhf launcher: rank {rank}{what} exited with code {code}; stopping the other ranks",
              file=sys.stderr, flush=True)
    _stop(procs, grace_s)
    return code


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
