"""Policy losses, value loss, entropy, KL estimators/controllers and loss aggregation.

Expected numbers are derived by hand in the comments; invariance tests check that the step's
gradient does not depend on how the step is split over ranks and micro-batches.
"""
from __future__ import annotations

import math

import pytest
import torch

from _thread_ranks import thread_ranks

from hpc_rlhf.algorithms.aggregation import StepNorm, aggregate
from hpc_rlhf.algorithms.kl import (AdaptiveKLController, FixedKLController, compute_kl, kl_penalty_rewards,
                                    make_kl_controller)
from hpc_rlhf.algorithms.policy_loss import entropy_from_logits, policy_loss
from hpc_rlhf.algorithms.registry import LOSS_AGGREGATIONS, POLICY_LOSSES
from hpc_rlhf.algorithms.value_loss import value_loss

L = math.log


def _tokens(ratios, advs, pad=1):
    """One row: log_probs (leaf) with log(ratio) over old_log_probs = -1, plus `pad` padded slots
    whose log-probs are garbage (-inf) to check masking."""
    old = torch.tensor([[-1.0] * len(ratios) + [-math.inf] * pad])
    lp = torch.tensor([[-1.0 + L(r) for r in ratios] + [-math.inf] * pad], requires_grad=True)
    adv = torch.tensor([list(advs) + [0.0] * pad])
    mask = torch.tensor([[1.0] * len(ratios) + [0.0] * pad])
    return lp, old, adv, mask


# ------------------------------------------------------------------ PPO

def test_ppo_clip_cases_values_and_gradients():
    # eps 0.2:
    #  rho 1.5, A +1: min(1.5, 1.2) = 1.2 -> loss -1.2, clipped, grad 0
    #  rho 1.5, A -1: min(-1.5, -1.2) = -1.5 -> loss 1.5, grad -rho*A = 1.5
    #  rho 0.5, A +1: min(0.5, 0.8) = 0.5 -> loss -0.5, grad -0.5
    #  rho 0.5, A -1: min(-0.5, -0.8) = -0.8 -> loss 0.8, clipped, grad 0
    #  rho 1.1, A +2: 2.2 both -> loss -2.2, grad -2.2
    lp, old, adv, mask = _tokens([1.5, 1.5, 0.5, 0.5, 1.1], [1, -1, 1, -1, 2])
    loss, met = POLICY_LOSSES.get("ppo")(lp, old, adv, mask, eps_clip=0.2)
    assert loss[0].tolist() == pytest.approx([-1.2, 1.5, -0.5, 0.8, -2.2, 0.0], abs=1e-6)
    loss.sum().backward()
    assert lp.grad[0].tolist() == pytest.approx([0, 1.5, -0.5, 0, -2.2, 0], abs=1e-6)
    assert met["clip_frac"].item() == pytest.approx(2 / 5)
    assert met["dual_clip_frac"].item() == 0
    # approx_kl = mean((rho - 1) - ln rho): 2*(0.5 - ln 1.5) + 2*(-0.5 + ln 2) + (0.1 - ln 1.1), / 5
    kl = (2 * (0.5 - L(1.5)) + 2 * (-0.5 + L(2)) + (0.1 - L(1.1))) / 5
    assert met["approx_kl"].item() == pytest.approx(kl, abs=1e-6)


def test_ppo_clip_higher():
    # eps_low 0.2, eps_high 0.28:
    #  rho 1.25, A +1: clip(1.25) = 1.25 (< 1.28) -> loss -1.25 (symmetric clip would give -1.2)
    #  rho 1.5,  A +1: clipped at 1.28 -> -1.28
    #  rho 0.75, A -1: lower bound still 0.8: min(-0.75, -0.8) = -0.8 -> 0.8
    lp, old, adv, mask = _tokens([1.25, 1.5, 0.75], [1, 1, -1])
    loss, met = policy_loss("ppo", lp, old, adv, mask, eps_clip=0.2, eps_clip_high=0.28)
    assert loss[0, :3].tolist() == pytest.approx([-1.25, -1.28, 0.8], abs=1e-6)
    assert met["clip_frac"].item() == pytest.approx(2 / 3)
    sym, _ = policy_loss("ppo", lp, old, adv, mask, eps_clip=0.2)
    assert sym[0, 0].item() == pytest.approx(-1.2)


def test_ppo_dual_clip():
    # c = 3:
    #  rho 5, A -1: min(-5, -1.2) = -5; max(-5, cA = -3) = -3 -> loss 3, grad 0 (dual clip active)
    #  rho 2, A -1: min(-2, -1.2) = -2; max(-2, -3) = -2 -> loss 2, grad 2
    #  rho 5, A +1: min(5, 1.2) = 1.2 (the dual clip is for A < 0 only) -> loss -1.2
    lp, old, adv, mask = _tokens([5.0, 2.0, 5.0], [-1, -1, 1])
    loss, met = policy_loss("ppo", lp, old, adv, mask, eps_clip=0.2, dual_clip=3.0)
    assert loss[0, :3].tolist() == pytest.approx([3.0, 2.0, -1.2], abs=1e-6)
    loss.sum().backward()
    assert lp.grad[0].tolist() == pytest.approx([0, 2.0, 0, 0], abs=1e-6)
    assert met["dual_clip_frac"].item() == pytest.approx(1 / 3)
    nodual, _ = policy_loss("ppo", lp, old, adv, mask, eps_clip=0.2)
    assert nodual[0, 0].item() == pytest.approx(5.0)
    with pytest.raises(ValueError):
        policy_loss("ppo", lp, old, adv, mask, dual_clip=1.0)


# ------------------------------------------------------------------ GSPO

def test_gspo_sequence_ratio_clip_and_token_gradients():
    # seq0: log ratios [0.3, -0.1, 0.1] -> mean 0.1 -> s0 = e^0.1 = 1.10517 (inside [0.8, 1.2])
    # seq1: log ratios [0.6, 0.2] (+ pad) -> mean 0.4 -> s1 = e^0.4 = 1.49182 (above 1.2)
    old = torch.tensor([[-1.0, -1.0, -1.0], [-2.0, -2.0, -math.inf]])
    lp = torch.tensor([[-0.7, -1.1, -0.9], [-1.4, -1.8, -math.inf]], requires_grad=True)
    mask = torch.tensor([[1.0, 1, 1], [1, 1, 0]])
    s0, s1 = math.exp(0.1), math.exp(0.4)
    # A = +1 for both: seq0 loss -s0 per token, grad -s0 per token (flows through each token);
    # seq1 clipped: loss -1.2 per token, grad 0
    loss, met = policy_loss("gspo", lp, old, torch.ones(2, 3), mask, eps_clip=0.2)
    assert loss[0].tolist() == pytest.approx([-s0] * 3, abs=1e-6)
    assert loss[1].tolist() == pytest.approx([-1.2, -1.2, 0.0], abs=1e-6)
    loss.sum().backward()
    assert lp.grad[0].tolist() == pytest.approx([-s0] * 3, abs=1e-6)
    assert lp.grad[1].tolist() == pytest.approx([0, 0, 0], abs=1e-6)
    assert met["clip_frac"].item() == pytest.approx(2 / 5)
    assert met["seq_ratio_mean"].item() == pytest.approx((s0 + s1) / 2, abs=1e-6)
    # A = -1 for seq1: min(-s1, -1.2) = -s1 -> loss s1 per token, grad +s1 per token.
    # (token-level PPO would instead clip token 0, ratio e^0.6 = 1.82, differently from token 1.)
    lp.grad = None
    adv = torch.tensor([[1.0, 1, 1], [-1, -1, -1]])
    loss2, _ = policy_loss("gspo", lp, old, adv, mask, eps_clip=0.2)
    loss2.sum().backward()
    assert lp.grad[1].tolist() == pytest.approx([s1, s1, 0], abs=1e-6)
    assert torch.isfinite(loss2).all()


# ------------------------------------------------------------------ CISPO

def test_cispo_gradient_is_clipped_weight_times_advantage():
    # rho [1.5, 0.5, 1.1], eps 0.2 -> w = sg[clip(rho)] = [1.2, 0.8, 1.1]; A = [1, -1, 2]
    # loss_t = -w A logp;  with token_mean over N = 3 tokens: d/dlogp = -w A / 3
    #   = [-1.2/3, 0.8/3, -2.2/3, 0]  (the clipped token 0 keeps a gradient, unlike PPO)
    lp, old, adv, mask = _tokens([1.5, 0.5, 1.1], [1, -1, 2])
    loss, met = policy_loss("cispo", lp, old, adv, mask, eps_clip=0.2)
    lpv = [-1.0 + L(1.5), -1.0 + L(0.5), -1.0 + L(1.1)]
    assert loss[0, :3].tolist() == pytest.approx([-1.2 * lpv[0], 0.8 * lpv[1], -2.2 * lpv[2]], abs=1e-6)
    assert loss[0, 3].item() == 0
    aggregate(loss, mask, "token_mean", StepNorm(tokens=3, seqs=1)).backward()
    assert lp.grad[0].tolist() == pytest.approx([-1.2 / 3, 0.8 / 3, -2.2 / 3, 0], abs=1e-6)
    assert met["clip_frac"].item() == pytest.approx(2 / 3)
    # clip-higher bound: eps_high 0.6 lets rho 1.5 through unclipped
    lp.grad = None
    loss_h, _ = policy_loss("cispo", lp, old, adv, mask, eps_clip=0.2, eps_clip_high=0.6)
    loss_h.sum().backward()
    assert lp.grad[0, 0].item() == pytest.approx(-1.5)
    with pytest.raises(ValueError):
        policy_loss("cispo", lp, old, adv, mask, dual_clip=3.0)


# ------------------------------------------------------------------ value loss, entropy

def test_value_loss_clipped_and_unclipped():
    # c = 0.2
    #  a: v 1.0, old 0.5, R 2.0: v_clip 0.7; (1-2)^2 = 1 < (0.7-2)^2 = 1.69 -> 0.845, grad 0
    #  b: v 1.0, old 0.5, R 0.0: v_clip 0.7; 1 > 0.49 -> 0.5, grad v - R = 1
    #  c: v 0.6, old 0.5, R 1.0: inside the clip -> 0.5*0.16 = 0.08, grad -0.4
    #  d: padding (nan) -> 0
    v = torch.tensor([[1.0, 1.0, 0.6, float("nan")]], requires_grad=True)
    old = torch.tensor([[0.5, 0.5, 0.5, 0.0]])
    ret = torch.tensor([[2.0, 0.0, 1.0, 0.0]])
    mask = torch.tensor([[1.0, 1, 1, 0]])
    loss, met = value_loss(v, old, ret, mask, value_clip=0.2)
    assert loss[0].tolist() == pytest.approx([0.845, 0.5, 0.08, 0.0], abs=1e-6)
    loss.sum().backward()
    assert v.grad[0].tolist() == pytest.approx([0.0, 1.0, -0.4, 0.0], abs=1e-6)
    assert met["value_clip_frac"].item() == pytest.approx(1 / 3)
    un, _ = value_loss(v, old, ret, mask, value_clip=None)
    assert un[0].tolist() == pytest.approx([0.5, 0.5, 0.08, 0.0], abs=1e-6)


def test_entropy_from_logits():
    # [0, 0] -> ln 2;  [ln 3, 0] -> p = (3/4, 1/4): -(3/4 ln 3/4 + 1/4 ln 1/4);  [0, -inf] -> 0
    logits = torch.tensor([[[0.0, 0.0], [L(3.0), 0.0], [0.0, -math.inf]]], requires_grad=True)
    h = entropy_from_logits(logits)
    assert h[0].tolist() == pytest.approx([L(2), -(0.75 * L(0.75) + 0.25 * L(0.25)), 0.0], abs=1e-6)
    h.sum().backward()
    assert torch.isfinite(logits.grad).all()


def test_entropy_is_logged_without_a_bonus_only_when_asked():
    """algo.log_entropy: actor/entropy is the token mean of the entropy over the mask (ln 4 and 0 on the two
    action tokens: ln 2; the padded 7 does not count), and the loss is the same as without it, with no gradient
    through the entropy."""
    from hpc_rlhf.algorithms.rl_algorithm import RLAlgorithm
    from hpc_rlhf.config.rl import AlgoConfig
    logp = torch.tensor([[-1.0, -0.5, -2.0]], requires_grad=True)
    old, adv, mask = logp.detach().clone(), torch.tensor([[1.0, -1.0, 3.0]]), torch.tensor([[1.0, 1, 0]])
    ent = torch.tensor([[L(4), 0.0, 7.0]], requires_grad=True)
    losses = {}
    for flag in (False, True):
        algo = RLAlgorithm(AlgoConfig(log_entropy=flag), single_update=True)
        losses[flag], metrics = algo.actor_token_loss(logp, old, old, None, adv, mask, lambda: ent)
        assert ("entropy" in metrics) is flag
    assert metrics["entropy"].item() == pytest.approx(L(2), abs=1e-6)
    assert torch.equal(losses[True], losses[False])
    losses[True].sum().backward()
    assert ent.grad is None and logp.grad is not None


# ------------------------------------------------------------------ KL

def test_kl_estimators_hand_values():
    # log_ratio = +ln 2: k1 = 0.693147; k2 = 0.5*ln(2)^2 = 0.240227; k3 = 1/2 - 1 + ln 2 = 0.193147
    # log_ratio = -ln 2: k1 = -0.693147; k2 = 0.240227;               k3 = 2 - 1 - ln 2 = 0.306853
    lp = torch.tensor([[0.0, -L(2), 0.0]])
    ref = torch.tensor([[-L(2), 0.0, -math.inf]])  # third position padded, garbage reference
    mask = torch.tensor([[1.0, 1, 0]])
    assert compute_kl(lp, ref, "k1", mask)[0].tolist() == pytest.approx([L(2), -L(2), 0], abs=1e-6)
    assert compute_kl(lp, ref, "k2", mask)[0].tolist() == pytest.approx(
        [0.5 * L(2) ** 2, 0.5 * L(2) ** 2, 0], abs=1e-6)
    k3 = compute_kl(lp, ref, "k3", mask)
    assert k3[0].tolist() == pytest.approx([0.5 - 1 + L(2), 2 - 1 - L(2), 0], abs=1e-6)
    assert kl_penalty_rewards(k3, 0.1)[0].tolist() == pytest.approx(
        [-0.1 * (L(2) - 0.5), -0.1 * (1 - L(2)), 0], abs=1e-6)
    with pytest.raises(KeyError, match="known: k1, k2, k3"):
        compute_kl(lp, ref, "k4")


def test_kl_controllers():
    # init 0.1, target 6, horizon 10000
    #  kl 9,   n 1000:  e = clip(0.5) = 0.2   -> 0.1 * (1 + 0.2*0.1)     = 0.102
    #  kl 3,   n 5000:  e = clip(-0.5) = -0.2 -> 0.102 * (1 - 0.2*0.5)   = 0.0918
    #  kl 6.6, n 10000: e = 0.1               -> 0.0918 * (1 + 0.1)       = 0.10098
    c = AdaptiveKLController(0.1, 6.0, 10000)
    assert c.update(9.0, 1000) == pytest.approx(0.102)
    assert c.update(3.0, 5000) == pytest.approx(0.0918)
    assert c.update(6.6, 10000) == pytest.approx(0.10098)
    d = AdaptiveKLController(1.0, 1.0, 1.0)
    d.load_state_dict(c.state_dict())
    assert d.coef == c.coef and d.target == 6.0 and d.horizon == 10000
    f = FixedKLController(0.05)
    f.update(100.0, 10)
    assert f.coef == 0.05 and f.state_dict() == {"coef": 0.05}
    assert isinstance(make_kl_controller(0.1), FixedKLController)
    assert isinstance(make_kl_controller(0.1, kl_target=6.0, kl_horizon=100), AdaptiveKLController)


# ------------------------------------------------------------------ aggregation

TL = torch.tensor([[1.0, 2.0, 3.0], [4.0, 99.0, float("nan")]])
TM = torch.tensor([[1.0, 1, 1], [1, 0, 0]])


def test_aggregation_hand_values():
    n = StepNorm(tokens=4, seqs=2, dp_world_size=1, constant=4)
    assert aggregate(TL, TM, "token_mean", n).item() == pytest.approx(2.5)   # (1+2+3+4)/4
    assert aggregate(TL, TM, "seq_mean", n).item() == pytest.approx(3.0)     # (6/3 + 4/1)/2
    assert aggregate(TL, TM, "constant", n).item() == pytest.approx(1.25)    # 10/(2*4)
    # a micro-batch's share when the step has 8 tokens / 4 seqs over 2 ranks: x W / step counts
    n2 = StepNorm(tokens=8, seqs=4, dp_world_size=2, constant=4)
    assert aggregate(TL, TM, "token_mean", n2).item() == pytest.approx(10 * 2 / 8)
    assert aggregate(TL, TM, "seq_mean", n2).item() == pytest.approx(6 * 2 / 4)
    assert aggregate(TL, TM, "constant", n2).item() == pytest.approx(10 * 2 / 16)
    with pytest.raises(ValueError):
        aggregate(TL, TM, "constant", StepNorm(tokens=4, seqs=2))
    with pytest.raises(KeyError, match="known: constant, seq_mean, token_mean"):
        aggregate(TL, TM, "sum", n)


def _problem():
    """A tiny 'policy': log-probs of 8 sequences (lengths 1..5) as a function of theta [4]."""
    g = torch.Generator().manual_seed(1)
    B, R, D = 8, 5, 4
    feats = torch.randn(B, R, D, generator=g)
    lengths = torch.tensor([5, 1, 3, 4, 2, 5, 3, 1])
    mask = (torch.arange(R)[None] < lengths[:, None]).float()
    theta0 = torch.randn(D, generator=g)
    old = torch.nn.functional.logsigmoid(feats @ theta0).detach() + 0.1 * torch.randn(B, R, generator=g)
    adv = torch.randn(B, R, generator=g)
    return feats, mask, theta0, old, adv


def _grad(theta0, feats, old, adv, mask, mode, norm, loss_name):
    theta = theta0.clone().requires_grad_(True)
    lp = torch.nn.functional.logsigmoid(feats @ theta)
    tok, _ = policy_loss(loss_name, lp, old, adv, mask, eps_clip=0.2)
    aggregate(tok, mask, mode, norm).backward()
    return theta.grad


@pytest.mark.parametrize("mode", ["token_mean", "seq_mean", "constant"])
def test_aggregation_invariant_to_ranks_and_accumulation(mode):
    feats, mask, theta0, old, adv = _problem()
    args = (feats, old, adv, mask)
    step = StepNorm.from_masks([mask], dp_world_size=1, constant=5)
    assert (step.tokens, step.seqs) == (24, 8)
    for loss_name in ("ppo", "cispo"):
        ref = _grad(theta0, *args, mode, step, loss_name)

        # 1 rank, 4 accumulation micro-batches of uneven size: sum the micro-batch gradients
        acc = sum(_grad(theta0, *(a[s] for a in args), mode, step, loss_name)
                  for s in (slice(0, 1), slice(1, 4), slice(4, 6), slice(6, 8)))
        assert torch.allclose(acc, ref, atol=1e-6), (mode, loss_name, "accumulation")

        # 2 ranks x 2 micro-batches; the step counts come from StepNorm.from_masks + all_reduce;
        # DP averaging divides the summed gradients by W = 2
        rank_mbs = [(slice(0, 1), slice(1, 4)), (slice(4, 7), slice(7, 8))]
        norms = thread_ranks([
            (lambda ar, mbs=mbs: StepNorm.from_masks([mask[s] for s in mbs], dp_world_size=2,
                                                     all_reduce=ar, constant=5))
            for mbs in rank_mbs])
        assert norms[0] == norms[1] and (norms[0].tokens, norms[0].seqs) == (24, 8)
        per_rank = [sum(_grad(theta0, *(a[s] for a in args), mode, norms[r], loss_name) for s in mbs)
                    for r, mbs in enumerate(rank_mbs)]
        assert torch.allclose((per_rank[0] + per_rank[1]) / 2, ref, atol=1e-6), (mode, loss_name)


def test_registries_list_everything():
    assert POLICY_LOSSES.names() == ["cispo", "dppo_kl", "dppo_tv", "gspo", "ppo", "sapo"]
    assert LOSS_AGGREGATIONS.names() == ["constant", "seq_mean", "token_mean"]


def test_policy_losses_ignore_garbage_on_padding():
    lp = torch.tensor([[-1.0, -0.5, -math.inf]], requires_grad=True)
    old = torch.tensor([[-1.2, -0.4, math.nan]])
    adv = torch.tensor([[1.0, -1.0, math.nan]])
    mask = torch.tensor([[1.0, 1, 0]])
    for name in POLICY_LOSSES.names():
        lp.grad = None
        loss, met = policy_loss(name, lp, old, adv, mask)
        aggregate(loss, mask, "token_mean", StepNorm(tokens=2, seqs=1)).backward()
        assert torch.isfinite(loss).all() and loss[0, 2] == 0, name
        assert torch.isfinite(lp.grad).all() and lp.grad[0, 2] == 0, name
        assert all(torch.isfinite(v) for v in met.values()), name
