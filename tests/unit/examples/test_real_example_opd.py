"""examples/real_asdiv/opd.yaml: on-policy distillation of GRPO seed 1 into the SFT model, every role on one rank."""
from pathlib import Path

from hpc_rlhf.config import load_config
from hpc_rlhf.config.rl import RLConfig
from hpc_rlhf.trainers.placement import plan_from_config

EXAMPLE = Path(__file__).parents[3] / "examples" / "real_asdiv"


def test_the_opd_example_distils_grpo_seed1_into_the_sft_model_with_grpo_settings():
    cfg = load_config(RLConfig, EXAMPLE / "opd.yaml")
    grpo = load_config(RLConfig, EXAMPLE / "grpo.yaml")
    assert (cfg.algo.advantage_estimator, cfg.model.pretrain, cfg.model.teacher_pretrain) == (
        "opd", grpo.model.pretrain, grpo.ckpt.save_path)  # the teacher is where run.sh's grpo_seed1 saves
    assert cfg.reference_pretrain() == grpo.ckpt.save_path
    assert (cfg.rollout, cfg.eval, cfg.data) == (grpo.rollout, grpo.eval, grpo.data)
    assert cfg.train.max_steps * 2 == grpo.train.max_steps
    plan = plan_from_config(cfg)
    assert plan.world_size == 1 and plan.roles_of(0) == ("actor", "reference", "reward", "rollout")
