"""`hpc-rlhf train sft` run again on its own ckpt_path: it resumes (the same config) past a damaged newest
checkpoint, and refuses in seconds with one line (another config, or no intact checkpoint).  ``start_over``
is tested on `trainers/lifecycle.py:resume` in test_checkpoint.py (a third run here would add 15 s).  Every file
of the exported model and of the checkpoints has the permissions the umask gives; the samples the last step of an
epoch repeats are logged only by a run that reaches such a step."""
from __future__ import annotations

import json
import os
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


@pytest.fixture(scope="module")
def umask_runs(tmp_path_factory) -> dict[int, tuple[Path, str]]:
    """umask -> (run folder, stderr): 30 rows, 8 per step (the 4th step of an epoch repeats 2), a checkpoint every
    step; 2 steps under umask 022, 4 under 077."""
    root = tmp_path_factory.mktemp("umask")
    config = sft_config(root, steps=2)
    data = root / "train30.jsonl"
    data.write_text("".join((root / "train.jsonl").read_text().splitlines(keepends=True)[:30]))
    config["data"]["dataset"] = [str(data)]
    runs = {}
    for mask, steps in ((0o022, 2), (0o077, 4)):
        out = root / f"umask{mask:03o}"
        config.update(ckpt={"save_path": str(out / "model"), "ckpt_path": str(out / "ckpt"), "save_steps": 1},
                      launch={"nproc": 1})
        config["train"]["max_steps"] = steps
        path = root / f"umask{mask:03o}.yaml"
        path.write_text(yaml.safe_dump(config))
        proc = subprocess.run([sys.executable, "-m", "hpc_rlhf.cli", "train", "sft", "--config", str(path)],
                              capture_output=True, text=True, timeout=300, preexec_fn=lambda m=mask: os.umask(m))
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs[mask] = out, proc.stderr
    return runs


@pytest.mark.parametrize("mask", [0o022, 0o077], ids=["umask022", "umask077"])
def test_every_file_of_the_model_and_the_checkpoints_has_the_permissions_of_the_umask(umask_runs, mask):
    out, _ = umask_runs[mask]
    paths = sorted(out.rglob("*"))
    assert out / "model" / "model.safetensors" in paths and out / "ckpt" / "global_step1" / MODEL in paths
    # read and write bits as the umask gives them (DeepSpeed's zero_to_fp32.py is also executable by its owner)
    def as_the_umask_gives(p: Path) -> bool:
        mode = p.stat().st_mode & 0o777
        return mode == 0o777 & ~mask if p.is_dir() else mode & 0o666 == 0o666 & ~mask
    wrong = {str(p.relative_to(out)): oct(p.stat().st_mode & 0o777) for p in paths if not as_the_umask_gives(p)}
    assert not wrong, wrong


def test_the_repeated_samples_are_logged_only_by_a_run_that_reaches_the_last_step_of_an_epoch(umask_runs):
    assert "to fill train_batch_size" not in umask_runs[0o022][1]  # steps 1-2 of 4
    assert "1 of the steps to run (the last of an epoch) repeat 2 samples from the epoch's start to fill " \
           "train_batch_size" in umask_runs[0o077][1]
