"""Reward shaping: combine, running moments, normalisation, clipping, DAPO overlong and truncation penalties."""
import math

import pytest
import torch

from hpc_rlhf.rewards.shaping import (RunningMoments, clip_rewards, combine, normalize_rewards, overlong_penalty,
                                      truncation_penalty)
from hpc_rlhf.rewards.types import RewardBatch

nan = float("nan")


def test_combine_weighted_sum_and_validity():
    a = RewardBatch(torch.tensor([1.0, 2.0, nan, 4.0]), torch.tensor([True, True, False, True]),
                    {"reward/func/failures": 1.0, "reward/acc": 1.0}, errors=["a failed"])
    b = RewardBatch(torch.tensor([10.0, nan, 30.0, -1.0]), torch.tensor([True, False, True, True]),
                    {"reward/func/failures": 1.0, "reward/acc": 0.0})
    out = combine([a, b], [0.5, 2.0])
    # 0.5*1 + 2*10 = 20.5; 0.5*4 + 2*(-1) = 0
    assert out.valid.tolist() == [True, False, False, True]
    assert out.rewards[0] == 20.5 and out.rewards[3] == 0.0
    assert math.isnan(out.rewards[1]) and math.isnan(out.rewards[2])
    assert out.extra["reward/func/failures"] == 2.0  # counts add up
    assert out.extra["reward/acc"] == pytest.approx(0.5)  # means average (3 valid samples each)
    assert out.errors == ["a failed"]
    with pytest.raises(ValueError, match="2 reward sources but 1 weights"):
        combine([a, b], [1.0])
    with pytest.raises(ValueError, match="has 1 samples"):
        combine([a, RewardBatch(torch.zeros(1), torch.ones(1, dtype=torch.bool))], [1.0, 1.0])


def test_running_moments_hand_values_and_torch():
    m = RunningMoments()
    m.update(torch.tensor([1.0, 2.0]))
    m.update(torch.tensor([3.0, 4.0, nan]))  # NaN (invalid) entries are skipped
    assert m.count == 4 and m.mean == 2.5
    assert m.var == pytest.approx(5.0 / 3.0)  # sum of squared deviations 5, unbiased / 3

    torch.manual_seed(0)
    x = torch.randn(101, dtype=torch.float64) * 3 + 7
    whole, first, second = RunningMoments(), RunningMoments(), RunningMoments()
    for chunk in x.split(17):
        whole.update(chunk)
    first.update(x[:50])
    second.update(x[50:])
    assert whole.mean == pytest.approx(x.mean().item(), rel=1e-12)
    assert whole.var == pytest.approx(x.var().item(), rel=1e-12)
    first.merge(second)  # merging two halves gives the moments of the whole
    assert first.count == 101
    assert first.mean == pytest.approx(whole.mean, rel=1e-12) and first.var == pytest.approx(whole.var, rel=1e-12)

    restored = RunningMoments()
    restored.load_state_dict(whole.state_dict())
    assert restored.state_dict() == whole.state_dict()

    masked = RunningMoments()
    masked.update(torch.tensor([1.0, 100.0, 3.0]), mask=torch.tensor([True, False, True]))
    assert masked.count == 2 and masked.mean == 2.0 and masked.var == 2.0


def test_running_moments_all_reduce_hook():
    # Two "ranks" holding the same values: an all_reduce that sums doubles every reduced tensor (in place).
    x = torch.tensor([1.0, 2.0, 6.0])
    m = RunningMoments(all_reduce=lambda t: t.mul_(2))
    m.update(x)
    both = torch.cat([x, x]).double()
    assert m.count == 6 and m.mean == pytest.approx(both.mean().item())
    assert m.var == pytest.approx(both.var().item())
    # a hook that returns the reduced tensor instead works as well
    r = RunningMoments(all_reduce=lambda t: t * 2)
    r.update(x)
    assert r.state_dict() == pytest.approx(m.state_dict())


def test_normalize_and_clip():
    m = RunningMoments()
    r = torch.tensor([1.0, 2.0, 3.0, 4.0])
    out = normalize_rewards(r, m)
    std = math.sqrt(5.0 / 3.0)
    assert out.tolist() == pytest.approx([(v - 2.5) / std for v in r.tolist()], rel=1e-6)
    # invalid samples are neither counted nor normalised
    m2 = RunningMoments()
    out2 = normalize_rewards(torch.tensor([1.0, 2.0, 3.0, 4.0, 50.0]), m2,
                             valid=torch.tensor([True, True, True, True, False]))
    assert m2.count == 4 and out2[:4].tolist() == pytest.approx(out.tolist()) and math.isnan(out2[4])
    # before two values, only the mean is removed
    assert normalize_rewards(torch.tensor([5.0]), RunningMoments()).tolist() == [0.0]
    assert normalize_rewards(torch.tensor([5.0]), RunningMoments(), update=False).tolist() == [5.0]

    c = clip_rewards(torch.tensor([-3.0, 0.5, 9.0, nan]), -1.0, 1.0)
    assert c[:3].tolist() == [-1.0, 0.5, 1.0] and math.isnan(c[3])
    assert clip_rewards(torch.tensor([-3.0, 9.0]), None, 2.0).tolist() == [-3.0, 2.0]
    with pytest.raises(ValueError):
        clip_rewards(torch.tensor([0.0]), 1.0, -1.0)


def test_overlong_penalty_three_regimes():
    # max_len 100, buffer 20: no penalty up to 80, linear to -factor at 100, -factor beyond
    lengths = [10, 80, 81, 90, 95, 100, 101, 500]
    p = overlong_penalty(lengths, max_len=100, buffer_len=20, factor=1.0)
    assert p.tolist() == pytest.approx([0.0, 0.0, -0.05, -0.5, -0.75, -1.0, -1.0, -1.0])
    p2 = overlong_penalty(torch.tensor([80, 90, 120]), max_len=100, buffer_len=20, factor=2.0)
    assert p2.tolist() == pytest.approx([0.0, -1.0, -2.0])
    with pytest.raises(ValueError):
        overlong_penalty([1], max_len=10, buffer_len=0)


def test_truncation_penalty():
    r = torch.tensor([1.0, 2.0, 3.0])
    assert truncation_penalty(["stop", "length", "stop"], r, -1.0).tolist() == [1.0, -1.0, 3.0]
    assert truncation_penalty(torch.tensor([True, False, True]), r, 0.0).tolist() == [0.0, 2.0, 0.0]
    assert r.tolist() == [1.0, 2.0, 3.0]  # input untouched
    with pytest.raises(ValueError, match="2 finish reasons for 3 rewards"):
        truncation_penalty(["stop", "stop"], r, -1.0)
