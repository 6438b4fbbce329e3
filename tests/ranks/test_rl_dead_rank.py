"""A rank that dies mid-run takes every other rank down within 60 s, each naming the dead role and rank; a
rank's own error ends the job at once.

The ranks of the first test are started as plain processes with the rendezvous in their environment, as srun
starts them, so nothing but the job's own watchdog notices the death.
"""
from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time

import pytest
import yaml

from rl_fixtures import make_assets, merged, start_rl

pytestmark = pytest.mark.slow  # about 26 s and 20 s: the default suite stays under 12 minutes


def test_killed_rollout_rank_stops_every_rank(tmp_path):
    cfg = merged(make_assets(tmp_path), train={"max_steps": 1000},
                 placement={"colocate_critic_reward": True, "dead_rank_timeout_s": 10},
                 ckpt={"save_path": str(tmp_path / "out"), "ckpt_path": str(tmp_path / "ck")})
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cfg))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    world = 3  # actor, reward, rollout
    procs = []
    for rank in range(world):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), OMP_NUM_THREADS="1")
        procs.append(subprocess.Popen([sys.executable, "-m", "hpc_rlhf.cli", "train", "rl", "--config", str(path)],
                                      env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True))
    try:
        metrics = tmp_path / "out" / "metrics.jsonl"
        deadline = time.time() + 180
        while not (metrics.is_file() and len(metrics.read_text().splitlines()) >= 2):
            assert all(p.poll() is None for p in procs), [p.communicate()[1][-2000:] for p in procs]
            assert time.time() < deadline, "training did not start"
            time.sleep(0.2)
        killed = time.time()
        os.kill(procs[2].pid, signal.SIGKILL)
        errs = {}
        for r in (0, 1):
            errs[r] = procs[r].communicate(timeout=90)[1]
            assert procs[r].returncode != 0, f"rank {r} exited 0 after its peer died"
        elapsed = time.time() - killed
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    print(f"all ranks exited {elapsed:.1f} s after the kill")
    assert elapsed < 60, elapsed
    for err in errs.values():
        assert "rank 2 (roles rollout" in err, err[-3000:]


def test_empty_prompt_file_on_three_ranks_ends_the_job_at_once(tmp_path):
    """Every rank fails on its own (an empty prompt file): the launcher exits with code 2 once they have
    started, naming one of them; before, each rank waited dead_rank_timeout_s + 5 s for a verdict first."""
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    cfg = merged(make_assets(tmp_path), data={"prompt_data": [str(empty)]},
                 placement={"colocate_critic_reward": True, "dead_rank_timeout_s": 120})
    started = time.time()
    proc = start_rl(cfg, tmp_path, "empty")
    try:
        _, err = proc.communicate(timeout=300)
    finally:
        proc.kill()
    took = time.time() - started
    print(f"the job ended after {took:.1f} s")
    assert proc.returncode == 2, err[-3000:]
    assert re.search(r"hpc-rlhf launcher: rank \d \(roles \w+\) .*; stopping the other ranks", err), err[-3000:]
    assert took < 120, took
