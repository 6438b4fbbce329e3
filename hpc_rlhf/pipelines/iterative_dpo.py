"""`hpc-rlhf iterative-dpo`: rounds of generate -> score -> best/worst pairs -> `train dpo`.

The driver is one process.  Each stage runs as its own `hpc-rlhf` command (a subprocess on
``iterative.stage_nproc`` local ranks), from a config file written into the round's folder, so any stage
can be rerun by hand.  Round ``k`` (0-based) lives in ``output_dir/round_k``:

    generate.yaml  samples.jsonl   the policy's responses (seed + k)
    score.yaml     scored.jsonl    with the reward model's scores
                   pairs.jsonl     best vs worst response per prompt
    dpo.yaml       model/          `train dpo` from the policy; the next round's policy
    commands.txt   DONE

A round with ``DONE`` is skipped, and within a round a stage whose output exists is not rerun, so a
stopped run continues where it stopped.  ``output_dir/rounds.jsonl`` has one summary row per round.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import shlex
import statistics
import subprocess
import sys
from pathlib import Path

import yaml

from ..config import load_config
from ..config.pipelines import GenerateConfig, IterativeDPOConfig, ScoreConfig
from .builders import best_worst_pairs
from .common import read_jsonl, write_jsonl
from .generate import run_generate
from .score import run_score

log = logging.getLogger("hpc_rlhf.iterative_dpo")

_RANK_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "SLURM_STEP_ID")


class StageFailed(RuntimeError):
    pass


def _run_stage(argv: list[str], rdir: Path, name: str) -> None:
    cmd = [sys.executable, "-m", "hpc_rlhf.cli", *argv]
    with (rdir / "commands.txt").open("a") as f:
        f.write(shlex.join(["hpc-rlhf", *argv]) + "\n")
    # The stage starts its own ranks: it must not believe it is one rank of the driver's launch.
    env = {k: v for k, v in os.environ.items() if k not in _RANK_VARS}
    log.info("%s: %s", name, shlex.join(cmd))
    with (rdir / f"{name}.log").open("w") as out:
        code = subprocess.run(cmd, env=env, stdout=out, stderr=subprocess.STDOUT).returncode
    if code != 0:
        tail = (rdir / f"{name}.log").read_text()[-3000:]
        raise StageFailed(f"{name} stage failed with exit code {code} (log: {rdir / f'{name}.log'}):\n{tail}")


def _run_local(argv: list[str], rdir: Path, name: str) -> None:
    """A one-rank generate/score stage in this process (no process group, nothing left behind); the
    command is still recorded in commands.txt."""
    with (rdir / "commands.txt").open("a") as f:
        f.write(shlex.join(["hpc-rlhf", *argv]) + "\n")
    cls, run = {"generate": (GenerateConfig, run_generate), "score": (ScoreConfig, run_score)}[argv[0]]
    log.info("%s (in process): %s", name, shlex.join(argv))
    run(load_config(cls, argv[2], argv[3:]))


def _write_yaml(path: Path, data: dict) -> Path:
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def run_iterative_dpo(cfg: IterativeDPOConfig) -> list[dict]:
    it = cfg.iterative
    root = Path(it.output_dir)
    root.mkdir(parents=True, exist_ok=True)
    nproc = f"launch.nproc={it.stage_nproc}"
    dpo_base = yaml.safe_load(Path(it.dpo_config).read_text()) if it.dpo_config else {}
    if dpo_base is not None and not isinstance(dpo_base, dict):
        raise ValueError(f"{it.dpo_config} must hold a mapping of options")
    # One-rank generate and score run in this process (a model load instead of a Python start); train dpo,
    # and every stage on several ranks, run as `hpc-rlhf` subprocesses.
    stage = _run_local if it.stage_nproc == 1 else _run_stage
    summaries = []
    policy = cfg.model.pretrain
    for k in range(it.rounds):
        rdir = root / f"round_{k}"
        rdir.mkdir(exist_ok=True)
        samples, scored, pairs_path, model = (rdir / "samples.jsonl", rdir / "scored.jsonl", rdir / "pairs.jsonl",
                                              rdir / "model")
        if (rdir / "DONE").is_file():
            summaries.append(json.loads((rdir / "DONE").read_text()))
            policy = str(model)
            continue
        if not samples.is_file():
            gen = {"model": {**dataclasses.asdict(cfg.model), "pretrain": policy},
                   "data": dataclasses.asdict(cfg.data),
                   "sampling": {**dataclasses.asdict(cfg.sampling), "seed": cfg.sampling.seed + k},
                   "output": {"output_path": str(samples)}}
            stage(["generate", "--config", str(_write_yaml(rdir / "generate.yaml", gen)), nproc], rdir, "generate")
        if not scored.is_file():
            sc = {"reward": dataclasses.asdict(cfg.reward),
                  "data": {"input_path": str(samples), "output_path": str(scored)}}
            stage(["score", "--config", str(_write_yaml(rdir / "score.yaml", sc)), nproc], rdir, "score")
        rows = read_jsonl(scored)
        pairs = best_worst_pairs(rows, min_margin=it.min_margin)
        if not pairs:
            raise StageFailed(f"round {k}: no prompt has responses whose rewards differ by more than "
                              f"min_margin {it.min_margin}; nothing to train on")
        write_jsonl(pairs, pairs_path)
        dpo_yaml = _write_yaml(rdir / "dpo.yaml", dpo_base or {})
        _run_stage(["train", "dpo", "--config", str(dpo_yaml), *it.dpo_overrides,
                    f"model.pretrain={policy}", f"data.dataset={pairs_path}", "data.prompt_key=prompt",
                    "data.chosen_key=chosen", "data.rejected_key=rejected", f"ckpt.save_path={model}",
                    f"ckpt.ckpt_path={rdir / 'dpo_ckpt'}", nproc], rdir, "train_dpo")
        summary = {"round": k, "policy": policy, "model": str(model), "samples": len(rows), "pairs": len(pairs),
                   "reward_mean": statistics.fmean(r["reward"] for r in rows),
                   "chosen_reward_mean": statistics.fmean(p["chosen_reward"] for p in pairs),
                   "rejected_reward_mean": statistics.fmean(p["rejected_reward"] for p in pairs)}
        (rdir / "DONE").write_text(json.dumps(summary) + "\n")
        summaries.append(summary)
        log.info("round %d done: %s", k, summary)
        policy = str(model)
    write_jsonl(summaries, root / "rounds.jsonl")
    return summaries
