"""The watchdog without the local launcher (as under srun: global rank 0 hosts the store): when rank 0 dies,
every other rank says so in one line, without the C++ stack trace torch logs for a store call on a closed
connection."""
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

ROLES_JOB = Path(__file__).resolve().parents[1] / "support" / "roles_job.py"
REPO = Path(__file__).resolve().parents[2]


def _start_ranks(tmp_path: Path, scenario: str) -> list[subprocess.Popen]:
    """Three ranks of tests/support/roles_job.py SCENARIO started as srun starts them; returns once each has
    written its marker."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, WORLD_SIZE="3", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
               PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    procs = [subprocess.Popen([sys.executable, str(ROLES_JOB), scenario, str(tmp_path)], env=dict(env, RANK=str(r)),
                              stderr=subprocess.PIPE, text=True) for r in range(3)]
    deadline = time.time() + 90
    while not all((tmp_path / f"rank-{r}").is_file() for r in range(3)):
        if any(p.poll() is not None for p in procs) or time.time() > deadline:
            for p in procs:
                p.kill()
            raise AssertionError(f"the ranks did not start: {[p.communicate()[1][-2000:] for p in procs]}")
        time.sleep(0.1)
    return procs


def test_dead_store_host_is_named_in_one_line(tmp_path):
    procs = _start_ranks(tmp_path, "barriers")
    try:
        procs[0].kill()
        errs = {r: procs[r].communicate(timeout=60)[1] for r in (1, 2)}
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for r, roles in ((1, "reward"), (2, "rollout")):
        assert procs[r].returncode == 1
        assert errs[r].splitlines() == [
            f"hpc-rlhf: rank {r} (roles {roles}) stops the job: the rendezvous store on global rank 0 (roles actor) "
            "stopped answering (ConnectionError); rank 0 has most likely died"], errs[r][-3000:]


def test_a_stop_signal_shortens_the_wait_even_while_the_ranks_wait_inside_gloo(tmp_path):
    """srun's ending of a step whose rank died: the survivors get SIGTERM, then SIGKILL KillWait seconds later
    (5 s on small clusters).  Ranks 0 and 1 wait inside a gloo receive (the Python signal handler cannot run
    there), peers count as dead after 60 s: rank 2 is killed, the others get SIGTERM, and each still names rank
    2 within a few heartbeats, before a KillWait would end it unnamed."""
    procs = _start_ranks(tmp_path, "stuck")
    try:
        time.sleep(1.5)  # ranks 0 and 1 are inside their receive
        procs[2].kill()
        t0 = time.time()
        for r in (0, 1):
            procs[r].send_signal(signal.SIGTERM)
        while procs[1].poll() is None and time.time() < t0 + 90:  # rank 1 does not host the store: no lingering
            time.sleep(0.05)
        took = time.time() - t0
        errs = {r: procs[r].communicate(timeout=90)[1] for r in (0, 1)}
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for r, roles in ((0, "actor"), (1, "reward")):
        assert procs[r].returncode == 1, errs[r][-3000:]
        assert f"hpc-rlhf: rank {r} (roles {roles}) stops the job: no heartbeat from rank 2 (roles rollout" \
            in errs[r], errs[r][-3000:]
    print(f"rank 1 named rank 2 and exited {took:.1f} s after the kill")
    assert took < 5, took  # three heartbeats of silence (3 s), checked every second; 60 s without the signal
