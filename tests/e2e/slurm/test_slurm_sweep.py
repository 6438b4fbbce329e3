"""`hpc-rlhf sweep` on the real local SLURM cluster: a 2x2 sweep of tiny GRPO runs as one job array, one element
preempted (`scontrol requeue`) and resumed from its checkpoint, all four complete, and the sweep report's
table matches each run's metrics.jsonl.  Also checks the reason the array elements are homogeneous: this
SLURM refuses --array on a heterogeneous job."""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest
import yaml
from rl_fixtures import make_assets, merged

from hpc_rlhf.reports import write_report
from hpc_rlhf.reports.summary import fmt_value

pytestmark = pytest.mark.slow
PY = sys.executable
STEPS = 6


def test_slurm_refuses_a_heterogeneous_job_array(slurm_cluster, tmp_path):
    script = tmp_path / "het.sbatch"
    script.write_text("#!/bin/bash\n#SBATCH --ntasks=1 --output=/dev/null\n#SBATCH hetjob\n#SBATCH --ntasks=1\n"
                      "true\n")
    proc = slurm_cluster.run(["sbatch", "--array=0-1", str(script)], check=False)
    assert proc.returncode != 0 and "array" in proc.stderr.lower(), proc.stderr
    print(f"sbatch --array on a heterogeneous job: {proc.stderr.strip()}")


def _rows(run: Path) -> list[dict]:
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()] \
        if (run / "metrics.jsonl").exists() else []


def test_a_2x2_sweep_as_a_job_array_with_one_element_requeued(slurm_cluster, tmp_path):
    # two ranks per run (actor+reference+reward, rollout); the base config asks for a heterogeneous job,
    # which an array element cannot be: the script gives both tasks the rollout's 2 CPUs
    config = merged(make_assets(tmp_path), train={"max_steps": STEPS, "actor_learning_rate": 1e-2},
                    ckpt={"save_steps": 2},
                    placement={"colocate_all": False, "colocate_actor_ref": True, "colocate_actor_reward": True,
                               "dead_rank_timeout_s": 20},
                    log={"use_tensorboard": True},
                    slurm={"hetjob": "always", "time": "00:15:00", "python": PY,
                           "roles": {"rollout": {"cpus_per_task": 2}}})
    base = tmp_path / "base.yaml"
    base.write_text(yaml.safe_dump(config))
    out = tmp_path / "sw"
    t0 = time.time()
    proc = slurm_cluster.run([PY, "-m", "hpc_rlhf.cli", "sweep", "--config", str(base), "--out", str(out),
                              "--grid", "algo.advantage_estimator=group_norm,rloo",
                              "--grid", "train.actor_learning_rate=1e-2,3e-2", "--max-parallel", "2"],
                             timeout=300, check=False, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    manifest = json.loads((out / "sweep.json").read_text())
    job = manifest["submissions"][0]["array_job_id"]
    assert manifest["submissions"][0]["array"] == "0-3%2"
    script = (out / "sweep.sbatch").read_text()
    assert "hetjob" not in script and "#SBATCH --ntasks=2 --cpus-per-task=2" in script

    # preempt element 1 once it has a committed checkpoint and has gone on
    run1 = out / "runs" / "001"
    deadline = time.time() + 400
    while not (len(_rows(run1)) >= 3 and list((run1 / "checkpoints").glob("global_step2/COMMITTED"))):
        assert time.time() < deadline, "element 1 never reached step 3"
        time.sleep(0.2)
    slurm_cluster.run(["scontrol", "requeue", f"{job}_1"])
    state = slurm_cluster.wait_done(job, timeout=900)
    assert state == "COMPLETED", (state, [p.read_text()[-2000:] for p in (out / "logs").glob("*.out")])
    elements = slurm_cluster.sacct(job, ("JobID", "State"), allocations_only=True)
    assert sorted(r["JobID"] for r in elements) == [f"{job}_{i}" for i in range(4)]

    # element 1: two attempts, the second resumed from a checkpoint; every run has all its steps
    attempts = [json.loads(x) for x in (run1 / "attempts.jsonl").read_text().splitlines()]
    starts = [a for a in attempts if a["event"] == "start"]
    assert [a["restart"] for a in starts] == [0, 1] and {a["array_task_id"] for a in starts} == {"1"}
    resumed = [a["start_step"] for a in attempts if a["event"] == "steps"]
    assert resumed[0] == 0 and resumed[1] >= 2, resumed
    for i in range(4):
        steps = sorted({r["step"] for r in _rows(out / "runs" / f"00{i}") if "reward/mean" in r})
        assert steps == list(range(1, STEPS + 1)), (i, steps)
        exported = yaml.safe_load((out / "runs" / f"00{i}" / "hpc_rlhf_config.yaml").read_text())
        assert (exported["algo"]["advantage_estimator"], exported["train"]["actor_learning_rate"]) == \
            (["group_norm", "group_norm", "rloo", "rloo"][i], [1e-2, 3e-2][i % 2])

    rep = write_report([out], tmp_path / "report")
    table = {(r[0], r[1]): r for r in rep.sweep_rows[1:]}
    for i, point in enumerate(manifest["points"]):
        rows = _rows(out / "runs" / f"00{i}")
        # the joined rows: a resumed run's metrics.jsonl holds the steps up to its checkpoint, then the new ones
        rewards = {r["step"]: r["reward/mean"] for r in rows if "reward/mean" in r}
        row = table[(point["label"], "reward/mean")]
        assert row[2] == "1" and row[3] == fmt_value(rewards[STEPS]) and row[5] == fmt_value(max(rewards.values()))
    print(f"2x2 sweep as a job array, element 1 requeued: {time.time() - t0:.0f} s")
