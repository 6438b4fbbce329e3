"""The demo's GRPO stage with the real vLLM engine generating (`demo --engine vllm`): it learns the
carry as with the transformers engine.  Runs in .venv-vllm (`bash scripts/test_vllm.sh`)."""
import json
import subprocess
import sys

import pytest


@pytest.mark.timeout(1800)
def test_demo_grpo_with_vllm(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "hpc_rlhf.cli", "demo", "--stages", "grpo", "--engine", "vllm",
                           "--out", str(tmp_path / "demo")], capture_output=True, text=True, timeout=1700)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    print(json.dumps(report))
    sft, grpo = report["sft"]["heldout_accuracy"], report["grpo"]
    assert grpo["heldout_accuracy"] >= sft + 0.15
    assert grpo["reward_mean_last"] > grpo["reward_mean_first"]
    rows = [json.loads(x) for x in (tmp_path / "demo" / "grpo" / "metrics.jsonl").read_text().splitlines()]
    assert max(r["actor/mismatch/max_abs_diff"] for r in rows if "reward/mean" in r) < 1e-3
