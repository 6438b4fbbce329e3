"""`hpc-rlhf steps` (launch/steps.py): what follows a failed step, decided from the ranks' record and the job's
nodes; the step command; the policy read from the step's config; and a whole run against a stand-in srun."""
from __future__ import annotations

import os
import stat
import sys
import textwrap
from pathlib import Path

import pytest

from hpc_rlhf.distributed import steprecord
from hpc_rlhf.distributed.steprecord import StepRecord
from hpc_rlhf.launch.steps import Placement, Policy, allocation_nodes, decide, policy_of_command, run, step_command

NODES = ["n1", "n2", "n3"]


def killed_on(host: str, rank: int = 2) -> StepRecord:
    """Three ranks on n1, n1, ``host``; rank ``rank`` was killed, the others' watchdogs exited 1 naming it."""
    hosts = {0: "n1", 1: "n1", 2: host}
    return StepRecord(hosts=hosts, exits={r: 1 for r in hosts if r != rank},
                      verdict=(rank, hosts[rank], f"no heartbeat from rank {rank} (roles rollout, host {hosts[rank]})"))


def test_a_finished_step_is_done():
    assert decide(Policy(), 0, StepRecord(), Placement(NODES, 3), [], 0).action == "done"


def test_a_user_error_ends_the_job_with_exit_2_and_is_never_retried():
    rec = StepRecord(hosts={0: "n1", 1: "n2"}, exits={0: 1, 1: 2}, verdict=(1, "n2", "rank 1 failed: DataError"))
    nxt = decide(Policy(max_restarts=5), 143, rec, Placement(NODES, 3), [], 0)
    assert (nxt.action, nxt.rc) == ("end", 2) and "rank 1" in nxt.why
    # no record at all (ranks that could not write one): srun's own exit code 2
    assert decide(Policy(), 2, StepRecord(), Placement(NODES, 3), [], 0).rc == 2


def test_ranks_stopped_by_a_signal_end_the_job_with_exit_3():
    rec = StepRecord(hosts={0: "n1", 1: "n2"}, exits={0: 3, 1: 3})
    assert (decide(Policy(), 3, rec, Placement(NODES, 3), [], 0).action,) == ("end",)
    assert decide(Policy(), 3, rec, Placement(NODES, 3), [], 0).rc == 3
    # one rank killed while the others stopped: a failure, not a stop
    rec.hosts[2] = "n3"
    assert decide(Policy(), 137, rec, Placement(NODES, 3), [], 0).action == "restart"


def test_a_failure_restarts_until_the_restarts_are_spent():
    p, rec = Placement(NODES, 3), killed_on("n3")
    first = decide(Policy(max_restarts=2), 137, rec, p, [], 0)
    assert first.action == "restart" and "restart 1 of 2" in first.why and "rank 2" in first.why
    assert decide(Policy(max_restarts=2), 137, rec, p, [], 1).action == "restart"
    last = decide(Policy(max_restarts=2), 137, rec, p, [], 2)
    assert (last.action, last.rc) == ("end", 137) and "launch.max_restarts=2" in last.why
    assert decide(Policy(max_restarts=0), 137, rec, Placement(NODES, 3), [], 0).action == "end"


def test_a_node_that_fails_twice_is_replaced_by_a_spare():
    """n1..n3 with one spare (n3): the ranks run on n1, n2; the culprit on n2 twice -> n2 out, n3 in."""
    p = Placement(NODES, 2)
    assert p.step_nodes() == ["n1", "n2"]
    decide(Policy(), 137, killed_on("n2"), p, [], 0)
    assert p.bad == set() and p.step_nodes() == ["n1", "n2"]  # once is not yet a pattern
    nxt = decide(Policy(), 137, killed_on("n2"), p, [], 1)
    assert nxt.action == "restart" and "n2 failed twice" in nxt.why
    assert p.bad == {"n2"} and p.step_nodes() == ["n1", "n3"]


def test_a_node_that_fails_twice_stays_when_no_spare_can_take_its_place():
    p = Placement(NODES, 3)
    for k in range(2):
        assert decide(Policy(max_restarts=3), 137, killed_on("n2"), p, [], k).action == "restart"
    assert p.bad == set() and p.step_nodes() is None  # every node of the allocation, as SLURM places them


def test_a_lost_node_is_left_out_and_a_spare_runs_its_ranks():
    p = Placement(NODES, 2)
    nxt = decide(Policy(), 137, killed_on("n2"), p, ["n2"], 0)
    assert nxt.action == "restart" and "lost node n2" in nxt.why
    assert p.step_nodes() == ["n1", "n3"] and p.failures["n2"] == 0  # a lost node is not counted as failing


@pytest.mark.parametrize("on_loss,action", [("requeue", "requeue"), ("end", "end")])
def test_a_lost_node_without_a_spare_requeues_the_job_or_ends_it(on_loss, action):
    p = Placement(NODES, 3)
    nxt = decide(Policy(on_node_loss=on_loss), 137, killed_on("n2"), p, ["n2"], 0)
    assert nxt.action == action and "2 good nodes of the 3 the ranks need" in nxt.why


def test_a_step_whose_ranks_say_nothing_restarts_and_one_that_started_no_rank_ends():
    p = Placement(NODES, 3)
    nxt = decide(Policy(), 1, StepRecord(hosts={0: "n1", 1: "n2"}, exits={1: 1}), p, [], 0)
    assert nxt.action == "restart" and "rank 0 was killed (it left no exit code)" in nxt.why
    assert p.failures == {"n1": 1}
    # every rank killed before a watchdog named the first to die: no rank or node is blamed
    p = Placement(NODES, 3)
    nxt = decide(Policy(), 1, StepRecord(hosts={0: "n1", 1: "n2", 2: "n3"}), p, [], 0)
    assert nxt.action == "restart" and "ranks 0, 1, 2 were killed (none left an exit code" in nxt.why
    assert not p.failures
    nxt = decide(Policy(), 1, StepRecord(hosts={0: "n1"}, exits={0: 0}), Placement(NODES, 3), [], 0)
    assert nxt.action == "restart" and "no rank said why" in nxt.why
    # srun refused the step ("More processors requested than permitted"): the same step would fail again
    nxt = decide(Policy(), 1, StepRecord(), Placement(NODES, 3), [], 0)
    assert (nxt.action, nxt.rc) == ("end", 1) and "srun started no rank" in nxt.why


def test_the_allocation_holds_every_components_nodes():
    assert allocation_nodes({"SLURM_JOB_NODELIST": "n[1-2]"}) == ["n1", "n2"]
    het = {"SLURM_JOB_NODELIST": "n1", "SLURM_JOB_NODELIST_HET_GROUP_0": "n1",
           "SLURM_JOB_NODELIST_HET_GROUP_10": "g[1-2]", "SLURM_JOB_NODELIST_HET_GROUP_2": "n[3,1]"}
    assert allocation_nodes(het) == ["n1", "n3", "g1", "g2"]


def test_the_step_command_fills_in_its_folder_and_its_nodes():
    srun = ["srun", "--kill-on-bad-exit=1", "--output={step_dir}/rank-%t.log", "python", "-m", "x"]
    assert step_command(srun, Path("/l/7/attempt-0"), None) == [
        "srun", "--kill-on-bad-exit=1", "--output=/l/7/attempt-0/rank-%t.log", "python", "-m", "x"]
    assert step_command(srun, Path("/d"), ["n1", "n3"])[:3] == ["srun", "--nodes=2", "--nodelist=n1,n3"]
    assert step_command(srun, Path("/d"), ["n1", "n3"], 3)[:4] == ["srun", "--nodes=2", "--nodelist=n1,n3",
                                                                    "--ntasks=3"]


def test_the_policy_comes_from_the_flags_then_the_steps_config(tmp_path):
    (tmp_path / "m").mkdir()
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"model: {{pretrain: {tmp_path / 'm'}}}\ndata: {{dataset: [{tmp_path / 'd.jsonl'}]}}\n"
                   "launch: {max_restarts: 5}\n")
    srun = ["srun", "-n", "2", "python", "-m", "hpc_rlhf.cli", "train", "sft", "--config", str(cfg),
            "slurm.spare_nodes=1"]
    assert policy_of_command(srun, {}) == Policy(max_restarts=5, spare_nodes=1, on_node_loss="requeue")
    assert policy_of_command(srun, {"max_restarts": 0, "spare_nodes": None}).max_restarts == 0
    assert policy_of_command(["srun", "python", "-m", "submitit.core._submit", "f"], {}) == Policy()


FAKE_SRUN = """\
#!{python}
# a stand-in srun: the first step's rank 2 "dies" on n2, the second step finishes
import os, sys
from pathlib import Path
d = Path(os.environ["HPC_RLHF_STEP_DIR"])
args = sys.argv[1:]
(d / "ranks").mkdir(parents=True, exist_ok=True)
with open({calls!r}, "a") as f:
    f.write(os.environ["HPC_RLHF_STEP_RESTART"] + " " + " ".join(args) + "\\n")
for r, h in ((0, "n1"), (1, "n1"), (2, "n2")):
    (d / "ranks" / f"{{r}}.host").write_text(h)
if os.environ["HPC_RLHF_STEP_RESTART"] == "0":
    (d / "ranks" / "0.exit").write_text("1"); (d / "ranks" / "1.exit").write_text("1")
    (d / "verdict").write_text("2 n2 no heartbeat from rank 2 (roles rollout, host n2)")
    sys.exit(137)
sys.exit(0)
"""


def test_a_run_restarts_a_failed_step_in_a_new_folder(tmp_path, monkeypatch, capsys):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "calls"
    for name, text in (("srun", FAKE_SRUN.format(python=sys.executable, calls=str(calls))),
                       ("scontrol", "#!/bin/sh\necho 'JobId=7 NodeList=n[1-2] NumNodes=2'\n")):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(stat.S_IRWXU)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_ID": "7",
           "SLURM_JOB_NODELIST": "n[1-2]", "SLURM_RESTART_COUNT": "0"}
    rc = run(["srun", "--output={step_dir}/rank-%t.log", "true"], Policy(max_restarts=2), tmp_path / "logs", env)
    out = capsys.readouterr().out
    assert rc == 0, out
    assert calls.read_text().splitlines() == [f"0 --output={tmp_path}/logs/7/attempt-0/rank-%t.log true",
                                              f"1 --output={tmp_path}/logs/7/attempt-0/restart-1/rank-%t.log true"]
    assert textwrap.dedent("""\
        hpc-rlhf: the step failed (exit 137): no heartbeat from rank 2 (roles rollout, host n2); restart 1 of 2 from \
the last checkpoint""") in out
    assert steprecord.read(tmp_path / "logs" / "7" / "attempt-0").verdict[1] == "n2"
    assert out.splitlines()[-1] == "hpc-rlhf: the step finished"
