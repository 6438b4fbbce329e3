"""Shared pieces of the stop/resume tests: a 2-rank SFT config on a tiny model, and its metrics."""
from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import yaml


def sft_config(root: Path, steps: int) -> dict:
    """A 2-rank SFT run on a tiny model whose every step is the same size (for resume equality)."""
    from hpc_rlhf.models.tiny import build_tiny_model
    model = build_tiny_model(root / "model", hidden_size=32, num_layers=2, num_heads=4, intermediate_size=64,
                             max_position_embeddings=64, seed=0)
    data = root / "train.jsonl"
    data.write_text("".join(json.dumps({"input": f"{10 + 3 * i}+{40 + 7 * i % 50}=",
                                        "output": str(50 + 3 * i + 7 * i % 50)}) + "\n" for i in range(32)))
    return {"model": {"pretrain": str(model), "param_dtype": "fp32"},
            "data": {"dataset": [str(data)], "max_len": 32},
            "train": {"train_batch_size": 8, "micro_train_batch_size": 2, "max_epochs": 100, "max_steps": steps,
                      "learning_rate": 1e-2, "zero_stage": 2, "seed": 3},
            "log": {"logging_steps": 1, "progress_bar": "off", "use_tensorboard": False},
            "launch": {"nproc": 2}}


def with_paths(config: dict, root: Path, name: str) -> Path:
    config = dict(config, ckpt={"save_path": str(root / name), "ckpt_path": str(root / f"{name}_ckpt")})
    path = root / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def losses(save: Path) -> dict[int, float]:
    rows = [json.loads(x) for x in (save / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


def wait_for_steps(save: Path, n: int, proc: subprocess.Popen, timeout_s: float = 120) -> None:
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if (save / "metrics.jsonl").exists() and len(losses(save)) >= n:
            return
        assert proc.poll() is None, "the run ended before it could be signalled"
        time.sleep(0.05)
    raise AssertionError(f"fewer than {n} steps after {timeout_s} s")
