"""Shared pieces of the RL tests: a tiny model, prompts, a reward file with spread, and the CLI runner."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import yaml

REWARD = '''
def reward_func(queries, prompts, labels):
    # more distinct characters in the response -> more reward: varied even for a random model
    return [len(set(q[len(p):])) / 6.0 for q, p in zip(queries, prompts)]
'''


def make_assets(root: Path, **model_shape) -> dict:
    from hpc_rlhf.models.tiny import build_tiny_model
    model = build_tiny_model(root / "model", **{"hidden_size": 32, "num_layers": 2, "max_position_embeddings": 64,
                                                "seed": 0, **model_shape})
    data = root / "prompts.jsonl"
    data.write_text("".join(json.dumps({"input": f"{i}+{i % 7}=", "label": str(i + i % 7)}) + "\n"
                            for i in range(40)))
    reward = root / "reward.py"
    reward.write_text(REWARD)
    return {"model": {"pretrain": str(model), "param_dtype": "fp32"},
            "data": {"prompt_data": [str(data)], "input_key": "input", "label_key": "label"},
            "reward": {"reward_func": str(reward)},
            "rollout": {"n_samples_per_prompt": 2, "rollout_batch_size": 4, "generate_max_len": 5},
            "train": {"train_batch_size": 8, "micro_train_batch_size": 4, "actor_learning_rate": 1e-3,
                      "critic_learning_rate": 1e-3, "max_steps": 4, "zero_stage": 2, "seed": 5},
            "log": {"logging_steps": 1, "progress_bar": "off", "check_weight_sync": True}}


def merged(base: dict, **sections) -> dict:
    out = {k: dict(v) if isinstance(v, dict) else v for k, v in base.items()}
    for k, v in sections.items():
        out.setdefault(k, {}).update(v)
    return out


def start_rl(config: dict, root: Path, name: str, *extra: str) -> subprocess.Popen:
    """`hpc-rlhf train rl` on ``config`` (save_path root/name) started in the background."""
    config = merged(config, ckpt={"save_path": str(root / name), "ckpt_path": config.get("ckpt", {}).get(
        "ckpt_path", str(root / f"{name}_ckpt"))})
    path = root / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    return subprocess.Popen([sys.executable, "-m", "hpc_rlhf.cli", "train", "rl", "--config", str(path), *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish_rl(proc: subprocess.Popen, root: Path, name: str, timeout: int = 400) -> list[dict]:
    """Wait for a run of ``start_rl``; it must succeed.  Its metrics rows (its log: root/name.log)."""
    try:
        _, stderr = proc.communicate(timeout=timeout)
    finally:
        proc.kill()
    (root / f"{name}.log").write_text(stderr)
    assert proc.returncode == 0, stderr[-5000:]
    return [json.loads(x) for x in (root / name / "metrics.jsonl").read_text().splitlines()]


def run_rl(config: dict, root: Path, name: str, *extra: str, timeout: int = 400) -> list[dict]:
    return finish_rl(start_rl(config, root, name, *extra), root, name, timeout)
