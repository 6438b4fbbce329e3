"""`hpc-rlhf demo`: build a tiny model, make the addition task, run the stages, report held-out accuracy.

Each stage is a registered function ``stage(ctx) -> dict`` that trains through the same CLI path a
user runs (a config file handed to ``hpc-rlhf train ...``) and returns its figures.  The last line
of stdout is one JSON object keyed by stage.
"""
from __future__ import annotations

import argparse
import json
import logging
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import yaml

from .addition import make_task, write_jsonl

log = logging.getLogger("hpc_rlhf.demo")

STAGES: dict[str, Callable[["DemoContext"], dict]] = {}


def stage(name: str):
    def register(fn):
        STAGES[name] = fn
        return fn
    return register


@dataclass
class DemoContext:
    out: Path
    nproc: int
    seed: int
    base_model: Path
    train_file: Path
    heldout_rows: list[dict]
    results: dict = field(default_factory=dict)
    models: dict = field(default_factory=dict)  # stage name -> trained model folder


def run_training(ctx: DemoContext, trainer: str, name: str, config: dict) -> Path:
    """Write the stage's config file and run `hpc-rlhf train TRAINER --config FILE` as a user would."""
    path = ctx.out / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    # A child process per stage, as a user would run it; no distributed state leaks between stages.
    code = subprocess.call([sys.executable, "-m", "hpc_rlhf.cli", "train", trainer, "--config", str(path)],
                           stdout=sys.stderr)
    if code != 0:
        raise RuntimeError(f"demo stage {name}: `hpc-rlhf train {trainer} --config {path}` exited with {code}")
    return Path(config["ckpt"]["save_path"])


def heldout_accuracy(model_dir: Path, rows: list[dict]) -> float:
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from .evaluate import exact_match_accuracy
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return exact_match_accuracy(model, tokenizer, rows)


@stage("sft")
def sft_stage(ctx: DemoContext) -> dict:
    save = ctx.out / "sft"
    config = {
        "model": {"pretrain": str(ctx.base_model), "param_dtype": "fp32"},
        "data": {"dataset": [str(ctx.train_file)], "input_key": "input", "output_key": "output",
                 "max_len": 32, "eval_split_ratio": 0.05},
        "train": {"train_batch_size": 32, "micro_train_batch_size": 32 // ctx.nproc, "max_epochs": 6,
                  "learning_rate": 1e-3, "lr_warmup_ratio": 0.05, "min_lr_ratio": 0.05, "zero_stage": 2,
                  "weight_decay": 0.0, "seed": ctx.seed},
        "ckpt": {"save_path": str(save), "ckpt_path": str(ctx.out / "sft_ckpt")},
        "log": {"logging_steps": 20, "eval_steps": 200},
        "launch": {"nproc": ctx.nproc},
    }
    t0 = time.time()
    model_dir = run_training(ctx, "sft", "sft", config)
    ctx.models["sft"] = model_dir
    metrics = [json.loads(x) for x in (model_dir / "metrics.jsonl").read_text().splitlines()]
    losses = [m["loss"] for m in metrics if "loss" in m]
    return {"heldout_accuracy": heldout_accuracy(model_dir, ctx.heldout_rows), "steps": metrics[-1]["step"],
            "first_loss": losses[0], "last_loss": losses[-1], "seconds": round(time.time() - t0, 1)}


REWARD_FILE = Path(__file__).with_name("exact_match_reward.py")


def rl_stage(name: str, algo: dict, rollout: dict, train: dict):
    """Register an RL stage: starts from the SFT model, exact-match reward on the training prompts."""

    def run(ctx: DemoContext) -> dict:
        t0 = time.time()
        config = {
            "model": {"pretrain": str(ctx.models["sft"]), "param_dtype": "fp32"},
            "data": {"prompt_data": [str(ctx.train_file)], "input_key": "input", "label_key": "label"},
            "reward": {"reward_func": str(REWARD_FILE)},
            "algo": algo,
            "rollout": {"generate_max_len": 6, **rollout},
            "train": {"zero_stage": 2, "seed": ctx.seed, "lr_scheduler": "constant_with_warmup",
                      "lr_warmup_ratio": 0.0, **train},
            "placement": {"colocate_all": True, "actor_num_ranks": ctx.nproc},
            "ckpt": {"save_path": str(ctx.out / name), "ckpt_path": str(ctx.out / f"{name}_ckpt")},
            "log": {"logging_steps": 1},
        }
        model_dir = run_training(ctx, "rl", name, config)
        metrics = [json.loads(x) for x in (model_dir / "metrics.jsonl").read_text().splitlines()]
        rewards = [m["reward/mean"] for m in metrics]
        k = max(1, len(rewards) // 5)
        return {"heldout_accuracy": heldout_accuracy(model_dir, ctx.heldout_rows), "steps": metrics[-1]["step"],
                "reward_mean_first": round(sum(rewards[:k]) / k, 4), "reward_mean_last": round(sum(rewards[-k:]) / k, 4),
                "seconds": round(time.time() - t0, 1)}
    run.needs = ("sft",)
    return stage(name)(run)


GROUP = {"n_samples_per_prompt": 8, "rollout_batch_size": 16}
GROUP_TRAIN = {"train_batch_size": 128, "micro_train_batch_size": 128, "actor_learning_rate": 5e-5, "max_steps": 40}
rl_stage("grpo", {"advantage_estimator": "group_norm"}, GROUP, GROUP_TRAIN)
rl_stage("reinforce_baseline", {"advantage_estimator": "reinforce_baseline"}, GROUP, GROUP_TRAIN)
rl_stage("rloo", {"advantage_estimator": "rloo"}, GROUP, GROUP_TRAIN)
rl_stage("ppo", {"advantage_estimator": "gae", "lambd": 0.95},
         {"n_samples_per_prompt": 2, "rollout_batch_size": 64},
         {"train_batch_size": 128, "micro_train_batch_size": 128, "actor_learning_rate": 5e-5,
          "critic_learning_rate": 2e-4, "freezing_actor_steps": 3, "max_steps": 40})


def add_cli_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--stages", default="all", help=f"comma-separated subset of: {', '.join(STAGES)} (default all)")
    p.add_argument("--out", default="demo_out", help="working folder (models, data, metrics)")
    p.add_argument("--nproc", type=int, default=1, help="local ranks per training stage")
    p.add_argument("--seed", type=int, default=1)


def run_demo(stages: list[str], out: Path, nproc: int, seed: int) -> dict:
    from ..models.tiny import build_tiny_model
    unknown = [s for s in stages if s not in STAGES]
    for name in list(stages):  # a stage that starts from another's model pulls that stage in first
        for need in getattr(STAGES.get(name), "needs", ()):
            if need not in stages:
                stages.insert(0, need)
    if unknown:
        raise SystemExit(f"hpc-rlhf demo: unknown stage(s) {', '.join(unknown)}; choose from {', '.join(STAGES)}")
    out.mkdir(parents=True, exist_ok=True)
    train_rows, held_rows = make_task(seed)
    train_file = write_jsonl(train_rows, out / "data" / "train.jsonl")
    write_jsonl(held_rows, out / "data" / "heldout.jsonl")
    base = build_tiny_model(out / "base_model", arch="llama", hidden_size=128, num_layers=4, num_heads=4,
                            intermediate_size=256, max_position_embeddings=64, seed=seed)
    ctx = DemoContext(out=out, nproc=nproc, seed=seed, base_model=base, train_file=train_file,
                      heldout_rows=held_rows)
    ctx.results["base"] = {"heldout_accuracy": heldout_accuracy(base, held_rows)}
    for name in stages:
        log.info("demo stage %s", name)
        ctx.results[name] = STAGES[name](ctx)
    return ctx.results


def run_cli(args: argparse.Namespace) -> int:
    stages = list(STAGES) if args.stages == "all" else [s.strip() for s in args.stages.split(",") if s.strip()]
    t0 = time.time()
    results = run_demo(stages, Path(args.out), args.nproc, args.seed)
    results["total_seconds"] = round(time.time() - t0, 1)
    sys.stdout.flush()
    print(json.dumps(results), flush=True)
    return 0
