"""Advantage estimators, whitening and the registry, against hand-derived numbers.

Common batch (2 prompts x 2 samples, R = 3):
    rewards   = [1, 0, 2, 0]
    group_ids = [7, 7, 3, 3]          (any integers; groups {0, 1} and {2, 3})
    mask      = [[1,1,1], [1,1,0], [1,1,1], [1,0,0]]    lengths 3, 2, 3, 1; N = 9 valid tokens
The scalar reward sits on each sample's last valid token (index 2, 1, 2, 0).
"""
from __future__ import annotations

import math

import pytest
import torch

from _thread_ranks import thread_ranks

import hpc_rlhf.algorithms.opd  # noqa: F401  (registers the estimator "opd")
from hpc_rlhf.algorithms.advantages import GAE, Reinforce, estimator_from_config, make_advantage_estimator
from hpc_rlhf.algorithms.groups import contiguous_group_ids, group_mean_std
from hpc_rlhf.algorithms.registry import ADVANTAGE_ESTIMATORS, Registry
from hpc_rlhf.algorithms.returns import discounted_returns, outcome_token_rewards
from hpc_rlhf.algorithms.whiten import masked_mean_var, masked_whiten

REWARDS = torch.tensor([1.0, 0.0, 2.0, 0.0])
GIDS = torch.tensor([7, 7, 3, 3])
MASK = torch.tensor([[1.0, 1, 1], [1, 1, 0], [1, 1, 1], [1, 0, 0]])
ZERO = torch.zeros(4, 3)


def rows(x, mask=MASK):
    """Valid entries of each row, as python lists (rounded)."""
    return [[round(float(v), 5) for v, m in zip(r, mr) if m > 0] for r, mr in zip(x, mask)]


def with_teacher(name, student, teacher):
    """The estimator ``name`` and, when it needs a teacher, the keyword arguments of its log-probs: ``student``'s
    and ``teacher``'s (opd with a task reward too, so that every input counts)."""
    est = make_advantage_estimator(name)
    if not est.needs_teacher:
        return est, {}
    est.task_reward_weight = 0.5
    return est, {"logprobs": student, "teacher_logprobs": teacher}


def test_outcome_token_rewards_puts_reward_on_last_valid_token():
    tok = torch.full((4, 3), -0.1)                      # also on padding: must be masked away
    r = outcome_token_rewards(REWARDS, tok, MASK)
    assert rows(r) == [[-0.1, -0.1, 0.9], [-0.1, -0.1], [-0.1, -0.1, 1.9], [-0.1]]
    assert r[1, 2] == 0 and r[3, 1] == 0 and r[3, 2] == 0
    # a sample with no valid token gets nothing
    r0 = outcome_token_rewards(torch.tensor([5.0]), None, torch.zeros(1, 3))
    assert r0.abs().sum() == 0


def test_discounted_returns_gamma_half():
    # r row0 = [-0.1, -0.1, 0.9]: G2 = 0.9; G1 = -0.1 + 0.5*0.9 = 0.35; G0 = -0.1 + 0.5*0.35 = 0.075
    # row1 [-0.1, -0.1]:           G1 = -0.1; G0 = -0.1 - 0.05 = -0.15
    # row2 [-0.1, -0.1, 1.9]:      G2 = 1.9; G1 = 0.85; G0 = -0.1 + 0.425 = 0.325
    # row3 [-0.1]:                 G0 = -0.1
    r = outcome_token_rewards(REWARDS, torch.full((4, 3), -0.1), MASK)
    g = discounted_returns(r, MASK, 0.5)
    assert rows(g) == [[0.075, 0.35, 0.9], [-0.15, -0.1], [0.325, 0.85, 1.9], [-0.1]]
    assert g[1, 2] == 0 and g[3, 1:].abs().sum() == 0


def test_group_stats_and_contiguous_ids():
    assert contiguous_group_ids(6, 3).tolist() == [0, 0, 0, 1, 1, 1]
    with pytest.raises(ValueError):
        contiguous_group_ids(5, 2)
    mean, std = group_mean_std(torch.tensor([1.0, 0.0, 2.0, 0.0, 5.0]), torch.tensor([7, 7, 3, 3, 9]))
    assert mean.tolist() == [0.5, 0.5, 1.0, 1.0, 5.0]
    # sample std: sqrt(((0.5)^2 + (0.5)^2) / 1) = sqrt(0.5); sqrt((1 + 1)/1) = sqrt(2); singleton 0
    assert std.tolist() == pytest.approx([math.sqrt(0.5)] * 2 + [math.sqrt(2.0)] * 2 + [0.0])
    _, pstd = group_mean_std(torch.tensor([1.0, 0.0]), torch.tensor([0, 0]), unbiased=False)
    assert pstd.tolist() == pytest.approx([0.5, 0.5])  # population std


# ------------------------------------------------------------------ whitening

def test_masked_whiten_hand_values():
    # valid 1, 2, 3, 5: mean 11/4 = 2.75; deviations -1.75, -0.75, 0.25, 2.25;
    # squares sum 3.0625 + 0.5625 + 0.0625 + 5.0625 = 8.75; population var 8.75/4 = 2.1875
    x = torch.tensor([[1.0, 2.0, 3.0], [5.0, 100.0, 100.0]])
    m = torch.tensor([[1.0, 1, 1], [1, 0, 0]])
    mean, var = masked_mean_var(x, m)
    assert mean.item() == pytest.approx(2.75) and var.item() == pytest.approx(2.1875)
    std = math.sqrt(2.1875)
    w = masked_whiten(x, m)
    assert w[0].tolist() == pytest.approx([-1.75 / std, -0.75 / std, 0.25 / std], abs=1e-6)
    assert w[1].tolist() == pytest.approx([2.25 / std, 0.0, 0.0], abs=1e-6)
    w2 = masked_whiten(x, m, shift_mean=False)
    assert w2[0, 0].item() == pytest.approx(2.75 - 1.75 / std, abs=1e-6) and w2[1, 1] == 0


def test_global_whitening_two_ranks_equals_concatenation():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 5, generator=g) * 3 + 2
    m = (torch.arange(5)[None, :] < torch.tensor([5, 1, 3, 4, 2, 5])[:, None]).float()
    full = masked_whiten(x, m)
    halves = thread_ranks([lambda ar: masked_whiten(x[:2], m[:2], ar),
                           lambda ar: masked_whiten(x[2:], m[2:], ar)])
    assert torch.allclose(torch.cat(halves), full, atol=1e-6)
    # a rank with no valid token at all still takes part
    empty = torch.zeros(2, 5)
    res = thread_ranks([lambda ar: masked_whiten(x, m, ar), lambda ar: masked_whiten(x[:2], empty, ar)])
    assert torch.allclose(res[0], full, atol=1e-6) and res[1].abs().sum() == 0


# ------------------------------------------------------------------ estimators

def test_reinforce_gamma1():
    # G = [1,1,1], [0,0], [2,2,2], [0]; N = 9, sum 9 -> mean 1;
    # deviations 0,0,0,-1,-1,1,1,1,-1 -> population var 6/9 = 2/3, std = sqrt(2/3)
    adv, ret = make_advantage_estimator("reinforce").compute(REWARDS, ZERO, MASK, gamma=1.0)
    assert rows(ret) == [[1, 1, 1], [0, 0], [2, 2, 2], [0]]
    s = 1 / math.sqrt(2 / 3)  # 1.22474
    assert adv[0].tolist() == pytest.approx([0, 0, 0], abs=1e-6)
    assert adv[1].tolist() == pytest.approx([-s, -s, 0], abs=1e-6)
    assert adv[2].tolist() == pytest.approx([s, s, s], abs=1e-6)
    assert adv[3].tolist() == pytest.approx([-s, 0, 0], abs=1e-6)


def test_reinforce_gamma_half_with_kl_token_rewards():
    est = Reinforce()
    adv, ret = est.compute(REWARDS, torch.full((4, 3), -0.1), MASK, gamma=0.5)
    assert rows(ret) == [[0.075, 0.35, 0.9], [-0.15, -0.1], [0.325, 0.85, 1.9], [-0.1]]
    mean, var = masked_mean_var(adv, MASK)
    assert mean.item() == pytest.approx(0, abs=1e-6) and var.item() == pytest.approx(1, abs=1e-5)
    # whitening is affine: adv = (G - mean_G)/std_G; G values sum 4.05 over 9 tokens
    gm = 4.05 / 9
    gv = sum((v - gm) ** 2 for v in [0.075, 0.35, 0.9, -0.15, -0.1, 0.325, 0.85, 1.9, -0.1]) / 9
    assert adv[2, 2].item() == pytest.approx((1.9 - gm) / math.sqrt(gv), abs=1e-5)
    assert est.kl_in_reward and not est.needs_critic


def test_reinforce_baseline():
    # group means 0.5 and 1 -> shaped rewards [0.5, -0.5, 1, -1]
    # G = [.5,.5,.5], [-.5,-.5], [1,1,1], [-1]: sum 2.5 over 9 -> mean 5/18;
    # E[G^2] = (0.75 + 0.5 + 3 + 1)/9 = 7/12; var = 7/12 - 25/324 = 41/81; std = sqrt(41)/9
    # adv = (G - 5/18) * 9/sqrt(41):  (4, -14, 13, -23)/18 * 9/sqrt(41) = (2, -7, 6.5, -11.5)/sqrt(41)
    adv, ret = make_advantage_estimator("reinforce_baseline").compute(
        REWARDS, ZERO, MASK, group_ids=GIDS, gamma=1.0)
    assert rows(ret) == [[0.5] * 3, [-0.5] * 2, [1.0] * 3, [-1.0]]
    q = math.sqrt(41)
    assert rows(adv) == [[round(2 / q, 5)] * 3, [round(-7 / q, 5)] * 2, [round(6.5 / q, 5)] * 3,
                         [round(-11.5 / q, 5)]]


def test_rloo():
    # leave-one-out baselines: sample0 -> 0 (the other), sample1 -> 1, sample2 -> 0, sample3 -> 2
    # shaped: [1, -1, 2, -2]; gamma 1 token returns; no whitening
    est = make_advantage_estimator("rloo")
    adv, ret = est.compute(REWARDS, ZERO, MASK, group_ids=GIDS, gamma=1.0)
    assert rows(adv) == [[1, 1, 1], [-1, -1], [2, 2, 2], [-2]]
    assert torch.equal(adv, ret)
    # n = 3: r = [3, 0, 0] -> baselines 0, 1.5, 1.5 -> [3, -1.5, -1.5] = 3/2 (r - mean)
    a3, _ = est.compute(torch.tensor([3.0, 0, 0]), None, torch.ones(3, 1),
                        group_ids=torch.tensor([0, 0, 0]))
    assert a3[:, 0].tolist() == pytest.approx([3, -1.5, -1.5])
    # a lone sample has no baseline -> 0
    a1, _ = est.compute(torch.tensor([4.0]), None, torch.ones(1, 2), group_ids=torch.tensor([0]))
    assert a1.abs().sum() == 0


def test_group_norm_grpo():
    # group {1, 0}: mean 0.5, sample std sqrt(0.5) -> +-0.5/sqrt(0.5) = +-0.70711
    # group {2, 0}: mean 1,   sample std sqrt(2)   -> +-1/sqrt(2)     = +-0.70711
    est = make_advantage_estimator("group_norm")
    adv, ret = est.compute(REWARDS, ZERO, MASK, group_ids=GIDS)
    a = 1 / math.sqrt(2)
    assert ret is None
    want = torch.tensor([[a, a, a], [-a, -a, 0], [a, a, a], [-a, 0, 0]])
    assert torch.allclose(adv, want, atol=1e-5)
    assert not est.kl_in_reward and est.uses_groups and est.default_loss_agg == "seq_mean"
    # with the KL moved into the reward, R_i = r_i + sum_t token_rewards (valid tokens only):
    # rewards [1, 0], token rewards -0.1 * lengths (3, 1) -> R = [0.7, -0.1]; mean 0.3, std sqrt(0.32)
    adv2, _ = est.compute(torch.tensor([1.0, 0.0]), torch.full((2, 3), -0.1),
                          torch.tensor([[1.0, 1, 1], [1, 0, 0]]), group_ids=torch.tensor([0, 0]))
    assert adv2[0, 0].item() == pytest.approx(0.4 / math.sqrt(0.32), abs=1e-5)


def test_dr_grpo():
    est = make_advantage_estimator("dr_grpo")
    adv, ret = est.compute(REWARDS, ZERO, MASK, group_ids=GIDS)
    assert ret is None
    assert adv.tolist() == [[0.5, 0.5, 0.5], [-0.5, -0.5, 0], [1, 1, 1], [-1, 0, 0]]
    assert est.default_loss_agg == "constant" and not est.kl_in_reward


def test_group_ids_in_any_order():
    # interleaved groups give the same per-sample advantages as contiguous ones
    perm = torch.tensor([0, 2, 1, 3])
    for name in ("group_norm", "dr_grpo", "rloo", "reinforce_baseline"):
        est = make_advantage_estimator(name)
        a, _ = est.compute(REWARDS, ZERO, MASK, group_ids=GIDS)
        b, _ = est.compute(REWARDS[perm], ZERO, MASK[perm], group_ids=GIDS[perm])
        assert torch.allclose(a[perm], b, atol=1e-6), name
        with pytest.raises(ValueError):
            est.compute(REWARDS, ZERO, MASK)  # no group ids


VALUES = torch.tensor([[0.5, 0.5, 0.5], [0.2, 0.1, 9.0], [1.0, 1.0, 1.0], [0.3, 9.0, 9.0]])  # 9 = pad


def test_gae_gamma1_lambda1():
    # gamma = lambda = 1: A_t = sum_{k>=t} r_k - V_t = G_t - V_t; returns = G
    adv, ret = GAE(whiten=False).compute(REWARDS, ZERO, MASK, values=VALUES, gamma=1.0, lambd=1.0)
    assert rows(adv) == [[0.5, 0.5, 0.5], [-0.2, -0.1], [1, 1, 1], [-0.3]]
    assert rows(ret) == [[1, 1, 1], [0, 0], [2, 2, 2], [0]]
    assert adv[1, 2] == 0 and ret[3, 1:].abs().sum() == 0
    # default: whitened over the 9 valid tokens: sum 3.9 -> mean 13/30;
    # E[A^2] = (0.75 + 0.04 + 0.01 + 3 + 0.09)/9 = 3.89/9; var = 3.89/9 - (13/30)^2 = 11/45
    wadv, wret = make_advantage_estimator("gae").compute(REWARDS, ZERO, MASK, values=VALUES,
                                                         gamma=1.0, lambd=1.0)
    sd = math.sqrt(11 / 45)
    assert wadv[0, 0].item() == pytest.approx((0.5 - 13 / 30) / sd, abs=1e-5)
    assert wadv[3, 0].item() == pytest.approx((-0.3 - 13 / 30) / sd, abs=1e-5)
    assert torch.equal(wret, ret)  # returns are never whitened


def test_gae_gamma_half_lambda_half():
    # row0 r = [0,0,1], V = [.5,.5,.5], V_next = [.5,.5,0]:
    #   delta = [0 + .25 - .5, -.25, 1 + 0 - .5] = [-.25, -.25, .5]; gamma*lambda = .25
    #   A2 = .5; A1 = -.25 + .25*.5 = -.125; A0 = -.25 + .25*(-.125) = -.28125; R = A + V
    # row1 r = [0,0], V = [.2,.1]: delta = [.05 - .2, -.1] = [-.15, -.1]; A1 = -.1; A0 = -.175
    # row2 r = [0,0,2], V = [1,1,1]: delta = [-.5, -.5, 1]; A = [-.5625, -.25, 1]
    # row3 r = [0], V = [.3]: A = -.3; R = 0
    adv, ret = GAE(whiten=False).compute(REWARDS, ZERO, MASK, values=VALUES, gamma=0.5, lambd=0.5)
    assert rows(adv) == [[-0.28125, -0.125, 0.5], [-0.175, -0.1], [-0.5625, -0.25, 1.0], [-0.3]]
    assert rows(ret) == [[0.21875, 0.375, 1.0], [0.025, 0.0], [0.4375, 0.75, 2.0], [0.0]]


def test_estimators_two_ranks_equal_one_rank():
    # whole groups per rank: ranks hold samples {0,1} and {2,3}
    for name in ADVANTAGE_ESTIMATORS.names():
        est, teacher = with_teacher(name, -VALUES, -VALUES.flip(0))

        def call(sl, ar=None):
            return est.compute(REWARDS[sl], torch.full((4, 3), -0.1)[sl], MASK[sl],
                               values=VALUES[sl], group_ids=GIDS[sl], gamma=0.9, lambd=0.8,
                               all_reduce=ar, **{k: v[sl] for k, v in teacher.items()})[0]
        full = call(slice(0, 4))
        parts = thread_ranks([lambda ar: call(slice(0, 2), ar), lambda ar: call(slice(2, 4), ar)])
        assert torch.allclose(torch.cat(parts), full, atol=1e-6), name
        assert (full * (1 - MASK)).abs().sum() == 0, name


def test_registry_units_and_errors():
    table = {n: (c.needs_critic, c.kl_in_reward, c.default_loss_agg, c.uses_groups)
             for n in ADVANTAGE_ESTIMATORS for c in [ADVANTAGE_ESTIMATORS.get(n)]}
    assert table == {
        "gae": (True, True, "token_mean", False),
        "reinforce": (False, True, "token_mean", False),
        "reinforce_baseline": (False, True, "token_mean", True),
        "rloo": (False, True, "token_mean", True),
        "group_norm": (False, False, "seq_mean", True),
        "dr_grpo": (False, False, "constant", True),
        "maxrl": (False, False, "token_mean", True),
        "gdpo": (False, False, "token_mean", True),
        "opd": (False, True, "token_mean", False),
    }
    with pytest.raises(KeyError, match="known: dr_grpo, gae"):
        ADVANTAGE_ESTIMATORS.get("ppo2")
    with pytest.raises(ValueError):
        make_advantage_estimator("gae").compute(REWARDS, ZERO, MASK)  # no values
    reg = Registry("thing")

    @reg.register("a")
    def a():
        return 1
    assert reg.get("a") is a and "a" in reg and reg.names() == ["a"]
    with pytest.raises(ValueError):
        reg.register("a")(lambda: 2)


def test_garbage_on_padding_does_not_leak():
    nan, inf = float("nan"), float("inf")
    pad = 1 - MASK
    values = torch.where(pad.bool(), torch.tensor(inf), VALUES)
    tok = torch.where(pad.bool(), torch.tensor(nan), torch.full((4, 3), -0.1))
    for name in ADVANTAGE_ESTIMATORS.names():
        est, teacher = with_teacher(name, torch.where(pad.bool(), nan, -VALUES), torch.where(pad.bool(), -inf, -1.0))
        adv, ret = est.compute(REWARDS, tok, MASK, values=values, group_ids=GIDS, gamma=0.9, lambd=0.8, **teacher)
        assert torch.isfinite(adv).all() and (adv * pad).abs().sum() == 0, name
        assert ret is None or (torch.isfinite(ret).all() and (ret * pad).abs().sum() == 0), name


# ------------------------------------------------------------------ tied rewards
# 0.7, 1.3, 5.3 and 100.3 are not representable in binary: a float32 group mean of n copies lands one
# ulp away from the copies, and dividing by a std just as small gave the whole group one same-sign
# advantage (+0.316 for eight rewards of 5.3, -0.859 for sixteen of 100.3).  The right answer is 0.
TIES = [(0.7, 8), (1.3, 8), (5.3, 8), (100.3, 16), (100.3, 7)]


def test_group_stats_of_a_tied_group_are_exact():
    for v, n in TIES:
        mean, std = group_mean_std(torch.full((n,), v), torch.zeros(n, dtype=torch.long))
        assert torch.equal(mean, torch.full((n,), v).double()) and std.abs().max() == 0, (v, n)


def test_tied_group_gets_exactly_zero_advantage():
    # the tied group (n copies of v, ids 0) next to the group {0, 1} (ids 1), one token each:
    # group_norm: +-0.5 / sqrt(0.5) = +-0.70711; dr_grpo: +-0.5; rloo: +-1;
    # reinforce_baseline: shaped [0]*n, -0.5, 0.5 -> mean 0, whitened: the tied group stays 0
    other = {"group_norm": 0.5 / math.sqrt(0.5), "dr_grpo": 0.5, "rloo": 1.0,
             "reinforce_baseline": None}
    for v, n in TIES:
        rewards = torch.cat([torch.full((n,), v), torch.tensor([0.0, 1.0])])
        gids = torch.tensor([0] * n + [1, 1])
        for name, want in other.items():
            adv, _ = make_advantage_estimator(name).compute(rewards, None, torch.ones(n + 2, 1),
                                                            group_ids=gids)
            assert adv.dtype == torch.float32, name
            assert adv[:n].abs().max().item() == 0.0, (name, v, n, adv[:n, 0].tolist())
            if want is not None:
                assert adv[n:, 0].tolist() == pytest.approx([-want, want], abs=1e-5), name


def test_whitening_equal_values_gives_exactly_zero():
    # global whitening of N equal values: (x - mean) must be exactly 0, not an ulp over sqrt(eps)
    for v, n in TIES:
        x = torch.full((n, 3), v)
        w = masked_whiten(x, torch.ones(n, 3))
        assert w.dtype == torch.float32 and w.abs().max().item() == 0.0, (v, n)
        adv, _ = make_advantage_estimator("reinforce").compute(torch.full((n,), v), None,
                                                               torch.ones(n, 3))
        assert adv.abs().max().item() == 0.0, ("reinforce", v, n)
        halves = thread_ranks([lambda ar: masked_whiten(x[:1], torch.ones(1, 3), ar),
                               lambda ar: masked_whiten(x[1:], torch.ones(n - 1, 3), ar)])
        assert all(h.abs().max().item() == 0.0 for h in halves), (v, n)


# ------------------------------------------------------------------ from the config

def algo(name, whiten=None, eps=None):
    from hpc_rlhf.config.algo import AdvantageOptions, AlgoConfig
    return AlgoConfig(advantage_estimator=name, advantage=AdvantageOptions(whiten_advantages=whiten, advantage_eps=eps))


def test_estimator_from_config_sets_whitening_and_eps():
    assert estimator_from_config(algo("gae")) == GAE(whiten=True, eps=1e-8)  # null options: the defaults
    est = estimator_from_config(algo("gae", whiten=False))
    adv, _ = est.compute(REWARDS, ZERO, MASK, values=VALUES, gamma=1.0, lambd=1.0)
    assert rows(adv) == [[0.5, 0.5, 0.5], [-0.2, -0.1], [1, 1, 1], [-0.3]]  # G - V, as in test_gae_gamma1_lambda1
    # eps = 11/45, the variance of test_gae_gamma1_lambda1's advantages: they are divided by sqrt(22/45)
    adv, _ = estimator_from_config(algo("gae", eps=11 / 45)).compute(REWARDS, ZERO, MASK, values=VALUES,
                                                                     gamma=1.0, lambd=1.0)
    assert adv[0, 0].item() == pytest.approx((0.5 - 13 / 30) / math.sqrt(22 / 45), abs=1e-5)
    # group_norm's eps is the one added to the std: group {1, 0} has std sqrt(0.5), eps 1 - sqrt(0.5)
    # makes the denominator 1: advantages +-0.5
    adv, _ = estimator_from_config(algo("group_norm", eps=1 - math.sqrt(0.5))).compute(
        REWARDS, ZERO, MASK, group_ids=GIDS)
    assert adv[0, 0].item() == pytest.approx(0.5, abs=1e-6) and adv[1, 0].item() == pytest.approx(-0.5, abs=1e-6)
    assert estimator_from_config(algo("rloo", whiten=True)).whiten



# ---- invalid samples (their reward function failed: the reward is a placeholder, NaN or 0) ----------------
NAN = float("nan")


def test_a_valid_sample_whose_only_peer_failed_gets_zero():
    # group {7: 1.0 valid, 0.0 invalid}: one valid sample, no baseline -> 0 (with the placeholder 0.0 counted
    # it got +0.70711 under group_norm); group {3: 2, 0} both valid -> +-0.70711 as in test_group_norm_grpo
    valid = torch.tensor([True, False, True, True])
    a = 1 / math.sqrt(2)
    for placeholder in (0.0, NAN):
        rewards = torch.tensor([1.0, placeholder, 2.0, 0.0])
        for name, want in (("group_norm", [0, 0, a, -a]), ("dr_grpo", [0, 0, 1, -1]), ("rloo", [0, 0, 2, -2])):
            adv, _ = make_advantage_estimator(name).compute(rewards, ZERO, MASK, group_ids=GIDS, valid=valid)
            assert adv[:, 0].tolist() == pytest.approx(want, abs=1e-5), (name, placeholder)
            assert adv[1].abs().sum() == 0 and not adv.isnan().any()


def test_invalid_samples_enter_no_group_statistic():
    # one group of four: rewards 1, 3, [invalid], 5 (placeholder 100 must not count)
    gid, mask = torch.zeros(4, dtype=torch.long), torch.ones(4, 1)
    r, valid = torch.tensor([1.0, 3.0, 100.0, 5.0]), torch.tensor([True, True, False, True])
    # valid mean 3, sample std 2 -> group_norm (r - 3) / 2 = -1, 0, 1
    adv, _ = make_advantage_estimator("group_norm", eps=0.0).compute(r, None, mask, group_ids=gid, valid=valid)
    assert adv[:, 0].tolist() == pytest.approx([-1, 0, 0, 1])
    # leave-one-out: 1 - (3+5)/2 = -3, 3 - (1+5)/2 = 0, 5 - (1+3)/2 = 3
    adv, _ = make_advantage_estimator("rloo").compute(r, None, mask, group_ids=gid, valid=valid)
    assert adv[:, 0].tolist() == pytest.approx([-3, 0, 0, 3])
    # reinforce_baseline: centred -2, 0, 2, whitened over the 3 valid tokens (mean 0, var 8/3)
    adv, ret = make_advantage_estimator("reinforce_baseline").compute(r, None, mask, group_ids=gid, valid=valid)
    s = math.sqrt(8 / 3)
    assert ret[:, 0].tolist() == pytest.approx([-2, 0, 0, 2])
    assert adv[:, 0].tolist() == pytest.approx([-2 / s, 0, 0, 2 / s], abs=1e-6)
    # every estimator: the invalid sample gets exactly 0, and equal valid rewards give exactly 0
    tied = torch.tensor([0.7, 0.7, NAN, 0.7])
    for name in ("group_norm", "dr_grpo", "rloo", "reinforce_baseline"):
        est = make_advantage_estimator(name)
        assert est.compute(r, None, mask, group_ids=gid, valid=valid)[0][2].item() == 0
        assert est.compute(tied, None, mask, group_ids=gid, valid=valid)[0].abs().sum().item() == 0, name


def test_global_whitening_skips_invalid_samples():
    # reinforce: returns 1 and 3 whiten to -1 and +1 (mean 2, var 1); the invalid sample (NaN) is 0, not NaN
    r, valid = torch.tensor([1.0, NAN, 3.0]), torch.tensor([True, False, True])
    adv, ret = Reinforce().compute(r, None, torch.ones(3, 1), valid=valid)
    assert adv[:, 0].tolist() == pytest.approx([-1, 0, 1], abs=1e-6)
    assert ret[:, 0].tolist() == [1, 0, 3]
    # gae: the same, with zero values
    adv, _ = GAE().compute(r, None, torch.ones(3, 1), values=torch.zeros(3, 1), valid=valid)
    assert adv[:, 0].tolist() == pytest.approx([-1, 0, 1], abs=1e-6)


def test_group_with_no_valid_sample():
    mean, std = group_mean_std(torch.tensor([NAN, NAN, 2.0]), torch.tensor([0, 0, 1]),
                               valid=torch.tensor([False, False, True]))
    assert mean.tolist() == [0, 0, 2] and std.tolist() == [0, 0, 0]
    adv, _ = make_advantage_estimator("group_norm").compute(torch.tensor([NAN, NAN]), None, torch.ones(2, 2),
                                                            group_ids=torch.tensor([0, 0]),
                                                            valid=torch.tensor([False, False]))
    assert adv.abs().sum() == 0
