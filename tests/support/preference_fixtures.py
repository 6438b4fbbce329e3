"""Shared pieces of the preference-trainer tests: tiny models, a separable toy preference set, the CLI runner."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import yaml

WORDS = ["cat", "dog", "sun", "map", "cup", "pen", "box", "hat", "car", "bed", "egg", "fan"]


def pair_rows(n: int) -> list[dict]:
    """Trivially separable: 'up' prompts prefer 111 over 0000, 'dn' prompts 00 over 1111.  Responses of
    different lengths, so a per-micro-batch mean would differ from the step's pair mean."""
    rows = []
    for i in range(n):
        up = i % 2 == 0
        good, bad = ("111", "0000") if up else ("00", "1111")
        rows.append({"prompt": f"{'up' if up else 'dn'} {WORDS[i % len(WORDS)]}{i // len(WORDS)}:",
                     "chosen": good, "rejected": bad, "margin": 0.1 * (i % 3)})
    return rows


def _write(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def make_assets(root: Path) -> dict:
    """A tiny policy, a second tiny model (a reference that differs from it), pairs and KTO rows."""
    from hpc_rlhf.models.tiny import build_tiny_model
    kw = dict(arch="llama", hidden_size=32, num_layers=1, num_heads=4, intermediate_size=64,
              max_position_embeddings=64)
    kto_rows = [{"prompt": r["prompt"], "completion": r[k], "label": k == "chosen"}
                for r in pair_rows(40) for k in ("chosen", "rejected")]
    return {"root": root, "model": build_tiny_model(root / "tiny", seed=0, **kw),
            "ref": build_tiny_model(root / "tiny_ref", seed=1, **kw),
            "pairs": _write(root / "pairs.jsonl", pair_rows(40)), "kto": _write(root / "kto.jsonl", kto_rows)}


def cli_config(assets: dict, name: str, data: str, **objective) -> dict:
    """32 training pairs (8 held out), 8 per step, 2 epochs: 8 steps; checkpoints every 2 steps."""
    root = assets["root"] / name
    root.mkdir()
    return {"model": {"pretrain": str(assets["model"]), "param_dtype": "fp32"},
            "data": {"dataset": [str(assets[data])], "max_len": 32, "eval_split_ratio": 0.2},
            "objective": objective,
            "train": {"train_batch_size": 8, "micro_train_batch_size": 2, "max_epochs": 2, "learning_rate": 1e-2,
                      "zero_stage": 2, "seed": 3},
            "ckpt": {"save_path": str(root / "single"), "ckpt_path": str(root / "single_ckpt"), "save_steps": 2},
            "log": {"logging_steps": 1, "eval_steps": 4, "progress_bar": "off"}}


def run_cli(trainer: str, config: dict, nproc: int, *extra: str) -> list[dict]:
    """`hpc-rlhf train TRAINER` on ``nproc`` local ranks; the rows of its metrics.jsonl."""
    root = Path(config["ckpt"]["save_path"]).parent
    cfg_file = root / f"cfg-{len(list(root.glob('cfg-*')))}.yaml"
    cfg_file.write_text(yaml.safe_dump(config))
    proc = subprocess.run([sys.executable, "-m", "hpc_rlhf.cli", "train", trainer, "--config", str(cfg_file),
                           f"launch.nproc={nproc}", *extra], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    save = Path(dict(a.split("=", 1) for a in extra if a.startswith("save_path=")).get(
        "save_path", config["ckpt"]["save_path"]))
    return [json.loads(x) for x in (save / "metrics.jsonl").read_text().splitlines()]


def losses(rows: list[dict]) -> dict[int, float]:
    return {m["step"]: m["loss"] for m in rows if "loss" in m}


def check_learned(rows: list[dict], save: Path, first_accuracy_below: float = 0.8) -> None:
    """The pair (row) accuracy rose to >= 0.9 on the eval set, the loss fell, and the model was exported."""
    train = [m for m in rows if "loss" in m]
    assert train[0]["accuracy"] < first_accuracy_below
    assert train[-1]["loss"] < train[0]["loss"]
    final = [m for m in rows if "eval_accuracy" in m][-1]
    assert final["eval_accuracy"] >= 0.9 > train[0]["accuracy"]
    assert (save / "model.safetensors").is_file() and (save / "hpc_rlhf_config.yaml").is_file()
    assert list((save / "tensorboard").glob("events.out.tfevents.*"))
