"""Every preference-family trainer, end to end through the CLI: 2 ranks log the same losses as 1 rank,
a run resumed from a checkpoint logs the same losses as the uninterrupted one, and the export loads."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from preference_fixtures import losses, make_assets, run_cli
from test_prm_kd import PH, _peaked, _write, kd_rows, prm_rows

pytestmark = pytest.mark.slow

TRAINERS = {  # trainer -> (data key, data options, objective options)
    "rm": ("pairs", {}, {}),
    "dpo": ("pairs", {}, {"beta": 0.1}),
    "kto": ("kto", {}, {"beta": 0.1}),
    "simpo": ("pairs", {}, {}),
    "orpo": ("pairs", {}, {}),
    "prm": ("prm", {"placeholder": PH}, {}),
    "kd": ("kd", {}, {}),
    # on-policy GKD: steps 1-3 train on the student's responses, step 4 on the data's (seed 3, λ = 3/4);
    # the resumed run's step 3 generates with the weights restored from step 2's checkpoint
    "kd on-policy": ("kd", {}, {"beta": 0.5, "lmbda": 0.75}),
}
STUDENT_STEPS = {1: 1.0, 2: 1.0, 3: 1.0, 4: 0.0}


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    from hpc_rlhf.models.tiny import build_tiny_model
    root = tmp_path_factory.mktemp("family")
    out = make_assets(root)
    out["teacher"] = _peaked(build_tiny_model(root / "teacher", arch="llama", hidden_size=32, num_layers=1,
                                              num_heads=4, intermediate_size=64, max_position_embeddings=64, seed=1))
    out["prm"] = _write(root / "prm.jsonl", prm_rows(24))
    out["kd"] = _write(root / "kd.jsonl", kd_rows(24))
    return out


@pytest.mark.parametrize("trainer", sorted(TRAINERS))
def test_two_ranks_and_resume_match_one_uninterrupted_rank(assets, trainer):
    from transformers import AutoConfig
    data, data_extra, objective = TRAINERS[trainer]
    command = trainer.split()[0]
    sections = {"rollout": {"engine": "hf", "generate_max_len": 6}} if "lmbda" in objective else {}
    if command == "kd":
        objective = {**objective, "teacher_pretrain": str(assets["teacher"])}
    root = assets["root"] / trainer.replace(" ", "_")
    root.mkdir()
    config = {"model": {"pretrain": str(assets["model"]), "param_dtype": "fp32"},
              "data": {"dataset": [str(assets[data])], "max_len": 64, **data_extra},
              "objective": objective,
              "train": {"train_batch_size": 8, "micro_train_batch_size": 2, "max_steps": 4, "max_epochs": 4,
                        "learning_rate": 1e-2, "zero_stage": 2, "seed": 3},
              "ckpt": {"save_path": str(root / "one"), "ckpt_path": str(root / "one_ckpt"), "save_steps": 2},
              "log": {"logging_steps": 1, "progress_bar": "off", "use_tensorboard": False}, **sections}
    rows = run_cli(command, config, 1)
    one = losses(rows)
    two = losses(run_cli(command, config, 2, f"save_path={root / 'two'}", f"ckpt_path={root / 'two_ckpt'}"))
    ckpt = root / "resume_ckpt"
    ckpt.mkdir()
    shutil.copytree(root / "one_ckpt" / "global_step2", ckpt / "global_step2")
    resumed = losses(run_cli(command, config, 1, f"save_path={root / 'resumed'}", f"ckpt_path={ckpt}",
                             "load_checkpoint=true"))
    if "lmbda" in objective:
        assert {m["step"]: m["student_step"] for m in rows if "loss" in m} == STUDENT_STEPS
    assert sorted(one) == [1, 2, 3, 4] and sorted(resumed) == [3, 4]
    for step in one:
        assert two[step] == pytest.approx(one[step], abs=1e-5), ("2 ranks", step)
    for step in resumed:
        assert resumed[step] == pytest.approx(one[step], abs=1e-6), ("resumed", step)
    assert AutoConfig.from_pretrained(Path(root / "one")).model_type == "llama"  # an HF folder
