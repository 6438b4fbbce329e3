"""The README's main job: every stage learns, and the last stdout line is the JSON report."""
import json
import subprocess
import sys

import pytest


@pytest.mark.slow
def test_demo_learns(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "hpc_rlhf.cli", "demo", "--out", str(tmp_path / "demo")],
                          capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    print(json.dumps(report))
    sft = report["sft"]["heldout_accuracy"]
    assert report["base"]["heldout_accuracy"] < 0.05
    assert 0.3 <= sft <= 0.7  # SFT copies the demonstrations' forgotten carries
    assert report["sft"]["last_loss"] < 0.5 * report["sft"]["first_loss"]
    assert report["grpo"]["heldout_accuracy"] >= sft + 0.15
    assert report["ppo"]["heldout_accuracy"] >= sft + 0.10
    for stage in ("reinforce_baseline", "rloo"):
        assert report[stage]["heldout_accuracy"] > sft, stage
    for stage in ("grpo", "reinforce_baseline", "rloo", "ppo"):
        assert report[stage]["reward_mean_last"] > report[stage]["reward_mean_first"], stage
