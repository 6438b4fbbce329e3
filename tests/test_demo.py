"""The README's main job: the demo learns, and its last stdout line is the JSON report."""
import json
import subprocess
import sys


def test_demo_sft_learns(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "hpc_rlhf.cli", "demo", "--stages", "sft", "--out",
                           str(tmp_path / "demo")], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["base"]["heldout_accuracy"] < 0.05
    assert report["sft"]["heldout_accuracy"] >= 0.3
    assert report["sft"]["last_loss"] < 0.5 * report["sft"]["first_loss"]
