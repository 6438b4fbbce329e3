import math

import pytest
import torch

from hpc_rlhf.algorithms.sft_loss import step_token_mean, token_nll_sum
from hpc_rlhf.engines.schedule import lr_factor


def test_token_nll_hand_values():
    # vocab 2; logits[0] = [0, 0] -> p = (1/2, 1/2); logits[1] = [ln 3, 0] -> p = (3/4, 1/4)
    logits = torch.tensor([[[0.0, 0.0], [math.log(3.0), 0.0], [5.0, -5.0]]])
    labels = torch.tensor([[-100, 1, 0]])  # label[t] is predicted by logits[t-1]
    s, n = token_nll_sum(logits, labels)
    assert n == 2
    assert s.item() == pytest.approx(math.log(2) + math.log(4 / 3), abs=1e-6)  # = ln(8/3)


def test_ignored_positions_contribute_nothing():
    logits = torch.randn(2, 4, 7)
    labels = torch.full((2, 4), -100)
    s, n = token_nll_sum(logits, labels)
    assert n == 0 and s.item() == 0.0


def test_step_token_mean_scales_by_world_over_tokens():
    # a rank's micro-batch with NLL sum 6 in a step of 12 target tokens over 2 ranks:
    # DP averaging halves it again, so the micro-batch's share of the step mean is 6/12 = 0.5.
    assert step_token_mean(torch.tensor(6.0), 12, 2).item() == pytest.approx(1.0)


def test_lr_schedule_hand_values():
    # 10 steps, 2 warm-up steps, cosine to 0.1
    f = [lr_factor(s, 10, 2, "cosine_with_min_lr", 0.1) for s in range(11)]
    assert f[0] == pytest.approx(1 / 3) and f[1] == pytest.approx(2 / 3)
    assert f[2] == pytest.approx(1.0)
    assert f[6] == pytest.approx(0.55)  # progress 4/8: 0.1 + 0.9 * (1 + cos(pi/2)) / 2
    assert f[10] == pytest.approx(0.1)
    assert lr_factor(7, 10, 2, "constant_with_warmup", 0.1) == 1.0
