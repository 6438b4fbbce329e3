"""hpc_rlhf/agents/: executors, the two environment forms, feedback tokens, limits, failures, seeds.

A scripted engine (``FakeEngine``) answers each call with ids the test chooses and records the contexts,
sampling settings and seeds it got; environments are loaded from files like a run loads them.  The byte
tokenizer of the tiny models (token id == byte value, <|endoftext|> 256, <|im_end|> 259) makes the expected
ids hand-derivable: ``B("Q?") == [81, 63]``.  One test drives the real transformers engine on a tiny model.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import re
import sys
import time
import types
from pathlib import Path

import pytest
import torch

from conftest import make_tokenizer
from hpc_rlhf.agents import (AgentError, AgentFileError, MultiTurnAgentExecutor, MultiTurnExecutor, Request,
                             SingleTurnExecutor, Trajectory, make_executor)
from hpc_rlhf.agents.contract import load_agent
from hpc_rlhf.agents.executor import TURN_SALT, merge_params
from hpc_rlhf.agents.feedback import FeedbackFormat, user_turn_text
from hpc_rlhf.config.rl import AgentConfig
from hpc_rlhf.generation.factory import transformers_engine
from hpc_rlhf.generation.engine import Completion, RolloutEngine, sample_seed, SamplingParams
from hpc_rlhf.models.tiny import build_tiny_model
from hpc_rlhf.models.tokenizer import build_tokenizer

EOS, IM_END = 256, 259
STOP = [EOS, IM_END]
TOK = build_tokenizer()
PARAMS = SamplingParams(temperature=1.0, max_new_tokens=4, stop_token_ids=STOP)


def B(text: str) -> list[int]:
    """The byte tokenizer's ids of an ASCII text (its bytes)."""
    return list(text.encode())


def lp(token: int) -> float:
    """The fake engine's log-prob of a sampled token."""
    return -token / 1000


# ---- the scripted engine ------------------------------------------------------------------------------------
@dataclasses.dataclass
class Call:
    contexts: list[list[int]]
    params: SamplingParams
    seeds: list[int]


class FakeEngine(RolloutEngine):
    """Call k gives each row ``script[k]`` (or ``script(k, context)``), cut after its first stop token and at
    max_new_tokens: finish "stop" when it ends with a stop token, else "length" (a real engine stops only so)."""

    def __init__(self, script):
        self.script, self.calls = script, []

    def generate(self, prompts, params, seeds):
        k = len(self.calls)
        self.calls.append(Call([list(p) for p in prompts], params, list(seeds)))
        out = []
        for p in prompts:
            ids = list(self.script(k, list(p)) if callable(self.script) else self.script[k])
            stops = [i for i, t in enumerate(ids) if t in params.stop_token_ids]
            ids = ids[:stops[0] + 1] if stops else ids
            ids = ids[:params.max_new_tokens]
            finish = "stop" if ids and ids[-1] in params.stop_token_ids else "length"
            out.append(Completion(list(p), ids, [lp(t) for t in ids], finish))
        return out

    def load_weights(self, named_tensors):
        raise NotImplementedError

    def probe_logprobs(self, prompt_ids, response_ids):
        raise NotImplementedError

    def part_checksums(self):
        return None


# ---- environments: a forwarding agent file whose behaviour is a class of this module ------------------------
_FORWARD = '''
import inspect
import agent_probe as probe
from hpc_rlhf.agents import AgentInstanceBase, MultiTurnAgentExecutor


class AgentInstance(AgentInstanceBase):
    def __init__(self, *args, **kwargs):
        self.impl = probe.Env()

    async def reset(self, states, **kwargs):
        out = self.impl.reset(states)
        return await out if inspect.isawaitable(out) else out

    async def step(self, states, **kwargs):
        probe.log.append(dict(states))
        out = self.impl.step(states)
        return await out if inspect.isawaitable(out) else out


class AgentExecutor(MultiTurnAgentExecutor):
    def __init__(self):
        super().__init__(AgentInstance)
'''
FORWARDERS = {"async": _FORWARD,  # plain methods: the executor runs them in worker threads
              "sync": _FORWARD.replace("async def", "def").replace("return await out if inspect.isawaitable(out) "
                                                                   "else out", "return out")}


class Env:
    """Step n (1-based) answers reward n, feedback "<n>", done after ``turns`` steps."""
    turns = 3

    def __init__(self):
        self.n = 0

    def reset(self, states):
        return {"observation": states["observation"]}

    def step(self, states):
        self.n += 1
        return {"rewards": float(self.n), "environment_feedback": f"<{self.n}>", "done": self.n == self.turns}


def env(base=Env, **attrs):
    """A subclass of ``base`` with class attributes or methods replaced."""
    return type("E", (base,), attrs)


def done_after(turns):
    return env(turns=turns)


@pytest.fixture
def agent(tmp_path, monkeypatch):
    """agent(env_cls, form="async"|"sync", tok=, style=, **AgentConfig options) -> a MultiTurnExecutor whose
    environment forwards to env_cls; agent.log holds every step's states."""
    probe = types.ModuleType("agent_probe")
    probe.log = []
    monkeypatch.setitem(sys.modules, "agent_probe", probe)

    def make(env_cls=Env, form="async", tok=TOK, style="raw", stop=STOP, **options):
        probe.Env = env_cls
        path = tmp_path / f"agent_{form}.py"
        path.write_text(FORWARDERS[form])
        cfg = AgentConfig(agent_func_path=str(path), feedback_template=style,
                          **{"max_turns": 4, "max_context_len": 64, "step_timeout_s": 5.0, **options})
        return make_executor(cfg, tok, stop)

    make.log = probe.log
    return make


def requests(*labels, prompt="Q?", seed=1000):
    """One request per label, seeds seed, seed + 1, ..."""
    return [Request(B(prompt), prompt, label, seed + i) for i, label in enumerate(labels)]


def action_traj(prompt, turns, feedbacks, finish="stop", rewards=None):
    """The expected trajectory of actions ``turns`` with ``feedbacks`` (byte texts) after all but the last."""
    resp, mask, lps, ends = [], [], [], []
    for k, a in enumerate(turns):
        resp += a
        mask += [1] * len(a)
        lps += [lp(t) for t in a]
        ends.append(len(resp) - 1)
        if k < len(feedbacks):
            resp += B(feedbacks[k])
            mask += [0] * len(feedbacks[k])
            lps += [0.0] * len(feedbacks[k])
    rewards = [float(n + 1) for n in range(len(turns))] if rewards is None else rewards
    return Trajectory(B(prompt), resp, lps, finish, action_mask=mask, turn_ends=ends, turn_rewards=rewards,
                      reward=sum(rewards), score=sum(rewards))


A0, A1, A2 = B("x1") + [IM_END], B("y") + [IM_END], B("zz") + [IM_END]


# ---- 1. token in, token out ---------------------------------------------------------------------------------
def test_context_is_prompt_plus_sampled_actions_plus_feedback(agent):
    engine = FakeEngine([A0, A1, A2])
    [t] = agent().run(engine, requests("L"), PARAMS)
    p = B("Q?")
    assert [c.contexts for c in engine.calls] == [[p], [p + A0 + B("<1>")], [p + A0 + B("<1>") + A1 + B("<2>")]]
    assert t == action_traj("Q?", [A0, A1, A2], ["<1>", "<2>"])
    assert t.response_ids == A0 + B("<1>") + A1 + B("<2>") + A2
    assert t.action_mask == [1, 1, 1, 0, 0, 0, 1, 1, 0, 0, 0, 1, 1, 1]
    assert t.logprobs == [-0.12, -0.049, -0.259, 0.0, 0.0, 0.0, -0.121, -0.259, 0.0, 0.0, 0.0, -0.122, -0.122,
                          -0.259]
    assert t.turn_ends == [2, 7, 13] and t.turns == 3
    # the environment reads the decoded action (the end-of-turn token skipped) and the text so far
    assert [(s["observation_text"], s["action_text"], s["label"], s["sampling_params"]) for s in agent.log] == [
        ("Q?", "x1", "L", PARAMS), ("Q?x1<1>", "y", "L", PARAMS), ("Q?x1<1>y<2>", "zz", "L", PARAMS)]


def merging_tokenizer():
    """Byte-level BPE with one merge, "a" + "b" -> "ab": the sampled ids [a, b] decode to "ab", which encodes
    to [ab]."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    vocab["ab"] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[("a", "b")]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|endoftext|>", "<|im_end|>"])
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")


def test_sampled_ids_are_kept_where_retokenizing_would_merge_them(agent):
    tok = merging_tokenizer()
    a, b, ab, end = tok.convert_tokens_to_ids(["a", "b", "ab", "<|im_end|>"])
    assert tok("ab", add_special_tokens=False)["input_ids"] == [ab] and tok.decode([a, b]) == "ab"
    q = tok("Q", add_special_tokens=False)["input_ids"]
    engine = FakeEngine([[a, b, end], [b, a, end]])
    feedback = env(step=lambda self, s: {"rewards": 0.0, "environment_feedback": s["action_text"],
                                         "done": s["action_text"] == "ba"})
    ex = agent(feedback, tok=tok, stop=[end])
    [t] = ex.run(engine, [Request(q, "Q", None, 0)], dataclasses.replace(PARAMS, stop_token_ids=[end]))
    assert [s["action_text"] for s in agent.log] == ["ab", "ba"]
    assert engine.calls[1].contexts == [q + [a, b, end, ab]]  # the action as sampled, the feedback on its own
    assert t.response_ids == [a, b, end, ab, b, a, end] and t.action_mask == [1, 1, 1, 0, 1, 1, 1]
    assert tok(tok.decode(t.response_ids), add_special_tokens=False)["input_ids"] != t.response_ids


# ---- 2. limits ----------------------------------------------------------------------------------------------
def test_max_turns_with_the_environment_going_is_length(agent):
    engine = FakeEngine([A0, A1, A2])
    [t] = agent(done_after(99), max_turns=2).run(engine, requests("L"), PARAMS)
    assert len(engine.calls) == 2 and len(agent.log) == 2  # the last action is still scored
    # no feedback after the last allowed turn: it would carry no loss and read as part of the answer
    assert t == action_traj("Q?", [A0, A1], ["<1>"], finish="length")


@pytest.mark.parametrize("script,finish", [([A0, A1], "stop"),               # done with a stop token
                                           ([A0, B("yyyyyy")], "length"),   # last turn cut at max_new_tokens
                                           ([B("xxxxxx"), A1], "stop")])     # an earlier cut does not count
def test_the_final_turn_decides_stop_or_length(agent, script, finish):
    [t] = agent(done_after(2)).run(FakeEngine(script), requests("L"), PARAMS)
    turns = [s[:4] for s in script]
    assert t == action_traj("Q?", turns, ["<1>"], finish=finish)


def test_context_budget_caps_each_turn_and_ends_the_trajectory(agent):
    # prompt 2 + action 3 + feedback 1 = 6 of 9: turn 1 may sample 3 tokens; at 9 the trajectory ends
    engine = FakeEngine([B("xx") + [EOS, IM_END], B("yyyyyyy")])
    never_done = env(step=lambda self, s: {"rewards": 1.0, "environment_feedback": "!", "done": False})
    [t] = agent(never_done, max_context_len=9).run(engine, requests("L"), PARAMS)
    assert [c.params.max_new_tokens for c in engine.calls] == [4, 3]
    assert [c.params for c in engine.calls] == [PARAMS, dataclasses.replace(PARAMS, max_new_tokens=3)]
    assert t == action_traj("Q?", [B("xx") + [EOS], B("yyy")], ["!"], finish="length", rewards=[1.0, 1.0])
    assert len(t.prompt_ids) + len(t.response_ids) == 9


@pytest.mark.parametrize("feedback,fits", [("<<>", True), ("<<<>", False)])
def test_feedback_that_would_fill_the_budget_is_cut(agent, feedback, fits):
    # prompt 2 + action 2 = 4 of 8: 3 feedback tokens leave room for one more token, 4 do not
    ex = agent(env(step=lambda self, s: {"rewards": 1.0, "environment_feedback": feedback,
                                         "done": s["action_text"] == "z"}), max_context_len=8)
    engine = FakeEngine([B("x") + [IM_END], B("z") + [IM_END]])
    [t] = ex.run(engine, requests("L"), PARAMS)
    if fits:  # the next turn gets the one token left, and the trajectory ends cut at exactly the budget
        assert [c.params.max_new_tokens for c in engine.calls] == [4, 1]
        assert t == action_traj("Q?", [B("x") + [IM_END], [B("z")[0]]], [feedback], "length", [1.0, 1.0])
    else:
        assert len(engine.calls) == 1
        assert t == action_traj("Q?", [B("x") + [IM_END]], [], finish="length", rewards=[1.0])


def test_a_prompt_filling_the_budget_is_length_without_generation(agent):
    engine = FakeEngine([A0])
    [t] = agent(max_context_len=4).run(engine, requests("L", prompt="Long"), PARAMS)
    assert engine.calls == [] and agent.log == []
    assert t == Trajectory(B("Long"), [], [], "length", action_mask=[])


# ---- 3. rewards ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("scores,score", [((None, None), 1.5), ((0.25, torch.tensor(0.75)), 0.75),
                                          ((0.25, None), 1.5)])
def test_rewards_scores_and_extra_logs(agent, scores, score):
    def step(self, s):
        self.n += 1
        out = {"rewards": torch.tensor(0.5 * self.n), "environment_feedback": "", "done": self.n == 2,
               "extra_logs": {"a": 1} if self.n == 1 else
               {"a": torch.tensor(2.5), "b": 3, "g": True, "c": "text", "d": [1, 2], "e": float("nan"),
                "f": torch.tensor([1.0, 2.0])}}
        if scores[self.n - 1] is not None:
            out["scores"] = scores[self.n - 1]
        return out

    [t] = agent(env(step=step)).run(FakeEngine([A0, A1]), requests("L"), PARAMS)
    assert (t.turn_rewards, t.reward, t.score) == ([0.5, 1.0], 1.5, score)
    assert t.extra_logs == {"a": 2.5, "b": 3.0, "g": 1.0}  # the last step's numbers only
    assert all(type(v) is float for v in t.extra_logs.values())


# ---- 4. failures --------------------------------------------------------------------------------------------
def _bad(states):
    return states.get("label") == "bad"


def _raise_in(method, exc):
    def f(self, states):
        if _bad(states):
            raise exc
        return getattr(Env, method)(self, states)
    return {method: f}


def _step_returns(value):
    return {"step": lambda self, s: value if _bad(s) else Env.step(self, s)}


def _sleep_sync(self, s):
    if _bad(s):
        time.sleep(1.0)
    return Env.step(self, s)


async def _sleep_async(self, s):
    if _bad(s):
        await asyncio.sleep(1.0)
    return Env.step(self, s)


FAILURES = {
    "reset raises": ("async", _raise_in("reset", ValueError("boom")), "raised ValueError: boom"),
    "step raises": ("sync", _raise_in("step", KeyError("k")), "raised KeyError: 'k'"),
    "reset not a dict": ("async", {"reset": lambda self, s: "text" if _bad(s) else Env.reset(self, s)},
                         "malformed: reset must return {'observation': str}"),
    "step not a dict": ("async", _step_returns([1.0]), "malformed: step must return a dict, got list"),
    "missing keys": ("async", _step_returns({"rewards": 1.0}), "malformed: step's dict lacks done"),
    "reward not a number": ("async", _step_returns({"rewards": "high", "done": True}),
                            "malformed: rewards must be a number"),
    "reward nan": ("async", _step_returns({"rewards": float("nan"), "done": True}),
                   "malformed: rewards must be finite"),
    "feedback not str": ("sync", _step_returns({"rewards": 1.0, "environment_feedback": 3, "done": False}),
                         "malformed: environment_feedback must be a str, got int"),
    "feedback missing": ("async", _step_returns({"rewards": 1.0, "done": False}),
                         "malformed: step's dict lacks environment_feedback while done is false"),
    "done of two elements": ("async", _step_returns({"rewards": 1.0, "done": torch.tensor([True, False])}),
                             "malformed: done must be a bool (or a one-element tensor)"),
    "empty observation": ("async", {"reset": lambda self, s: {"observation": ""} if _bad(s) else Env.reset(self, s)},
                          "malformed: reset returned an empty observation"),
    "sync timeout": ("sync", {"step": _sleep_sync}, "timeout: step took more than agent.step_timeout_s=0.2 s"),
    "async timeout": ("async", {"step": _sleep_async}, "timeout: step took more than agent.step_timeout_s=0.2 s"),
}


@pytest.mark.parametrize("case", list(FAILURES))
def test_a_failing_environment_invalidates_only_its_sample(agent, case):
    form, methods, message = FAILURES[case]
    ex = agent(env(**methods), form=form, step_timeout_s=0.2)
    [ok, bad] = ex.run(FakeEngine([A0, A1, A2]), requests("ok", "bad"), PARAMS)
    assert bad.error is not None and bad.error.startswith(message), bad.error
    alone = ex.run(FakeEngine([A0, A1, A2]), requests("ok"), PARAMS)
    assert ok == alone[0] == action_traj("Q?", [A0, A1, A2], ["<1>", "<2>"])


def test_the_final_feedback_is_neither_appended_nor_checked(agent):
    ex = agent(env(step=lambda self, s: {"rewards": torch.tensor([2.0]), "done": torch.tensor(True),
                                         "environment_feedback": 3}))
    [t] = ex.run(FakeEngine([A0]), requests("L"), PARAMS)
    assert t == action_traj("Q?", [A0], [], rewards=[2.0])


@pytest.mark.parametrize("body,message", [
    ("return prompt\n    def step(self, action):\n        return [action, 1.0, True]",
     "malformed: step must return (feedback, reward, done), got ['x1', 1.0, True]"),
    ("return None\n    def step(self, action):\n        return '', 1.0, True",
     "malformed: reset must return the observation text, got NoneType"),
    ("return prompt\n    def step(self, action):\n        return '', 'one', True",
     "malformed: rewards must be a number (or a one-element tensor), got 'one'"),
    ("return prompt\n    def step(self, action):\n        return 5, 1.0, False",
     "malformed: environment_feedback must be a str, got int")])
def test_simple_form_malformed_results(tmp_path, body, message):
    path = tmp_path / "env.py"
    path.write_text(f"class Environment:\n    def reset(self, prompt, label):\n        {body}\n")
    ex = make_executor(AgentConfig(agent_func_path=str(path), max_failure_fraction=1.0), TOK, STOP)
    [t] = ex.run(FakeEngine([A0]), requests("L"), PARAMS)
    assert t.error == message


def test_an_environment_raising_in_init_invalidates_its_sample(agent):
    class Flaky(Env):
        made = 0

        def __init__(self):
            super().__init__()
            type(self).made += 1
            if type(self).made == 2:
                raise RuntimeError("no sandbox")

    out = agent(Flaky).run(FakeEngine([A0, A1, A2]), requests("a", "b", "c"), PARAMS)
    assert [t.error for t in out] == [None, "raised RuntimeError: no sandbox", None]
    assert out[1] == Trajectory(B("Q?"), [], [], "stop", action_mask=[], error="raised RuntimeError: no sandbox")


def test_each_failure_kind_is_logged_once(agent, caplog):
    def step(self, s):
        if s["label"] == "raise":
            raise ValueError("boom")
        return {"rewards": "x", "done": True} if s["label"] == "malformed" else Env.step(self, s)

    ex = agent(env(step=step), max_failure_fraction=1.0)
    with caplog.at_level(logging.WARNING, logger="hpc_rlhf.agents"):
        for _ in range(2):
            out = ex.run(FakeEngine([A0, A1, A2]), requests("raise", "malformed", "raise", "ok", "malformed"), PARAMS)
    assert [t.error is None for t in out] == [False, False, False, True, False]
    warnings = [r.getMessage() for r in caplog.records if r.name == "hpc_rlhf.agents"]
    assert len(warnings) == 2
    assert "(raised ValueError;" in warnings[0] and "raised ValueError: boom" in warnings[0]
    assert "(malformed;" in warnings[1] and "rewards must be a number" in warnings[1]


@pytest.mark.parametrize("labels,fraction,raises", [(["raise", "raise", "ok", "ok"], 0.5, False),
                                                    (["raise", "malformed", "raise", "ok"], 0.5, True),
                                                    (["ok", "raise"], 0.0, True),
                                                    (["raise", "raise"], 1.0, False)])
def test_too_many_failures_stop_the_run(agent, labels, fraction, raises):
    def step(self, s):
        if s["label"] == "raise":
            raise ValueError("boom")
        return {"rewards": 1.0} if s["label"] == "malformed" else Env.step(self, s)

    ex = agent(env(step=step), max_failure_fraction=fraction)
    if not raises:
        assert sum(t.error is not None for t in ex.run(FakeEngine([A0, A1, A2]), requests(*labels), PARAMS)) \
            == labels.count("raise") + labels.count("malformed")
        return
    with pytest.raises(AgentError) as e:
        ex.run(FakeEngine([A0, A1, A2]), requests(*labels), PARAMS)
    n = len(labels) - labels.count("ok")
    kinds = "raised ValueError x2, malformed x1" if n == 3 else "raised ValueError x1"
    assert str(e.value) == (f"{n} of {len(labels)} trajectories failed in the environment (more than "
                            f"agent.max_failure_fraction={fraction}): {kinds}; first: raised ValueError: boom")


# ---- 5. the two contract forms ------------------------------------------------------------------------------
RETRY_OPENRLHF = '''
from hpc_rlhf.agents import AgentInstanceBase, MultiTurnAgentExecutor


class AgentInstance(AgentInstanceBase):
    def __init__(self, *args, **kwargs):
        self.tries = 0

    async def reset(self, states, **kwargs):
        self.label = states["label"]
        return {"observation": states["observation"]}

    async def step(self, states, **kwargs):
        self.tries += 1
        ok = states["action_text"].strip() == self.label
        done = ok or self.tries == 3
        return {"rewards": float(ok) / self.tries, "environment_feedback": "" if done else f" no{self.tries} ",
                "done": done}


class AgentExecutor(MultiTurnAgentExecutor):
    def __init__(self):
        super().__init__(AgentInstance)
'''
RETRY_SIMPLE = '''
class Environment:
    async def reset(self, prompt, label):
        self.label, self.tries = label, 0
        return prompt

    async def step(self, action):
        self.tries += 1
        ok = action.strip() == self.label
        done = ok or self.tries == 3
        return ("" if done else f" no{self.tries} "), float(ok) / self.tries, done
'''
RETRY_FORMS = {"openrlhf async": (RETRY_OPENRLHF, "openrlhf"),
               "openrlhf sync": (RETRY_OPENRLHF.replace("async def", "def"), "openrlhf"),
               "openrlhf AgentInstance only": (RETRY_OPENRLHF.split("class AgentExecutor")[0], "openrlhf"),
               "simple sync": (RETRY_SIMPLE.replace("async def", "def"), "simple"),
               "simple async": (RETRY_SIMPLE, "simple")}


@pytest.mark.parametrize("form", list(RETRY_FORMS))
def test_both_forms_give_the_same_trajectories(tmp_path, form):
    source, name = RETRY_FORMS[form]
    path = tmp_path / "retry_env.py"
    path.write_text(source)
    assert load_agent(str(path))[1] == name
    ex = make_executor(AgentConfig(agent_func_path=str(path), feedback_template="raw"), TOK, STOP)
    assert isinstance(ex, MultiTurnExecutor) and ex.feedback.style == "raw"
    answers = [B("5") + [IM_END], B(" 7") + [IM_END], B("8") + [IM_END]]  # turn k answers answers[k]
    out = ex.run(FakeEngine(answers), requests("5", "7", "8", "9"), PARAMS)
    expect = [action_traj("Q?", answers[:1], [], rewards=[1.0]),
              action_traj("Q?", answers[:2], [" no1 "], rewards=[0.0, 0.5]),
              action_traj("Q?", answers, [" no1 ", " no2 "], rewards=[0.0, 0.0, 1 / 3]),
              action_traj("Q?", answers, [" no1 ", " no2 "], rewards=[0.0, 0.0, 0.0])]
    assert out == expect


@pytest.mark.parametrize("marker,feedback,logs", [("class AgentInstance", "\nWrong, try again: ", {"tries": 2.0}),
                                                 ("class Environment", "Wrong, try again.", {})])
def test_the_examples_of_docs_agents_md_run(tmp_path, marker, feedback, logs):
    docs = (Path(__file__).resolve().parents[3] / "docs" / "agents.md").read_text()
    [source] = [b for b in re.findall(r"```python\n(.*?)```", docs, re.S) if marker in b]
    path = tmp_path / "docs_env.py"
    path.write_text(source)
    ex = make_executor(AgentConfig(agent_func_path=str(path), feedback_template="raw"), TOK, STOP)
    answers = [B("5") + [IM_END], B("7") + [IM_END]]
    [t] = ex.run(FakeEngine(answers), requests("7"), PARAMS)
    assert t == dataclasses.replace(action_traj("Q?", answers, [feedback], rewards=[0.0, 0.5]), extra_logs=logs)


@pytest.mark.parametrize("source,message", [
    (None, "no such file"),
    ("import hpc_rlhf_no_such_module\n", "importing it failed: ModuleNotFoundError"),
    ("def f(:\n", "importing it failed: SyntaxError"),
    ("x = 1\n", "defines no environment"),
    ("class Environment:\n    def reset(self, prompt, label):\n        return prompt\n", "defines no environment"),
    ("from hpc_rlhf.agents import MultiTurnAgentExecutor\nclass AgentExecutor(MultiTurnAgentExecutor):\n"
     "    def __init__(self):\n        super().__init__(42)\n", "AgentExecutor() failed: TypeError")])
def test_load_agent_errors_name_the_file(tmp_path, source, message):
    path = tmp_path / "my_env.py"
    if source is not None:
        path.write_text(source)
    with pytest.raises(AgentFileError, match=re.escape(message)) as e:
        load_agent(str(path))
    assert str(path) in str(e.value) and "\n" not in str(e.value)


def test_multi_turn_agent_executor_needs_an_environment_class():
    with pytest.raises(TypeError, match="needs an environment class with reset and step"):
        MultiTurnAgentExecutor(Env())


def test_a_rewritten_observation_replaces_the_prompt_ids(agent, bos_tokenizer):
    ex = agent(env(done_after(1), reset=lambda self, s: {"observation": "Say hi:"}), tok=bos_tokenizer)
    engine = FakeEngine([[bos_tokenizer.eos_token_id]])
    [t] = ex.run(engine, requests("L", prompt="Q?"), dataclasses.replace(PARAMS, stop_token_ids=[
        bos_tokenizer.eos_token_id]))
    ids = bos_tokenizer("Say hi:", add_special_tokens=False)["input_ids"]
    assert len(ids) == 7 and bos_tokenizer.convert_tokens_to_ids("<|bos|>") not in ids
    assert t.prompt_ids == ids and engine.calls[0].contexts == [ids]
    assert agent.log[0]["observation_text"] == "Say hi:"


# ---- 6. sampling params from the environment ----------------------------------------------------------------
NEXT = SamplingParams(temperature=0.5, top_p=0.9, top_k=3, max_new_tokens=3, stop_token_ids=STOP)


@pytest.mark.parametrize("given,expect", [
    (SamplingParams(temperature=0.5, top_p=0.9, top_k=3, max_new_tokens=3), NEXT),
    (SamplingParams(temperature=0.5, top_p=0.9, top_k=3, max_new_tokens=3, stop_token_ids=[7]),
     dataclasses.replace(NEXT, stop_token_ids=[7])),
    ({"temperature": 0.5, "top_p": 0.9, "top_k": 3, "max_tokens": 3, "n": 4, "stop": ["x"]}, NEXT),
    ({"temperature": 0.5, "top_p": 0.9, "top_k": 3, "max_new_tokens": 3}, NEXT),
    ({"temperature": 0.0}, dataclasses.replace(PARAMS, temperature=0.0)),
    (types.SimpleNamespace(temperature=0.5, top_p=0.9, top_k=-1, max_tokens=3, n=1, stop_token_ids=[9]),
     dataclasses.replace(NEXT, top_k=0)),
])
def test_sampling_params_from_the_environment_drive_the_next_turn(agent, given, expect):
    def step(self, s):
        self.n += 1
        return {"rewards": 0.0, "environment_feedback": "", "done": self.n == 2,
                "sampling_params": given if self.n == 1 else None}

    engine = FakeEngine([A0, B("yyyyyy")])
    [t] = agent(env(step=step)).run(engine, requests("L"), PARAMS)
    assert [c.params for c in engine.calls] == [PARAMS, expect] == [s["sampling_params"] for s in agent.log]
    assert merge_params(PARAMS, given) == expect
    assert t.response_ids == A0 + B("yyyyyy")[:expect.max_new_tokens]


@pytest.mark.parametrize("given", [{"temperature": -1.0}, {"top_p": 0.0}, {"max_tokens": 0}, {"top_k": "x"},
                                   {"temperature": "hot"}, types.SimpleNamespace(top_p=1.5)])
def test_invalid_sampling_params_are_a_malformed_step(agent, given):
    step = env(step=lambda self, s: {"rewards": 0.0, "environment_feedback": "", "done": False,
                                     "sampling_params": given})
    [t] = agent(step, max_failure_fraction=1.0).run(FakeEngine([A0]), requests("L"), PARAMS)
    assert t.error.startswith("malformed: sampling_params: "), t.error


# ---- 7. seeds -----------------------------------------------------------------------------------------------
def test_turn_seeds(agent):
    assert TURN_SALT == -7  # docs/agents.md names it
    engine = FakeEngine([A0, A1, A2])
    agent().run(engine, requests("a", "b", seed=41), PARAMS)
    assert [c.seeds for c in engine.calls] == [[41, 42]] + [
        [sample_seed(41, -7, k, 0), sample_seed(42, -7, k, 0)] for k in (1, 2)]


def test_single_turn_executor_is_one_engine_call():
    engine, reqs = FakeEngine([A0 + B("tail")]), requests("a", "b", seed=3)
    out = SingleTurnExecutor().run(engine, reqs, PARAMS)
    assert engine.calls == [Call([B("Q?")] * 2, PARAMS, [3, 4])]
    assert out == [Trajectory(B("Q?"), A0, [lp(t) for t in A0], "stop")] * 2
    assert SingleTurnExecutor().run(engine, [], PARAMS) == [] and len(engine.calls) == 1


def test_no_requests_no_engine_call(agent):
    engine = FakeEngine([A0])
    assert agent().run(engine, [], PARAMS) == [] and engine.calls == []


@pytest.fixture(scope="module")
def hf_engine(tmp_path_factory):
    path = build_tiny_model(tmp_path_factory.mktemp("agent_tiny"), hidden_size=32, num_layers=2, num_heads=4,
                            max_position_embeddings=128)
    return transformers_engine(path)


def test_real_engine_turn_zero_is_the_single_turn_sample_and_turn_one_its_own_seed(agent, hf_engine):
    params = SamplingParams(temperature=1.0, max_new_tokens=6, stop_token_ids=STOP)
    reqs = requests("a", "b", prompt="Hello", seed=11)
    single = SingleTurnExecutor().run(hf_engine, reqs, params)
    one = agent(done_after(1)).run(hf_engine, reqs, params)
    assert [(t.response_ids, t.logprobs, t.finish_reason) for t in one] == \
        [(s.response_ids, s.logprobs, s.finish_reason) for s in single]
    assert [(t.action_mask, t.turn_ends) for t in one] == [([1] * len(s.response_ids), [len(s.response_ids) - 1])
                                                           for s in single]
    two = agent(done_after(2)).run(hf_engine, reqs, params)
    # turn 1 of both samples is one engine call, as the executor makes it: a row's float log-probs depend on
    # the batch it is computed in (padding, matmul blocking), its sampled ids do not
    turn1 = hf_engine.generate([r.prompt_ids + s.response_ids + B("<1>") for r, s in zip(reqs, single)], params,
                               [sample_seed(r.seed, TURN_SALT, 1, 0) for r in reqs])
    for s, t, c in zip(single, two, turn1):
        assert t.response_ids == s.response_ids + B("<1>") + c.token_ids
        assert t.logprobs == s.logprobs + [0.0] * 3 + c.logprobs
        assert t.finish_reason == c.finish_reason


# ---- 8. feedback formats ------------------------------------------------------------------------------------
def test_user_turn_text_from_the_chat_template(chatml_tokenizer):
    assert user_turn_text(chatml_tokenizer) == ("<|im_end|>\n<|im_start|>user\n",
                                                "<|im_end|>\n<|im_start|>assistant\n")


@pytest.mark.parametrize("cut", [False, True])
def test_user_turn_feedback_closes_the_turn_only_when_the_model_did_not(agent, chatml_tokenizer, cut):
    tok = chatml_tokenizer
    enc = lambda s: tok(s, add_special_tokens=False)["input_ids"]  # noqa: E731
    end = tok.convert_tokens_to_ids("<|im_end|>")
    fmt = FeedbackFormat(tok, "user_turn", [end])
    action = enc("abcd") if cut else enc("ab") + [end]
    text = ("" if not cut else "<|im_end|>") + "\n<|im_start|>user\nTry again<|im_end|>\n<|im_start|>assistant\n"
    assert fmt.tokens("Try again", action) == enc(text)
    assert (enc(text)[0] == end) == cut  # the framework's end-of-turn token, only after a cut action
    params = SamplingParams(max_new_tokens=4, stop_token_ids=[end])
    ex = agent(env(done_after(2), step=lambda self, s: {**Env.step(self, s), "environment_feedback": "Try again"}),
               tok=tok, style="user_turn")
    [t] = ex.run(FakeEngine([action, enc("5") + [end]]), [Request(enc("Q"), "Q", None, 0)], params)
    assert t.response_ids == action + enc(text) + enc("5") + [end]
    assert t.action_mask == [1] * len(action) + [0] * len(enc(text)) + [1, 1]
    assert t.finish_reason == "stop"


def test_raw_feedback_is_the_text_as_written(chatml_tokenizer):
    fmt = FeedbackFormat(chatml_tokenizer, "raw", [])
    assert fmt.tokens("<|im_start|>x", [1]) == chatml_tokenizer("<|im_start|>x", add_special_tokens=False)[
        "input_ids"] == [chatml_tokenizer.convert_tokens_to_ids("<|im_start|>"), chatml_tokenizer.encode("x")[0]]
    assert fmt.tokens("", [1]) == []


@pytest.mark.parametrize("template,message", [(None, "needs a tokenizer with a chat template"),
                                              ("{% for m in messages %}x{% endfor %}", "drops message contents")])
def test_user_turn_needs_a_usable_chat_template(template, message):
    tok = make_tokenizer()
    tok.chat_template = template
    with pytest.raises(ValueError, match=message):
        FeedbackFormat(tok, "user_turn", [])


@pytest.mark.parametrize("form,template,style,resolved", [
    ("simple", True, "auto", "user_turn"), ("simple", False, "auto", "raw"), ("openrlhf", True, "auto", "raw"),
    ("openrlhf", True, "user_turn", "user_turn"), ("simple", True, "raw", "raw"),
    ("simple", False, "user_turn", ValueError)])
def test_make_executor_resolves_the_feedback_style(tmp_path, form, template, style, resolved):
    path = tmp_path / "env.py"
    path.write_text(RETRY_SIMPLE if form == "simple" else RETRY_OPENRLHF)
    tok = make_tokenizer()
    if not template:
        tok.chat_template = None
    cfg = AgentConfig(agent_func_path=str(path), feedback_template=style)
    if resolved is ValueError:
        with pytest.raises(ValueError, match="chat template"):
            make_executor(cfg, tok, STOP)
        return
    assert make_executor(cfg, tok, STOP).feedback.style == resolved


def test_make_executor_without_an_environment_is_single_turn():
    assert isinstance(make_executor(AgentConfig(), TOK, STOP), SingleTurnExecutor)


# ---- 9. concurrency and grouping ----------------------------------------------------------------------------
async def _slow_async(self, s):
    await asyncio.sleep(0.2)
    return {"rewards": 1.0, "done": True}


def _slow_sync(self, s):
    time.sleep(0.2)
    return {"rewards": 1.0, "done": True}


@pytest.mark.parametrize("form,step", [("async", _slow_async), ("sync", _slow_sync)])
def test_environment_steps_run_concurrently(agent, form, step):
    ex = agent(env(step=step), form=form)
    start = time.perf_counter()
    out = ex.run(FakeEngine([A0]), requests(*"abcdefgh"), PARAMS)
    elapsed = time.perf_counter() - start
    assert [t.reward for t in out] == [1.0] * 8 and all(t.error is None for t in out)
    assert elapsed < 0.8, f"8 steps of 0.2 s took {elapsed:.2f} s: not concurrent"


def test_samples_are_grouped_by_sampling_params(agent):
    def step(self, s):
        self.n += 1
        hot = s["label"] in ("a", "c")
        return {"rewards": 0.0, "environment_feedback": "", "done": self.n == 3,
                "sampling_params": {"temperature": 0.5} if hot else None}

    # each row's action at call k: its label (the prompt's byte), the digit k, <|im_end|>
    engine = FakeEngine(lambda k, ctx: [ctx[0], 48 + k, IM_END])
    reqs = [Request(B(x), x, x, i) for i, x in enumerate("abcd")]
    out = agent(env(step=step)).run(engine, reqs, PARAMS)
    hot = dataclasses.replace(PARAMS, temperature=0.5)
    assert [(len(c.contexts), c.params) for c in engine.calls] == [(4, PARAMS), (2, hot), (2, PARAMS),
                                                                   (2, hot), (2, PARAMS)]
    assert [c.contexts for c in engine.calls[1:3]] == [[B("aa0") + [IM_END], B("cc0") + [IM_END]],
                                                       [B("bb0") + [IM_END], B("dd0") + [IM_END]]]
    assert [c.seeds for c in engine.calls[1:3]] == [[sample_seed(i, TURN_SALT, 1, 0) for i in rows]
                                                    for rows in ((0, 2), (1, 3))]
    assert [t.response_ids for t in out] == [sum((B(x + k) + [IM_END] for k in calls), [])
                                             for x, calls in zip("abcd", ["013", "024", "013", "024"])]
