"""Evaluation with n samples per prompt in `train rl` and `hpc-rlhf eval` (docs/eval.md): the keys and their
values against the pure metrics, eval_at_start and eval_only, the best model kept apart from the checkpoint
rotation, the early stop, and the eval command giving the in-training numbers."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from hpc_rlhf.algorithms.eval_metrics import EvalSample, group_metrics
from hpc_rlhf.checkpoint.layout import committed_steps
from rl_fixtures import make_assets, merged, run_rl

LOGGING_REWARD = '''
import json

def reward_func(queries, prompts, labels):
    # 1 when the response has at least 3 distinct characters: varied for a random model; each call logged
    out = [1.0 if len(set(q[len(p):])) >= 3 else 0.0 for q, p in zip(queries, prompts)]
    with open({log!r}, "a") as f:
        for label, r in zip(labels, out):
            f.write(json.dumps({{"label": label, "reward": r}}) + "\\n")
    return out
'''

KNOWN_REWARD = '''
def reward_func(queries, prompts, labels):
    # the label decides: right answers 1, wrong 0, "fail" rows a failed reward (NaN: invalid)
    return [{"good": 1.0, "bad": 0.0}.get(label, float("nan")) for label in labels]
'''

EVAL_KEYS = {"eval/prompts", "eval/prompts_no_valid", "eval/invalid_samples", "eval/samples", "eval/reward_mean",
             "time/eval_s", "time/eval_generate_s", "time/eval_score_s",
             "eval/reward/func/retries", "eval/reward/func/timeouts"}  # the reward function's own counters


def _metric_keys(n: int, stem: str) -> set[str]:
    ks = [1, 2, 4][:{1: 1, 2: 2, 4: 3}[n]]
    return (EVAL_KEYS | {f"eval/pass@{k}" for k in ks} | {f"eval/left_out@{k}" for k in ks}
            | {f"eval/avg@{n}", f"eval_{stem}_pass1", f"eval_{stem}_pass{n}"})


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("rl_eval")
    return root, make_assets(root)


def _write(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _without_time(m: dict) -> dict:
    return {k: v for k, v in m.items() if not k.startswith("time/")}


SAMPLING = {"eval_n_samples_per_prompt": 4, "eval_temperature": 1.0, "eval_batch_size": 2, "eval_max_new_tokens": 6}


@pytest.fixture(scope="module")
def eval_only_run(assets):
    """`train rl` with eval.eval_only: 4 sampled responses per eval prompt (two prompts share their text), 2
    prompts per generate call, a reward function that logs what it saw."""
    root, base = assets
    reward = root / "logging_reward.py"
    reward.write_text(LOGGING_REWARD.format(log=str(root / "rewards_seen.jsonl")))
    evalset = _write(root / "evalset.jsonl", [{"input": "7+1=", "label": "e0"}, {"input": "7+1=", "label": "e1"},
                                             {"input": "3+3=", "label": "e2"}])
    cfg = merged(base, reward={"reward_func": str(reward)}, placement={"colocate_all": True},
                 data={"eval_prompt_data": [evalset]}, eval={"eval_only": True, **SAMPLING})
    [row] = run_rl(cfg, root, "eval_only")
    return row, evalset, reward


def test_eval_only_n_samples_match_the_pure_metrics(assets, eval_only_run):
    """The logged metrics are group_metrics of the rewards the reward function saw, grouped by prompt."""
    root, _ = assets
    row, _, _ = eval_only_run
    log = root / "rewards_seen.jsonl"
    assert row["step"] == 0 and set(row) - {"step"} == _metric_keys(4, "evalset")
    seen = [json.loads(x) for x in log.read_text().splitlines()]
    assert sorted(s["label"] for s in seen) == ["e0"] * 4 + ["e1"] * 4 + ["e2"] * 4  # e0, e1: two groups
    index: dict[str, int] = {}
    expected = group_metrics([EvalSample(s["label"], index.setdefault(s["label"], 0), True, s["reward"])
                              for s in seen], n=4)
    assert 0 < expected["pass@1"] < expected["pass@4"]  # the rewards vary: a test that can fail
    for k, v in expected.items():
        if k not in ("reward_mean", "max_reward_mean"):
            assert row[f"eval/{k}"] == pytest.approx(v, abs=1e-12), k
    assert row["eval_evalset_pass1"] == pytest.approx(expected["reward_mean"])
    assert row["eval_evalset_pass4"] == pytest.approx(expected["max_reward_mean"])
    assert row["eval/samples"] == 12 and row["time/eval_s"] >= row["time/eval_generate_s"] > 0
    saved = json.loads((root / "eval_only" / "eval_metrics.json").read_text())
    assert saved == {"step": 0, "metrics": {k: v for k, v in row.items() if k != "step"}}
    assert not list((root / "eval_only").glob("*.safetensors"))  # no training, no export


@pytest.mark.slow  # about 20 s: the default suite keeps under 12 min
def test_eval_at_start_and_best_model_kept_apart_from_rotation(assets):
    root, base = assets
    cfg = merged(base, placement={"colocate_all": True}, train={"max_steps": 3},
                 data={"eval_prompt_data": base["data"]["prompt_data"], "max_eval_prompts": 4},
                 eval={"eval_at_start": True, "eval_n_samples_per_prompt": 2, "eval_temperature": 1.0,
                       "best_metric": "eval/avg@2"},
                 log={"eval_steps": 1}, ckpt={"save_steps": 1, "max_ckpt_num": 1})
    rows = run_rl(cfg, root, "best")
    evals = [r for r in rows if "eval/avg@2" in r]
    assert [r["step"] for r in evals] == [0, 1, 2, 3]  # at the start, then every step
    assert "actor/loss" not in evals[0] and "actor/loss" in evals[1]
    best = max(evals, key=lambda r: r["eval/avg@2"])  # the first of equal values stays
    saved = json.loads((root / "best" / "best" / "best.json").read_text())
    assert saved == {"metric": "eval/avg@2", "value": best["eval/avg@2"], "mode": "max", "step": best["step"]}
    assert (root / "best" / "best" / "model.safetensors").is_file()
    assert committed_steps(root / "best_ckpt") == [2]  # saved after steps 1 and 2, the rotation kept one
    assert (root / "best" / "model.safetensors").is_file()  # the final export beside best/


@pytest.mark.slow  # about 20 s: the default suite keeps under 12 min
def test_early_stop_at_the_threshold_checkpoints_and_exports(assets):
    """best_mode min with a threshold every value reaches: the run stops at the first eval (after step 1 of 4),
    with a checkpoint of step 1 and the final model."""
    root, base = assets
    evalset = _write(root / "early.jsonl", [{"input": "1+1=", "label": "2"}, {"input": "2+2=", "label": "4"}])
    cfg = merged(base, placement={"colocate_all": True}, train={"max_steps": 4}, log={"eval_steps": 1},
                 data={"eval_prompt_data": [evalset]},
                 eval={"best_metric": "eval_early_pass1", "best_mode": "min", "early_stop_threshold": 100.0})
    rows = run_rl(cfg, root, "early")
    assert [r["step"] for r in rows if "eval/pass@1" in r] == [1]
    assert max(r["step"] for r in rows) == 1
    assert committed_steps(root / "early_ckpt") == [1]
    assert (root / "early" / "model.safetensors").is_file()
    assert json.loads((root / "early" / "best" / "best.json").read_text())["step"] == 1


def _eval_command(root: Path, name: str, config: dict) -> dict:
    """`hpc-rlhf eval` on ``config``: the metrics it printed."""
    path = root / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    proc = subprocess.run([sys.executable, "-m", "hpc_rlhf.cli", "eval", "--config", str(path)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_eval_command_gives_hand_values(assets):
    """`hpc-rlhf eval` on rewards set by the labels: pass@k known by hand; metrics printed and written."""
    root, base = assets
    reward = root / "known_reward.py"
    reward.write_text(KNOWN_REWARD)
    evalset = _write(root / "known.jsonl", [{"input": "1+1=", "label": "good"}, {"input": "1+1=", "label": "good"},
                                           {"input": "2+2=", "label": "bad"}, {"input": "3+3=", "label": "fail"}])
    out = root / "eval_cmd"
    printed = _eval_command(root, "eval_cmd", {
        "model": base["model"], "data": {"eval_prompt_data": [evalset]}, "reward": {"reward_func": str(reward)},
        "output_path": str(out), "rollout": {"generate_max_len": 5},
        "eval": {"eval_n_samples_per_prompt": 2, "eval_temperature": 1.0, "save_samples": True}})
    # groups: good, good (same text, another prompt), bad, fail (no valid sample)
    assert printed["eval/prompts"] == 4 and printed["eval/prompts_no_valid"] == 1
    assert printed["eval/invalid_samples"] == 2 and printed["eval/samples"] == 8
    assert printed["eval/pass@1"] == printed["eval/pass@2"] == pytest.approx(2 / 3)
    assert printed["eval/avg@2"] == pytest.approx(2 / 3) and printed["eval/left_out@2"] == 1
    assert printed["eval_known_pass1"] == pytest.approx(4 / 6) and printed["eval_known_pass2"] == pytest.approx(2 / 3)
    assert set(printed) == _metric_keys(2, "known")
    assert json.loads((out / "eval_metrics.json").read_text())["metrics"] == printed
    [row] = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert row == {"step": 0, **printed}
    # eval.save_samples: every sample, in prompt and sample order, with its reward and correctness
    saved = [json.loads(x) for x in (out / "eval_samples" / "step_0.jsonl").read_text().splitlines()]
    assert [(s["prompt_id"], s["sample"]) for s in saved] == [(p, k) for p in range(4) for k in range(2)]
    assert [s["label"] for s in saved] == ["good"] * 4 + ["bad"] * 2 + ["fail"] * 2
    assert [s["correct"] for s in saved] == [True] * 4 + [False] * 4
    assert [s["reward"] for s in saved] == [1.0] * 4 + [0.0] * 2 + [None] * 2
    assert [s["valid"] for s in saved] == [True] * 6 + [False] * 2
    assert all(s["prompt"] == ["1+1=", "1+1=", "2+2=", "3+3="][s["prompt_id"]] for s in saved)
    assert all(isinstance(s["response"], str) for s in saved)


@pytest.mark.slow  # about 20 s: the default suite keeps under 12 min
def test_eval_command_gives_the_in_training_numbers(assets, eval_only_run):
    """The same model, data, reward, sampling and seed: `hpc-rlhf eval` (no actor) draws the same samples
    as `train rl`'s eval and reports the same numbers."""
    root, base = assets
    row, evalset, reward = eval_only_run
    printed = _eval_command(root, "eval_same", {
        "model": base["model"], "data": {"eval_prompt_data": [evalset]}, "reward": {"reward_func": str(reward)},
        "output_path": str(root / "eval_same"), "seed": base["train"]["seed"],
        "rollout": {"generate_max_len": base["rollout"]["generate_max_len"]}, "eval": SAMPLING})
    assert _without_time(printed) == _without_time({k: v for k, v in row.items() if k != "step"})


@pytest.mark.parametrize("overrides, message", [
    (["eval.eval_n_samples_per_prompt=4"], "identical greedy samples"),
    (["eval.early_stop_threshold=0.5"], "needs eval.best_metric"),
    (["eval.best_metric=reward/mean"], "is not an eval metric"),
    (["data.eval_prompt_data=null", "eval.eval_only=true"], "eval.eval_only needs eval prompts"),
])
def test_eval_options_are_checked_at_parse_time(overrides, message):
    from hpc_rlhf.config import ConfigError, load_config
    from hpc_rlhf.config.rl import RLConfig
    with pytest.raises(ConfigError, match=message):
        load_config(RLConfig, None, ["model.pretrain=./m", "data.prompt_data=./p.jsonl", "reward.reward_func=./r.py",
                                     "data.eval_prompt_data=./e.jsonl", *overrides])
