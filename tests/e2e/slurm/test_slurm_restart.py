"""A failed step started again inside the allocation (launch/steps.py) on the real local SLURM cluster: a killed
rank, a lost node with and without a spare, a rank that always fails, a user error."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest
from rl_fixtures import merged
from slurm_jobs import PY, grpo_config, job_script, rank_pid, write_yaml

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[3]
STEPS = 12


def rows(save: Path) -> dict[int, dict]:
    """The metrics of each step (a step logged again by a restarted attempt: its last row), timings left out."""
    out = {}
    for line in (save / "metrics.jsonl").read_text().splitlines():
        r = json.loads(line)
        out[r["step"]] = {k: v for k, v in r.items() if not (k.startswith("time/") or k.endswith("_s"))}
    return out


def assert_same_metrics(got: dict[int, dict], want: dict[int, dict]) -> None:
    assert sorted(got) == sorted(want) == list(range(1, STEPS + 1)), (sorted(got), sorted(want))
    for step in want:
        assert got[step].keys() == want[step].keys(), step
        for k, v in want[step].items():
            assert got[step][k] == pytest.approx(v, abs=1e-6), (step, k)


def config(tmp_path: Path, name: str, async_train: bool) -> dict:
    return merged(grpo_config(tmp_path, STEPS), ckpt={"save_path": str(tmp_path / name),
                                                     "ckpt_path": str(tmp_path / f"{name}_ckpt"), "save_steps": 1},
                  train={"async_train": async_train})


def wait_rows(save: Path, n: int, timeout: float = 240) -> None:
    deadline = time.time() + timeout
    while not ((save / "metrics.jsonl").exists() and len(rows(save)) >= n):
        assert time.time() < deadline, f"fewer than {n} steps in {save} after {timeout} s"
        time.sleep(0.1)


def first_step_of_restart(save: Path, timeout: float = 300) -> int:
    """Wait for the first step that the restarted attempt logs; returns it.  The attempt's "steps" row says where it
    starts (S, its checkpoint); then it rewrites metrics.jsonl to S rows and logs step S + 1."""
    deadline = time.time() + timeout
    while True:
        assert time.time() < deadline, f"no restarted attempt logged a step in {save} after {timeout} s"
        events = [json.loads(x) for x in (save / "attempts.jsonl").read_text().splitlines()]
        starts = [i for i, e in enumerate(events) if e["event"] == "start"]
        steps = [e for e in events[starts[-1]:] if e["event"] == "steps"] if len(starts) > 1 else []
        if steps:
            first, since = steps[0]["start_step"] + 1, steps[0]["time"]
            metrics = save / "metrics.jsonl"
            if metrics.stat().st_mtime > since and first in rows(save):
                return first
        time.sleep(0.05)


def submitit_job(cluster, config: Path, logs: Path) -> tuple[str, threading.Thread]:
    """`launchers/submit_grpo.py` in a thread (it waits for the results); the job id once submitted."""
    proc = subprocess.Popen([PY, str(ROOT / "launchers" / "submit_grpo.py"), str(config), f"slurm.log_dir={logs}"],
                            cwd=config.parent, env=cluster.environ(None), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    first = proc.stdout.readline()
    m = re.match(r"submitted job (\d+)", first)
    assert m, first + proc.stderr.read()[-3000:]
    waiter = threading.Thread(target=proc.communicate, daemon=True)
    waiter.start()
    return m.group(1), waiter


@pytest.mark.parametrize("async_train,path", [(False, "plan"), (True, "submitit")])
def test_a_killed_rank_is_restarted_in_the_allocation_and_the_run_matches_an_uninterrupted_one(
        slurm_cluster, tmp_path, async_train, path):
    """3-rank GRPO (actor+reference, reward, rollout: a heterogeneous job), a checkpoint every step: SIGKILL to the
    rollout rank after step 5 of 12.  The job's script starts a new step in the same job, which resumes from the
    newest intact checkpoint (step 5, or 4 while step 5's was being written) and finishes; every step's metrics
    equal those of the same job run without the kill.  The script `hpc-rlhf plan` writes (sync training) and the
    submitit path (async training)."""
    logs = tmp_path / "logs"

    def submit(name: str) -> str:
        cfg = write_yaml(tmp_path / f"{name}.yaml", config(tmp_path, name, async_train))
        if path == "plan":
            return slurm_cluster.sbatch(job_script(slurm_cluster, "rl", cfg, f"slurm.log_dir={logs}"))
        return submitit_job(slurm_cluster, cfg, logs)[0]

    whole = submit("whole")
    assert slurm_cluster.wait_done(whole, timeout=400) == "COMPLETED", (logs / f"{whole}.out").read_text()
    job = submit("cut")
    wait_rows(tmp_path / "cut", 5)
    t_kill = time.time()
    os.kill(rank_pid(job, 2), signal.SIGKILL)
    first = first_step_of_restart(tmp_path / "cut")
    cost = time.time() - t_kill
    assert slurm_cluster.wait_done(job, timeout=400) == "COMPLETED", (logs / f"{job}.out").read_text()

    out = (logs / f"{job}.out").read_text()
    assert re.search(r"the step failed \(exit \d+\): no heartbeat from rank 2 \(roles rollout, host node\d\); "
                     r"restart 1 of 2 from the last checkpoint", out), out
    assert out.count("restart 1 of 2") == 1 and "hpc-rlhf: the step finished" in out
    restarted = logs / job / "attempt-0" / "restart-1"
    log0 = (restarted / "actor+reference-0.log").read_text()
    m = re.search(r"resumed from \S+global_step(\d+) at step (\d+)", log0)
    assert m and m.group(2) in ("4", "5"), log0[-3000:]  # step 5's checkpoint may still be in writing at the kill
    assert_same_metrics(rows(tmp_path / "cut"), rows(tmp_path / "whole"))
    attempts = [json.loads(x) for x in (tmp_path / "cut" / "attempts.jsonl").read_text().splitlines()]
    assert [(a["job_id"], a["step_restart"]) for a in attempts if a["event"] == "start"] == [(job, 0), (job, 1)]
    status = subprocess.run([PY, "-m", "hpc_rlhf.cli", "status", str(tmp_path / "cut")], capture_output=True,
                            text=True, timeout=120).stdout
    assert f"job {job} restart 0 (new step 1 in the allocation)" in status, status
    print(f"{path} ({'async' if async_train else 'sync'}): kill after step 5 -> step {first} logged by the restart "
          f"{cost:.1f} s later (checkpoint load included)")
    assert cost < 60


def colocated(tmp_path: Path, name: str, ranks: int, **sections) -> Path:
    """GRPO with every role on each of ``ranks`` ranks: one homogeneous component, a checkpoint every step."""
    cfg = merged(config(tmp_path, name, False), placement={"colocate_all": True, "actor_num_ranks": ranks},
                 slurm={"hetjob": "never"})
    for k, v in sections.items():
        cfg = merged(cfg, **{k: v})
    return write_yaml(tmp_path / f"{name}.yaml", cfg)


def node_of(pid: int) -> str:
    env = dict(x.split("=", 1) for x in Path(f"/proc/{pid}/environ").read_text().split("\0") if "=" in x)
    return env["SLURMD_NODENAME"]


@pytest.fixture
def downed(slurm_cluster):
    """Mark a node down (scontrol update state=down), and bring it back after the test."""
    marked = []

    def down(node: str) -> None:
        slurm_cluster.run(["scontrol", "update", f"nodename={node}", "state=down", "reason=hpc-rlhf test"])
        marked.append(node)
    yield down
    for node in marked:
        slurm_cluster.run(["scontrol", "update", f"nodename={node}", "state=resume"], check=False)


def test_a_lost_node_is_replaced_by_the_spare(slurm_cluster, tmp_path, downed):
    """2 ranks on 2 nodes plus 1 spare: rank 1's node goes down after step 5; --no-kill keeps the job, and the
    new step runs on the remaining node and the spare, resuming from the step-5 checkpoint."""
    logs = tmp_path / "logs"
    cfg = colocated(tmp_path, "spare", 2)
    job = slurm_cluster.sbatch(job_script(slurm_cluster, "rl", cfg, f"slurm.log_dir={logs}", "slurm.spare_nodes=1",
                                          "slurm.roles.actor.nodes=2", "slurm.roles.actor.cpus_per_task=2"))
    wait_rows(tmp_path / "spare", 5)
    lost = node_of(rank_pid(job, 1))
    downed(lost)
    assert slurm_cluster.wait_done(job, timeout=400) == "COMPLETED", (logs / f"{job}.out").read_text()
    out = (logs / f"{job}.out").read_text()
    assert re.search(rf"the step failed \(exit \d+\): lost node {lost}; restart 1 of 2 from the last checkpoint",
                     out), out
    used = re.search(r"hpc-rlhf: job \d+ attempt 0 restart 1 on (\S+),", out).group(1).split(",")
    assert lost not in used and len(used) == 2, out
    assert sorted(rows(tmp_path / "spare")) == list(range(1, STEPS + 1))
    hosts = sorted(p.read_text() for p in (logs / job / "attempt-0" / "restart-1" / "ranks").glob("*.host"))
    assert hosts == sorted(used), hosts
    print(f"node {lost} lost: the job finished on {', '.join(used)}")


def test_a_lost_node_without_a_spare_requeues_the_job(slurm_cluster, tmp_path, downed):
    """2 ranks on 2 nodes, no spare: rank 1's node goes down; the job requeues itself (one line) and its next
    start resumes from the last checkpoint once SLURM has nodes for it."""
    logs = tmp_path / "logs"
    cfg = colocated(tmp_path, "nospare", 2)
    job = slurm_cluster.sbatch(job_script(slurm_cluster, "rl", cfg, f"slurm.log_dir={logs}",
                                          "slurm.roles.actor.nodes=2", "slurm.roles.actor.cpus_per_task=2"))
    wait_rows(tmp_path / "nospare", 5)
    lost = node_of(rank_pid(job, 1))
    downed(lost)
    deadline = time.time() + 120
    while "requeueing the job" not in (logs / f"{job}.out").read_text():
        assert time.time() < deadline, (logs / f"{job}.out").read_text()
        time.sleep(0.5)
    out = (logs / f"{job}.out").read_text()
    assert re.search(rf"lost node {lost}; 1 good nodes of the 2 the ranks need, no spare left \(slurm.spare_nodes\): "
                     "requeueing the job", out), out
    slurm_cluster.run(["scontrol", "update", f"nodename={lost}", "state=resume"], check=False)
    assert slurm_cluster.wait_done(job, timeout=400) == "COMPLETED", (logs / f"{job}.out").read_text()
    log = (logs / job / "attempt-1" / "rank-0.log").read_text()
    assert re.search(r"resumed from \S+global_step\d+ at step [1-9]", log), log[-3000:]  # not from step 0
    assert sorted(rows(tmp_path / "nospare")) == list(range(1, STEPS + 1))


ALWAYS_FAILS = '''
import os

def reward_func(queries, prompts, labels):
    os._exit(1)  # as a crash would: no exit code of its own, no verdict
'''


def test_a_rank_that_always_fails_is_restarted_max_restarts_times_and_a_user_error_never(slurm_cluster, tmp_path):
    logs = tmp_path / "logs"
    (tmp_path / "crash.py").write_text(ALWAYS_FAILS)
    cfg = colocated(tmp_path, "crash", 2, reward={"reward_func": str(tmp_path / "crash.py")})
    job = slurm_cluster.sbatch(job_script(slurm_cluster, "rl", cfg, f"slurm.log_dir={logs}", "launch.max_restarts=1"))
    assert slurm_cluster.wait_done(job, timeout=400) == "FAILED"
    out = (logs / f"{job}.out").read_text()
    assert out.count("restart 1 of 1 from the last checkpoint") == 1, out
    assert re.search(r"the step failed \(exit \d+\): .*; restarts spent \(launch.max_restarts=1\)\n", out), out
    assert sorted(p.name for p in (logs / job / "attempt-0").glob("restart-*")) == ["restart-1"]

    bad = tmp_path / "bad_prompts.jsonl"
    bad.write_text('{"input": "1+1=", "label": "2"}\n{"question": "2+2=", "label": "4"}\n')
    cfg = colocated(tmp_path, "user", 2, data={"prompt_data": [str(bad)], "bad_rows": "error"})
    job = slurm_cluster.sbatch(job_script(slurm_cluster, "rl", cfg, f"slurm.log_dir={logs}"))
    assert slurm_cluster.wait_done(job, timeout=400) == "FAILED"
    out = (logs / f"{job}.out").read_text()
    assert "stopped on a user error (exit 2): not retried" in out, out
    assert not list((logs / job / "attempt-0").glob("restart-*"))
    assert "bad_prompts.jsonl" in "".join(p.read_text() for p in (logs / job / "attempt-0").glob("*.log"))
