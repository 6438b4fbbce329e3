"""Preference (DPO, cDPO, IPO, SimPO, ORPO, KTO), reward-model (pairwise, PRM) and distillation
losses, against numbers derived by hand from the formulas in the comments.

sp(x) = log(1 + e^x) is the softplus, so −log σ(x) = sp(−x); sig(x) = 1 / (1 + e^−x).
"""
from __future__ import annotations

import math

import pytest
import torch

from hpc_rlhf.algorithms.distill import distill_loss
from hpc_rlhf.algorithms.preference import (dpo_loss, kto_loss, kto_reference_point, orpo_loss, sequence_logprobs,
                                            simpo_loss)
from hpc_rlhf.algorithms.reward_model_loss import pairwise_reward_loss, process_reward_loss

L = math.log
NAN = float("nan")


def sp(x):
    return math.log1p(math.exp(x))


def sig(x):
    return 1.0 / (1.0 + math.exp(-x))


def t(*v, grad=False):
    return torch.tensor([float(x) for x in v], requires_grad=grad)


# ------------------------------------------------------------------ sequence log-probs

def test_sequence_logprobs_sum_mean_and_padding():
    # row0 [-1, -2, -3] all valid: sum -6, mean -2;  row1 [-0.5, nan, -inf] one valid: -0.5, -0.5
    # row2 nothing valid: 0 (mean divides by max(0, 1) = 1)
    lp = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, NAN, -math.inf], [NAN, NAN, NAN]],
                      requires_grad=True)
    m = torch.tensor([[1.0, 1, 1], [1, 0, 0], [0, 0, 0]])
    assert sequence_logprobs(lp, m).tolist() == pytest.approx([-6.0, -0.5, 0.0])
    mean = sequence_logprobs(lp, m, average=True)
    assert mean.tolist() == pytest.approx([-2.0, -0.5, 0.0])
    mean.sum().backward()
    # d mean / d logp_t = 1/|y| on valid tokens, 0 on padding (no nan leaks)
    assert lp.grad.flatten().tolist() == pytest.approx([1 / 3] * 3 + [1.0, 0, 0] + [0, 0, 0])


# ------------------------------------------------------------------ reward model, pairwise

def test_pairwise_reward_loss_sigmoid_margin_and_accuracy():
    # r_c = [2, 0, 1], r_r = [1, 1, 1] -> differences [1, -1, 0]
    # loss = mean(sp(-1), sp(1), sp(0)); accuracy: only pair 0 has r_c > r_r (a tie is not right)
    rc, rr = t(2, 0, 1, grad=True), t(1, 1, 1)
    loss, met = pairwise_reward_loss(rc, rr)
    assert loss.item() == pytest.approx((sp(-1) + sp(1) + L(2)) / 3, abs=1e-6)
    assert met["accuracy"].item() == pytest.approx(1 / 3)
    assert met["margins"].tolist() == pytest.approx([1, -1, 0])
    # per-pair margin m = [0.5, 0, 2]: -log σ(d - m) = sp(m - d) -> sp(-0.5), sp(1), sp(2)
    lm, met_m = pairwise_reward_loss(rc, rr, t(0.5, 0, 2))
    assert lm.item() == pytest.approx((sp(-0.5) + sp(1) + sp(2)) / 3, abs=1e-6)
    assert met_m["accuracy"].item() == pytest.approx(1 / 3)     # the margin does not change it
    # gradient: d/dr_c of sp(m - d)/3 = -σ(m - d)/3 < 0: pushes every chosen reward up
    lm.backward()
    assert rc.grad.tolist() == pytest.approx([-sig(-0.5) / 3, -sig(1) / 3, -sig(2) / 3], abs=1e-6)


def test_log_exp_equals_sigmoid_loss():
    # log(1 + exp(r_r - r_c)) with r_c = 0.3, r_r = 1.1: log(1 + e^0.8)
    le, _ = pairwise_reward_loss(t(0.3), t(1.1), loss_type="log_exp")
    assert le.item() == pytest.approx(L(1 + math.exp(0.8)), abs=1e-6)
    g = torch.Generator().manual_seed(0)
    rc, rr = torch.randn(16, generator=g) * 5, torch.randn(16, generator=g) * 5
    a, _ = pairwise_reward_loss(rc, rr, loss_type="sigmoid")
    b, _ = pairwise_reward_loss(rc, rr, loss_type="log_exp")
    assert a.item() == pytest.approx(b.item(), rel=1e-6)
    with pytest.raises(ValueError):
        pairwise_reward_loss(rc, rr, loss_type="hinge")


# ------------------------------------------------------------------ DPO family
# Two pairs, beta = 0.5:
#   pair 0: pi_c -2, pi_r -5, ref_c -3, ref_r -4: ratios +1, -1 -> Δ = 2, βΔ = 1
#   pair 1: pi_c -4, pi_r -3, ref_c -3, ref_r -3: ratios -1,  0 -> Δ = -1, βΔ = -0.5
# implicit rewards β·ratio: chosen [0.5, -0.5], rejected [-0.5, 0]; margins [1, -0.5]

def _dpo_inputs():
    return t(-2, -4, grad=True), t(-5, -3, grad=True), t(-3, -3, grad=True), t(-4, -3, grad=True)


def test_dpo_sigmoid_values_metrics_and_gradient():
    pc, pr, rc, rr = _dpo_inputs()
    loss, met = dpo_loss(pc, pr, rc, rr, beta=0.5)
    # -log σ(1) = sp(-1);  -log σ(-0.5) = sp(0.5)
    assert loss.item() == pytest.approx((sp(-1) + sp(0.5)) / 2, abs=1e-6)
    assert met["chosen_rewards"].tolist() == pytest.approx([0.5, -0.5])
    assert met["rejected_rewards"].tolist() == pytest.approx([-0.5, 0.0])
    assert met["margins"].tolist() == pytest.approx([1.0, -0.5])
    assert met["accuracy"].item() == pytest.approx(0.5)
    loss.backward()
    # d/dpi_c [sp(-βΔ)]/2 = -β σ(-βΔ)/2: negative (descent raises the chosen log-prob);
    # d/dpi_r is the opposite.  pair 0: σ(-1), pair 1: σ(0.5)
    assert pc.grad.tolist() == pytest.approx([-0.25 * sig(-1), -0.25 * sig(0.5)], abs=1e-6)
    assert pr.grad.tolist() == pytest.approx([0.25 * sig(-1), 0.25 * sig(0.5)], abs=1e-6)
    assert rc.grad is None and rr.grad is None          # the reference is detached


def test_cdpo_label_smoothing():
    # ε = 0.1: -(0.9) log σ(x) - 0.1 log σ(-x) = 0.9 sp(-x) + 0.1 sp(x), x = βΔ = 1, -0.5
    pc, pr, rc, rr = _dpo_inputs()
    loss, _ = dpo_loss(pc, pr, rc, rr, beta=0.5, label_smoothing=0.1)
    want = ((0.9 * sp(-1) + 0.1 * sp(1)) + (0.9 * sp(0.5) + 0.1 * sp(-0.5))) / 2
    assert loss.item() == pytest.approx(want, abs=1e-6)
    with pytest.raises(ValueError):
        dpo_loss(pc, pr, rc, rr, label_smoothing=0.6)


def test_ipo_loss_and_gradient():
    # 1/(2β) = 1: (2 - 1)^2 = 1, (-1 - 1)^2 = 4 -> mean 2.5
    pc, pr, rc, rr = _dpo_inputs()
    loss, met = dpo_loss(pc, pr, rc, rr, beta=0.5, loss_type="ipo")
    assert loss.item() == pytest.approx(2.5)
    assert met["accuracy"].item() == pytest.approx(0.5)
    loss.backward()
    # d/dpi_c (Δ - 1)^2 / 2 = (Δ - 1): pair 0 +1 (Δ above the target 1: pulls back), pair 1 -2
    assert pc.grad.tolist() == pytest.approx([1.0, -2.0])
    with pytest.raises(ValueError):
        dpo_loss(pc, pr, rc, rr, loss_type="ipo", label_smoothing=0.1)
    with pytest.raises(ValueError):
        dpo_loss(pc, pr, rc, rr, loss_type="kto")


def test_dpo_nll_term_per_chosen_token():
    # coef 0.5, chosen lengths [4, 2]: NLL/token = 2/4 = 0.5 and 4/2 = 2
    # -> the loss grows by 0.5·(0.5 + 2)/2 = 0.625
    pc, pr, rc, rr = _dpo_inputs()
    loss, met = dpo_loss(pc, pr, rc, rr, beta=0.5, nll_coef=0.5, chosen_lengths=t(4, 2))
    assert loss.item() == pytest.approx((sp(-1) + sp(0.5)) / 2 + 0.625, abs=1e-6)
    assert met["nll"].item() == pytest.approx(1.25)
    loss.backward()
    # extra gradient on pi_c: 0.5 · (-1/|y_c|) / 2 = [-1/16, -1/8]
    assert pc.grad.tolist() == pytest.approx(
        [-0.25 * sig(-1) - 1 / 16, -0.25 * sig(0.5) - 1 / 8], abs=1e-6)
    with pytest.raises(ValueError):
        dpo_loss(pc, pr, rc, rr, nll_coef=1.0)


# ------------------------------------------------------------------ SimPO

def test_simpo_length_normalisation_margin_and_smoothing():
    # β = 2, γ = 0.5
    #  pair 0: pi_c -3 over 3 tokens (-1/token), pi_r -8 over 4 (-2/token): x = -2 + 4 - 0.5 = 1.5
    #          (without the normalisation it would be 2·(-3 + 8) - 0.5 = 9.5)
    #  pair 1: pi_c -4 over 2 (-2), pi_r -2 over 2 (-1): x = -4 + 2 - 0.5 = -2.5
    pc, pr = t(-3, -4, grad=True), t(-8, -2)
    lc, lr = t(3, 2), t(4, 2)
    loss, met = simpo_loss(pc, pr, lc, lr, beta=2.0, gamma=0.5)
    assert loss.item() == pytest.approx((sp(-1.5) + sp(2.5)) / 2, abs=1e-6)
    assert met["chosen_rewards"].tolist() == pytest.approx([-2.0, -4.0])
    assert met["rejected_rewards"].tolist() == pytest.approx([-4.0, -2.0])
    assert met["margins"].tolist() == pytest.approx([2.0, -2.0])      # γ not included
    assert met["accuracy"].item() == pytest.approx(0.5)
    loss.backward()
    # d/dpi_c sp(-x)/2 = -σ(-x)·β/|y_c|/2: pair 0 -σ(-1.5)/3, pair 1 -σ(2.5)/2
    assert pc.grad.tolist() == pytest.approx([-sig(-1.5) / 3, -sig(2.5) / 2], abs=1e-6)
    # γ = 0: x = 2, -2
    l0, _ = simpo_loss(pc, pr, lc, lr, beta=2.0, gamma=0.0)
    assert l0.item() == pytest.approx((sp(-2) + sp(2)) / 2, abs=1e-6)
    # ε = 0.2: 0.8 sp(-x) + 0.2 sp(x)
    ls, _ = simpo_loss(pc, pr, lc, lr, beta=2.0, gamma=0.5, label_smoothing=0.2)
    want = (0.8 * sp(-1.5) + 0.2 * sp(1.5) + 0.8 * sp(2.5) + 0.2 * sp(-2.5)) / 2
    assert ls.item() == pytest.approx(want, abs=1e-6)


# ------------------------------------------------------------------ ORPO

def test_orpo_odds_ratio_and_nll():
    # chosen: -2 over 4 tokens -> log p_c = -0.5;  rejected: -6 over 3 -> log p_r = -2
    # log odds = log p - log(1 - p):  o_c = -0.5 - log(1 - e^-0.5),  o_r = -2 - log(1 - e^-2)
    # loss = NLL_c + λ·sp(-(o_c - o_r)),  NLL_c = 0.5,  λ = 0.5
    o_c = -0.5 - L(1 - math.exp(-0.5))      # = 0.4587
    o_r = -2.0 - L(1 - math.exp(-2.0))      # = -1.8546
    pc = t(-2, grad=True)
    loss, met = orpo_loss(pc, t(-6), t(4), t(3), lam=0.5)
    assert loss.item() == pytest.approx(0.5 + 0.5 * sp(-(o_c - o_r)), abs=1e-6)
    assert met["log_odds_ratio"].tolist() == pytest.approx([o_c - o_r], abs=1e-6)
    assert met["nll"].item() == pytest.approx(0.5)
    assert met["or_loss"].item() == pytest.approx(sp(-(o_c - o_r)), abs=1e-6)
    assert met["accuracy"].item() == 1.0
    loss.backward()
    # d o/d log p = 1 + p/(1 - p) = 1/(1 - p); d log p_c/d pi_c = 1/4
    # d loss/d pi_c = (-1 - λ σ(-(o_c - o_r)) / (1 - p_c)) / 4
    p_c = math.exp(-0.5)
    want = (-1 - 0.5 * sig(-(o_c - o_r)) / (1 - p_c)) / 4
    assert pc.grad.item() == pytest.approx(want, abs=1e-6)


def test_orpo_is_finite_near_certainty():
    # log p -> 0 (p -> 1): log(1 - p) must stay finite (log1mexp with the clamp at -1e-7)
    pc = t(0.0, -1e-9, -1e-3, grad=True)
    pr = t(-1e-6, -30.0, -0.7, grad=True)
    loss, _ = orpo_loss(pc, pr, t(1, 1, 1), t(1, 1, 1))
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(pc.grad).all() and torch.isfinite(pr.grad).all()
    # close to 0 the log odds ≈ log p − log(−log p): for log p = -1e-3, o ≈ -1e-3 - log(1e-3 - 5e-7)
    one, met = orpo_loss(t(-1e-3), t(-0.7), t(1), t(1), lam=1.0)
    o_c = -1e-3 - L(-math.expm1(-1e-3))
    o_r = -0.7 - L(1 - math.exp(-0.7))
    assert met["log_odds_ratio"].item() == pytest.approx(o_c - o_r, rel=1e-5)


# ------------------------------------------------------------------ KTO

def test_kto_reference_point_mean_clamp_detach():
    # mean(0.3, -0.1, 0.4) = 0.2;  mean(-0.5, 0.1) = -0.2 -> clamped to 0
    x = t(0.3, -0.1, 0.4, grad=True)
    z = kto_reference_point(x)
    assert z.item() == pytest.approx(0.2) and not z.requires_grad and z.dim() == 0
    assert kto_reference_point(t(-0.5, 0.1)).item() == 0.0
    # over 2 "ranks": rank values [0.3] and [-0.1, 0.4]; all_reduce sums [Σ, count] -> 0.6/3
    other = torch.tensor([0.3, 1.0])
    zr = kto_reference_point(t(-0.1, 0.4), all_reduce=lambda s: s + other)
    assert zr.item() == pytest.approx(0.2)


def test_kto_loss_weights_and_gradient():
    # β = 0.5, z0 = 0.2, λ_D = 1.5, λ_U = 0.5
    # r = pi - ref = [-1 - -2, -2 - -2, -3 - -1] = [1, 0, -2]; labels [D, U, U]
    #  row 0 (D): 1.5 (1 - σ(0.5 (1 - 0.2)))  = 1.5 (1 - σ(0.4))
    #  row 1 (U): 0.5 (1 - σ(0.5 (0.2 - 0)))  = 0.5 (1 - σ(0.1))
    #  row 2 (U): 0.5 (1 - σ(0.5 (0.2 + 2)))  = 0.5 (1 - σ(1.1))
    # mean over the 3 rows
    pi = t(-1, -2, -3, grad=True)
    ref = t(-2, -2, -1)
    lab = torch.tensor([True, False, False])
    loss, met = kto_loss(pi, ref, lab, torch.tensor(0.2), beta=0.5, desirable_weight=1.5,
                         undesirable_weight=0.5)
    rows = [1.5 * (1 - sig(0.4)), 0.5 * (1 - sig(0.1)), 0.5 * (1 - sig(1.1))]
    assert loss.item() == pytest.approx(sum(rows) / 3, abs=1e-6)
    assert met["rewards"].tolist() == pytest.approx([0.5, 0.0, -1.0])
    loss.backward()
    # d/dr λ(1 - σ(±β(r - z0)))/3 = ∓ λ β σ(x)(1 - σ(x)) / 3: desirable negative (raise it),
    # undesirable positive (lower it)
    d = lambda w, x: w * 0.5 * sig(x) * (1 - sig(x)) / 3  # noqa: E731
    assert pi.grad.tolist() == pytest.approx([-d(1.5, 0.4), d(0.5, 0.1), d(0.5, 1.1)], abs=1e-6)
    # z0 as a float, default weights: row 0 (1 - σ(0.4)), rows 1, 2 (1 - σ(0.1)), (1 - σ(1.1))
    l1, _ = kto_loss(pi, ref, lab, 0.2, beta=0.5)
    assert l1.item() == pytest.approx((3 - sig(0.4) - sig(0.1) - sig(1.1)) / 3, abs=1e-6)


def test_kto_z0_clamp_changes_the_loss():
    # mismatched-pair log ratios with a negative mean -> z0 = 0, not -0.5
    # one desirable row r = 1, β = 1: 1 - σ(1 - 0) (an unclamped z0 would give 1 - σ(1.5))
    z0 = kto_reference_point(t(-1.0, 0.0))
    loss, met = kto_loss(t(0.0), t(-1.0), torch.tensor([True]), z0, beta=1.0)
    assert met["z0"].item() == 0.0
    assert loss.item() == pytest.approx(1 - sig(1.0), abs=1e-6)


# ------------------------------------------------------------------ process reward model
# V = 5, reward tokens ids (negative, positive) = (3, 1); other entries are large (the loss must
# only look at the two reward tokens).
#  pos 0: z[3] = 0,    z[1] = ln 3 -> q = (1/4, 3/4)
#  pos 1: z[3] = ln 3, z[1] = 0    -> q = (3/4, 1/4)
#  pos 2: no placeholder, nan logits and garbage target

def _prm_logits():
    z = torch.full((3, 5), 50.0)
    z[0, 3], z[0, 1] = 0.0, L(3)
    z[1, 3], z[1, 1] = L(3), 0.0
    z[2] = NAN
    return z.requires_grad_(True)


def test_prm_hard_labels():
    # targets [1, 1]: pos 0 -ln(3/4) (right), pos 1 -ln(1/4) = ln 4 (wrong) -> mean, accuracy 1/2
    z = _prm_logits()
    mask = torch.tensor([True, True, False])
    loss, met = process_reward_loss(z, torch.tensor([1, 1, -100]), mask, (3, 1))
    assert loss.item() == pytest.approx((L(4 / 3) + L(4)) / 2, abs=1e-6)
    assert met["accuracy"].item() == pytest.approx(0.5) and met["steps"].item() == 2
    loss.backward()
    # gradient only on the reward tokens of placeholder rows: (q - onehot)/2 at ids (3, 1)
    g = z.grad
    assert torch.isfinite(g).all() and g[2].abs().sum() == 0
    assert [g[0, 3].item(), g[0, 1].item()] == pytest.approx([0.25 / 2, -0.25 / 2])
    assert [g[1, 3].item(), g[1, 1].item()] == pytest.approx([0.75 / 2, -0.75 / 2])
    assert g[0, [0, 2, 4]].abs().sum() == 0
    with pytest.raises(ValueError):
        process_reward_loss(z, torch.tensor([2, 1, 0]), mask, (3, 1))


def test_prm_soft_labels_and_batch_shape():
    # soft s = P(positive): pos 0 s = 0.75 -> -(0.75 ln 3/4 + 0.25 ln 1/4)
    #                       pos 1 s = 0.2  -> -(0.2 ln 1/4 + 0.8 ln 3/4)
    # accuracy: pos 0 predicts + (3/4), s > 0.5 -> right; pos 1 predicts - , s < 0.5 -> right
    z = _prm_logits()
    mask = torch.tensor([True, True, False])
    loss, met = process_reward_loss(z, torch.tensor([0.75, 0.2, NAN]), mask, (3, 1))
    want = (-(0.75 * L(0.75) + 0.25 * L(0.25)) - (0.2 * L(0.25) + 0.8 * L(0.75))) / 2
    assert loss.item() == pytest.approx(want, abs=1e-6)
    assert met["accuracy"].item() == 1.0
    # soft 1.0 / 0.0 is the same loss as hard 1 / 0
    hard, _ = process_reward_loss(z, torch.tensor([1, 0, 0]), mask, (3, 1))
    soft, _ = process_reward_loss(z, torch.tensor([1.0, 0.0, 0.0]), mask, (3, 1))
    assert soft.item() == pytest.approx(hard.item(), abs=1e-6)
    # [B, T, V] with a [B, T] mask gives the same as the flattened [N, V]
    zb = z.detach().reshape(1, 3, 5)
    lb, _ = process_reward_loss(zb, torch.tensor([[0.75, 0.2, NAN]]), mask[None], (3, 1))
    assert lb.item() == pytest.approx(want, abs=1e-6)
    # no placeholder at all: loss 0, no nan
    none = torch.zeros(3, dtype=torch.bool)
    l0, m0 = process_reward_loss(z, torch.tensor([1, 1, 1]), none, (3, 1))
    assert l0.item() == 0 and m0["steps"].item() == 0
    with pytest.raises(ValueError):
        process_reward_loss(z, torch.tensor([0.5, 0.5, 0.5]), mask, (3, 1, 0))


# ------------------------------------------------------------------ knowledge distillation
# V = 2, one row, T = 3:
#  pos 0: student [0, 0] -> p_s (1/2, 1/2); teacher [ln 3, 0] -> p_t (3/4, 1/4); label 0
#         KL = 3/4 ln(3/2) + 1/4 ln(1/2);  CE = ln 2
#  pos 1: student = teacher = [ln 3, 0]: KL = 0; label 1 -> CE = -ln(1/4) = ln 4
#  pos 2: padding (nan logits, label -100)

def _kd_inputs():
    s = torch.tensor([[[0.0, 0.0], [L(3), 0.0], [NAN, NAN]]], requires_grad=True)
    te = torch.tensor([[[L(3), 0.0], [L(3), 0.0], [NAN, NAN]]], requires_grad=True)
    return s, te, torch.tensor([[0, 1, -100]]), torch.tensor([[1.0, 1.0, 0.0]])


KL0 = 0.75 * L(1.5) + 0.25 * L(0.5)


def test_distill_kl_value_and_alpha_mixing():
    s, te, y, m = _kd_inputs()
    # α = 0.25: mean over 2 tokens of 0.75·CE + 0.25·KL
    loss, met = distill_loss(s, te, y, m, kd_coef=0.25)
    want = (0.75 * (L(2) + L(4)) + 0.25 * KL0) / 2
    assert loss.item() == pytest.approx(want, abs=1e-6)
    assert met["kl"].item() == pytest.approx(KL0 / 2, abs=1e-6)
    assert met["ce"].item() == pytest.approx((L(2) + L(4)) / 2, abs=1e-6)
    # α = 0: plain CE;  α = 1: pure KL
    assert distill_loss(s, te, y, m, kd_coef=0.0)[0].item() == pytest.approx((L(2) + L(4)) / 2)
    assert distill_loss(s, te, y, m, kd_coef=1.0)[0].item() == pytest.approx(KL0 / 2, abs=1e-6)
    # per-token form: 0 on padding
    tok, _ = distill_loss(s, te, y, m, kd_coef=0.25, reduction="none")
    assert tok[0].tolist() == pytest.approx([0.75 * L(2) + 0.25 * KL0, 0.75 * L(4), 0.0], abs=1e-6)


def test_distill_gradient_and_temperature():
    s, te, y, m = _kd_inputs()
    loss, _ = distill_loss(s, te, y, m, kd_coef=1.0)
    loss.backward()
    # d KL/d z_s = p_s - p_t: pos 0 (1/2 - 3/4, 1/2 - 1/4) = (-1/4, 1/4), /2 tokens;
    # pos 1 zero; padding zero; the teacher gets no gradient
    assert s.grad.flatten().tolist() == pytest.approx([-0.125, 0.125, 0, 0, 0, 0], abs=1e-6)
    assert te.grad is None
    # τ = 2 on pos 0 only: teacher [ln 3 / 2, 0] -> p_t = (√3, 1)/(√3 + 1); student stays (1/2, 1/2)
    # KL·τ² = 4 (a ln(2a) + b ln(2b)), a = √3/(√3 + 1), b = 1/(√3 + 1)
    a, b = math.sqrt(3) / (math.sqrt(3) + 1), 1 / (math.sqrt(3) + 1)
    m0 = torch.tensor([[1.0, 0.0, 0.0]])
    lt, met = distill_loss(s, te, y, m0, kd_coef=1.0, temperature=2.0)
    assert lt.item() == pytest.approx(4 * (a * L(2 * a) + b * L(2 * b)), abs=1e-6)
    # CE stays at temperature 1
    assert met["ce"].item() == pytest.approx(L(2))


def test_distill_teacher_zero_probability_and_errors():
    # teacher logit -inf on token 1: p_t = (1, 0); student [0, 0]: KL = 1·ln(1/(1/2)) = ln 2
    s = torch.tensor([[[0.0, 0.0]]], requires_grad=True)
    te = torch.tensor([[[0.0, -math.inf]]])
    loss, _ = distill_loss(s, te, torch.tensor([[0]]), torch.ones(1, 1), kd_coef=1.0)
    assert loss.item() == pytest.approx(L(2))
    loss.backward()
    assert torch.isfinite(s.grad).all()
    with pytest.raises(ValueError):
        distill_loss(s, torch.zeros(1, 1, 3), torch.tensor([[0]]), torch.ones(1, 1))
    with pytest.raises(ValueError):
        distill_loss(s, te, torch.tensor([[0]]), torch.ones(1, 1), kd_coef=1.5)


# ------------------------------------------------------------------ generalized JSD (GKD): β and on-policy tokens
# _kd_inputs, pos 0: p = teacher (3/4, 1/4), q = student (1/2, 1/2); pos 1: p = q (every divergence 0).
#  β = 1, reverse KL(q ‖ p) = 1/2 ln((1/2)/(3/4)) + 1/2 ln((1/2)/(1/4)) = 1/2 ln(4/3)
#     d/dz_j = q_j (ln(q_j/p_j) − KL) = 1/2 (ln(2/3) − 1/2 ln(4/3)), 1/2 (ln 2 − 1/2 ln(4/3)) = ∓ (ln 3)/4
#  β = 1/2: m = (p + q)/2 = (5/8, 3/8)
#     JSD = 1/2 KL(p ‖ m) + 1/2 KL(q ‖ m),
#     KL(p ‖ m) = 3/4 ln(6/5) + 1/4 ln(2/3),  KL(q ‖ m) = 1/2 ln(4/5) + 1/2 ln(4/3)
#     ∂JSD/∂q_v = (1 − β) ln(q_v/m_v) (the terms through m cancel), so d/dz_j = q_j (g_j − Σ_v q_v g_v) with
#     g = 1/2 (ln(4/5), ln(4/3)): d/dz_0 = 1/8 (2 ln(4/5) − ln(16/15)) = 1/8 ln(3/5), d/dz_1 = 1/8 ln(5/3)
# Every value is a mean over the 2 valid tokens; the padding position (nan logits) is never read.

RKL0 = 0.5 * L(4 / 3)
JSD0 = 0.5 * (0.75 * L(6 / 5) + 0.25 * L(2 / 3)) + 0.5 * (0.5 * L(4 / 5) + 0.5 * L(4 / 3))


@pytest.mark.parametrize("beta, div, grad0", [(1.0, RKL0, -L(3) / 4), (0.5, JSD0, L(3 / 5) / 8)])
def test_distill_reverse_kl_and_generalized_jsd(beta, div, grad0):
    s, te, y, m = _kd_inputs()
    loss, met = distill_loss(s, te, y, m, kd_coef=1.0, beta=beta)
    assert loss.item() == pytest.approx(div / 2, abs=1e-6)
    assert met["kl"].item() == pytest.approx(div / 2, abs=1e-6)
    loss.backward()
    assert s.grad.flatten().tolist() == pytest.approx([grad0 / 2, -grad0 / 2, 0, 0, 0, 0], abs=1e-6)
    assert te.grad is None
    # α = 1/4 mixes the CE in as with β = 0; per token: 0 on padding
    tok, _ = distill_loss(s, te, y, m, kd_coef=0.25, beta=beta, reduction="none")
    assert tok[0].tolist() == pytest.approx([0.75 * L(2) + 0.25 * div, 0.75 * L(4), 0.0], abs=1e-6)


def test_distill_reverse_kl_temperature_and_student_responses():
    s, te, y, m = _kd_inputs()
    # τ = 2, β = 1 on pos 0 only: p = (a, b) = (√3, 1)/(√3 + 1), q = (1/2, 1/2);
    # τ²·KL(q ‖ p) = 4 (1/2 ln(1/(2a)) + 1/2 ln(1/(2b))) = −2 ln(4ab)
    a, b = math.sqrt(3) / (math.sqrt(3) + 1), 1 / (math.sqrt(3) + 1)
    m0 = torch.tensor([[1.0, 0.0, 0.0]])
    lt, _ = distill_loss(s, te, y, m0, kd_coef=1.0, temperature=2.0, beta=1.0)
    assert lt.item() == pytest.approx(-2 * L(4 * a * b), abs=1e-6)
    # the student's own responses (supervised=False): α·D only, the CE neither in the loss nor in the metrics
    lu, met = distill_loss(s, te, y, m, kd_coef=0.25, beta=0.5, supervised=False)
    assert lu.item() == pytest.approx(0.25 * JSD0 / 2, abs=1e-6)
    assert "ce" not in met and met["kl"].item() == pytest.approx(JSD0 / 2, abs=1e-6)
    # a teacher probability of 0 (logit −inf) contributes 0 to KL(p ‖ m): p = (1, 0), q = (1/2, 1/2), m = (3/4, 1/4),
    # JSD = 1/2 ln(4/3) + 1/2 (1/2 ln(2/3) + 1/2 ln 2) = 3/4 ln(4/3), with a finite gradient
    s0 = torch.tensor([[[0.0, 0.0]]], requires_grad=True)
    l0, _ = distill_loss(s0, torch.tensor([[[0.0, -math.inf]]]), torch.tensor([[0]]), torch.ones(1, 1), kd_coef=1.0,
                         beta=0.5)
    assert l0.item() == pytest.approx(0.75 * L(4 / 3), abs=1e-6)
    l0.backward()
    assert torch.isfinite(s0.grad).all()
    with pytest.raises(ValueError):
        distill_loss(s, te, y, m, beta=1.5)


def _forward_kl_before_beta(student_logits, teacher_logits, labels, mask, kd_coef, temperature, reduction):
    """The forward-KL distillation loss as it was before β and on-policy responses (kept here verbatim, as the
    reference that β = 0 must reproduce bit for bit)."""
    import torch.nn.functional as F
    valid = mask.bool()
    zs = student_logits[valid].float()
    zt = teacher_logits.detach()[valid].float()
    y = labels[valid].long()
    logp_s = F.log_softmax(zs, dim=-1)
    ce = -logp_s.gather(-1, y[:, None]).squeeze(-1)
    tau = float(temperature)
    logp_s_tau = logp_s if tau == 1.0 else F.log_softmax(zs / tau, dim=-1)
    logp_t = F.log_softmax(zt / tau, dim=-1)
    p_t = logp_t.exp()
    terms = torch.where(p_t > 0, p_t * (logp_t - logp_s_tau), torch.zeros_like(p_t))
    kl = terms.sum(-1) * (tau * tau)
    tok = (1.0 - kd_coef) * ce + kd_coef * kl
    n = tok.shape[0]
    metrics = {"ce": ce.detach().sum() / max(n, 1), "kl": kl.detach().sum() / max(n, 1),
               "tokens": torch.tensor(float(n))}
    if reduction == "none":
        out = torch.zeros(mask.shape, dtype=tok.dtype, device=tok.device)
        out[valid] = tok
        return out, metrics
    return tok.sum() / max(n, 1), metrics


@pytest.mark.parametrize("kd_coef, temperature, reduction", [(0.5, 1.0, "mean"), (0.9, 2.0, "mean"),
                                                             (1.0, 0.5, "none"), (0.0, 1.0, "mean")])
def test_distill_beta_zero_is_the_forward_kl_bit_for_bit(kd_coef, temperature, reduction):
    g = torch.Generator().manual_seed(7)
    zs, zt = torch.randn(3, 6, 11, generator=g) * 3, torch.randn(3, 6, 11, generator=g) * 3
    zt[0, 1, 4] = -math.inf  # a teacher probability of 0
    labels = torch.randint(0, 11, (3, 6), generator=g)
    mask = torch.ones(3, 6)
    mask[1, 4:] = 0
    mask[2, :2] = 0
    results = []
    for fn in (lambda s, t: distill_loss(s, t, labels, mask, kd_coef=kd_coef, temperature=temperature,
                                         reduction=reduction),
               lambda s, t: _forward_kl_before_beta(s, t, labels, mask, kd_coef, temperature, reduction)):
        s = zs.clone().requires_grad_()
        loss, met = fn(s, zt)
        loss.sum().backward()
        results.append((loss.detach(), met, s.grad))
    (new, new_m, new_g), (old, old_m, old_g) = results
    assert torch.equal(new, old) and torch.equal(new_g, old_g)
    assert new_m.keys() == old_m.keys() and all(torch.equal(new_m[k], old_m[k]) for k in old_m)


@pytest.mark.parametrize("beta", [0.0, 0.3, 0.5, 1.0])
@pytest.mark.parametrize("temperature", [1.0, 2.0])
def test_distill_divergence_equals_trl_generalized_jsd(beta, temperature):
    """TRL 1.16's GKDTrainer.generalized_jsd_loss on the same logits, values and student gradients.  Conventions:
    TRL's loss has no τ² factor (ours is τ² × TRL's), no CE term (ours with kd_coef = 1), and its "batchmean"
    with labels is the mean over the valid tokens (ours "mean"), valid meaning label != −100 (ours: the mask)."""
    from trl.experimental.gkd.gkd_trainer import GKDTrainer  # the test extra pins trl==1.16.0
    g = torch.Generator().manual_seed(11)
    zs, zt = torch.randn(2, 5, 7, generator=g) * 2, torch.randn(2, 5, 7, generator=g) * 2
    labels = torch.randint(0, 7, (2, 5), generator=g)
    labels[0, :2] = -100
    labels[1, 4] = -100
    ours_s, trl_s = zs.clone().requires_grad_(), zs.clone().requires_grad_()
    ours, _ = distill_loss(ours_s, zt, labels.clamp(min=0), labels != -100, kd_coef=1.0, temperature=temperature,
                           beta=beta)
    trl = GKDTrainer.generalized_jsd_loss(trl_s, zt.clone(), labels=labels, beta=beta, temperature=temperature,
                                          reduction="batchmean")
    (ours / temperature**2).backward()
    trl.backward()
    torch.testing.assert_close(ours / temperature**2, trl, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(ours_s.grad, trl_s.grad, atol=1e-6, rtol=1e-5)
