"""On-policy distillation end to end: the teacher, another tiny model with the same tokenizer, runs in the reference
role; the student's reverse KL to it falls; two actor ranks, the teacher on a rank of its own, match one rank."""
from __future__ import annotations

import pytest
import torch
from rl_fixtures import make_assets, merged, run_rl
from transformers import AutoModelForCausalLM

from hpc_rlhf.models.tiny import build_tiny_model


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    """The student (make_assets' model) and a teacher built from another seed whose input embeddings are all one
    row: every token looks the same to it, so its next-token distribution is one fixed distribution whatever the
    context, peaked by an output head scaled 20x.  The student starts near uniform (reverse KL about 2.3 nats) and
    can reach that distribution, so the KL falls within a few steps."""
    root = tmp_path_factory.mktemp("opd")
    base = make_assets(root)
    teacher = build_tiny_model(root / "teacher", hidden_size=32, num_layers=2, max_position_embeddings=64, seed=7)
    model = AutoModelForCausalLM.from_pretrained(teacher)
    with torch.no_grad():
        embeddings = model.get_input_embeddings().weight
        embeddings.copy_(embeddings[:1].expand_as(embeddings))
        model.get_output_embeddings().weight.mul_(20.0)
    model.save_pretrained(teacher)
    # 8 prompts x 4 samples of up to 16 tokens a step, 5 steps an epoch of the 40 prompts
    cfg = merged(base, model={"teacher_pretrain": str(teacher)}, algo={"advantage_estimator": "opd"},
                 rollout={"rollout_batch_size": 8, "n_samples_per_prompt": 4, "generate_max_len": 16},
                 train={"train_batch_size": 32, "micro_train_batch_size": 16, "actor_learning_rate": 1e-2,
                        "lr_scheduler": "constant_with_warmup", "lr_warmup_ratio": 0.0, "num_episodes": 2,
                        "max_steps": None},
                 log={"check_weight_sync": False})
    return root, cfg


def test_the_student_moves_toward_the_teacher(assets):
    """Every role on one rank, 10 steps.  ``kl`` is the student's reverse KL to the teacher on its own samples
    (the reference role runs the teacher: with the student's weights there it would be 0); with no task reward the
    mean advantage is its negative."""
    root, cfg = assets
    metrics = run_rl(merged(cfg, placement={"colocate_all": True}), root, "opd1")
    kl = [m["kl"] for m in metrics]
    assert [m["step"] for m in metrics] == list(range(1, 11))
    assert kl[0] > 1.0 and sum(kl[-2:]) < 0.6 * sum(kl[:2]), kl
    for m in metrics:
        assert m["advantages/mean"] == pytest.approx(-m["kl"], rel=1e-5)


@pytest.mark.slow  # two runs on up to four ranks
def test_two_actor_ranks_and_a_teacher_rank_match_one_rank(assets):
    """Three steps on one rank (every role, one micro-batch of 32) against two actor ranks (two micro-batches of 8
    each) with the reward role on them, the teacher on a rank of its own and the rollout on another: the same
    samples, KL, loss and gradient."""
    root, cfg = assets
    cfg = merged(cfg, train={"max_steps": 3})
    one = run_rl(merged(cfg, placement={"colocate_all": True}, train={"micro_train_batch_size": 32}), root, "opd_one")
    four = run_rl(merged(cfg, placement={"actor_num_ranks": 2, "colocate_actor_reward": True},
                         train={"micro_train_batch_size": 8}), root, "opd_four")
    assert [m["step"] for m in one] == [m["step"] for m in four] == [1, 2, 3]
    for a, b in zip(one, four):
        assert a["reward/mean"] == pytest.approx(b["reward/mean"], abs=1e-6)
        assert a["kl"] == pytest.approx(b["kl"], rel=1e-4)
        assert a["actor/loss"] == pytest.approx(b["actor/loss"], rel=1e-4, abs=1e-6)
        assert a["actor/grad_norm"] == pytest.approx(b["actor/grad_norm"], rel=1e-4)
