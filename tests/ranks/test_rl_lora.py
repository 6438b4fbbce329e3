"""`train rl` with a LoRA actor: every sync sends the merged LoRA layers (never the frozen rest of the
base after the first sync), and the rollout engine ends up with exactly the merged weights."""
import pytest
import torch

from rl_fixtures import make_assets, merged, run_rl


@pytest.mark.slow  # the default suite stays under 12 minutes (issue 14 added ~120 s)
def test_lora_actor_syncs_merged_layers_only(tmp_path):
    from transformers import AutoModelForCausalLM
    base = make_assets(tmp_path)
    config = merged(base, model={"lora_rank": 4, "lora_alpha": 8},
                    placement={"actor_num_ranks": 1, "rollout_num_ranks": 1, "reward_num_ranks": 1},
                    algo={"advantage_estimator": "group_norm"})
    rows = [r for r in run_rl(config, tmp_path, "lora") if "reward/mean" in r]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    model = AutoModelForCausalLM.from_pretrained(base["model"]["pretrain"])
    full = sum(p.numel() for p in model.parameters())
    linear = sum(m.weight.numel() for n, m in model.named_modules()
                 if isinstance(m, torch.nn.Linear) and n != "lm_head")  # LoRA's all-linear targets
    for r in rows:
        # the loaded weights (engine: all of its parameters) are the sent ones (every tensor sent so far)
        assert r["sync/checksum_loaded/0"] == pytest.approx(r["sync/checksum_sent"], rel=1e-12)
        assert r["sync/numel_sent"] == linear < full
        assert r["sync/receipt_max_abs_diff"] < 1e-5  # the adapter's forward and the merged weights agree
    assert rows[-1]["sync/checksum_sent"] != rows[0]["sync/checksum_sent"]  # the adapter trained
