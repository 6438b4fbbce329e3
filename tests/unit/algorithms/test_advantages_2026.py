"""The 2026 advantage estimators: MaxRL (mean-normalised group advantage) and GDPO (each reward component
normalised in its group, summed, then scaled over the batch), against hand-derived numbers and TRL 1.16's GDPO.

One response token per sample unless said otherwise: the advantage of sample i is adv[i, 0].
"""
from __future__ import annotations

import inspect
import math
import textwrap

import pytest
import torch

from _thread_ranks import thread_ranks

from hpc_rlhf.algorithms.advantages import GDPO, MaxRL, make_advantage_estimator

ONE = torch.ones(1, 1)


def adv(est, rewards, gids, valid=None, components=None, mask=None, token_rewards=None, all_reduce=None):
    rewards = torch.tensor(rewards, dtype=torch.float32)
    mask = torch.ones(len(rewards), 1) if mask is None else mask
    kwargs = {} if components is None else {"components": torch.tensor(components, dtype=torch.float32)}
    out, ret = est.compute(rewards, token_rewards, mask, group_ids=torch.tensor(gids),
                           valid=None if valid is None else torch.tensor(valid), all_reduce=all_reduce, **kwargs)
    assert ret is None and out.dtype == torch.float32
    return out


def first(x):
    return [round(float(v), 5) for v in x[:, 0]]


# ---------------------------------------------------------------------------------------------------- MaxRL
def test_maxrl_binary_groups_give_one_over_pass_rate():
    # group 7: [1, 0, 0, 0], mean 1/4: correct (1 - 1/4)/(1/4) = 3, wrong (0 - 1/4)/(1/4) = -1
    # group 3: [1, 1, 0, 0], mean 1/2: +-(1/2)/(1/2) = +-1
    a = adv(MaxRL(eps=0.0), [1, 0, 0, 0, 1, 1, 0, 0], [7, 7, 7, 7, 3, 3, 3, 3])
    assert first(a) == [3.0, -1.0, -1.0, -1.0, 1.0, 1.0, -1.0, -1.0]
    # the default eps = 1e-6: 0.75 / 0.250001 = 2.999988
    a = adv(MaxRL(), [1, 0, 0, 0], [0, 0, 0, 0])
    assert a[0, 0].item() == pytest.approx(0.75 / 0.250001, abs=1e-6) and a[1, 0].item() == pytest.approx(
        -0.25 / 0.250001, abs=1e-6)


def test_maxrl_group_with_mean_zero_or_negative_gets_zero():
    # [0, 0]: tied, 0.  [1, -1]: mean 0, (1 - 0)/(0 + 1e-6) would be 1e6 -> 0.
    # [-1, -3]: mean -2, (-1 + 2)/(-2) = -0.5 would punish the better sample -> 0.
    # next to [2, 2, 1] (ties inside): mean 5/3: (1/3)/(5/3) = 0.2, 0.2, (-2/3)/(5/3) = -0.4
    a = adv(MaxRL(), [0, 0, 1, -1, -1, -3, 2, 2, 1], [0, 0, 1, 1, 2, 2, 3, 3, 3])
    assert first(a) == [0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.2, 0.2, -0.4]


def test_maxrl_tied_group_is_exactly_zero():
    # eight rewards of 5.3: a float32 mean lands an ulp away; group_centered gives exact 0
    a = adv(MaxRL(), [5.3] * 8 + [0.0, 1.0], [0] * 8 + [1, 1])
    assert a[:8].abs().max().item() == 0.0 and first(a)[8:] == [-1.0, 1.0]


def test_maxrl_invalid_samples_padding_and_empty_groups():
    # group 0: [1, 0, failed(NaN)]: mean over the valid two = 1/2 -> +1, -1, the failed one 0
    # group 1: [3, failed]: one valid sample -> 0;  group 2: [failed, failed] (an empty group) -> 0
    # two tokens each, the second padding for samples 1 and 3 (garbage there must not leak)
    nan = float("nan")
    mask = torch.tensor([[1.0, 1], [1, 0], [1, 1], [1, 0], [1, 1], [1, 1], [1, 1]])
    tok = torch.where(mask.bool(), torch.zeros(7, 2), torch.tensor(nan))
    a = adv(MaxRL(eps=0.0), [1, 0, nan, 3, nan, nan, nan], [0, 0, 0, 1, 1, 2, 2],
            valid=[True, True, False, True, False, False, False], mask=mask, token_rewards=tok)
    assert a.tolist() == [[1.0, 1.0], [-1.0, 0.0], [0.0, 0.0], [0.0, 0.0], [0.0, 0.0], [0.0, 0.0], [0.0, 0.0]]


def test_maxrl_uses_the_sequence_reward():
    # KL penalty in the token rewards: R = r + sum(tok) = [1 - 0.2, 0 - 0.2] = [0.8, -0.2], mean 0.3:
    # (0.8 - 0.3)/0.3 = 5/3, (-0.2 - 0.3)/0.3 = -5/3
    tok = torch.tensor([[-0.1, -0.1], [-0.1, -0.1]])
    a = adv(MaxRL(eps=0.0), [1, 0], [0, 0], mask=torch.ones(2, 2), token_rewards=tok)
    assert first(a) == [round(5 / 3, 5), round(-5 / 3, 5)]


# ---------------------------------------------------------------------------------------------------- GDPO
# Two groups of two, two components (correct, format):
#   group 0: [[1, 1], [0, 1]]  correct [1, 0]: mean 1/2, sample std sqrt(2 * 1/4 / 1) = 1/sqrt2 -> +-1/sqrt2
#                              format  [1, 1]: tied (zero variance) -> 0, 0          S = [+1/sqrt2, -1/sqrt2]
#   group 1: [[0, 2], [1, 0]]  correct [0, 1] -> -+1/sqrt2;  format [2, 0]: mean 1, std sqrt2 -> +-1/sqrt2
#                                                                                    S = [0, 0]
#   batch: sum S^2 = 1 over N = 4 valid samples, sample std sqrt(1/3) -> A = S * sqrt3 = [1.22474, -1.22474, 0, 0]
# GRPO on the summed reward would see [2, 1] in both groups (+-0.70711 each): group 1's trade-off is lost there.
COMPONENTS = [[1, 1], [0, 1], [0, 2], [1, 0]]
SUMS = [2.0, 1.0, 2.0, 1.0]
GIDS = [0, 0, 1, 1]


def test_gdpo_hand_values_with_a_zero_variance_component():
    a = adv(GDPO(eps=1e-12), SUMS, GIDS, components=COMPONENTS)
    assert first(a) == [1.22474, -1.22474, 0.0, 0.0]
    # with eps = 1e-6 on both stds: 0.5/(0.70711 + 1e-6) ... / (0.57735 + 1e-6): within 1e-5 of the above
    assert torch.allclose(adv(GDPO(), SUMS, GIDS, components=COMPONENTS)[:, 0],
                          torch.tensor([1.22474, -1.22474, 0.0, 0.0]), atol=1e-5)
    grpo = adv(make_advantage_estimator("group_norm"), SUMS, GIDS)
    assert first(grpo) == [0.70711, -0.70711, 0.70711, -0.70711]


def test_gdpo_a_tied_component_changes_nothing():
    # a second component 5.3 in every sample (not representable: a float32 mean of the eight samples of group 0 is
    # an ulp off, which eps = 1e-6 would blow up to ~0.5) adds exactly 0
    gids = [0] * 8 + [1, 1]
    plain = [[float(i % 2)] for i in range(8)] + [[0.0], [2.0]]
    with_tie = [row + [5.3] for row in plain]
    sums = [sum(row) for row in with_tie]
    assert torch.equal(adv(GDPO(), sums, gids, components=with_tie), adv(GDPO(), sums, gids, components=plain))
    # every component tied in every group: std(S) = 0 -> 0 / (0 + eps) = exactly 0
    assert adv(GDPO(), [2.0] * 4, GIDS, components=[[1, 1]] * 4).abs().max().item() == 0.0


def test_gdpo_without_components_normalises_the_sequence_reward():
    # one component, the reward [1, 0, 3, 1]: group z-scores +-1/sqrt2 (+-0.70711) in both groups; S^2 sums to 2
    # over 4 samples, std sqrt(2/3) -> +-0.70711 / 0.81650 = +-0.86603
    a = adv(GDPO(eps=1e-12), [1, 0, 3, 1], GIDS)
    assert first(a) == [0.86603, -0.86603, 0.86603, -0.86603]


def test_gdpo_invalid_samples_padding_and_empty_groups():
    # group 0: [[1], [0], failed]  -> +-1/sqrt2 and 0;  group 1: [[3], failed] -> one valid sample: 0
    # group 2: [failed, failed] -> 0.  Batch: valid S = [1/sqrt2, -1/sqrt2, 0], sum S^2 = 1 over N = 3,
    # std sqrt(1/2) -> A = [1, -1]; the lone valid sample keeps 0; the failed ones 0 (their NaN enters nothing)
    nan = float("nan")
    mask = torch.tensor([[1.0, 1], [1, 0], [1, 1], [1, 0], [1, 1], [1, 1], [1, 1]])
    tok = torch.where(mask.bool(), torch.zeros(7, 2), torch.tensor(nan))
    a = adv(GDPO(eps=1e-12), [1, 0, nan, 3, nan, nan, nan], [0, 0, 0, 1, 1, 2, 2],
            valid=[True, True, False, True, False, False, False], mask=mask, token_rewards=tok,
            components=[[1], [0], [nan], [3], [nan], [nan], [nan]])
    assert [[round(v, 5) for v in row] for row in a.tolist()] == [[1.0, 1.0], [-1.0, 0.0], [0.0, 0.0], [0.0, 0.0],
                                                                  [0.0, 0.0], [0.0, 0.0], [0.0, 0.0]]


def test_gdpo_refuses_components_of_another_batch_size():
    with pytest.raises(ValueError, match=r"components must be \[B, K\] with B=4, got \(3, 2\)"):
        adv(GDPO(), SUMS, GIDS, components=COMPONENTS[:3])


# ------------------------------------------------------------------------------------------- N ranks vs 1
def test_two_ranks_equal_one_rank():
    # whole groups per rank; rank 1 holds a group whose samples all failed (it still takes part in the reductions)
    nan = float("nan")
    rewards = [2.0, 1.0, 2.0, 1.0, 0.0, 1.0, 1.0, nan, nan]
    gids = [0, 0, 1, 1, 2, 2, 2, 3, 3]
    valid = [True] * 7 + [False, False]
    comps = COMPONENTS + [[0, 0], [1, 0], [0, 1], [nan, nan], [nan, nan]]
    for est, components in ((GDPO(), comps), (MaxRL(), None), (GDPO(), None)):
        def call(sl, ar=None):
            c = None if components is None else components[sl]
            return adv(est, rewards[sl], gids[sl], valid=valid[sl], components=c, all_reduce=ar)
        full = call(slice(0, 9))
        parts = thread_ranks([lambda ar: call(slice(0, 4), ar), lambda ar: call(slice(4, 9), ar)])
        assert torch.allclose(torch.cat(parts), full, atol=1e-6), est.name
        assert full.abs().sum() > 0, est.name


# ---------------------------------------------------------------------------------------------- TRL 1.16
def _trl_normalize_then_sum(rewards_per_func: torch.Tensor, num_generations: int) -> torch.Tensor:
    """TRL 1.16's own GRPOTrainer code, from the advantage part of ``_generate_and_score_completions`` (it is
    inline in that method): the lines from ``unscorable_mask = ...`` to ``advantages = torch.nan_to_num(...)``,
    run as TRL has them with ``multi_objective_aggregation="normalize_then_sum"`` and equal reward weights."""
    from trl.trainer import grpo_trainer

    src = inspect.getsource(grpo_trainer.GRPOTrainer._generate_and_score_completions)
    start = src.rindex("\n", 0, src.index("unscorable_mask = torch.isnan(rewards_per_func)")) + 1
    end_line = "advantages = torch.nan_to_num(advantages, nan=0.0)"
    block = textwrap.dedent(src[start:src.index(end_line) + len(end_line)])
    k = rewards_per_func.shape[1]
    stub = type("Trainer", (), {"multi_objective_aggregation": "normalize_then_sum", "reward_funcs": [None] * k,
                                "reward_weights": torch.ones(k), "scale_rewards": "group"})()
    scope = {"torch": torch, "nanstd": grpo_trainer.nanstd, "self": stub, "device": "cpu",
             "rewards_per_func": rewards_per_func, "num_generations": num_generations}
    exec(block, scope)  # noqa: S102 - TRL's installed source, unchanged
    return scope["advantages"]


def test_gdpo_equals_trl_normalize_then_sum():
    """Identical tensors, eps = TRL's 1e-4 (on both stds, Bessel-corrected as TRL's nanstd).  Conventions that
    differ, none exercised here: TRL subtracts the batch mean of the summed advantages (0 up to rounding, each
    group's normalised components summing to 0), we do not; TRL weights the components (reward_weights), we sum
    them unweighted; TRL's float32 group mean of a tied component of non-representable values (5.3) is an ulp
    off, which its 1e-4 turns into ~1e-3, where ours is exactly 0.  An unscorable completion (every component
    NaN) is our invalid sample: advantage 0 in both, outside every statistic."""
    nan = float("nan")
    per_func = torch.tensor([[1.0, 1.0, 0.5], [0.0, 1.0, 0.0], [1.0, 0.0, 0.25], [1.0, 1.0, 0.0],   # group 0
                             [0.0, 2.0, 1.0], [1.0, 0.0, 1.0], [0.0, 0.0, 1.0], [0.0, 2.0, 1.0],   # group 1
                             [1.0, 0.5, 0.0], [nan, nan, nan], [0.0, 0.5, 0.5], [1.0, 0.5, 2.0]])  # group 2
    want = _trl_normalize_then_sum(per_func, 4)
    valid = ~torch.isnan(per_func).all(1)
    got = adv(GDPO(eps=1e-4), per_func.nansum(1).tolist(), [0] * 4 + [1] * 4 + [2] * 4, valid=valid.tolist(),
              components=per_func.tolist())[:, 0]
    assert torch.allclose(got, want, atol=1e-5), (got, want)
    assert got[9] == 0 and want[9] == 0 and got.abs().min() < 1 < got.abs().max()


def test_registry_reads_advantage_eps():
    from hpc_rlhf.algorithms.advantages import estimator_from_config
    from hpc_rlhf.config.algo import AlgoConfig

    for name, cls in (("maxrl", MaxRL), ("gdpo", GDPO)):
        algo = AlgoConfig(advantage_estimator=name)
        algo.advantage.advantage_eps = 0.5
        est = estimator_from_config(algo)
        assert type(est) is cls and est.eps == 0.5 and math.isclose(cls().eps, 1e-6)
