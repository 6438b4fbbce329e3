"""The ready job scripts in slurm/: valid, with the HPC options set, accepted by a real sbatch, and the
SFT one run end to end."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from sft_fixtures import losses, sft_config, with_paths

SLURM_DIR = Path(__file__).resolve().parents[3] / "slurm"
SCRIPTS = sorted(SLURM_DIR.glob("*.sbatch"))
CPU_ONLY = ["--gpus-per-task=0", "--cpus-per-task=1"]  # the test cluster has no GPUs


def test_the_expected_scripts_exist():
    assert {p.name for p in SCRIPTS} >= {"sft.sbatch", "rm.sbatch", "dpo.sbatch", "grpo.sbatch", "ppo_hetjob.sbatch"}


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_script_options_and_sbatch_accepts_it(script, slurm_cluster, tmp_path):
    text = script.read_text()
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    for option in ("--kill-on-bad-exit=1", "--requeue", "--signal=USR1@", "# ==== environment", "HF_HUB_OFFLINE=1"):
        assert option in text, (script.name, option)
    if "hetjob" in text:  # per-component options cannot come from the command line: drop the GPUs in a copy
        copy = tmp_path / script.name
        copy.write_text(text.replace(" --gpus-per-task=1", "").replace("--cpus-per-task=8", "--cpus-per-task=1"))
        proc = slurm_cluster.run(["sbatch", "--test-only", str(copy), "cfg.yaml"], check=False)
    else:
        proc = slurm_cluster.run(["sbatch", "--test-only", *CPU_ONLY, "--ntasks-per-node=2", str(script), "cfg.yaml"],
                                 check=False)
    assert proc.returncode == 0 and "to start at" in proc.stderr, proc.stderr


@pytest.mark.slow  # the default suite stays under 12 minutes (moved in issue 16)
def test_sft_script_runs_on_two_tasks(slurm_cluster, tmp_path):
    config = with_paths(sft_config(tmp_path, 4), tmp_path, "sft")
    job = slurm_cluster.sbatch(SLURM_DIR / "sft.sbatch", *CPU_ONLY, "--ntasks-per-node=2",
                               f"--export=ALL,HPC_RLHF_VENV={Path(sys.executable).parents[1]}",
                               script_args=[str(config), "train.learning_rate=0.02"], cwd=tmp_path)
    state = slurm_cluster.wait_done(job, timeout=240)
    assert state == "COMPLETED", (tmp_path / f"hpc-rlhf-sft-{job}.out").read_text()
    assert sorted(losses(tmp_path / "sft")) == [1, 2, 3, 4]
    assert sorted(p.name for p in (tmp_path / "logs" / job / "attempt-0").glob("*.log")) == ["rank-0.log",
                                                                                            "rank-1.log"]
    assert "learning_rate: 0.02" in (tmp_path / "logs" / job / "attempt-0" / "rank-0.log").read_text()
