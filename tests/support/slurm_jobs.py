"""Helpers of the training jobs on the local SLURM cluster (tests/e2e/slurm/): configs, the job script `hpc-rlhf
plan` writes, waiting for logged steps, finding a rank's process."""
from __future__ import annotations

import re
import sys
import time
from pathlib import Path

import yaml
from rl_fixtures import make_assets, merged
from sft_fixtures import losses

PY = sys.executable


def write_yaml(path: Path, config: dict) -> Path:
    path.write_text(yaml.safe_dump(config))
    return path


def job_script(cluster, trainer: str, config: Path, *overrides: str) -> Path:
    """`hpc-rlhf plan --script-only`, saved next to the config (what a user would sbatch)."""
    (config.parent / "logs").mkdir(exist_ok=True)
    proc = cluster.run([PY, "-m", "hpc_rlhf.cli", "plan", trainer, "--config", str(config), "--script-only",
                        f"slurm.python={PY}", *overrides], timeout=120)
    path = config.with_suffix(".sbatch")
    path.write_text(proc.stdout)
    return path


def grpo_config(root: Path, steps: int) -> dict:
    """GRPO whose roles form three components: actor+reference, reward, rollout (one node each)."""
    return merged(make_assets(root),
                  rollout={"n_samples_per_prompt": 4, "rollout_batch_size": 4, "generate_max_len": 6},
                  train={"train_batch_size": 16, "micro_train_batch_size": 8, "max_steps": steps, "num_episodes": 3,
                         "actor_learning_rate": 1e-2},
                  algo={"advantage_estimator": "group_norm", "init_kl_coef": 0.001, "use_kl_loss": True},
                  placement={"colocate_actor_ref": True, "dead_rank_timeout_s": 20},
                  log={"logging_steps": 1, "progress_bar": "off", "check_weight_sync": True,
                       "use_tensorboard": False},
                  slurm={"hetjob": "always", "time": "00:10:00"})


def wait_steps(save: Path, n: int, timeout: float = 240) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if (save / "metrics.jsonl").exists() and len(losses(save)) >= n:
            return
        time.sleep(0.1)
    raise AssertionError(f"fewer than {n} logged steps in {save} after {timeout} s")


def first_line_time(path: Path, pattern: str, timeout: float) -> float:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if path.exists() and re.search(pattern, path.read_text()):
            return time.time()
        time.sleep(0.1)
    raise AssertionError(f"{pattern!r} never appeared in {path}")


def rank_pid(job: str, rank: int, timeout: float = 120, step: int = 0) -> int:
    """The process of global rank `rank` of the job's step `step` (found by its SLURM environment): `hpc-rlhf train`,
    or submitit's task running it."""
    deadline = time.time() + timeout
    want = {f"SLURM_JOB_ID={job}".encode(), f"SLURM_PROCID={rank}".encode(), f"SLURM_STEP_ID={step}".encode()}
    while time.time() < deadline:
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                env = set((entry / "environ").read_bytes().split(b"\0"))
                cmd = (entry / "cmdline").read_bytes()
            except OSError:
                continue
            if want <= env and (b"hpc_rlhf.cli" in cmd or b"submitit.core._submit" in cmd):
                return int(entry.name)
        time.sleep(0.2)
    raise AssertionError(f"no process of rank {rank} in job {job}")
