"""On-policy distillation (advantage estimator "opd"), against hand-derived numbers and TRL 1.16's IW-OPD loss.

Common batch (2 prompts x 2 samples, R = 3), the student's log-probs of its sampled tokens S and the teacher's T:
    mask = [[1,1,1], [1,1,0], [1,1,1], [1,0,0]]
    S    = [[-1.0, -0.5, -2.0], [-0.2, -3.0, nan], [-0.7, -0.1, -0.4], [-2.5, nan, nan]]      (nan: padding)
    T    = [[-1.5, -0.5, -1.0], [-0.2, -1.0, -inf], [-0.9, -0.1, -0.9], [-0.5, -inf, -inf]]
reverse KL per token S - T: [[0.5, 0, -1], [0, -2, .], [0.2, 0, 0.5], [-2, ., .]]
A = -c (S - T), c = 1:      [[-0.5, 0, 1], [0, 2, 0], [-0.2, 0, -0.5], [2, 0, 0]]
(a token the teacher gives the student's own probability gets 0: (0, 1), (1, 0), (2, 1)).
"""
from __future__ import annotations

import math
import warnings
from collections import defaultdict

import pytest
import torch
from _thread_ranks import thread_ranks

from hpc_rlhf.algorithms.aggregation import StepNorm, aggregate
from hpc_rlhf.algorithms.opd import OnPolicyDistillation
from hpc_rlhf.algorithms.policy_loss import policy_loss
from hpc_rlhf.algorithms.rl_algorithm import RLAlgorithm
from hpc_rlhf.config import load_config
from hpc_rlhf.config.rl import RLConfig

NAN, INF = math.nan, math.inf
MASK = torch.tensor([[1.0, 1, 1], [1, 1, 0], [1, 1, 1], [1, 0, 0]])
S = torch.tensor([[-1.0, -0.5, -2.0], [-0.2, -3.0, NAN], [-0.7, -0.1, -0.4], [-2.5, NAN, NAN]])
T = torch.tensor([[-1.5, -0.5, -1.0], [-0.2, -1.0, -INF], [-0.9, -0.1, -0.9], [-0.5, -INF, -INF]])
GIDS = torch.tensor([7, 7, 3, 3])
TEACHER_TERM = [[-0.5, 0.0, 1.0], [0.0, 2.0, 0.0], [-0.2, 0.0, -0.5], [2.0, 0.0, 0.0]]


def opd(**kw):
    return OnPolicyDistillation(**kw)


def test_teacher_term_per_token_with_padding_and_equal_tokens_zero():
    adv, ret = opd().compute(torch.zeros(4), None, MASK, group_ids=GIDS, logprobs=S, teacher_logprobs=T)
    assert ret is None
    assert torch.allclose(adv, torch.tensor(TEACHER_TERM), atol=1e-6)
    assert torch.isfinite(adv).all()  # nan / -inf on padding stay out
    assert adv[0, 1] == 0 and adv[1, 0] == 0 and adv[2, 1] == 0  # student == teacher on these tokens
    # c = 2 doubles it; no discount: gamma and lambd change nothing
    adv2, _ = opd(teacher_kl_coef=2.0).compute(torch.zeros(4), None, MASK, group_ids=GIDS, logprobs=S,
                                               teacher_logprobs=T, gamma=0.5, lambd=0.5)
    assert torch.allclose(adv2, 2 * torch.tensor(TEACHER_TERM), atol=1e-6)


def test_task_reward_centred_on_its_group_and_weighted():
    # rewards [1, 0 | 3, 3]: group 7 mean 0.5 -> centred [+0.5, -0.5]; group 3 tied -> [0, 0]
    # w = 0.5: +0.25 on every valid token of sample 0, -0.25 on sample 1's, nothing on samples 2 and 3
    rewards = torch.tensor([1.0, 0.0, 3.0, 3.0])
    adv, _ = opd(task_reward_weight=0.5).compute(rewards, torch.zeros(4, 3), MASK, group_ids=GIDS, logprobs=S,
                                                 teacher_logprobs=T)
    want = [[-0.25, 0.25, 1.25], [-0.25, 1.75, 0.0], [-0.2, 0.0, -0.5], [2.0, 0.0, 0.0]]
    assert torch.allclose(adv, torch.tensor(want), atol=1e-6)
    # token rewards count in the sample's reward R = r + sum of its valid token rewards: -0.1 x lengths (3, 2)
    # -> R = [0.7, -0.2], centred [+0.45, -0.45], x 0.5 = +-0.225
    adv, _ = opd(task_reward_weight=0.5).compute(rewards, torch.full((4, 3), -0.1), MASK, group_ids=GIDS,
                                                 logprobs=S, teacher_logprobs=T)
    assert adv[0, 0].item() == pytest.approx(-0.5 + 0.225) and adv[1, 1].item() == pytest.approx(2.0 - 0.225)
    # weight 0 (the default): the reward is not read at all
    adv0, _ = opd().compute(rewards, None, MASK, logprobs=S, teacher_logprobs=T)
    assert torch.allclose(adv0, torch.tensor(TEACHER_TERM), atol=1e-6)
    with pytest.raises(ValueError, match="needs group_ids"):
        opd(task_reward_weight=0.5).compute(rewards, None, MASK, logprobs=S, teacher_logprobs=T)


def test_an_invalid_sample_gets_zero_and_leaves_its_group():
    # sample 1's reward failed: all its tokens 0, teacher term included; sample 0 alone in group 7 -> no task term
    rewards = torch.tensor([1.0, NAN, 3.0, 3.0])
    valid = torch.tensor([True, False, True, True])
    adv, _ = opd(task_reward_weight=0.5).compute(rewards, None, MASK, group_ids=GIDS, logprobs=S,
                                                 teacher_logprobs=T, valid=valid)
    want = torch.tensor(TEACHER_TERM)
    want[1] = 0.0
    assert torch.allclose(adv, want, atol=1e-6)


def test_without_the_log_probs_it_says_what_it_needs():
    with pytest.raises(ValueError, match=r"needs teacher_logprobs \[B, R\]=\(4, 3\), got None"):
        opd().compute(torch.zeros(4), None, MASK, logprobs=S)
    with pytest.raises(ValueError, match=r"needs logprobs \[B, R\]=\(4, 3\), got \(4, 2\)"):
        opd().compute(torch.zeros(4), None, MASK, logprobs=S[:, :2], teacher_logprobs=T)


def _algorithm(*overrides: str) -> RLAlgorithm:
    cfg = load_config(RLConfig, None, ["pretrain=/m", "prompt_data=/p.jsonl", "reward_func=builtin:math",
                                       "advantage_estimator=opd", "teacher_pretrain=/t", *overrides])
    return RLAlgorithm(cfg.algo, single_update=True)


def test_the_algorithm_runs_the_teacher_in_the_reference_role():
    """One optimizer step on fresh samples needs no old-policy pass for GRPO; OPD needs the student's log-probs
    before the advantages, and the reference role's, which run the teacher.  The KL measured (logged as ``kl``) is
    the student's to the teacher: S - T on the valid tokens."""
    algo = _algorithm("n_samples_per_prompt=2", "task_reward_weight=0.5")
    assert algo.needs_reference and algo.needs_old_logprobs and not algo.needs_critic
    assert _algorithm("use_kl_loss=true").needs_old_logprobs  # the KL's place does not matter: no KL, a teacher
    assert algo.agg_mode == "token_mean"
    adv, ret, kl = algo.advantages(torch.tensor([1.0, 0.0, 3.0, 3.0]), MASK, GIDS, S, T, None, all_reduce=None)
    want = [[-0.25, 0.25, 1.25], [-0.25, 1.75, 0.0], [-0.2, 0.0, -0.5], [2.0, 0.0, 0.0]]
    assert ret is None and torch.allclose(adv, torch.tensor(want), atol=1e-6)
    assert torch.allclose(kl, -torch.tensor(TEACHER_TERM), atol=1e-6)


def _actor_grad(theta0, feats, tokens, teacher, mask, norm, all_reduce=None):
    """The actor's gradient for one micro-batch: the policy log_softmax(feats @ theta) picks ``tokens``; OPD's
    advantages from its detached log-probs (the old policy's, one update on fresh samples) and the teacher's."""
    theta = theta0.clone().requires_grad_(True)
    logp = torch.log_softmax(feats @ theta, -1).gather(-1, tokens[..., None])[..., 0]
    old = logp.detach()
    algo = _algorithm()
    adv, _, _ = algo.advantages(torch.zeros(len(mask)), mask, torch.arange(len(mask)), old, teacher, None,
                                all_reduce=all_reduce)
    token_loss, _ = algo.actor_token_loss(logp, old, old, None, adv, mask, entropy=None)
    algo.actor_loss(token_loss, mask, norm).backward()
    return theta.grad


def test_two_ranks_and_accumulated_micro_batches_give_the_one_batch_gradient():
    g = torch.Generator().manual_seed(3)
    B, R, D, V = 6, 4, 5, 7
    feats = torch.randn(B, R, D, generator=g)
    theta0 = torch.randn(D, V, generator=g)
    tokens = torch.randint(0, V, (B, R), generator=g)
    teacher = torch.log_softmax(torch.randn(B, R, V, generator=g), -1).gather(-1, tokens[..., None])[..., 0]
    mask = (torch.arange(R)[None] < torch.tensor([4, 1, 3, 2, 4, 2])[:, None]).float()
    args = (feats, tokens, teacher, mask)
    ref = _actor_grad(theta0, *args, StepNorm.from_masks([mask], 1))
    # one rank, three micro-batches of uneven size
    parts = (slice(0, 1), slice(1, 4), slice(4, 6))
    acc = sum(_actor_grad(theta0, *(a[s] for a in args), StepNorm.from_masks([mask], 1)) for s in parts)
    assert torch.allclose(acc, ref, atol=1e-6)
    # two ranks of three samples; data-parallel averaging divides the summed gradients by 2
    halves = (slice(0, 3), slice(3, 6))

    def rank(k):
        def run(ar):
            norm = StepNorm.from_masks([mask[halves[k]]], dp_world_size=2, all_reduce=ar)
            return _actor_grad(theta0, *(a[halves[k]] for a in args), norm, all_reduce=ar)
        return run
    per_rank = thread_ranks([rank(0), rank(1)])
    assert torch.allclose((per_rank[0] + per_rank[1]) / 2, ref, atol=1e-6)


class _IWOPD:
    """What TRL's IWOPDTrainer._compute_iw_opd_loss reads of its trainer."""
    temperature, iw_opd_epsilon, iw_opd_gamma = 1.0, 1e-8, 0.0

    def __init__(self):
        self.model = torch.nn.Module()  # in training mode
        self._metrics = {"train": defaultdict(list)}


def test_equal_to_trl_iw_opd_with_no_position_weight():
    """TRL 1.16's IW-OPD (trl.experimental.iw_opd) with iw_opd_gamma = 0 weighs every position by 1: its advantage
    is T - S on each sampled token, detached, and its loss -Σ log π(y_t)·A_t / (valid tokens).  Ours (opd, the ppo
    policy loss, token_mean) is -Σ (π/π_old)(y_t)·A_t / (valid tokens), the same gradient at π = π_old.  The
    advantages are equal (TRL logs their mean), and the gradients; the loss values differ by convention: TRL's
    multiplies by log π, ours by the ratio, which is 1 here, so ours is -mean(A) and TRL's -mean(A·log π)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from trl.experimental.iw_opd.iw_opd_trainer import IWOPDTrainer
    g = torch.Generator().manual_seed(0)
    B, R, V = 3, 4, 6
    logits = torch.randn(B, R, V, generator=g)
    tokens = torch.randint(0, V, (B, R), generator=g)
    mask = torch.tensor([[1.0, 1, 1, 1], [1, 1, 0, 0], [1, 1, 1, 0]])
    teacher = torch.log_softmax(torch.randn(B, R, V, generator=g), -1).gather(-1, tokens[..., None])[..., 0]

    trl_logits = logits.clone().requires_grad_(True)
    trainer = _IWOPD()
    labels = torch.where(mask > 0, tokens, -100)
    trl_loss = IWOPDTrainer._compute_iw_opd_loss(trainer, trl_logits, tokens, labels, teacher)
    trl_loss.backward()

    ours_logits = logits.clone().requires_grad_(True)
    logp = torch.log_softmax(ours_logits, -1).gather(-1, tokens[..., None])[..., 0]
    adv, _ = OnPolicyDistillation().compute(torch.zeros(B), None, mask, logprobs=logp.detach(),
                                            teacher_logprobs=teacher)
    token_loss, _ = policy_loss("ppo", logp, logp.detach(), adv, mask, eps_clip=0.2)
    loss = aggregate(token_loss, mask, "token_mean", StepNorm.from_masks([mask], 1))
    loss.backward()

    n = mask.sum()
    assert trainer._metrics["train"]["iw_opd/mean_advantage"][0] == pytest.approx(float(adv.sum() / n), abs=1e-6)
    assert trainer._metrics["train"]["iw_opd/mean_weight"][0] == 1.0
    assert torch.allclose(ours_logits.grad, trl_logits.grad, atol=1e-6)
    assert loss.item() == pytest.approx(float(-adv.sum() / n), abs=1e-6)
    assert trl_loss.item() == pytest.approx(float(-(adv * logp.detach()).sum() / n), abs=1e-6)


def test_the_teacher_is_placed_as_the_reference_is():
    """With no KL coefficient the reference role exists for the teacher alone: ref_num_ranks ranks of its own, or
    the actor's ranks with colocate_actor_ref; it loads model.teacher_pretrain."""
    from hpc_rlhf.trainers.placement import plan_from_config
    args = ["pretrain=/m", "prompt_data=/p.jsonl", "reward_func=builtin:math", "advantage_estimator=opd",
            "teacher_pretrain=/t", "ref_num_ranks=2"]
    apart = load_config(RLConfig, None, args)
    assert [(c.name, list(c.ranks)) for c in plan_from_config(apart).components] == [
        ("actor", [0]), ("reference", [1, 2]), ("reward", [3]), ("rollout", [4])]
    assert apart.reference_pretrain() == "/t"
    together = load_config(RLConfig, None, args + ["colocate_actor_ref=true"])
    assert plan_from_config(together).components[0].roles == ("actor", "reference")
