"""Training jobs on the real local SLURM cluster: submitit, a heterogeneous GRPO job, requeue with
exact resume, and a killed rank taking the job down fast."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from rl_fixtures import merged
from sft_fixtures import losses, sft_config, with_paths
from slurm_jobs import first_line_time, grpo_config, job_script, rank_pid, wait_steps, write_yaml

pytestmark = pytest.mark.slow
PY = sys.executable
ROOT = Path(__file__).resolve().parents[3]


def run_launcher(cluster, name: str, config: Path, *overrides: str, timeout: float = 400) -> dict:
    """python launchers/NAME CONFIG ...: submits through submitit, waits, prints the final JSON line."""
    proc = cluster.run([PY, str(ROOT / "launchers" / name), str(config), *overrides], timeout=timeout, check=False,
                       cwd=config.parent)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_sft_through_submitit_on_two_tasks(slurm_cluster, tmp_path):
    config = with_paths(sft_config(tmp_path, 6), tmp_path, "sft")
    t0 = time.time()
    out = run_launcher(slurm_cluster, "submit_sft.py", config, f"slurm.log_dir={tmp_path / 'logs'}")
    assert out["ranks"] == 2 and out["final"]["loss"] > 0
    got = losses(tmp_path / "sft")
    assert sorted(got) == list(range(1, 7)) and got[6] < got[1]
    assert got[6] == pytest.approx(out["final"]["loss"])
    attempt = tmp_path / "logs" / out["job_id"] / "attempt-0"
    assert sorted(p.name for p in attempt.glob("*.log")) == ["rank-0.log", "rank-1.log"]
    print(f"submitit SFT 2 tasks: {time.time() - t0:.1f} s")


def _reward_means(save: Path) -> list[float]:
    rows = [json.loads(x) for x in (save / "metrics.jsonl").read_text().splitlines()]
    return [r["reward/mean"] for r in rows if "reward/mean" in r]


def test_grpo_as_a_heterogeneous_job_through_submitit_learns(slurm_cluster, tmp_path):
    config = merged(grpo_config(tmp_path, 20), ckpt={"save_path": str(tmp_path / "grpo"),
                                                    "ckpt_path": str(tmp_path / "grpo_ckpt")})
    path = write_yaml(tmp_path / "grpo.yaml", config)
    t0 = time.time()
    out = run_launcher(slurm_cluster, "submit_grpo.py", path, f"slurm.log_dir={tmp_path / 'logs'}")
    job = out["job_id"]
    assert out["ranks"] == 3  # a result from every rank of the three components
    script = next((tmp_path / "logs" / "submitit").glob(f"{job}_submission.sh")).read_text()
    assert script.count("#SBATCH hetjob") == 2 and "--cpus-per-task=2   # rollout" in script
    rows = slurm_cluster.sacct(job, ("JobID", "NodeList"), allocations_only=True)
    assert [r["JobID"] for r in rows] == [f"{job}+0", f"{job}+1", f"{job}+2"]
    assert len({r["NodeList"] for r in rows}) == 3  # one node per component
    means = _reward_means(tmp_path / "grpo")
    assert len(means) == 20 and out["reward_mean"] == pytest.approx(means[-1])
    first, last = sum(means[:5]) / 5, sum(means[-5:]) / 5
    assert last > first + 0.05, means
    metrics = [json.loads(x) for x in (tmp_path / "grpo" / "metrics.jsonl").read_text().splitlines()]
    for m in metrics:  # the rollout component generated with exactly the actor's weights after each sync
        assert m["sync/checksum_loaded/0"] == pytest.approx(m["sync/checksum_sent"], rel=1e-12)
    print(f"GRPO het job: {time.time() - t0:.1f} s, reward mean first 5 {first:.3f} -> last 5 {last:.3f}")


def test_time_limit_signal_and_preemption_requeue_and_resume_exactly(slurm_cluster, tmp_path):
    """USR1 (sbatch --signal's time-limit warning): the ranks checkpoint and rank 0 requeues.  Then
    `scontrol requeue` (what preemption does): SIGTERM, checkpoint, SLURM requeues.  The job that
    finally completes has logged the same per-step losses as an uninterrupted run."""
    steps = 40
    config = sft_config(tmp_path, steps)
    subprocess.run([PY, "-m", "hpc_rlhf.cli", "train", "sft", "--config", str(with_paths(config, tmp_path, "full"))],
                   check=True, capture_output=True, timeout=400)
    cut = with_paths(config, tmp_path, "cut")
    logs = tmp_path / "logs"
    job = slurm_cluster.sbatch(job_script(slurm_cluster, "sft", cut, f"slurm.log_dir={logs}"))

    wait_steps(tmp_path / "cut", 3)
    t_signal = time.time()
    slurm_cluster.run(["scancel", "--signal=USR1", job])
    t_resumed = first_line_time(logs / job / "attempt-1" / "rank-0.log", r"resumed from .*global_step", 180)
    first_stop = max(losses(tmp_path / "cut"))

    wait_steps(tmp_path / "cut", first_stop + 3)
    slurm_cluster.run(["scontrol", "requeue", job])
    first_line_time(logs / job / "attempt-2" / "rank-0.log", r"resumed from .*global_step", 180)
    assert slurm_cluster.wait_done(job, timeout=300) == "COMPLETED", (logs / f"{job}.out").read_text()

    # (the batch script itself is killed by the requeue, so the ranks' logs tell what happened)
    for attempt in (0, 1):
        text = (logs / job / f"attempt-{attempt}" / "rank-0.log").read_text()
        assert "stopped by a signal after step" in text, text[-3000:]
    assert "requeued SLURM job" in (logs / job / "attempt-0" / "rank-0.log").read_text()
    got, want = losses(tmp_path / "cut"), losses(tmp_path / "full")
    assert sorted(got) == list(range(1, steps + 1))
    for step, loss in want.items():
        assert got[step] == pytest.approx(loss, abs=1e-6), step
    print(f"USR1 at step {first_stop}: signal -> resumed in attempt 1 after {t_resumed - t_signal:.1f} s")


def test_a_killed_rank_ends_the_job_fast_and_is_named(slurm_cluster, tmp_path):
    """With no restart allowed (launch.max_restarts=0) a killed rank ends the job within seconds, every log naming
    it; tests/e2e/slurm/test_slurm_restart.py restarts it."""
    config = merged(grpo_config(tmp_path, 200), ckpt={"save_path": str(tmp_path / "grpo"),
                                                     "ckpt_path": str(tmp_path / "grpo_ckpt")})
    logs = tmp_path / "logs"
    job = slurm_cluster.sbatch(job_script(slurm_cluster, "rl", write_yaml(tmp_path / "grpo.yaml", config),
                                          f"slurm.log_dir={logs}", "launch.max_restarts=0"))
    _wait_steps_rl = tmp_path / "grpo" / "metrics.jsonl"
    deadline = time.time() + 240
    while not (_wait_steps_rl.exists() and _wait_steps_rl.read_text().count("\n") >= 2):
        assert time.time() < deadline, "the job never logged two steps"
        time.sleep(0.2)
    pid = rank_pid(job, 2)  # the rollout component
    t_kill = time.time()
    os.kill(pid, signal.SIGKILL)
    state = slurm_cluster.wait_done(job, timeout=90)
    took = time.time() - t_kill
    assert state not in ("COMPLETED", "RUNNING") and took < 60, (state, took)
    rank_logs = "".join(p.read_text() for p in (logs / job / "attempt-0").glob("*.log"))
    assert re.search(r"rank 2 \(roles rollout, host node\d\)", rank_logs), rank_logs[-4000:]
    out = (logs / f"{job}.out").read_text()
    assert re.search(r"the step failed \(exit \d+\): no heartbeat from rank 2 \(roles rollout, host node\d\); "
                     r"restarts spent \(launch.max_restarts=0\)", out), out
    print(f"killed rank 2 (rollout): job {state} {took:.1f} s later")
