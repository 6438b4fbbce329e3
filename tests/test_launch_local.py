"""The local launcher: a rank that dies takes the job down quickly, naming itself."""
import json
import os
import signal
import subprocess
import sys
import time

import psutil
import yaml


def test_killed_rank_stops_the_job(tmp_path):
    from hpc_rlhf.models.tiny import build_tiny_model
    model = build_tiny_model(tmp_path / "m", hidden_size=32, num_layers=2, max_position_embeddings=64)
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"input": f"{i}+1=", "output": str(i + 1)}) + "\n" for i in range(64)))
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump({
        "model": {"pretrain": str(model), "param_dtype": "fp32"},
        "data": {"dataset": [str(data)], "max_len": 32},
        "train": {"train_batch_size": 4, "micro_train_batch_size": 2, "max_epochs": 1000, "zero_stage": 1},
        "ckpt": {"save_path": str(tmp_path / "out"), "ckpt_path": str(tmp_path / "ck")},
        "log": {"logging_steps": 1, "progress_bar": "off"}}))
    launcher = subprocess.Popen([sys.executable, "-m", "hpc_rlhf.cli", "train", "sft", "--config", str(cfg),
                                 "launch.nproc=2"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        metrics = tmp_path / "out" / "metrics.jsonl"
        deadline = time.time() + 120
        while not (metrics.is_file() and metrics.read_text().strip()):
            assert launcher.poll() is None, launcher.communicate()[1][-3000:]
            assert time.time() < deadline, "training did not start"
            time.sleep(0.2)
        ranks = {int(p.environ()["RANK"]): p for p in psutil.Process(launcher.pid).children()}
        assert sorted(ranks) == [0, 1]
        t_kill = time.time()
        os.kill(ranks[1].pid, signal.SIGKILL)
        _, err = launcher.communicate(timeout=60)
        elapsed = time.time() - t_kill
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert launcher.returncode != 0
    assert "rank 1 exited with code -9" in err
    print(f"launcher exited {elapsed:.1f} s after the kill")
    assert elapsed < 30, elapsed
    assert not ranks[0].is_running() or ranks[0].status() == psutil.STATUS_ZOMBIE
