"""The frozen models of `train rl` under train.zero_stage=3: the reference (and teacher) and the reward model sharded
by ZeRO-3 over the two ranks of their world give the log-probs and scores of the whole model on every rank, with each
rank holding about half of the parameters, when the ranks have different numbers of samples (ZeRO-3 gathers the
parameters in every forward, collectively: a rank with fewer micro-batches must still run as many forwards)."""
from __future__ import annotations

import pytest

from _dist import run_ranks

# wide enough that every matrix is above DeepSpeed's persistence threshold (1e5 elements: smaller ones stay whole)
SHAPE = {"hidden_size": 512, "num_layers": 2, "num_heads": 8, "intermediate_size": 1024,
         "max_position_embeddings": 64, "seed": 0}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    import torch
    from transformers import AutoModelForSequenceClassification

    from hpc_rlhf.models.tiny import build_tiny_model
    lm = build_tiny_model(tmp_path_factory.mktemp("lm"), **SHAPE)
    rm = AutoModelForSequenceClassification.from_pretrained(lm, num_labels=1)
    torch.manual_seed(1)
    torch.nn.init.normal_(rm.score.weight, std=0.5)  # a random head (the causal LM has none)
    out = tmp_path_factory.mktemp("rm")
    rm.save_pretrained(out)
    return str(lm), str(out)


def _samples(count: int, seed: int) -> list:
    """``count`` samples of different lengths, one prompt group each."""
    import random

    from hpc_rlhf.roles.experience import Experience
    rng = random.Random(seed)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(3, 250) for _ in range(n)]
    return [Experience(i, 0, tokens(2 + i), tokens(3 + 2 * i), [], "stop", "", "", None) for i in range(count)]


def _local_elements(module) -> tuple[int, int]:
    """(the elements of ``module``'s parameters this rank holds, those of the whole model): a ZeRO-3 parameter
    holds its partition (``ds_tensor``), any other its whole tensor."""
    held = sum(p.ds_tensor.numel() if hasattr(p, "ds_tensor") else p.numel() for p in module.parameters())
    whole = sum(p.ds_numel if hasattr(p, "ds_numel") else p.numel() for p in module.parameters())
    return held, whole


def _frozen(lm_dir: str, rm_dir: str) -> dict:
    """Rank 0 has 3 samples (3 micro-batches of 1), rank 1 has 1 (reference) or none (reward model)."""
    import torch.distributed as dist

    from hpc_rlhf.config.rl import AgentConfig, RewardConfig, RLTrainConfig
    from hpc_rlhf.config.sections import ModelConfig
    from hpc_rlhf.roles.reference import Reference
    from hpc_rlhf.roles.reward import RewardRole

    rank, world = dist.get_rank(), dist.get_world_size()
    samples = _samples(3 if rank == 0 else 1, seed=rank)
    out = {}
    for stage in (0, 3):
        train = RLTrainConfig(zero_stage=stage, micro_train_batch_size=1, share_prompts=True)
        ref = Reference(ModelConfig(pretrain=lm_dir, param_dtype="fp32"), train, 0.7, 0, "cpu", world)
        out[f"ref{stage}"] = ref.logprobs(samples)
        out[f"ref{stage}_elements"] = _local_elements(ref.model)
        out[f"ref{stage}_shares"] = ref.share_prompts
        reward = RewardRole(RewardConfig(reward_pretrain=rm_dir, reward_batch_size=1), AgentConfig(), "fp32", 64,
                            "cpu", stage, world)
        out[f"rm{stage}"] = reward.score(samples if rank == 0 else [])[0]
        out[f"rm{stage}_elements"] = _local_elements(reward.scorer.scores)
    bf16 = Reference(ModelConfig(pretrain=lm_dir, param_dtype="bf16"), RLTrainConfig(zero_stage=3), 1.0, 0, "cpu",
                     world)
    out["bf16"] = (bf16.model.bfloat16_enabled(), {p.ds_tensor.dtype for p in bf16.model.parameters()})
    return out


@pytest.fixture(scope="module")
def ranks(models):
    return run_ranks(_frozen, 2, *models)


def test_sharded_reference_logprobs_are_the_whole_models(ranks):
    """(The ranks ran 3 and 1 micro-batches: without the agreed count the second forward of rank 0 waits forever.)"""
    import torch
    for rank, r in enumerate(ranks):
        assert len(r["ref3"]) == len(r["ref0"]) == (3 if rank == 0 else 1)
        for a, b in zip(r["ref3"], r["ref0"]):
            torch.testing.assert_close(torch.tensor(a), torch.tensor(b), rtol=0, atol=1e-5)
        assert r["ref0_shares"] and not r["ref3_shares"]  # prompt sharing is off under ZeRO-3


def test_sharded_reward_model_scores_are_the_whole_models(ranks):
    """Rank 0 scores 3 batches of 1, rank 1 none: it still runs 3 forwards with rank 0."""
    import torch
    assert ranks[1]["rm3"] == ranks[1]["rm0"] == []
    assert len(ranks[0]["rm3"]) == 3
    torch.testing.assert_close(torch.tensor(ranks[0]["rm3"]), torch.tensor(ranks[0]["rm0"]), rtol=0, atol=1e-5)


def test_each_rank_holds_half_of_the_frozen_parameters(ranks):
    for r in ranks:
        for name in ("ref", "rm"):
            held, whole = r[f"{name}3_elements"]
            assert r[f"{name}0_elements"] == (whole, whole)  # unsharded: every rank holds the whole model
            assert whole > 5_000_000 and 0.5 * whole <= held < 0.501 * whole, (name, held, whole)


def test_bf16_parameters_make_a_bf16_engine(ranks):
    import torch
    for r in ranks:
        assert r["bf16"] == (True, {torch.bfloat16})


@pytest.mark.slow  # ~60 s: a whole `train rl` of three ranks (the default suite stays under 12 minutes)
def test_train_rl_shards_the_frozen_models_on_the_actors_ranks(tmp_path):
    """`train rl` with ZeRO-3, the reference and a reward model on the two actor ranks (one world for all three)
    and a rollout rank: both frozen models are sharded there, and the reference's log-probs at the first step
    are the actor's own (the same weights: a KL of 0)."""
    from transformers import AutoModelForSequenceClassification

    from rl_fixtures import make_assets, merged, run_rl
    base = make_assets(tmp_path)
    rm = AutoModelForSequenceClassification.from_pretrained(base["model"]["pretrain"], num_labels=1)
    rm.save_pretrained(tmp_path / "rm")
    cfg = merged(base, algo={"advantage_estimator": "reinforce", "init_kl_coef": 0.05},
                 train={"max_steps": 2, "zero_stage": 3}, reward={"reward_pretrain": str(tmp_path / "rm")},
                 placement={"actor_num_ranks": 2, "colocate_actor_ref": True, "colocate_actor_reward": True})
    metrics = run_rl(cfg, tmp_path, "frozen_zero3")
    assert [m["step"] for m in metrics] == [1, 2]
    assert abs(metrics[0]["kl"]) < 1e-6 and metrics[1]["kl"] != 0, [m["kl"] for m in metrics]
    assert "reward/model" in metrics[0]
    log = (tmp_path / "frozen_zero3.log").read_text()
    for role in ("reference", "reward model"):
        assert f"INFO hpc_rlhf.engines.deepspeed_strategy: {role}: ZeRO-3 over 2 ranks" in log, role
