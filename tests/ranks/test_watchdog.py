"""The watchdog without the local launcher (as under srun: global rank 0 hosts the store): when rank 0 dies,
every other rank says so in one line, without the C++ stack trace torch logs for a store call on a closed
connection."""
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

ROLES_JOB = Path(__file__).resolve().parents[1] / "support" / "roles_job.py"
REPO = Path(__file__).resolve().parents[2]


def test_dead_store_host_is_named_in_one_line(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, WORLD_SIZE="3", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
               PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    procs = [subprocess.Popen([sys.executable, str(ROLES_JOB), "barriers", str(tmp_path)], env=dict(env, RANK=str(r)),
                              stderr=subprocess.PIPE, text=True) for r in range(3)]
    try:
        deadline = time.time() + 90
        while not all((tmp_path / f"rank-{r}").is_file() for r in range(3)):
            assert all(p.poll() is None for p in procs), [p.communicate()[1][-2000:] for p in procs if p.poll()]
            assert time.time() < deadline, "the ranks did not start"
            time.sleep(0.1)
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
