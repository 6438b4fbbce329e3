"""pass@k, avg@n, maj@k and the eval report (algorithms/eval_metrics.py) against hand-computed values."""
from __future__ import annotations

import pytest

from hpc_rlhf.algorithms.eval_metrics import (EvalSample, dataset_names, eval_report, group_metrics, ks_up_to,
                                              majority_vote, pass_at_k)


def S(pid, i, reward, valid=True, pred=None, ds=""):
    return EvalSample(prompt_id=pid, index=i, valid=valid, reward=reward, prediction=pred, dataset=ds)


@pytest.mark.parametrize("n,c,k,expected", [
    (4, 1, 2, 1 - 3 / 6),          # 1 - C(3,2)/C(4,2) = 1 - 3/6
    (4, 1, 1, 1 / 4),              # pass@1 = c/n
    (5, 2, 2, 1 - 3 / 10),         # 1 - C(3,2)/C(5,2)
    (8, 3, 4, 1 - 5 / 70),         # 1 - C(5,4)/C(8,4)
    (4, 1, 4, 1.0),                # k = n with a correct sample: every draw holds it
    (4, 0, 4, 0.0),                # k = n, none correct
    (4, 0, 2, 0.0),                # c = 0
    (4, 4, 1, 1.0),                # c = n
    (3, 2, 2, 1.0),                # n - c < k
])
def test_pass_at_k_hand_values(n, c, k, expected):
    assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12)


def test_pass_at_k_is_stable_for_large_n():
    # 1 - C(900, 10)/C(1000, 10) = 1 - prod_{i=0}^{9} (900 - i)/(1000 - i); the binomials themselves overflow floats
    expected = 1.0
    for i in range(10):
        expected *= (900 - i) / (1000 - i)
    assert pass_at_k(1000, 100, 10) == pytest.approx(1 - expected, rel=1e-12)


@pytest.mark.parametrize("n,c,k", [(4, 5, 1), (4, -1, 1), (4, 1, 0), (4, 1, 5)])
def test_pass_at_k_rejects_impossible_counts(n, c, k):
    with pytest.raises(ValueError, match="pass@k needs"):
        pass_at_k(n, c, k)


def test_ks_up_to():
    assert ks_up_to(1) == [1]
    assert ks_up_to(4) == [1, 2, 4]
    assert ks_up_to(6) == [1, 2, 4, 6]
    assert ks_up_to(8) == [1, 2, 4, 8]
    with pytest.raises(ValueError):
        ks_up_to(0)


def test_majority_vote_ties_go_to_the_first_seen_and_none_does_not_vote():
    assert majority_vote(["3", "5", "5", "3"]) == "3"     # 2 votes each: "3" came first
    assert majority_vote(["5", "3", "3", "5"]) == "5"
    assert majority_vote([None, None, "7"]) == "7"         # None never wins, even as the most frequent
    assert majority_vote(["1", "2", "2"]) == "2"
    assert majority_vote([None, None]) is None
    assert majority_vote([]) is None


def test_group_metrics_hand_computed():
    """Two prompts, n = 4, verifier rewards.  p0: correct at samples 1 and 3 (c=2); p1: sample 2 correct (c=1)."""
    samples = [S(0, 0, 0.0, pred="4"), S(0, 1, 1.0, pred="5"), S(0, 2, 0.0, pred="4"), S(0, 3, 1.0, pred="5"),
               S(1, 0, 0.0, pred="1"), S(1, 1, 0.0, pred=None), S(1, 2, 1.0, pred="2"), S(1, 3, 0.0, pred="1")]
    m = group_metrics(samples, n=4)
    # pass@1: (2/4 + 1/4)/2; pass@2: (1 - C(2,2)/C(4,2) = 5/6, 1 - C(3,2)/C(4,2) = 1/2) / 2; pass@4: (1 + 1)/2
    assert m["pass@1"] == pytest.approx((0.5 + 0.25) / 2)
    assert m["pass@2"] == pytest.approx((5 / 6 + 0.5) / 2)
    assert m["pass@4"] == 1.0
    assert m["avg@4"] == pytest.approx((0.5 + 0.25) / 2)
    # maj@1: p0's first vote "4" (wrong), p1's "1" (wrong) -> 0; maj@2: p0 "4" vs "5" tie -> "4" (first) wrong;
    # p1 "1" alone (None does not vote) wrong -> 0; maj@4: p0 tie 2-2 -> "4" wrong; p1 "1" twice wins, wrong -> 0
    assert m["maj@1"] == 0.0 and m["maj@2"] == 0.0 and m["maj@4"] == 0.0
    assert m["reward_mean"] == pytest.approx(3 / 8) and m["max_reward_mean"] == 1.0
    assert m["prompts"] == 2 and m["prompts_no_valid"] == 0 and m["invalid_samples"] == 0
    assert m["left_out@1"] == m["left_out@2"] == m["left_out@4"] == 0


def test_maj_at_k_counts_the_winners_correct_share():
    # the winner "5" (2 votes of 3) is right; maj@1 reads sample 0 only ("3", wrong), whatever the input order
    samples = [S(0, 2, 1.0, pred="5"), S(0, 0, 0.0, pred="3"), S(0, 1, 1.0, pred="5")]
    m = group_metrics(samples, n=3)
    assert m["maj@1"] == 0.0 and m["maj@2"] == 0.0 and m["maj@3"] == 1.0  # maj@2: tie "3" vs "5" -> "3"
    # a reward model may score the same prediction differently: the winner's samples give their correct share
    m = group_metrics([S(0, 0, 1.0, pred="5"), S(0, 1, 0.0, pred="5")], n=2)
    assert m["maj@2"] == 0.5
    # no prediction in the first k: the group scores 0; no prediction anywhere: no maj@k at all
    assert group_metrics([S(0, 0, 1.0, pred=None), S(0, 1, 1.0, pred="1")], n=2)["maj@1"] == 0.0
    assert not any(k.startswith("maj@") for k in group_metrics([S(0, 0, 1.0), S(0, 1, 1.0)], n=2))


def test_dropped_samples_shrink_their_group_and_short_groups_are_left_out():
    """n = 4.  p0: samples 1 and 2 failed -> n_g=2, c_g=1; p1: all 4 valid, c=0; p2: every sample failed."""
    samples = [S(0, 0, 1.0, pred="a"), S(0, 1, 0.0, valid=False), S(0, 2, 0.0, valid=False), S(0, 3, 0.0, pred="b"),
               *[S(1, i, 0.0, pred="c") for i in range(4)],
               *[S(2, i, 0.0, valid=False) for i in range(4)]]
    m = group_metrics(samples, n=4)
    assert m["prompts"] == 3 and m["prompts_no_valid"] == 1 and m["invalid_samples"] == 6
    assert m["pass@1"] == pytest.approx((1 / 2 + 0) / 2)        # p2 has no valid sample: out of every metric
    assert m["pass@2"] == pytest.approx((1.0 + 0) / 2)          # p0: n_g - c_g = 1 < 2 -> 1
    assert m["pass@4"] == 0.0                                    # only p1 has 4 valid samples
    assert m["left_out@1"] == 1 and m["left_out@2"] == 1 and m["left_out@4"] == 2
    # maj@2 over p0 (valid samples 0 and 3: "a" vs "b" tie -> "a", right) and p1 ("c", wrong)
    assert m["maj@2"] == pytest.approx(0.5)
    assert m["avg@4"] == pytest.approx((0.5 + 0.0) / 2)
    assert m["reward_mean"] == pytest.approx(1 / 6)              # over the 6 valid samples
    assert m["max_reward_mean"] == pytest.approx(0.5)


def test_groups_are_keyed_by_prompt_id_not_text():
    # two prompts that happen to have the same text are two groups: each has one right of two
    samples = [S(0, 0, 1.0), S(0, 1, 0.0), S(1, 0, 1.0), S(1, 1, 0.0)]
    m = group_metrics(samples, n=2)
    assert m["prompts"] == 2 and m["pass@2"] == 1.0 and m["pass@1"] == 0.5


def test_threshold_decides_correctness_but_not_avg():
    samples = [S(0, 0, 0.7), S(0, 1, 0.2)]
    assert group_metrics(samples, n=2)["pass@1"] == 0.0            # threshold 1.0: neither is correct
    m = group_metrics(samples, n=2, threshold=0.5)
    assert m["pass@1"] == 0.5 and m["pass@2"] == 1.0 and m["avg@2"] == pytest.approx(0.45)


def test_empty_eval_set_gives_counts_only():
    m = group_metrics([], n=4)
    assert m == {"prompts": 0.0, "prompts_no_valid": 0.0, "invalid_samples": 0.0,
                 "left_out@1": 0.0, "left_out@2": 0.0, "left_out@4": 0.0}
    assert eval_report([], n=4) == {f"eval/{k}": v for k, v in m.items()}


def test_eval_report_keys_one_dataset():
    samples = [S(0, 0, 1.0, ds="asdiv"), S(0, 1, 0.0, ds="asdiv"), S(1, 0, 0.0, ds="asdiv"), S(1, 1, 0.5, ds="asdiv")]
    r = eval_report(samples, n=2)
    assert r["eval/pass@1"] == 0.25 and r["eval/pass@2"] == 0.5 and r["eval/avg@2"] == pytest.approx(0.375)
    assert r["eval/reward_mean"] == pytest.approx(0.375)
    assert r["eval_asdiv_pass1"] == pytest.approx(0.375) and r["eval_asdiv_pass2"] == pytest.approx(0.75)
    assert not any(k.startswith("eval/asdiv/") for k in r)  # one dataset: no per-dataset copies


def test_eval_report_per_dataset_with_several_sources():
    samples = [S(0, 0, 1.0, ds="a"), S(1, 0, 0.0, ds="b"), S(2, 0, 0.0, ds="b")]
    r = eval_report(samples, n=1)
    assert r["eval/pass@1"] == pytest.approx(1 / 3) and r["eval/prompts"] == 3
    assert r["eval/a/pass@1"] == 1.0 and r["eval/b/pass@1"] == 0.0 and r["eval/b/prompts"] == 2
    assert r["eval_a_pass1"] == 1.0 and r["eval_b_pass1"] == 0.0


def test_dataset_names():
    assert dataset_names(["/x/asdiv/heldout.jsonl", "/y/gsm8k", "org/math@test", "/z/heldout.jsonl", "a b.csv"]) == [
        "heldout", "gsm8k", "math", "heldout_2", "a_b"]


def test_pass_rates_per_prompt():
    from hpc_rlhf.algorithms.eval_metrics import pass_rates
    rows = [{"prompt_id": 0, "valid": True, "correct": True}, {"prompt_id": 0, "valid": True, "correct": False},
            {"prompt_id": 0, "valid": False, "correct": False},  # a failed reward: not counted
            {"prompt_id": 1, "valid": True, "correct": True}, {"prompt_id": 1, "correct": True},  # valid by default
            {"prompt_id": 2, "valid": False, "correct": False}]  # no valid sample: left out
    assert pass_rates(rows) == {0: 0.5, 1: 1.0}
    assert pass_rates([]) == {}


def test_paired_bootstrap_by_hand():
    from hpc_rlhf.algorithms.eval_metrics import paired_bootstrap
    # every problem gains 0.25: every resample's mean gain is 0.25, so the interval is [0.25, 0.25]
    out = paired_bootstrap([0.0, 0.5, 0.25], [0.25, 0.75, 0.5], n_boot=200)
    assert out["gain"] == pytest.approx(0.25) and out["ci"] == pytest.approx([0.25, 0.25])
    # two problems, gains 0 and 1: a resample of two holds both (mean 0.5, probability 1/2), twice the first (0, 1/4)
    # or twice the second (1, 1/4); the 2.5% and 97.5% quantiles of 4000 draws are 0 and 1
    out = paired_bootstrap([0.0, 0.0], [0.0, 1.0], n_boot=4000, seed=3)
    assert out["gain"] == pytest.approx(0.5) and out["ci"] == pytest.approx([0.0, 1.0])
    # a loss is negative; the order of the pairs does not matter for the gain
    assert paired_bootstrap([1.0, 0.5], [0.5, 0.5])["gain"] == pytest.approx(-0.25)
    # the same seed, the same interval
    a = paired_bootstrap([0.1, 0.4, 0.3, 0.9], [0.2, 0.4, 0.8, 0.6], seed=7)
    assert a == paired_bootstrap([0.1, 0.4, 0.3, 0.9], [0.2, 0.4, 0.8, 0.6], seed=7)
    assert a["ci"][0] <= a["gain"] <= a["ci"][1]
    with pytest.raises(ValueError, match="pair the same problems"):
        paired_bootstrap([0.1], [0.1, 0.2])
    with pytest.raises(ValueError, match="no problems"):
        paired_bootstrap([], [])
