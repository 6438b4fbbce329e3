"""Reward-function files: loading errors, batching, per-batch failure accounting, timeouts."""
import logging
import textwrap
import time

import pytest
import torch

from hpc_rlhf.rewards.errors import RewardError, RewardFileError
from hpc_rlhf.rewards.function import RewardFunction
from hpc_rlhf.rewards.reward_file import load_reward_function
from hpc_rlhf.rewards.types import RewardBatch

REWARD_FILE = '''
import time
import torch

CALLS = []

def reward_func(queries, prompts, labels):
    CALLS.append(len(queries))
    if "raise" in labels:
        raise ValueError("boom in this batch")
    if "short" in labels:
        return [1.0] * (len(queries) - 1)
    if "hang" in labels:
        time.sleep(2.0)
        return [0.0] * len(queries)
    if "words" in labels:
        return ["high"] * len(queries)
    if "nodict" in labels:
        return {"reward": [1.0] * len(queries)}
    if "tensor" in labels:
        return torch.arange(len(queries), dtype=torch.float32)[:, None]
    if "nan" in labels:
        return [float("nan") if l == "nan" else 1.0 for l in labels]
    return {"rewards": [float(len(q)) for q in queries],
            "scores": [1.0 if q.endswith(l) else 0.0 for q, l in zip(queries, labels)],
            "extra_logs": {"length": torch.tensor([float(len(q)) for q in queries]), "const": 2.0}}
'''


@pytest.fixture
def reward_file(tmp_path):
    p = tmp_path / "my_reward.py"
    p.write_text(REWARD_FILE)
    return p


def _inputs(labels):
    queries = [f"q{i}" + "x" * i for i in range(len(labels))]
    return queries, [f"p{i}" for i in range(len(labels))], list(labels)


def test_batches_rewards_scores_and_logs(reward_file):
    rf = RewardFunction(reward_file, batch_size=2, timeout_s=5.0)
    queries, prompts, labels = _inputs(["a", "b", "c", "d", "x"])
    queries[4] = "endswith-x"
    out = rf.score(queries, prompts, labels)
    assert isinstance(out, RewardBatch)
    assert rf.fn.__globals__["CALLS"] == [2, 2, 1]
    assert out.rewards.dtype == torch.float32 and out.valid.dtype == torch.bool
    assert out.rewards.tolist() == [float(len(q)) for q in queries]
    assert out.valid.all() and out.num_failed == 0 and out.errors == []
    assert out.scores.tolist() == [0.0, 0.0, 0.0, 0.0, 1.0]
    assert out.extra["reward/length"] == pytest.approx(sum(len(q) for q in queries) / 5)
    assert out.extra["reward/const"] == 2.0
    assert out.extra["reward/func/failures"] == 0 and out.extra["reward/func/timeouts"] == 0
    # a [B, 1] tensor is accepted as well
    t = RewardFunction(reward_file, batch_size=8, timeout_s=None).score(*_inputs(["tensor"] * 3))
    assert t.rewards.tolist() == [0.0, 1.0, 2.0] and t.valid.all()
    assert len(RewardFunction(reward_file).score([], [], [])) == 0


def test_failures_are_narrowed_to_their_samples_counted_and_logged(reward_file, caplog):
    rf = RewardFunction(reward_file, batch_size=2, timeout_s=1.0, max_failure_fraction=1.0, max_abandoned=1)
    labels = ["ok", "ok", "raise", "x", "short", "x", "hang", "x"]
    caplog.set_level(logging.WARNING, logger="hpc_rlhf.rewards")
    t0 = time.monotonic()
    out = rf.score(*_inputs(labels))
    elapsed = time.monotonic() - t0
    assert elapsed < 1.9  # the hung batch was abandoned after ~1 s, not waited for (it sleeps 2 s)
    # a failed batch is retried sample by sample (halves of 2); the timed-out batch is not retried
    assert rf.fn.__globals__["CALLS"] == [2, 2, 1, 1, 2, 1, 1, 2]
    assert out.valid.tolist() == [True, True, False, True, False, True, False, False]
    assert out.rewards[[0, 1, 3, 5]].tolist() == [2.0, 3.0, 5.0, 7.0]
    assert torch.isnan(out.rewards[[2, 4, 6, 7]]).all()  # failed samples are NaN, never a silent 0
    assert out.extra["reward/func/failures"] == 4
    assert out.extra["reward/func/failed_batches"] == 3
    assert out.extra["reward/func/retries"] == 4
    assert out.extra["reward/func/timeouts"] == 1
    path = str(reward_file)
    assert out.errors == [
        f"{path}: reward_func on sample 2 raised ValueError: boom in this batch",
        f"{path}: reward_func on sample 4 returned a list of length 0 for 1 sample; expected one number per sample",
        f"{path}: reward_func on samples [6, 8) did not return within 1 s (the call was abandoned and may still be "
        f"running in a background thread)"]
    text = caplog.text
    assert "ValueError: boom in this batch" in text and "Traceback" in text  # the traceback is in the log
    assert (f"{path}: reward_func on samples [4, 6) returned a list of length 1 for 2 samples; expected one number "
            f"per sample; retrying on halves of the batch") in text
    # the abandoned call is still sleeping: with max_abandoned=1 the next call refuses to pile up more
    with pytest.raises(RewardError, match="still running"):
        rf.score(*_inputs(["ok"]))


def test_one_bad_sample_costs_only_itself(reward_file):
    """One sample the function raises on, in a batch of 8: the other 7 are scored.  The search calls the halves;
    [4, 8) is not called since [0, 4) scored, so the failure must be in it, and so is sample 5 after sample 4."""
    rf = RewardFunction(reward_file, batch_size=8, timeout_s=5.0)  # default max_failure_fraction=0.5
    labels = ["ok"] * 8
    labels[5] = "raise"
    out = rf.score(*_inputs(labels))
    assert rf.fn.__globals__["CALLS"] == [8, 4, 2, 1, 1, 2]
    assert out.valid.tolist() == [True] * 5 + [False] + [True] * 2
    assert out.num_failed == 1 and out.extra["reward/func/retries"] == 5
    assert out.errors == [f"{reward_file}: reward_func on sample 5 raised ValueError: boom in this batch"]


@pytest.mark.parametrize("label, message", [
    ("words", "returned a list whose value 0 is 'high' (str); expected numbers"),
    ("nodict", "returned a dict without a 'rewards' key (keys: ['reward'])"),
    ("short", "returned a list of length 0 for 1 sample; expected one number per sample"),
])
def test_wrong_return_types_say_what_is_wrong(reward_file, caplog, label, message):
    rf = RewardFunction(reward_file, batch_size=4, timeout_s=5.0, max_failure_fraction=1.0)
    out = rf.score(*_inputs([label, "ok"]))
    assert out.valid.tolist() == [False, True] and out.extra["reward/func/failures"] == 1
    assert out.errors == [f"{reward_file}: reward_func on sample 0 {message}"] and message in caplog.text


def test_nan_marks_only_those_samples(reward_file):
    rf = RewardFunction(reward_file, batch_size=4, timeout_s=5.0, max_failure_fraction=1.0)
    out = rf.score(*_inputs(["ok", "nan", "ok", "nan"]))
    assert out.valid.tolist() == [True, False, True, False]
    assert out.rewards[0] == 1.0 and torch.isnan(out.rewards[1])
    assert out.extra["reward/func/failures"] == 2 and out.extra["reward/func/retries"] == 0
    assert "non-finite rewards for 2 of 4 samples (samples [1, 3]: [nan, nan])" in out.errors[0]


def test_max_failure_fraction(reward_file):
    rf = RewardFunction(reward_file, batch_size=1, timeout_s=5.0)  # default max_failure_fraction=0.5
    out = rf.score(*_inputs(["raise", "raise", "ok", "ok"]))  # exactly half: allowed
    assert out.num_failed == 2
    with pytest.raises(RewardError) as e:
        rf.score(*_inputs(["raise", "raise", "raise", "ok"]))
    assert str(e.value) == (f"{reward_file}: reward_func failed on 3 of 4 samples, more than "
                            f"max_failure_fraction=0.5 allows; first failure: on sample 0 it raised ValueError: "
                            f"boom in this batch")
    with pytest.raises(ValueError, match="differ in length"):
        rf.score(["a"], ["b", "c"], ["d"])


def test_a_function_that_always_fails_stops_early_with_one_line(reward_file):
    """Every sample returns strings: the search stops once more than half of the samples failed, and the
    error names the file, the function and what it returned for the first batch."""
    rf = RewardFunction(reward_file, batch_size=8, timeout_s=5.0)
    with pytest.raises(RewardError) as e:
        rf.score(*_inputs(["words"] * 8))
    assert str(e.value) == (f"{reward_file}: reward_func failed on 5 of 8 samples, more than "
                            f"max_failure_fraction=0.5 allows; first failure: on samples [0, 8) it returned a list "
                            f"whose value 0 is 'high' (str); expected numbers")
    assert rf.fn.__globals__["CALLS"] == [8, 4, 2, 1, 1, 2, 1, 1, 4, 2, 1]  # not all 15 calls of the search


def test_load_errors_are_clear(tmp_path):
    with pytest.raises(RewardFileError, match="does not exist"):
        load_reward_function(tmp_path / "missing.py")
    no_func = tmp_path / "no_func.py"
    no_func.write_text("def reward(q, p, l):\n    return [0.0] * len(q)\n")
    with pytest.raises(RewardFileError, match=r"no_func.py defines no `reward_func"):
        load_reward_function(no_func)
    bad = tmp_path / "bad_syntax.py"
    bad.write_text(textwrap.dedent("""
        def reward_func(queries, prompts, labels)
            return []
    """))
    with pytest.raises(RewardFileError) as e:
        load_reward_function(bad)
    assert str(e.value) == (f"syntax error in reward function file {bad}, line 2: expected ':': "
                            f"def reward_func(queries, prompts, labels)")
    broken = tmp_path / "broken.py"
    broken.write_text("import os\nimport not_a_module_xyz\n")
    with pytest.raises(RewardFileError) as e:
        load_reward_function(broken)
    assert str(e.value) == (f"importing reward function file {broken} failed at line 2: ModuleNotFoundError: "
                            f"No module named 'not_a_module_xyz'")
    # helper modules next to the file can be imported
    (tmp_path / "helper_mod_rw.py").write_text("BONUS = 3.0\n")
    uses = tmp_path / "uses_helper.py"
    uses.write_text("from helper_mod_rw import BONUS\ndef reward_func(q, p, l):\n    return [BONUS] * len(q)\n")
    assert load_reward_function(uses)(["a"], ["b"], ["c"]) == [3.0]


# -- reward model (a sequence-classification model scored at the last real token) --------------------------

@pytest.fixture(scope="module")
def tiny_rm(tmp_path_factory):
    from transformers import AutoModelForSequenceClassification

    from hpc_rlhf.models.tiny import build_tiny_model
    src = build_tiny_model(tmp_path_factory.mktemp("lm"), hidden_size=32, num_layers=2, max_position_embeddings=64)
    rm = AutoModelForSequenceClassification.from_pretrained(src, num_labels=1)
    torch.manual_seed(1)
    torch.nn.init.normal_(rm.score.weight, std=0.5)  # random head (the causal LM has none)
    rm.config.pad_token_id = rm.config.eos_token_id  # the hard case: pad id == eos id
    out = tmp_path_factory.mktemp("rm")
    rm.save_pretrained(out)
    return out, rm.eval()


def test_reward_model_scores_last_real_token(tiny_rm):
    from hpc_rlhf.rewards.model import RewardModelScorer
    path, rm = tiny_rm
    eos = rm.config.eos_token_id
    seqs = [[5, 6, 7], [10, 11, 12, 13, 14, 15, 16, eos], [3], [40, 41, 42, 43, eos], list(range(60, 90))]
    scorer = RewardModelScorer(path, batch_size=2)
    got = scorer.score_tokens(seqs)
    assert got.shape == (5,) and got.dtype == torch.float32

    def manual(seq):  # unpadded forward: the head's value at the final position
        with torch.no_grad():
            h = rm.model(input_ids=torch.tensor([seq])).last_hidden_state
            return rm.score(h)[0, -1, 0].item()

    assert got.tolist() == pytest.approx([manual(s) for s in seqs], abs=1e-5)
    # sequences without a trailing pad/eos id agree with Hugging Face's own pooled output
    with torch.no_grad():
        assert got[0].item() == pytest.approx(rm(input_ids=torch.tensor([seqs[0]])).logits[0, 0].item(), abs=1e-5)
        # ... while for a sequence ending in eos (== pad id) their pooling takes the token before it
        hf = rm(input_ids=torch.tensor([seqs[1]])).logits[0, 0].item()
        assert hf == pytest.approx(manual(seqs[1][:-1]), abs=1e-5) and abs(hf - got[1].item()) > 1e-4
    # independent of padding: alone, in other batches, in another order
    alone = torch.stack([scorer.score_tokens([s])[0] for s in seqs])
    assert torch.allclose(alone, got, atol=1e-5)
    assert torch.allclose(RewardModelScorer(path, batch_size=5).score_tokens(seqs[::-1]), got.flip(0), atol=1e-5)
    with pytest.raises(ValueError, match="empty"):
        scorer.score_tokens([[1], []])
    with pytest.raises(ValueError, match="at most 64"):
        scorer.score_tokens([list(range(65))])


def test_reward_model_normalisation_from_config(tiny_rm, tmp_path):
    import json

    from hpc_rlhf.rewards.model import RewardModelScorer
    path, _ = tiny_rm
    seqs = [[5, 6, 7], [8, 9]]
    raw = RewardModelScorer(path).score_tokens(seqs)
    norm_dir = tmp_path / "rm_norm"
    norm_dir.mkdir()
    for f in path.iterdir():
        (norm_dir / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((norm_dir / "config.json").read_text())
    cfg.update(reward_mean=0.25, reward_std=2.0)
    (norm_dir / "config.json").write_text(json.dumps(cfg))
    assert torch.allclose(RewardModelScorer(norm_dir).score_tokens(seqs), (raw - 0.25) / 2.0, atol=1e-6)
    assert torch.allclose(RewardModelScorer(norm_dir, normalize=False).score_tokens(seqs), raw, atol=1e-6)
