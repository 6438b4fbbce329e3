"""The local Slurm test cluster (tests/support/slurm_cluster.py) does what the launch tests rely on."""
from __future__ import annotations

import time

import pytest


def _script(path, body: str):
    path.write_text("#!/bin/bash\n" + body.lstrip())
    return path


def test_srun_step_spans_nodes(slurm_cluster):
    out = slurm_cluster.run(
        ["srun", "-N2", "--ntasks-per-node=3", "--cpus-per-task=1", "bash", "-c",
         'echo "$SLURM_PROCID $SLURM_NTASKS $SLURMD_NODENAME '
         '$(getent hosts $SLURMD_NODENAME | head -n1 | cut -d" " -f1)"'],
        timeout=60).stdout
    rows = sorted((line.split() for line in out.splitlines()), key=lambda r: int(r[0]))
    assert [r[:2] for r in rows] == [[str(i), "6"] for i in range(6)], out
    nodes = [r[2] for r in rows]
    assert len(set(nodes)) == 2 and set(nodes) <= set(slurm_cluster.nodes), out
    assert all(nodes.count(n) == 3 for n in set(nodes)), out
    assert {r[3] for r in rows} == {"127.0.0.1"}, out  # node names resolve (/etc/hosts)


def test_sbatch_completes_and_failure_is_accounted(slurm_cluster, tmp_path):
    ok = _script(tmp_path / "ok.sh", '#SBATCH -n1\necho "hello from $SLURM_JOB_ID on $SLURMD_NODENAME"\n')
    bad = _script(tmp_path / "bad.sh", "#SBATCH -n1\nexit 3\n")
    ok_id = slurm_cluster.sbatch(ok, "-o", str(tmp_path / "ok.out"))
    bad_id = slurm_cluster.sbatch(bad, "-o", str(tmp_path / "bad.out"))
    assert slurm_cluster.wait_done(ok_id, timeout=30) == "COMPLETED"
    assert f"hello from {ok_id} on node" in (tmp_path / "ok.out").read_text()
    assert slurm_cluster.wait_done(bad_id, timeout=30) == "FAILED"
    [row] = slurm_cluster.sacct(bad_id, allocations_only=True)
    assert row["ExitCode"] == "3:0", row


def test_het_job_components_see_their_env(slurm_cluster, tmp_path):
    task = 'echo "$0 procid=$SLURM_PROCID ntasks=$SLURM_NTASKS het_size=$SLURM_HET_SIZE node=$SLURMD_NODENAME"'
    script = _script(tmp_path / "het.sh", f"""
#SBATCH -n1 --cpus-per-task=1
#SBATCH hetjob
#SBATCH -n2 --cpus-per-task=1
echo "batch het_size=$SLURM_HET_SIZE ids=$SLURM_JOB_ID_HET_GROUP_0,$SLURM_JOB_ID_HET_GROUP_1 \\
ntasks=$SLURM_NTASKS_HET_GROUP_0,$SLURM_NTASKS_HET_GROUP_1"
srun --het-group=0 bash -c '{task}' actor : --het-group=1 bash -c '{task}' rollout
""")
    job = slurm_cluster.sbatch(script, "-o", str(tmp_path / "het.out"))
    assert slurm_cluster.wait_done(job, timeout=45) == "COMPLETED"
    out = (tmp_path / "het.out").read_text()
    assert f"batch het_size=2 ids={job},{int(job) + 1} ntasks=1,2" in out, out
    tasks = sorted(line.split() for line in out.splitlines() if line.startswith(("actor", "rollout")))
    assert [t[:4] for t in tasks] == [
        ["actor", "procid=0", "ntasks=3", "het_size=2"],
        ["rollout", "procid=1", "ntasks=3", "het_size=2"],
        ["rollout", "procid=2", "ntasks=3", "het_size=2"]], out
    assert {r["JobID"] for r in slurm_cluster.sacct(job, allocations_only=True)} == {f"{job}+0", f"{job}+1"}


@pytest.mark.slow  # the default suite stays under 12 minutes (moved in issue 16)
def test_requeue_runs_the_job_again(slurm_cluster, tmp_path):
    log = tmp_path / "runs.log"
    script = _script(tmp_path / "requeue.sh", """
#SBATCH -n1
echo "run restart=${SLURM_RESTART_COUNT:-0}" >> "$1"
[ "${SLURM_RESTART_COUNT:-0}" -ge 1 ] && exit 0
sleep 300
""")
    job = slurm_cluster.sbatch(script, "--requeue", "-o", "/dev/null", script_args=[str(log)])
    slurm_cluster.wait_output(log, "run restart=0")
    slurm_cluster.run(["scontrol", "requeue", job])
    # the requeued job waits cred_expire (10 s) + the scheduler's 2 s tick before it runs again
    assert slurm_cluster.wait_done(job, timeout=45) == "COMPLETED"
    assert log.read_text().split("\n") == ["run restart=0", "run restart=1", ""]


def test_scancel_signal_usr1(slurm_cluster, tmp_path):
    """`scancel --signal=USR1` reaches the job's srun steps; the batch script itself only gets it
    with --full (or --batch): Slurm's default spares the batch step."""
    log = tmp_path / "signals.log"
    script = _script(tmp_path / "usr1.sh", """
#SBATCH -n1
trap 'echo "batch got USR1" >> "$1"' USR1
srun bash -c 'trap "echo step got USR1 >> $0" USR1; echo step ready >> $0; while :; do sleep 0.1; done' "$1" &
echo "batch ready" >> "$1"
while :; do sleep 0.1; done
""")
    job = slurm_cluster.sbatch(script, "-o", str(tmp_path / "usr1.out"), script_args=[str(log)])
    slurm_cluster.wait_output(log, "step ready")
    slurm_cluster.wait_output(log, "batch ready")
    slurm_cluster.run(["scancel", "--signal=USR1", job])
    slurm_cluster.wait_output(log, "step got USR1", timeout=10)
    time.sleep(0.5)
    assert "batch got USR1" not in log.read_text()
    slurm_cluster.run(["scancel", "--full", "--signal=USR1", job])
    slurm_cluster.wait_output(log, "batch got USR1", timeout=10)
    slurm_cluster.run(["scancel", job])
    assert slurm_cluster.wait_done(job, timeout=30) == "CANCELLED"
