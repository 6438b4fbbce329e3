"""SAPO, DPPO (binary TV and binary KL) and the M2PO token mask.

Expected numbers are derived by hand in the comments.  SAPO is checked against TRL 1.16's own code; every
unit is checked for gradient accumulation (micro-batches summed == one batch) and for N ranks == 1 rank.
"""
from __future__ import annotations

import math
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from _thread_ranks import thread_ranks

from hpc_rlhf.algorithms.aggregation import StepNorm, aggregate
from hpc_rlhf.algorithms.mismatch import m2po_mask
from hpc_rlhf.algorithms.policy_loss import policy_loss
from hpc_rlhf.algorithms.rl_algorithm import RLAlgorithm
from hpc_rlhf.config.algo import AlgoConfig
from hpc_rlhf.config.base import ConfigError, load_config

L = math.log


def sig(x: float) -> float:
    return 1 / (1 + math.exp(-x))


def _row(probs, advs, old_probs=None, pad=1):
    """One row: log-probs (a leaf) of the given probabilities over old log-probs (0.5 unless given), plus `pad`
    padded slots holding garbage (-inf log-probs, nan advantages) that must not leak."""
    old_probs = old_probs or [0.5] * len(probs)
    lp = torch.tensor([[L(p) for p in probs] + [-math.inf] * pad], requires_grad=True)
    old = torch.tensor([[L(p) for p in old_probs] + [math.nan] * pad])
    adv = torch.tensor([list(advs) + [math.nan] * pad], dtype=torch.float32)
    mask = torch.tensor([[1.0] * len(probs) + [0.0] * pad])
    return lp, old, adv, mask


def _loss_and_grad(name, row, **options):
    lp, old, adv, mask = row
    loss, metrics = policy_loss(name, lp, old, adv, mask, **options)
    loss.sum().backward()
    return loss[0].tolist(), lp.grad[0].tolist(), metrics


# ---------------------------------------------------------------------------------------------------- SAPO

def test_sapo_hand_values_and_gradients():
    # f_τ(ρ) = σ(τ(ρ−1))·4/τ, loss = −f·A; d loss / d log π = −w·ρ·A with w = 4σ(1−σ).  tau_pos 1, tau_neg 2:
    #  ρ 1,   A +1, τ 1: σ(0) = .5, f = 2          -> loss −2;            w = 1         -> grad −1 (PPO's at ρ = 1)
    #  ρ 2,   A +1, τ 1: σ(1),      f = 4σ(1)      -> loss −4σ(1);        w = 4σ(1)σ(−1) -> grad −2w
    #  ρ .5,  A −1, τ 2: σ(−1),     f = 2σ(−1)     -> loss +2σ(−1);       w = 4σ(1)σ(−1) -> grad +.5w
    #  ρ 2,   A −1, τ 2: σ(2),      f = 2σ(2)      -> loss +2σ(2);        w2 = 4σ(2)σ(−2) -> grad +2·w2
    #  ρ 1,   A 0 (τ_neg):                         -> loss 0, grad 0
    #  padding: 0, 0
    row = _row([0.5, 1.0, 0.25, 1.0, 0.5], [1, 1, -1, -1, 0], old_probs=[0.5, 0.5, 0.5, 0.5, 0.5])
    loss, grad, met = _loss_and_grad("sapo", row, tau_pos=1.0, tau_neg=2.0)
    w, w2 = 4 * sig(1) * sig(-1), 4 * sig(2) * sig(-2)
    assert loss == pytest.approx([-2, -4 * sig(1), 2 * sig(-1), 2 * sig(2), 0, 0], abs=1e-6)
    assert grad == pytest.approx([-1, -2 * w, 0.5 * w, 2 * w2, 0, 0], abs=1e-6)
    # the gate at ρ = 1 is 1 for both temperatures: (1 + w + w + w2 + 1) / 5
    assert met["sapo_gate_mean"].item() == pytest.approx((2 + 2 * w + w2) / 5, abs=1e-6)
    assert met["clip_frac"].item() == 0
    # defaults (TRL 1.16 and AReaL): tau_pos 1.0, tau_neg 1.05; A = 0 takes tau_neg, as in TRL (A > 0 is "pos")
    assert (AlgoConfig().sapo.tau_pos, AlgoConfig().sapo.tau_neg) == (1.0, 1.05)
    loss, _, _ = _loss_and_grad("sapo", _row([0.5], [-1]), **AlgoConfig().sapo.__dict__)
    assert loss[0] == pytest.approx(0.5 * 4 / 1.05, abs=1e-6)  # σ(0)·4/1.05·1


def test_sapo_huge_ratio_has_a_finite_zero_gradient():
    # log ρ = 100 (ρ = e^100 overflows float32): the log-ratio is capped at 20, the gate is saturated
    # (σ = 1, f = 4/τ) and its slope 0, so the gradient is 0, not 0·inf = nan
    lp = torch.tensor([[100.0 - 1]], requires_grad=True)
    loss, _ = policy_loss("sapo", lp, torch.tensor([[-1.0]]), torch.tensor([[1.0]]), torch.ones(1, 1))
    loss.sum().backward()
    assert loss.item() == pytest.approx(-4.0) and lp.grad.item() == 0.0


def _trl_sapo(lp, old, adv_seq, mask, tau_pos, tau_neg):
    """TRL 1.16's own GRPOTrainer._compute_loss (trl/trainer/grpo_trainer.py, the branch loss_type == "sapo",
    line 3121 ff.) run on a stub trainer whose model forward returns ``lp``; everything the method reads for
    this loss type is set to what GRPOConfig would give with beta 0, no vLLM, token-level ratios, no entropy
    bonus, one accumulation step."""
    from trl.trainer.grpo_trainer import GRPOTrainer

    B, R = lp.shape
    stub = SimpleNamespace(
        _get_per_token_logps_and_entropies=lambda *a, **k: (lp, torch.zeros_like(lp), None),
        aux_loss_enabled=False, top_entropy_quantile=1.0, off_policy_mask_threshold=None,
        importance_sampling_level="token", beta=0.0, loss_type="sapo", use_vllm=False,
        args=SimpleNamespace(sapo_temperature_pos=tau_pos, sapo_temperature_neg=tau_neg),
        model=SimpleNamespace(training=True), current_gradient_accumulation_steps=1,
        _entropy_bonus_enabled=False, _metrics={"train": defaultdict(list)},
        accelerator=SimpleNamespace(reduce=lambda t, reduction: t))
    inputs = {"prompt_ids": torch.zeros(B, 1, dtype=torch.long), "prompt_mask": torch.ones(B, 1),
              "completion_ids": torch.zeros(B, R, dtype=torch.long), "completion_mask": mask,
              "advantages": adv_seq, "old_per_token_logps": old}
    return GRPOTrainer._compute_loss(stub, None, inputs)


def test_sapo_equals_trl_values_and_gradients():
    # Convention differences: TRL's advantage is one number per sequence [B] (ours [B, R]: the same number on
    # every token here) and TRL aggregates sapo as its "grpo" mode: per-sequence token mean, then the mean over
    # sequences, which is our seq_mean.  TRL does not cap the log-ratio (ours at 20; |log ρ| < 2 here).
    g = torch.Generator().manual_seed(3)
    B, R = 4, 6
    mask = torch.tensor([[1.0] * 6, [1.0] * 3 + [0.0] * 3, [1.0] * 5 + [0.0], [1.0] * 1 + [0.0] * 5])
    old = torch.log(torch.rand(B, R, generator=g) * 0.9 + 0.05)
    lp0 = old + 0.6 * torch.randn(B, R, generator=g)
    lp0[0, 0] = old[0, 0]  # ρ exactly 1
    adv_seq = torch.tensor([1.5, -0.7, 0.0, -2.0])  # both signs and A = 0
    for tau_pos, tau_neg in ((1.0, 1.05), (0.5, 3.0)):
        ours_lp = lp0.clone().requires_grad_(True)
        tok, _ = policy_loss("sapo", ours_lp, old, adv_seq[:, None].expand(B, R), mask, tau_pos=tau_pos,
                             tau_neg=tau_neg)
        ours = aggregate(tok, mask, "seq_mean", StepNorm(tokens=float(mask.sum()), seqs=B))
        ours.backward()
        trl_lp = lp0.clone().requires_grad_(True)
        trl = _trl_sapo(trl_lp, old, adv_seq, mask, tau_pos, tau_neg)
        trl.backward()
        assert ours.item() == pytest.approx(trl.item(), rel=1e-6, abs=1e-7)
        assert torch.allclose(ours_lp.grad, trl_lp.grad, rtol=1e-6, atol=1e-7)
        assert ours_lp.grad[mask == 0].abs().sum() == 0


# ---------------------------------------------------------------------------------------------------- DPPO

def test_dppo_tv_hand_values_edges_and_directions():
    # μ = 0.5 for every token, delta 0.125 both sides; loss = −M·ρ·A, d loss / d log π = −M·ρ·A.
    #  π .75,  A +1: π−μ = +.25 > .125, pushed further up        -> masked: loss 0, grad 0
    #  π .75,  A −1: rose, but A pushes it back down              -> kept: ρ 1.5, loss +1.5, grad +1.5
    #  π .625, A +1: π−μ = +.125, exactly at the edge             -> kept: ρ 1.25, loss −1.25, grad −1.25
    #  π .25,  A −1: π−μ = −.25 < −.125, pushed further down      -> masked
    #  π .25,  A +2: fell, A pushes it back up                    -> kept: ρ .5, loss −1, grad −1
    #  π .375, A −1: π−μ = −.125, at the edge                     -> kept: ρ .75, loss +.75, grad +.75
    #  π .5,   A +1: ρ exactly 1                                  -> kept: loss −1, grad −1
    #  π .75,  A 0:  no push                                      -> kept (loss 0, grad 0), not counted as masked
    #  padding: 0
    row = _row([0.75, 0.75, 0.625, 0.25, 0.25, 0.375, 0.5, 0.75], [1, -1, 1, -1, 2, -1, 1, 0])
    loss, grad, met = _loss_and_grad("dppo_tv", row, delta_low=0.125, delta_high=0.125)
    assert loss == pytest.approx([0, 1.5, -1.25, 0, -1, 0.75, -1, 0, 0], abs=1e-6)
    assert grad == pytest.approx([0, 1.5, -1.25, 0, -1, 0.75, -1, 0, 0], abs=1e-6)
    assert met["clip_frac"].item() == pytest.approx(2 / 8)
    # asymmetric region: delta_high .3 keeps the +.25 rise (loss −1.5), delta_low .125 still masks the −.25 fall
    loss, _, met = _loss_and_grad("dppo_tv", _row([0.75, 0.25], [1, -1]), delta_low=0.125, delta_high=0.3)
    assert loss == pytest.approx([-1.5, 0, 0], abs=1e-6) and met["clip_frac"].item() == 0.5
    # prime-rl's defaults: 0.2 both sides
    assert (AlgoConfig().dppo_tv.delta_low, AlgoConfig().dppo_tv.delta_high) == (0.2, 0.2)


def test_dppo_kl_hand_values_and_the_zero_region():
    # μ = .5: D = KL(Bern(.5) ‖ Bern(π)) = .5 ln(.5/π) + .5 ln(.5/(1−π)) = −.5 ln(4π(1−π))
    #   π .75 or .25: −.5 ln .75 = .143841;   π .625 or .375: −.5 ln .9375 = .032269
    # delta .05:
    #  π .75,  A +1: D .1438 > .05, rose with A > 0              -> masked
    #  π .625, A +1: D .0323 <= .05                               -> kept: ρ 1.25, loss −1.25
    #  π .25,  A −1: D .1438, fell with A < 0                     -> masked
    #  π .25,  A +1: fell, A pushes back up                       -> kept: ρ .5, loss −.5
    #  π .75,  A −1: rose, A pushes back down                     -> kept: ρ 1.5, loss +1.5
    row = _row([0.75, 0.625, 0.25, 0.25, 0.75], [1, 1, -1, 1, -1])
    loss, grad, met = _loss_and_grad("dppo_kl", row, delta_low=0.05, delta_high=0.05)
    assert loss == pytest.approx([0, -1.25, 0, -0.5, 1.5, 0], abs=1e-6)
    assert grad == pytest.approx([0, -1.25, 0, -0.5, 1.5, 0], abs=1e-6)
    assert met["clip_frac"].item() == pytest.approx(2 / 5)
    # delta 0: ρ exactly 1 (D = 0, not > 0) is kept; the smallest move in the pushed direction is masked
    row = _row([0.5, 0.5 + 2**-10, 0.5 - 2**-10, 0.5 + 2**-10], [1, 1, -1, -1])
    loss, _, met = _loss_and_grad("dppo_kl", row, delta_low=0.0, delta_high=0.0)
    assert loss[:3] == pytest.approx([-1, 0, 0], abs=1e-6) and loss[3] > 1
    assert met["clip_frac"].item() == pytest.approx(2 / 4)
    # a token whose probability reached 1 has D = +inf: masked when A > 0 (no nan anywhere)
    loss, grad, _ = _loss_and_grad("dppo_kl", _row([1.0, 1.0], [1, -1]), delta_low=0.05, delta_high=0.05)
    assert loss == pytest.approx([0, 2, 0]) and grad == pytest.approx([0, 2, 0])
    assert (AlgoConfig().dppo_kl.delta_low, AlgoConfig().dppo_kl.delta_high) == (0.05, 0.05)


def test_dppo_kl_divergence_matches_its_definition():
    # the binary KL in float64 from its definition against the mask's decision on random probabilities:
    # a token with A > 0 that rose is masked exactly when the float64 divergence exceeds delta (away from ties)
    g = torch.Generator().manual_seed(5)
    mu, pi = torch.rand(2, 400, generator=g, dtype=torch.float64) * 0.98 + 0.01
    d = mu * torch.log(mu / pi) + (1 - mu) * torch.log((1 - mu) / (1 - pi))
    delta = 0.02
    lp = torch.log(pi).float()[None].requires_grad_(True)
    adv = torch.where(pi > mu, 1.0, -1.0).float()[None]
    loss, _ = policy_loss("dppo_kl", lp, torch.log(mu).float()[None], adv, torch.ones(1, 400), delta_low=delta,
                          delta_high=delta)
    far = (d - delta).abs() > 1e-5
    assert torch.equal((loss[0] == 0)[far], (d > delta)[far])


# ---------------------------------------------------------------------------------------------------- M2PO

def _m2_tokens(ds, masks):
    """engine log-probs −1, old = engine + d, per row; padded slots hold nan."""
    eng = torch.tensor([[-1.0 if m else math.nan for m in row] for row in masks])
    old = torch.tensor([[-1.0 + d if m else math.nan for d, m in zip(drow, mrow)] for drow, mrow in zip(ds, masks)])
    return old, eng, torch.tensor(masks, dtype=torch.float32)


def test_m2po_drops_the_largest_until_the_mean_is_below_the_threshold():
    # d = log π_old − log π_engine, M2 = d²: row 0 [.25, .0625, 0 (ρ exactly 1), pad], row 1 [.0625, 0, pad, pad],
    # row 2 all padding (garbage everywhere).  Valid M2: {.25, .0625, .0625, 0, 0}, sum .375, n 5, mean .075.
    ds = [[0.5, 0.25, 0.0, 0.0], [-0.25, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]]
    masks = [[1, 1, 1, 0], [1, 1, 0, 0], [0, 0, 0, 0]]
    old, eng, mask = _m2_tokens(ds, masks)
    # τ .04: drop .25 -> {.0625, .0625, 0, 0}: .125/4 = .03125 < .04 -> keep 4
    keep, met = m2po_mask(old, eng, mask, m2_threshold=0.04)
    assert keep.tolist() == [[0, 1, 1, 0], [1, 1, 0, 0], [0, 0, 0, 0]]
    assert (met["m2po/m2"].item(), met["m2po/m2_kept"].item()) == pytest.approx((0.075, 0.03125))
    assert met["m2po/masked_frac"].item() == pytest.approx(1 / 5)
    # τ = .03125 exactly: .03125 is not below it -> the tied pair .0625 goes as a whole -> {0, 0}, mean 0
    # (AReaL sorts and drops one of the pair first: .0625/3 < τ would keep the other; here ties go together)
    keep, met = m2po_mask(old, eng, mask, m2_threshold=0.03125)
    assert keep.tolist() == [[0, 0, 1, 0], [0, 1, 0, 0], [0, 0, 0, 0]]
    assert met["m2po/masked_frac"].item() == pytest.approx(3 / 5) and met["m2po/m2_kept"].item() == 0
    # τ .08 > .075: nothing to drop
    keep, met = m2po_mask(old, eng, mask, m2_threshold=0.08)
    assert keep.tolist() == mask.tolist() and met["m2po/masked_frac"].item() == 0


def test_m2po_can_drop_everything_and_treats_nan_as_infinite():
    # M2 {.25, .0625}, τ .04: drop .25 -> .0625 >= .04 -> drop it too: no token is left
    old, eng, mask = _m2_tokens([[0.5, 0.25]], [[1, 1]])
    keep, met = m2po_mask(old, eng, mask, m2_threshold=0.04)
    assert keep.tolist() == [[0, 0]] and met["m2po/masked_frac"].item() == 1
    # a valid token whose old log-prob is nan: M2 = +inf, dropped first; the rest {0, .015625} is kept
    old, eng, mask = _m2_tokens([[math.nan, 0.0, 0.125]], [[1, 1, 1]])
    keep, met = m2po_mask(old, eng, mask, m2_threshold=0.04)
    assert keep.tolist() == [[0, 1, 1]] and met["m2po/m2_kept"].item() == pytest.approx(0.015625 / 2)


def test_m2po_statistic_is_over_every_rank():
    # rank 0: M2 {.0625, 0, 0, 0} (alone: mean .015625 < .04, keeps all); rank 1: M2 {.25, .0625} (alone: drops
    # both).  Together {.25, .0625, .0625, 0, 0, 0}: mean .0625 >= .04; without .25: .125/5 = .025 -> keep 5.
    parts = [_m2_tokens([[0.25, 0.0, 0.0, 0.0]], [[1, 1, 1, 1]]), _m2_tokens([[0.5, -0.25, 0.0, 0.0]], [[1, 1, 0, 0]])]
    whole = [torch.cat(x) for x in zip(*parts)]
    keep1, met1 = m2po_mask(*whole, m2_threshold=0.04)
    assert keep1.tolist() == [[1, 1, 1, 1], [0, 1, 0, 0]]
    calls = [0, 0]

    def on_rank(r):
        def fn(all_reduce):
            def counted(t):
                calls[r] += 1
                return all_reduce(t)
            return m2po_mask(*parts[r], m2_threshold=0.04, all_reduce=counted)
        return fn
    (k0, m0), (k1, m1) = thread_ranks([on_rank(0), on_rank(1)])
    assert torch.equal(torch.cat([k0, k1]), keep1) and calls[0] == calls[1]
    floats = [{k: v.item() for k, v in m.items()} for m in (m0, m1, met1)]
    assert floats[0] == floats[1] and floats[0] == pytest.approx(floats[2])


# ------------------------------------------------------------- accumulation and ranks, through RLAlgorithm

def _algo(**options) -> RLAlgorithm:
    return RLAlgorithm(load_config(AlgoConfig, None, [f"{k}={v}" for k, v in options.items()]), single_update=True)


def _batch():
    """8 samples in 4 groups of 2 (lengths 1..5), log-probs of a tiny 'policy' logsigmoid(feats @ θ), an old
    policy far enough from it that the trust regions, gates and the M2PO mask all act, engine log-probs."""
    g = torch.Generator().manual_seed(11)
    B, R, D = 8, 5, 4
    feats = torch.randn(B, R, D, generator=g)
    mask = (torch.arange(R)[None] < torch.tensor([5, 1, 3, 4, 2, 5, 3, 1])[:, None]).float()
    theta0 = torch.randn(D, generator=g)
    old = torch.nn.functional.logsigmoid(feats @ theta0).detach() + 0.5 * torch.randn(B, R, generator=g)
    old = old.clamp(max=-0.01)
    engine = old + 0.3 * torch.randn(B, R, generator=g)
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.3, 0.9])
    groups = torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])
    return feats, mask, theta0, old, engine, rewards, groups


def _step_grad(algo, theta0, feats, old, engine, adv, mask, norm):
    theta = theta0.clone().requires_grad_(True)
    lp = torch.nn.functional.logsigmoid(feats @ theta)
    tok, metrics = algo.actor_token_loss(lp, old, engine, None, adv, mask, lambda: None)
    algo.actor_loss(tok, mask, norm).backward()
    return theta.grad, metrics


CASES = [dict(policy_loss="sapo", **{"sapo.tau_pos": 0.8, "sapo.tau_neg": 1.5}),
         dict(policy_loss="dppo_tv", **{"dppo_tv.delta_low": 0.05, "dppo_tv.delta_high": 0.1}),
         dict(policy_loss="dppo_kl", **{"dppo_kl.delta_low": 0.01, "dppo_kl.delta_high": 0.02}),
         dict(token_mask="m2po", **{"m2po.m2_threshold": 0.05})]


@pytest.mark.parametrize("mode", ["token_mean", "seq_mean"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: next(iter(c.values())))
def test_step_gradient_is_invariant_to_accumulation_and_ranks(case, mode):
    algo = _algo(loss_agg_mode=mode, **case)
    feats, mask, theta0, old, engine, rewards, groups = _batch()
    adv, _, _ = algo.advantages(rewards, mask, groups, old, None, None, None, engine=engine)
    if "token_mask" in case:  # the mask acts, on some tokens only
        assert 0 < algo.token_mask_metrics["m2po/masked_frac"] < 1
    step = StepNorm.from_masks([mask])
    ref, met = _step_grad(algo, theta0, feats, old, engine, adv, mask, step)
    if case.get("policy_loss", "").startswith("dppo"):
        assert 0 < met["clip_frac"] < 1
    if case.get("policy_loss") == "sapo":
        assert met["sapo_gate_mean"] < 0.99

    def rows(s):
        return feats[s], old[s], engine[s], adv[s], mask[s]
    # one rank, 3 accumulation micro-batches of uneven size
    acc = sum(_step_grad(algo, theta0, *rows(s), step)[0] for s in (slice(0, 1), slice(1, 6), slice(6, 8)))
    assert torch.allclose(acc, ref, atol=1e-6)

    # 2 ranks holding 2 groups each, 2 micro-batches each: each rank computes its shard's advantages (group
    # statistics and the M2PO statistic over both ranks through all_reduce), then its gradient; DP averages
    shards = [(slice(0, 4), (slice(0, 1), slice(1, 4))), (slice(4, 8), (slice(0, 3), slice(3, 4)))]

    def rank(r):
        def fn(all_reduce):
            sh, mbs = shards[r]
            algo_r = _algo(loss_agg_mode=mode, **case)
            a, _, _ = algo_r.advantages(rewards[sh], mask[sh], groups[sh], old[sh], None, None, all_reduce,
                                        engine=engine[sh])
            norm = StepNorm.from_masks([mask[sh][s] for s in mbs], dp_world_size=2, all_reduce=all_reduce)
            local = (feats[sh], old[sh], engine[sh], a, mask[sh])
            g = sum(_step_grad(algo_r, theta0, *(x[s] for x in local), norm)[0] for s in mbs)
            return a, g, algo_r.token_mask_metrics
        return fn
    (a0, g0, m0), (a1, g1, m1) = thread_ranks([rank(0), rank(1)])
    assert torch.allclose(torch.cat([a0, a1]), adv, atol=1e-6)
    assert torch.allclose((g0 + g1) / 2, ref, atol=1e-6)
    assert m0 == pytest.approx(algo.token_mask_metrics) and m1 == m0


def test_m2po_zeroes_the_advantage_of_dropped_tokens_and_needs_the_old_policy():
    algo = _algo(token_mask="m2po", **{"m2po.m2_threshold": 0.04})
    assert algo.needs_old_logprobs  # even with one update per step: the mask reads π_old before the advantages
    assert not _algo().needs_old_logprobs
    # one group of 2 (group_norm); M2 row 0 [.25, .0625, 0], row 1 [.0625, 0, pad]:
    # as in the hand case above, τ .04 drops only the .25 token
    old, eng, mask = _m2_tokens([[0.5, 0.25, 0.0], [-0.25, 0.0, 0.0]], [[1, 1, 1], [1, 1, 0]])
    adv, _, _ = algo.advantages(torch.tensor([1.0, 0.0]), mask, torch.tensor([0, 0]), old, None, None, None,
                                engine=eng)
    plain, _, _ = _algo().advantages(torch.tensor([1.0, 0.0]), mask, torch.tensor([0, 0]), old, None, None, None)
    expected = plain.clone()
    expected[0, 0] = 0
    assert torch.equal(adv, expected) and plain[0, 0] != 0
    assert algo.token_mask_metrics["m2po/masked_frac"] == pytest.approx(1 / 5)
    # a sample whose reward failed (valid False) enters no statistic: row 1's M2 {4, 4} would be dropped first
    # (masked 3 of 5); without it, row 0 {.25, .0625, 0} drops .25 only (.0625/2 < .04): masked 1 of 3
    old2, eng2, _ = _m2_tokens([[0.5, 0.25, 0.0], [2.0, 2.0, 0.0]], [[1, 1, 1], [1, 1, 0]])
    adv, _, _ = algo.advantages(torch.tensor([1.0, 0.0]), mask, torch.tensor([0, 0]), old2, None, None, None,
                                valid=torch.tensor([True, False]), engine=eng2)
    assert algo.token_mask_metrics["m2po/masked_frac"] == pytest.approx(1 / 3)
    with pytest.raises(ValueError, match="needs the old policy's and the engine's log-probs"):
        algo.advantages(torch.tensor([1.0, 0.0]), mask, torch.tensor([0, 0]), old, None, None, None)


# ---------------------------------------------------------------------------------------------------- config

def test_config_sections_ranges_and_checks():
    from hpc_rlhf.config.rl import RLConfig
    base = ["pretrain=m", "prompt_data=p.jsonl", "reward_func=r.py"]
    cfg = load_config(RLConfig, None, base + ["policy_loss=dppo_kl", "algo.dppo_kl.delta_high=0.1"])
    assert cfg.algo.dppo_kl.delta_high == 0.1
    for bad in (["policy_loss=sapo", "algo.sapo.tau_pos=0"], ["policy_loss=dppo_tv", "algo.dppo_tv.delta_low=1.5"],
                ["token_mask=m2po", "algo.m2po.m2_threshold=0"]):
        with pytest.raises(ConfigError, match=bad[1].split("=")[0].replace(".", r"\.")):
            load_config(RLConfig, None, base + bad)
    # an option of a unit that is not selected is an error naming the unit that reads it
    with pytest.raises(ConfigError, match=r"algo\.sapo\.tau_neg is set but algo\.policy_loss is 'ppo'.*sapo"):
        load_config(RLConfig, None, base + ["algo.sapo.tau_neg=2"])
    with pytest.raises(ConfigError, match=r"algo\.m2po\.m2_threshold is set but algo\.token_mask is 'none'"):
        load_config(RLConfig, None, base + ["algo.m2po.m2_threshold=0.1"])
    # the mask compares the trainer's log-probs with the engine's, which are at temperature 1
    with pytest.raises(ConfigError, match=r"algo\.token_mask='m2po' needs rollout\.temperature 1"):
        load_config(RLConfig, None, base + ["token_mask=m2po", "rollout.temperature=0.7"])
