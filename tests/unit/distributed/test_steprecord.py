"""What a rank leaves for the job's step runner (distributed/steprecord.py): its node, its exit code, the verdict;
the first word stands; nothing is written outside a step of `hpc-rlhf steps`."""
from __future__ import annotations

import subprocess
import sys

from hpc_rlhf.distributed import steprecord


def test_a_rank_notes_its_node_exit_code_and_the_verdict_once(tmp_path):
    env = {steprecord.STEP_DIR: str(tmp_path), "RANK": "3", "SLURMD_NODENAME": "gpu7"}
    steprecord.note_start(env)
    steprecord.note_exit(2, env)
    steprecord.note_exit(1, env)  # a later word does not replace the first
    steprecord.note_verdict(3, "gpu7", "rank 3 (roles reward) failed: DataError: row 4", env)
    steprecord.note_verdict(0, "gpu1", "no heartbeat from rank 0", env)
    steprecord.note_start({**env, "RANK": "5"})
    steprecord.note_exit(0, {**env, "RANK": "0", "SLURM_PROCID": "6"})  # RANK as a role's world has it: 0
    rec = steprecord.read(tmp_path)
    assert rec.hosts == {3: "gpu7", 5: "gpu7"} and rec.exits == {3: 2, 6: 0}
    assert rec.verdict == (3, "gpu7", "rank 3 (roles reward) failed: DataError: row 4")
    assert rec.killed == [5]


def test_nothing_is_written_outside_a_step(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    steprecord.note_start({"RANK": "0"})
    steprecord.note_exit(1, {"RANK": "0"})
    assert list(tmp_path.iterdir()) == []
    assert steprecord.read(tmp_path / "none") == steprecord.StepRecord()


def test_the_cli_notes_its_exit_code(tmp_path):
    """A config error exits 2 and says so in the record, as the runner reads it."""
    env = {steprecord.STEP_DIR: str(tmp_path), "RANK": "0", "PATH": "/usr/bin:/bin"}
    proc = subprocess.run([sys.executable, "-m", "hpc_rlhf.cli", "train", "sft", "pretrain=/nowhere", "bogus=1"],
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert steprecord.read(tmp_path).exits == {0: 2}


def test_the_exit_code_of_an_ending():
    """`hpc-rlhf train` and the submitit task note the same code for the same ending (commands.exit_code)."""
    from hpc_rlhf.commands import exit_code
    from hpc_rlhf.config import ConfigError

    assert exit_code(SystemExit(3)) == 3 and exit_code(SystemExit(0)) == 0
    assert exit_code(SystemExit("usage: ...")) == 1 and exit_code(SystemExit(None)) == 0
    assert exit_code(ConfigError("bad key")) == 2 and exit_code(FileNotFoundError("x.jsonl")) == 2
    assert exit_code(RuntimeError("gloo")) == 1 and exit_code(KeyboardInterrupt()) == 1
