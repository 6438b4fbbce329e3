"""`hpc-rlhf train sft` run again on its own ckpt_path: it resumes (the same config) past a damaged newest
checkpoint, and refuses in seconds with one line (another config, or no intact checkpoint).  ``start_over``
is tested on `trainers/lifecycle.py:resume` in test_checkpoint.py (a third run here would add 15 s)."""
from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from sft_fixtures import sft_config

pytestmark = pytest.mark.slow  # about 27 s; test_checkpoint.py covers each rule in the default suite in seconds

MODEL = "model/mp_rank_00_model_states.pt"


def train(config: Path, *extra: str) -> tuple[subprocess.CompletedProcess, float]:
    t0 = time.time()
    proc = subprocess.run([sys.executable, "-m", "hpc_rlhf.cli", "train", "sft", "--config", str(config), *extra],
                          capture_output=True, text=True, timeout=300)
    return proc, time.time() - t0


def rows(save: Path) -> list[dict]:
    return [json.loads(x) for x in (save / "metrics.jsonl").read_text().splitlines() if '"loss"' in x]


def truncate(path: Path) -> int:
    size = path.stat().st_size
    with open(path, "r+b") as f:
        f.truncate(100)
    return size


def test_rerun_resumes_past_a_damaged_checkpoint_and_refuses_another_config_or_no_intact_one(tmp_path):
    config = sft_config(tmp_path, steps=3)
    save, ckpt = tmp_path / "out", tmp_path / "ckpt"
    config.update(ckpt={"save_path": str(save), "ckpt_path": str(ckpt), "save_steps": 1},
                  launch={"nproc": 1})
    path = tmp_path / "sft.yaml"
    path.write_text(yaml.safe_dump(config))

    proc, _ = train(path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    full = {r["step"]: r["loss"] for r in rows(save)}
    assert sorted(full) == [1, 2, 3] and sorted(p.name for p in ckpt.iterdir()) == ["global_step1", "global_step2"]

    # the same command again: the same config resumes, from step 1 since step 2's model file is truncated
    damaged = ckpt / "global_step2" / MODEL
    size = truncate(damaged)
    proc, _ = train(path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"checkpoint global_step2 is damaged ({damaged}: {size} bytes expected, 100 found): resuming from " \
           f"global_step1" in proc.stderr
    resumed = rows(save)  # step 1's row kept, steps 2 and 3 logged again
    assert [r["step"] for r in resumed] == [1, 2, 3]
    for r in resumed:
        assert r["loss"] == pytest.approx(full[r["step"]], abs=1e-6)

    # another config: one line, before any model is loaded
    proc, seconds = train(path, "learning_rate=0.02")
    assert proc.returncode == 2
    [line] = proc.stderr.strip().splitlines()
    assert line.startswith(f"hpc-rlhf: {ckpt} holds checkpoints of another config (global_step2: "
                           f"train.learning_rate 0.01 -> 0.02)")
    assert "load_checkpoint=true" in line and "ckpt.start_over=true" in line
    assert seconds < 30

    # no intact checkpoint left: one line naming the damaged files
    for step in (1, 2):
        truncate(ckpt / f"global_step{step}" / MODEL)
    proc, seconds = train(path, "load_checkpoint=true")
    assert proc.returncode == 2
    [line] = proc.stderr.strip().splitlines()
    assert line.startswith(f"hpc-rlhf: no intact checkpoint in {ckpt}: {ckpt / 'global_step2' / MODEL}: ")
    assert f"{ckpt / 'global_step1' / MODEL}: " in line
    assert seconds < 30
