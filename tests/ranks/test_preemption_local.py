"""A signal to the local launcher: every rank stops at the same step boundary with a committed
checkpoint and exit code 3; the resumed run logs exactly the losses of an uninterrupted one."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
from sft_fixtures import losses, sft_config, wait_for_steps, with_paths

pytestmark = pytest.mark.slow  # about 50 s: the default suite stays under 12 minutes


def test_signal_stops_every_rank_with_a_checkpoint_and_resume_is_exact(tmp_path):
    """SIGTERM (what SLURM sends on preemption); the SLURM tests cover USR1 and the requeue."""
    steps = 16
    config = sft_config(tmp_path, steps)
    cli = [sys.executable, "-m", "hpc_rlhf.cli", "train", "sft", "--config"]
    subprocess.run(cli + [str(with_paths(config, tmp_path, "full"))], check=True, capture_output=True, timeout=300)
    full = losses(tmp_path / "full")
    assert sorted(full) == list(range(1, steps + 1))

    cut = with_paths(config, tmp_path, "cut")
    proc = subprocess.Popen(cli + [str(cut)], stderr=subprocess.PIPE, text=True)
    wait_for_steps(tmp_path / "cut", 3, proc)
    t0 = time.time()
    os.kill(proc.pid, signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    stop_s = time.time() - t0
    assert proc.returncode == 3, err[-3000:]
    assert "stopped by a signal after step" in err
    stopped_at = max(losses(tmp_path / "cut"))
    assert 3 <= stopped_at < steps
    committed = sorted(p.name for p in (tmp_path / "cut_ckpt").iterdir() if (p / "COMMITTED").exists())
    assert committed == [f"global_step{stopped_at}"]
    assert stop_s < 30

    subprocess.run(cli + [str(cut), "load_checkpoint=true"], check=True, capture_output=True, timeout=300)
    resumed = losses(tmp_path / "cut")  # the same metrics.jsonl, appended by the second run
    assert sorted(resumed) == list(range(1, steps + 1))
    for step, loss in full.items():
        assert resumed[step] == pytest.approx(loss, abs=1e-6), step
