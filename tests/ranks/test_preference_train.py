"""DPO and the reward model end to end through `hpc-rlhf train dpo|rm`: each learns a separable toy set and
exports a loadable model; a resumed run logs the uninterrupted run's losses; 2 ranks log the same run as 1
(rm, with ZeRO-2 and evaluation); the reward model loads with AutoModelForSequenceClassification and the RL
loop's scorer and gives the trainer's scores.  (KTO, SimPO, ORPO end to end: test_preference_objectives.py.)"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from _dist import run_ranks
from preference_fixtures import check_learned, cli_config, losses, make_assets, pair_rows, run_cli


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return make_assets(tmp_path_factory.mktemp("pref"))


def _single_and_resumed(assets, trainer: str, **objective):
    """An uninterrupted run (checkpoints every 2 steps) and the same run resumed after step 2."""
    config = cli_config(assets, trainer, "pairs", **objective)
    root = Path(config["ckpt"]["save_path"]).parent
    single = run_cli(trainer, config, 1)
    ckpt = root / "resume_ckpt"
    ckpt.mkdir()
    shutil.copytree(root / "single_ckpt" / "global_step2", ckpt / "global_step2")  # stopped after step 2
    resumed = run_cli(trainer, config, 1, f"save_path={root / 'resumed'}", f"ckpt_path={ckpt}",
                      "load_checkpoint=true")
    return root, single, resumed, config


def _check_resumed(single: list[dict], resumed: list[dict]):
    want, got = losses(single), losses(resumed)
    assert sorted(want) == list(range(1, 9))  # 32 training pairs / 8 per step, 2 epochs
    assert sorted(got) == list(range(3, 9))   # across the epoch boundary after step 4
    for step, loss in got.items():
        assert loss == pytest.approx(want[step], abs=1e-6), step


@pytest.fixture(scope="module")
def dpo_runs(assets):
    return _single_and_resumed(assets, "dpo")


def test_dpo_learns_and_exports(dpo_runs):
    from transformers import AutoModelForCausalLM
    root, single, _, _ = dpo_runs
    check_learned(single, root / "single", first_accuracy_below=0.01)  # policy = reference: every margin is 0
    for key in ("chosen_reward", "rejected_reward", "margin", "eval_loss", "eval_margin"):
        assert any(key in m for m in single), key
    assert [p.name for p in sorted((root / "single_ckpt").iterdir())] == ["global_step2", "global_step4",
                                                                          "global_step6"]
    assert AutoModelForCausalLM.from_pretrained(root / "single").config.vocab_size > 0


def test_dpo_resumed_run_logs_the_same_losses(dpo_runs):
    _check_resumed(*dpo_runs[1:3])


@pytest.fixture(scope="module")
def rm_runs(assets):
    return _single_and_resumed(assets, "rm", margin_key="margin")


def test_rm_learns(rm_runs):
    root, single, _, _ = rm_runs
    check_learned(single, root / "single")


def test_rm_resumed_run_logs_the_same_losses(rm_runs):
    _check_resumed(*rm_runs[1:3])


# a 2-process run; 2 ranks == 1 at the step level is in the default suite (test_preference_objectives)
@pytest.mark.slow
def test_rm_two_ranks_log_the_same_run_as_one(rm_runs):
    """8 steps with ZeRO-2, one pair per micro-batch: losses, eval metrics and the stored reward statistics."""
    root, one, _, config = rm_runs
    two = run_cli("rm", config, 2, f"save_path={root / 'two'}", f"ckpt_path={root / 'two_ckpt'}",
                  "micro_train_batch_size=1")
    assert list(losses(two).values()) == pytest.approx(list(losses(one).values()), abs=1e-5)

    def final(rows):
        return {k: v for m in rows if m["step"] == 8 for k, v in m.items() if k.startswith(("eval_", "reward_"))}
    assert {"eval_accuracy", "eval_loss", "reward_mean", "reward_std"} <= set(final(one))
    assert final(two) == pytest.approx(final(one), abs=1e-5)
    stored = [json.loads((p / "config.json").read_text()) for p in (root / "single", root / "two")]
    assert stored[1]["reward_std"] == pytest.approx(stored[0]["reward_std"], abs=1e-5)


def _rm_one_step(model_dir: str, overrides: list[str]) -> tuple[list, dict]:
    """`train rm` in process, counting the forward passes: (pairs scored, engine in training mode) per call of
    pair_scores, and the run's summary."""
    from hpc_rlhf.config import load_config
    from hpc_rlhf.config.preference import RMConfig
    from hpc_rlhf.trainers.objectives.reward_model import RewardModel
    from hpc_rlhf.trainers.offline import run_offline

    calls, score = [], RewardModel.pair_scores

    def counted(self, engine, pairs):
        calls.append((len(pairs), engine.module.training))
        return score(self, engine, pairs)
    RewardModel.pair_scores = counted
    return calls, run_offline(load_config(RMConfig, None, [f"pretrain={model_dir}", *overrides]))


def test_rm_reward_statistics_come_from_the_eval_pass(assets, tmp_path):
    from transformers import AutoModelForSequenceClassification

    from hpc_rlhf.config import load_config
    from hpc_rlhf.config.preference import RMConfig
    from hpc_rlhf.data.packing import collate_padded
    from hpc_rlhf.data.preference import load_pairs
    from hpc_rlhf.models.loading import load_tokenizer

    rows = pair_rows(12)
    train, evals = tmp_path / "train.jsonl", tmp_path / "eval.jsonl"
    for path, part in ((train, rows[:8]), (evals, rows[8:])):
        path.write_text("".join(json.dumps(r) + "\n" for r in part))
    save = tmp_path / "rm"
    overrides = [f"dataset={train}", f"eval_dataset={evals}", f"save_path={save}", f"ckpt_path={tmp_path / 'ckpt'}",
                 "param_dtype=fp32", "train_batch_size=4", "micro_train_batch_size=2", "max_steps=1",
                 "zero_stage=0", "progress_bar=off", "use_tensorboard=false"]
    calls, summary = run_ranks(_rm_one_step, 1, str(assets["model"]), overrides)[0]
    # the step: 4 pairs in 2 micro-batches; the eval after it: the 4 eval pairs in 2; no pass after it
    assert calls == [(2, True), (2, True), (2, False), (2, False)]

    # what a pass of the exported model over the eval set gives: the mean and (population) std of its 8 scores
    tokenizer = load_tokenizer(str(save))
    _, eval_pairs, _ = load_pairs(load_config(RMConfig, None, [f"pretrain={save}", *overrides]).data, tokenizer, 0)
    batch = collate_padded([p.chosen for p in eval_pairs] + [p.rejected for p in eval_pairs], tokenizer.pad_token_id)
    model = AutoModelForSequenceClassification.from_pretrained(save).eval()
    with torch.no_grad():
        scores = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits[:, 0].double()
    assert len(eval_pairs) == 4 and float(scores.std()) > 1e-3
    stored = json.loads((save / "config.json").read_text())
    for values in (summary, stored):
        assert values["reward_mean"] == pytest.approx(float(scores.mean()), abs=1e-5)
        assert values["reward_std"] == pytest.approx(float(scores.std(unbiased=False)), abs=1e-5)


def test_rm_export_loads_and_scores_like_the_trainer(rm_runs):
    from transformers import AutoModelForSequenceClassification

    from hpc_rlhf.config import load_config
    from hpc_rlhf.config.preference import RMConfig
    from hpc_rlhf.data.packing import collate_padded
    from hpc_rlhf.data.preference import load_pairs
    from hpc_rlhf.models.loading import load_tokenizer
    from hpc_rlhf.rewards.model import RewardModelScorer

    root, single, _, _ = rm_runs
    save = root / "single"
    cfg = load_config(RMConfig, save / "hpc_rlhf_config.yaml")
    tokenizer = load_tokenizer(str(save))
    _, eval_pairs, _ = load_pairs(cfg.data, tokenizer, cfg.train.seed, cfg.objective.margin_key)
    model = AutoModelForSequenceClassification.from_pretrained(save).eval()
    assert model.config.num_labels == 1 and model.config.pad_token_id == tokenizer.pad_token_id
    seqs = [p.chosen for p in eval_pairs] + [p.rejected for p in eval_pairs]
    batch = collate_padded(seqs, tokenizer.pad_token_id)
    with torch.no_grad():
        scores = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits[:, 0]
    n = len(eval_pairs)
    final = [m for m in single if "eval_chosen_reward" in m][-1]  # evaluated after the last step
    assert float(scores[:n].mean()) == pytest.approx(final["eval_chosen_reward"], abs=1e-5)
    assert float(scores[n:].mean()) == pytest.approx(final["eval_rejected_reward"], abs=1e-5)
    stored = json.loads((save / "config.json").read_text())
    assert stored["reward_mean"] == pytest.approx(float(scores.mean()), abs=1e-5)
    assert stored["reward_std"] == pytest.approx(float(scores.std(unbiased=False)), abs=1e-5)
    # the RL loop's scorer reads the same model, gives the same scores and normalises with the stored values
    raw = RewardModelScorer(save, normalize=False).score_tokens([s.input_ids for s in seqs])
    torch.testing.assert_close(raw, scores, atol=1e-5, rtol=1e-5)
    normalised = RewardModelScorer(save).score_tokens([s.input_ids for s in seqs])
    torch.testing.assert_close(normalised, (scores - stored["reward_mean"]) / stored["reward_std"],
                               atol=1e-4, rtol=1e-4)
