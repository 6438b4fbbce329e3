"""examples/real_asdiv/run.sh end to end on the real assets, shortened: the split, SFT, the held-out eval of the SFT
model, the curriculum (the SFT model's pass rates on the SFT problems, those solved sometimes kept), GRPO from the
SFT model with its validation evals and the held-out eval of its final model, and the report.

Shortened so that CI can afford it: a few SFT steps; the curriculum rated on 32 problems (a seeded subset); GRPO on the
curriculum's first four problems, all four every step, so that the reward the later steps earn on them can be
compared with the first steps'; evals of a few problems.  It checks the records the recipe promises and that the
training reward rose: not a timing test, and not the figures of docs/real_model.md (the full recipe).
"""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[3]
STEPS = 10


@pytest.mark.timeout(1500)
def test_shortened_recipe_writes_its_records_and_the_reward_rises(tmp_path, real_model, asdiv):
    out = tmp_path / "recipe"
    env = dict(os.environ,
               SFT_ARGS="train.max_steps=8 data.max_samples=128",
               RL_ARGS=f"train.max_steps={STEPS} train.num_episodes={STEPS} data.max_samples=4 "
                       "rollout.rollout_batch_size=4 train.train_batch_size=32 train.actor_learning_rate=1e-5 "
                       "data.max_eval_prompts=8 "
                       "eval.eval_n_samples_per_prompt=2 log.eval_steps=-1",
               HELDOUT_ARGS="data.max_eval_prompts=8", CURRICULUM_ARGS="data.max_eval_prompts=32")
    proc = subprocess.run(["bash", str(ROOT / "examples" / "real_asdiv" / "run.sh"), str(out),
                           "--stages", "split,sft,eval_sft,curriculum,grpo_seed1,report"],
                          capture_output=True, text=True, timeout=1400, env=env)
    assert proc.returncode == 0, proc.stderr[-5000:]
    # the splits: 200 validation problems carved out of the 2,005 training ones
    assert len((out / "validation.jsonl").read_text().splitlines()) == 200
    assert len((out / "rl_train.jsonl").read_text().splitlines()) == 1805
    # the curriculum: of the 32 problems rated (8 samples each), those solved sometimes, in the SFT file's order
    cur = json.loads((out / "curriculum_summary.json").read_text())
    kept = [json.loads(x) for x in (out / "curriculum.jsonl").read_text().splitlines()]
    sft_rows = [json.loads(x) for x in (out / "sft_train.jsonl").read_text().splitlines()]
    assert cur["rated"] == 32 and cur["kept"] == len(kept) >= 4
    assert sum(cur["by_correct"].values()) == 32 and cur["kept"] == 32 - cur["by_correct"]["0"] - cur["by_correct"]["8"]
    positions = [sft_rows.index(r) for r in kept]
    assert positions == sorted(positions)
    # the held-out evals: metrics and every sample (8 problems x 8 samples), for both models
    for name in ("sft", "grpo_seed1"):
        metrics = json.loads((out / "heldout" / name / "eval_metrics.json").read_text())["metrics"]
        assert metrics["eval/prompts"] == 8 and {"eval/pass@1", "eval/pass@8", "eval/maj@8"} <= set(metrics)
        [samples] = (out / "heldout" / name / "eval_samples").glob("step_*.jsonl")
        assert len(samples.read_text().splitlines()) == 64
    # the RL run: validation evals at the start and the end, the training reward over its steps
    rows = [json.loads(x) for x in (out / "grpo_seed1" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "eval/pass@1" in r] == [0, STEPS]
    rewards = [r["reward/mean"] for r in rows if "reward/mean" in r]
    assert len(rewards) == STEPS
    assert sum(rewards[-3:]) / 3 > sum(rewards[:3]) / 3, rewards
    # the report: the summary with SFT and the GRPO run's gain and interval, and the stage times
    summary = json.loads((out / "summary.json").read_text())
    grpo = summary["heldout"]["grpo_seed1"]
    assert grpo["gain_ci95"][0] <= grpo["gain_pass@1"] <= grpo["gain_ci95"][1]
    assert set(summary["heldout"]) == {"sft", "grpo_seed1"} and summary["problems"] == 8
    assert {"sft", "eval_sft", "curriculum", "grpo_seed1"} <= set(json.loads((out / "times.json").read_text()))
    assert "| GRPO, seed 1 |" in (out / "report.md").read_text()
