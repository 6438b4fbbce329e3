"""The `multiturn` demo stage's pure parts: its environment (two tries at a sum), the two-try demonstrations and
the figures (the stage's target is asserted by the full demo, tests/e2e/demo/test_demo.py)."""
import pytest

from hpc_rlhf.agents import AgentLimits, MultiTurnExecutor, Request, load_agent
from hpc_rlhf.agents.feedback import FeedbackFormat
from hpc_rlhf.demo.addition import forgetful_sum, retry_rows
from hpc_rlhf.demo.addition_env import RETRY, RIGHT, WRONG, is_correct, judge
from hpc_rlhf.demo.run import ENV_FILE, two_turn_figures
from hpc_rlhf.generation.engine import Completion, SamplingParams
from hpc_rlhf.models.tokenizer import build_tokenizer


def test_judge():
    first_right = {"first_try_correct": 1.0, "wrong_first": 0.0, "fixed": 0.0, "final_correct": 1.0}
    first_wrong = {"first_try_correct": 0.0, "wrong_first": 1.0, "fixed": 0.0, "final_correct": 0.0}
    fixed = {"first_try_correct": 0.0, "wrong_first": 1.0, "fixed": 1.0, "final_correct": 1.0}
    assert judge(0, True) == (1.0, True, first_right)
    assert judge(0, False) == (-0.5, False, first_wrong)
    assert judge(1, True) == (1.0, True, fixed)
    assert judge(1, False) == (-0.5, True, first_wrong)
    with pytest.raises(ValueError, match="two tries at most"):
        judge(2, True)
    assert (RIGHT, WRONG) == (1.0, -0.5)  # totals: 1 first try, 0.5 fixed, -1 two misses
    assert is_correct(" 82\n", "82") and not is_correct("8", "82") and not is_correct("820", "82")
    assert not is_correct("", "82") and not is_correct("8 2", "82")


class Scripted:
    """An engine answering each prompt (by its text) with the scripted answers in turn, then EOS."""

    def __init__(self, tok, answers: dict[str, list[str]]):
        self.tok, self.answers, self.seen = tok, {k: list(v) for k, v in answers.items()}, []

    def generate(self, prompts, params, seeds):
        out = []
        for ids in prompts:
            text = self.tok.decode(ids)
            self.seen.append((text, params))
            question = text.split("=")[0] + "="
            new = self.tok(self.answers[question].pop(0), add_special_tokens=False)["input_ids"]
            new = new + [self.tok.eos_token_id]
            out.append(Completion(list(ids), new, [-0.5] * len(new), "stop"))
        return out


def test_environment_through_the_executor():
    """The stage's environment file run by the multi-turn executor: right first (1), fixed (0.5), wrong twice
    (-1); what follows a wrong answer is the feedback and the question again, with action mask 0."""
    tok = build_tokenizer()
    make_episode, form = load_agent(str(ENV_FILE))
    assert form == "openrlhf"
    eos = tok.eos_token_id
    fb = FeedbackFormat(tok, "raw", [eos])
    ex = MultiTurnExecutor(make_episode, lambda ids: tok.decode(ids, skip_special_tokens=True), fb,
                           AgentLimits(max_turns=2, max_context_len=64, step_timeout_s=10, max_failure_fraction=0))
    engine = Scripted(tok, {"12+34=": ["46"], "45+37=": ["72", "82"], "19+19=": ["28", "x"]})
    reqs = [Request(tok(q, add_special_tokens=False)["input_ids"], q, label, seed=i)
            for i, (q, label) in enumerate([("12+34=", "46"), ("45+37=", "82"), ("19+19=", "38")])]
    greedy_first = SamplingParams(temperature=1.0, top_k=1, max_new_tokens=6, stop_token_ids=[eos])
    right, fixed, wrong = ex.run(engine, reqs, greedy_first)
    assert (right.reward, fixed.reward, wrong.reward) == (1.0, 0.5, -1.0)
    assert (right.turn_rewards, fixed.turn_rewards, wrong.turn_rewards) == ([1.0], [-0.5, 1.0], [-0.5, -0.5])
    assert (right.score, fixed.score, wrong.score) == (1.0, 0.5, -1.0)
    assert (right.turns, fixed.turns, wrong.turns) == (1, 2, 2)
    assert right.extra_logs == {"first_try_correct": 1.0, "wrong_first": 0.0, "fixed": 0.0, "final_correct": 1.0}
    assert fixed.extra_logs == {"first_try_correct": 0.0, "wrong_first": 1.0, "fixed": 1.0, "final_correct": 1.0}
    assert wrong.extra_logs == {"first_try_correct": 0.0, "wrong_first": 1.0, "fixed": 0.0, "final_correct": 0.0}
    retry = tok(RETRY + "45+37=", add_special_tokens=False)["input_ids"]
    first, second = tok("72")["input_ids"] + [eos], tok("82")["input_ids"] + [eos]
    assert fixed.response_ids == first + retry + second
    assert fixed.action_mask == [1] * len(first) + [0] * len(retry) + [1] * len(second)
    # what the model reads before its second try, and how it samples there: top_k off, the rest kept
    assert ("45+37=72<|endoftext|> no 45+37=", 0) in [(text, p.top_k) for text, p in engine.seen]
    assert [p.top_k for _, p in engine.seen] == [1, 1, 1, 0, 0]
    assert all(p.temperature == 1.0 and p.max_new_tokens == 6 for _, p in engine.seen)
    # a greedy eval stays greedy on the second try
    engine = Scripted(tok, {"45+37=": ["72", "82"]})
    ex.run(engine, reqs[1:2], SamplingParams(temperature=0.0, max_new_tokens=6, stop_token_ids=[eos]))
    assert [p.greedy for _, p in engine.seen] == [True, True]
    # 400 sums: 240 right first, 160 wrong of which 40 fixed
    assert two_turn_figures({"eval/agent/first_try_correct": 0.6, "eval/agent/final_correct": 0.7,
                             "eval/agent/fixed": 0.1, "eval/agent/wrong_first": 0.4}, 400) == \
        {"first_try_accuracy": 0.6, "final_accuracy": 0.7, "fix_rate": 0.25, "fixed": 40}
    assert two_turn_figures({"eval/agent/first_try_correct": 1.0, "eval/agent/final_correct": 1.0,
                             "eval/agent/fixed": 0.0, "eval/agent/wrong_first": 0.0}, 400)["fix_rate"] == 0.0


def test_retry_demonstrations():
    """A second try only after a wrong demonstration; its input is the transcript up to the second try, its
    output the forgotten carry again (forget_prob 1) or the true sum (forget_prob 0)."""
    rows = [{"input": "45+37=", "output": "72", "label": "82"}, {"input": "12+34=", "output": "46", "label": "46"},
            {"input": "19+19=", "output": "28", "label": "38"}]
    assert retry_rows(rows, 0, " no ", "<E>", forget_prob=1.0) == [
        {"input": "45+37=72<E> no 45+37=", "output": "72", "label": "82"},
        {"input": "19+19=28<E> no 19+19=", "output": "28", "label": "38"}]
    assert [r["output"] for r in retry_rows(rows, 0, " no ", "<E>", forget_prob=0.0)] == ["82", "38"]
    assert retry_rows(rows[1:2], 0, " no ", "<E>") == []
    # the default: the second answer forgets the carry again about 70% of the time, independently of the first
    many = [{"input": f"{a}+{b}=", "output": str(forgetful_sum(a, b)), "label": str(a + b)}
            for a in range(10, 100) for b in range(10, 100) if a % 10 + b % 10 >= 10]
    second = retry_rows(many, 3, " no ", "<E>")
    assert len(second) == len(many) == 3645
    forgot = sum(r["output"] != r["label"] for r in second) / len(second)
    assert 0.67 < forgot < 0.73  # binomial(3645, 0.7): standard deviation 0.008
