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
    """Write the stage's config file and run `hpc-rlhf train TRAINER --config FILE` on ctx.nproc ranks."""
    path = ctx.out / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    # A child process per stage, as a user would run it; no distributed state leaks between stages.
    code = subprocess.call([sys.executable, "-m", "hpc_rlhf.cli", "train", trainer, "--config", str(path),
                            f"launch.nproc={ctx.nproc}"], stdout=sys.stderr)
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
    }
    t0 = time.time()
    model_dir = run_training(ctx, "sft", "sft", config)
    ctx.models["sft"] = model_dir
    metrics = [json.loads(x) for x in (model_dir / "metrics.jsonl").read_text().splitlines()]
    losses = [m["loss"] for m in metrics if "loss" in m]
    return {"heldout_accuracy": heldout_accuracy(model_dir, ctx.heldout_rows), "steps": metrics[-1]["step"],
            "first_loss": losses[0], "last_loss": losses[-1], "seconds": round(time.time() - t0, 1)}


def add_cli_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--stages", default="all", help=f"comma-separated subset of: {', '.join(STAGES)} (default all)")
    p.add_argument("--out", default="demo_out", help="working folder (models, data, metrics)")
    p.add_argument("--nproc", type=int, default=1, help="local ranks per training stage")
    p.add_argument("--seed", type=int, default=1)


def run_demo(stages: list[str], out: Path, nproc: int, seed: int) -> dict:
    from ..models.tiny import build_tiny_model
    unknown = [s for s in stages if s not in STAGES]
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
