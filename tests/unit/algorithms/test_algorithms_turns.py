"""Multi-turn samples in the advantage math, against hand-derived numbers (issue 16).

A multi-turn sample's response holds the action tokens of every turn with the environment's feedback tokens
between them (mask 0 there).  The advantages run on the compacted action tokens (``returns.action_positions``)
and are expanded back with 0 on the feedback.  Each turn's reward but the last sits on the turn's last action
token (``Experience.intermediate_rewards``); the scalar reward of the sample keeps the rest of the total.

Common batch (one group of three samples, R = 6):
    mask   row 0 = [1, 1, 0, 0, 1, 1]   turn 1: actions 0, 1; feedback 2, 3; turn 2: actions 4, 5
           row 1 = [1, 1, 1, 0, 0, 0]   one turn, three tokens
           row 2 = [1, 0, 0, 0, 0, 0]   one token
    scalar = [1.0, 2.0, 0.0]            on each row's last action token (5, 2, 0)
    turn   = 0.5 at row 0, position 1   (turn 1's reward on its last action token)
    values row 0 = [0.1, 0.2, 9, 9, 0.3, 0.4]   (9: on feedback tokens, must not count)
           row 1 = [0.5, 0.5, 0.5, 9, 9, 9]    row 2 = [0.25, 9, 9, 9, 9, 9]
Compacted row 0: r = [0, 0.5, 0, 1], V = [0.1, 0.2, 0.3, 0.4].
"""
from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from hpc_rlhf.algorithms.returns import action_positions, compact, expand, has_gaps
from hpc_rlhf.algorithms.rl_algorithm import RLAlgorithm
from hpc_rlhf.config import load_config
from hpc_rlhf.config.rl import AlgoConfig, RLConfig
from hpc_rlhf.roles.experience import Experience

MASK = torch.tensor([[1.0, 1, 0, 0, 1, 1], [1, 1, 1, 0, 0, 0], [1, 0, 0, 0, 0, 0]])
SCALAR = torch.tensor([1.0, 2.0, 0.0])
TURN = torch.zeros(3, 6)
TURN[0, 1] = 0.5
VALUES = torch.tensor([[0.1, 0.2, 9, 9, 0.3, 0.4], [0.5, 0.5, 0.5, 9, 9, 9], [0.25, 9, 9, 9, 9, 9]])
GROUP = torch.tensor([0, 0, 0])


def _algo(**options) -> RLAlgorithm:
    return RLAlgorithm(load_config(AlgoConfig, None, [f"{k}={v}" for k, v in options.items()]), single_update=True)


def _advantages(algo: RLAlgorithm, values=None, valid=None, turn=TURN, mask=MASK, scalar=SCALAR):
    return algo.advantages(scalar, mask, GROUP, None, None, values, all_reduce=None, valid=valid, turn_rewards=turn)


def _close(x: torch.Tensor, want: list[list[float]], tol: float = 1e-6) -> None:
    assert x.shape == torch.Size([len(want), len(want[0])])
    assert x.flatten().tolist() == pytest.approx([v for row in want for v in row], abs=tol), x.tolist()


# ---- returns.py: has_gaps, action_positions, compact, expand ---------------------------------------------------
def test_has_gaps_only_for_a_zero_before_a_one():
    assert has_gaps(MASK)
    assert not has_gaps(torch.tensor([[1.0, 1, 1, 0], [1, 0, 0, 0]]))   # padding after the end is no gap
    assert has_gaps(torch.tensor([[0.0, 1]]))                            # a leading 0 is one
    assert not has_gaps(torch.tensor([[1.0], [0.0]]))                    # one column: nothing to compare
    assert not has_gaps(torch.zeros(2, 0))
    assert not has_gaps(torch.zeros(0, 4))


def test_action_positions_left_align_the_action_tokens():
    mask = torch.tensor([[1.0, 0, 0, 1, 1], [1, 1, 0, 0, 0], [0, 0, 0, 0, 0], [0, 1, 0, 1, 0]])
    idx, cmask = action_positions(mask)
    assert idx.tolist() == [[0, 3, 4], [0, 1, 0], [0, 0, 0], [1, 3, 0]]
    assert cmask.tolist() == [[1, 1, 1], [1, 1, 0], [0, 0, 0], [1, 1, 0]]
    assert cmask.dtype == mask.dtype
    x = torch.arange(20.0).reshape(4, 5) + 1
    xc = compact(x, idx, cmask)
    assert xc.tolist() == [[1, 4, 5], [6, 7, 0], [0, 0, 0], [17, 19, 0]]
    back = expand(xc, idx, cmask, 5)
    assert back.tolist() == (x * mask).tolist()       # expand inverts compact on the action positions, 0 elsewhere
    # no action token anywhere: an empty compact axis, and expand gives zeros
    idx0, cmask0 = action_positions(torch.zeros(2, 3))
    assert idx0.shape == (2, 0) and cmask0.shape == (2, 0)
    assert expand(compact(torch.ones(2, 3), idx0, cmask0), idx0, cmask0, 3).tolist() == [[0.0] * 3] * 2


def test_compact_ignores_garbage_off_the_action_tokens():
    idx, cmask = action_positions(MASK)
    _close(compact(VALUES, idx, cmask), [[0.1, 0.2, 0.3, 0.4], [0.5, 0.5, 0.5, 0], [0.25, 0, 0, 0]])


# ---- RLAlgorithm.advantages on a gapped mask with turn rewards -------------------------------------------------
def test_gae_gamma1_lambda1_bootstraps_across_the_feedback():
    """γ = λ = 1: A_t = Σ_{k ≥ t} r_k − V_t on the compacted row; returns = Σ_{k ≥ t} r_k.
    Row 0: A = [1.5 − 0.1, 1.5 − 0.2, 1 − 0.3, 1 − 0.4], returns [1.5, 1.5, 1, 1]; row 1: [2 − 0.5] x 3;
    row 2: [0 − 0.25].  (With the feedback left in place, V_2 = 0 would cut the bootstrap: A_1 = 1.0.)"""
    adv, ret, kl = _advantages(_algo(advantage_estimator="gae", gamma=1.0, lambd=1.0, whiten_advantages=False),
                               VALUES)
    _close(adv, [[1.4, 1.3, 0, 0, 0.7, 0.6], [1.5, 1.5, 1.5, 0, 0, 0], [-0.25, 0, 0, 0, 0, 0]])
    _close(ret, [[1.5, 1.5, 0, 0, 1.0, 1.0], [2, 2, 2, 0, 0, 0], [0, 0, 0, 0, 0, 0]])
    assert kl.tolist() == [[0.0] * 6] * 3


def test_gae_lambda_half_steps_over_the_feedback():
    """γ = 1, λ = 0.5.  Row 0 compacted: δ = [0 + 0.2 − 0.1, 0.5 + 0.3 − 0.2, 0 + 0.4 − 0.3, 1 − 0.4]
    = [0.1, 0.6, 0.1, 0.6]; A_3 = 0.6, A_2 = 0.1 + 0.3 = 0.4, A_1 = 0.6 + 0.2 = 0.8, A_0 = 0.1 + 0.4 = 0.5;
    returns = A + V = [0.6, 1.0, 0.7, 1.0].  Row 1: δ = [0, 0, 1.5]: A = [0.375, 0.75, 1.5], returns
    [0.875, 1.25, 2.0].  Row 2: A = −0.25, returns 0."""
    adv, ret, _ = _advantages(_algo(advantage_estimator="gae", gamma=1.0, lambd=0.5, whiten_advantages=False),
                              VALUES)
    _close(adv, [[0.5, 0.8, 0, 0, 0.4, 0.6], [0.375, 0.75, 1.5, 0, 0, 0], [-0.25, 0, 0, 0, 0, 0]])
    _close(ret, [[0.6, 1.0, 0, 0, 0.7, 1.0], [0.875, 1.25, 2.0, 0, 0, 0], [0, 0, 0, 0, 0, 0]])


def test_gae_whitening_counts_action_tokens_only():
    """The λ = 1 advantages above, whitened over the 8 action tokens (not the 2 feedback tokens):
    values [1.4, 1.3, 0.7, 0.6, 1.5, 1.5, 1.5, −0.25], μ = 8.25/8 = 1.03125, σ² = population variance."""
    adv, _, _ = _advantages(_algo(advantage_estimator="gae", gamma=1.0, lambd=1.0, whiten_advantages=True), VALUES)
    vals = [1.4, 1.3, 0.7, 0.6, 1.5, 1.5, 1.5, -0.25]
    mu = 8.25 / 8
    sd = math.sqrt(sum((v - mu) ** 2 for v in vals) / 8 + 1e-8)
    w = [(v - mu) / sd for v in vals]
    _close(adv, [[w[0], w[1], 0, 0, w[2], w[3]], [w[4], w[5], w[6], 0, 0, 0], [w[7], 0, 0, 0, 0, 0]], 1e-5)


def test_reinforce_returns_hold_the_turn_reward_before_it_only():
    """REINFORCE++ (γ = 1, no whitening): G = [1.5, 1.5, 1, 1] on row 0's actions (the turn reward 0.5 on
    token 1 counts for tokens 0 and 1 only), [2, 2, 2], [0]."""
    adv, ret, _ = _advantages(_algo(advantage_estimator="reinforce", gamma=1.0, whiten_advantages=False))
    _close(adv, [[1.5, 1.5, 0, 0, 1, 1], [2, 2, 2, 0, 0, 0], [0, 0, 0, 0, 0, 0]])
    assert torch.equal(ret, adv)


def test_reinforce_discounts_per_action_token_not_per_feedback_token():
    """γ = 0.5 on the compacted row 0, r = [0, 0.5, 0, 1]: G_3 = 1, G_2 = 0.5, G_1 = 0.5 + 0.25 = 0.75,
    G_0 = 0.375 (with the two feedback tokens counted as steps G_1 would be 0.5 + 0.5^4 = 0.5625)."""
    adv, _, _ = _advantages(_algo(advantage_estimator="reinforce", gamma=0.5, whiten_advantages=False))
    _close(adv[:1], [[0.375, 0.75, 0, 0, 0.5, 1.0]])


def test_reinforce_whitening_over_action_tokens():
    """G over the 8 action tokens [1.5, 1.5, 1, 1, 2, 2, 2, 0]: μ = 11/8 = 1.375, σ² = 3.375/8 = 0.421875."""
    adv, _, _ = _advantages(_algo(advantage_estimator="reinforce", gamma=1.0, whiten_advantages=True))
    sd = math.sqrt(0.421875 + 1e-8)
    a, b, c, d = ((v - 1.375) / sd for v in (1.5, 1.0, 2.0, 0.0))
    _close(adv, [[a, a, 0, 0, b, b], [c, c, c, 0, 0, 0], [d, 0, 0, 0, 0, 0]], 1e-5)


def test_group_norm_sees_the_total_of_the_turn_rewards():
    """GRPO on totals R = [1 + 0.5, 2, 0] (mean 7/6, sample std sqrt(13/12)): every action token of a sample
    gets (R − mean)/(std + 1e-6), feedback 0.  (Without the turn reward row 0 would get exactly 0.)"""
    adv, ret, _ = _advantages(_algo(advantage_estimator="group_norm"))
    sd = math.sqrt(13 / 12) + 1e-6
    a, b, c = ((r - 7 / 6) / sd for r in (1.5, 2.0, 0.0))
    _close(adv, [[a, a, 0, 0, a, a], [b, b, b, 0, 0, 0], [c, 0, 0, 0, 0, 0]], 1e-5)
    assert ret is None


def test_dr_grpo_sees_the_total_of_the_turn_rewards():
    adv, _, _ = _advantages(_algo(advantage_estimator="dr_grpo"))
    a, b, c = (r - 7 / 6 for r in (1.5, 2.0, 0.0))
    _close(adv, [[a, a, 0, 0, a, a], [b, b, b, 0, 0, 0], [c, 0, 0, 0, 0, 0]], 1e-5)


def test_an_invalid_multi_turn_sample_gets_zero_and_leaves_the_group():
    """Row 0's environment failed: group_norm over rows 1 and 2 (R = 2, 0: ±1/(sqrt(2) + 1e-6)), row 0 all 0."""
    adv, _, _ = _advantages(_algo(advantage_estimator="group_norm"), valid=torch.tensor([False, True, True]))
    s = 1 / (math.sqrt(2) + 1e-6)
    _close(adv, [[0] * 6, [s, s, s, 0, 0, 0], [-s, 0, 0, 0, 0, 0]], 1e-5)


def test_a_mask_without_gaps_takes_the_plain_path():
    """The same numbers whether or not the gap is compacted away by hand: row 0 written without its feedback."""
    mask = torch.tensor([[1.0, 1, 1, 1], [1, 1, 1, 0], [1, 0, 0, 0]])
    turn = torch.zeros(3, 4)
    turn[0, 1] = 0.5
    values = torch.tensor([[0.1, 0.2, 0.3, 0.4], [0.5, 0.5, 0.5, 0], [0.25, 0, 0, 0]])
    algo = _algo(advantage_estimator="gae", gamma=1.0, lambd=0.5, whiten_advantages=False)
    adv, ret, _ = algo.advantages(SCALAR, mask, GROUP, None, None, values, None, turn_rewards=turn)
    _close(adv, [[0.5, 0.8, 0.4, 0.6], [0.375, 0.75, 1.5, 0], [-0.25, 0, 0, 0]])
    _close(ret, [[0.6, 1.0, 0.7, 1.0], [0.875, 1.25, 2.0, 0], [0, 0, 0, 0]])


# ---- Experience: action mask, loss mask, action length, intermediate rewards -----------------------------------
def _experience(response, action_mask=None, turn_ends=(), turn_rewards=(), **kw) -> Experience:
    return Experience(prompt_index=kw.pop("prompt_index", 0), sample_index=kw.pop("sample_index", 0),
                      prompt_ids=[1, 2], response_ids=list(response), engine_logprobs=[0.0] * len(response),
                      finish_reason="stop", prompt_text="p", response_text="r", label=None, action_mask=action_mask,
                      turn_ends=list(turn_ends), turn_rewards=list(turn_rewards), **kw)


def test_experience_masks_and_lengths():
    multi = _experience([5, 6, 7, 8, 9, 10], [1, 1, 0, 0, 1, 1], turn_ends=[1, 5], turn_rewards=[0.4, 0.7])
    assert multi.loss_mask == [1.0, 1.0, 0.0, 0.0, 1.0, 1.0]
    assert multi.action_length == 4
    assert multi.intermediate_rewards() == [0.0, 0.4, 0.0, 0.0, 0.0, 0.0]   # the last turn's reward is not here
    single = _experience([5, 6, 7])
    assert single.loss_mask == [1.0, 1.0, 1.0] and single.action_length == 3
    assert single.intermediate_rewards() == [0.0, 0.0, 0.0]
    three = _experience([1, 2, 3, 4, 5, 6, 7], [1, 0, 1, 1, 0, 1, 0], turn_ends=[0, 3, 5],
                        turn_rewards=[0.25, -1.0, 2.0])
    assert three.action_length == 4
    assert three.intermediate_rewards() == [0.25, 0.0, 0.0, -1.0, 0.0, 0.0, 0.0]
    failed = _experience([5, 6], [1, 1], turn_ends=[1], turn_rewards=[])   # the environment raised in step 1
    assert failed.intermediate_rewards() == [0.0, 0.0]


# ---- RLRun.advantages: the scalar keeps the total minus the weighted intermediate rewards ----------------------
ENV = '''
class Environment:
    def reset(self, prompt, label):
        return prompt

    def step(self, action):
        return "", 0.0, True
'''


def _rl_run(tmp_path: Path, *overrides: str):
    """An RLRun with just what ``advantages`` reads, on one process (its exchange is the identity)."""
    from hpc_rlhf.rewards.shaping import RunningMoments
    from hpc_rlhf.trainers.rl import RLRun, algorithm_for
    env = tmp_path / "env.py"
    env.write_text(ENV)
    cfg = load_config(RLConfig, None, ["model.pretrain=./m", "data.prompt_data=./p.jsonl",
                                       f"agent.agent_func_path={env}", *overrides])
    run = RLRun.__new__(RLRun)
    run.cfg, run.algo, run.reward_moments = cfg, algorithm_for(cfg), RunningMoments()
    run.roles = SimpleNamespace(actor=object())
    run._on_roles = lambda jobs, samples: {key: dict(zip((s.uid for s in samples), fn(samples)))
                                           for key, (_, fn) in jobs.items()}
    return run


def _two_turn_samples():
    """Two samples of one prompt.  Sample 0: turns end at 1 and 4 (feedback at 2), turn rewards 0.4, 0.6.
    Sample 1: one turn of two tokens, turn reward 0.2."""
    a = _experience([5, 6, 7, 8, 9], [1, 1, 0, 1, 1], turn_ends=[1, 4], turn_rewards=[0.4, 0.6], env_reward=1.0)
    b = _experience([5, 6], [1, 1], turn_ends=[1], turn_rewards=[0.2], env_reward=0.2, sample_index=1)
    return [a, b]


def test_scalar_is_the_reward_minus_the_weighted_intermediate_rewards(tmp_path):
    """reward_weights [1, 0.5] (function, environment): a sample's combined reward is f + 0.5·env total.  With
    f = 0.3: sample 0's reward is 0.8; its turn-1 reward enters as 0.5·0.4 = 0.2 on token 1 and the scalar
    keeps 0.8 − 0.2 = 0.6.  REINFORCE (γ = 1, unwhitened) returns: [0.8, 0.8, 0, 0.6, 0.6]; sample 1 (one
    turn: no intermediate reward): 0.3 + 0.5·0.2 = 0.4 on both tokens."""
    run = _rl_run(tmp_path, "reward.reward_func=./r.py", "reward.reward_weights=1.0,0.5",
                  "algo.advantage_estimator=reinforce", "algo.whiten_advantages=false")
    a, b = _two_turn_samples()
    a.reward, b.reward = 0.3 + 0.5 * 1.0, 0.3 + 0.5 * 0.2
    run.advantages([a, b])
    assert a.advantages == pytest.approx([0.8, 0.8, 0.0, 0.6, 0.6])
    assert a.returns == pytest.approx(a.advantages)
    assert b.advantages == pytest.approx([0.4, 0.4])


def test_the_environment_alone_has_weight_one(tmp_path):
    """reward: {} with the environment as the source: weight 1, so the intermediate reward enters whole:
    sample 0 (reward 1.0): [1.0, 1.0, 0, 0.6, 0.6]."""
    run = _rl_run(tmp_path, "algo.advantage_estimator=reinforce", "algo.whiten_advantages=false")
    a, b = _two_turn_samples()
    a.reward, b.reward = 1.0, 0.2
    run.advantages([a, b])
    assert a.advantages == pytest.approx([1.0, 1.0, 0.0, 0.6, 0.6])
    assert b.advantages == pytest.approx([0.2, 0.2])


def test_normalized_rewards_stay_whole_on_the_last_token(tmp_path):
    """reward.normalize_reward: the normalised total is the scalar (no turn reward is split off), so every
    action token of a sample gets the same return under REINFORCE with γ = 1.  Rewards 1.0 and 0.2 normalised
    by their running moments (mean 0.6, std of the two): ±1 up to the moments' correction."""
    run = _rl_run(tmp_path, "algo.advantage_estimator=reinforce", "algo.whiten_advantages=false",
                  "reward.normalize_reward=true")
    a, b = _two_turn_samples()
    a.reward, b.reward = 1.0, 0.2
    run.advantages([a, b])
    assert a.advantages[2] == 0.0
    assert len({round(x, 6) for i, x in enumerate(a.advantages) if i != 2}) == 1
    assert a.advantages[0] == pytest.approx(-b.advantages[0]) and a.advantages[0] > 0


def test_an_invalid_sample_gets_no_turn_reward(tmp_path):
    """A sample whose environment failed (reward_valid False) gets advantage 0 everywhere, its turn rewards
    included; its peer keeps its own."""
    run = _rl_run(tmp_path, "algo.advantage_estimator=reinforce", "algo.whiten_advantages=false")
    a, b = _two_turn_samples()
    a.reward, a.reward_valid, b.reward = float("nan"), False, 0.2
    run.advantages([a, b])
    assert a.advantages == [0.0] * 5
    assert b.advantages == pytest.approx([0.2, 0.2])
