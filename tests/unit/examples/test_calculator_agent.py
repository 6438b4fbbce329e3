"""examples/calculator_agent: the safe evaluator, the environment's steps, and the tool loop end to end.

A random tiny model never writes ``<calc>..</calc>`` by chance, so the end-to-end tests script the policy:
a scripted engine drives the real executor (the full trajectory, token by token), and a tiny model that has
memorised those trajectories generates them greedily inside ``hpc-rlhf train rl`` (the transformers engine).
"""
from __future__ import annotations

import asyncio
import importlib.util
import json
import re
from fractions import Fraction
from pathlib import Path

import pytest
import yaml

from rl_fixtures import run_rl

ROOT = Path(__file__).resolve().parents[3]
EXAMPLE = ROOT / "examples" / "calculator_agent"
ENV_FILE = EXAMPLE / "calculator_env.py"

_spec = importlib.util.spec_from_file_location("calculator_env_under_test", ENV_FILE)
calc = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(calc)


# ---- the evaluator -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("expression, value", [
    ("37*12", 444), ("2+3*4", 14), ("(2+3)*4", 20), ("10-4-3", 3), ("48/4/2", 6), ("2*3**2", 18),
    ("2**3**2", 512), ("-2**2", -4), ("(-2)**2", 4), ("-(3-5)", 2), ("+7", 7), ("10/4", Fraction(5, 2)),
    ("0.1+0.2", Fraction(3, 10)), ("1.5*4", 6), (".5+1", Fraction(3, 2)), ("2**-2", Fraction(1, 4)),
    (" 18.69 - 3 ", Fraction(1569, 100)), ("(" * 90 + "1" + ")" * 90, 1), ("10**30", 10 ** 30),
])
def test_evaluate_hand_values(expression, value):
    assert calc.evaluate(expression) == value


@pytest.mark.parametrize("expression, message", [
    ("1/0", "division by zero"), ("5/(3-3)", "division by zero"), ("0**-1", "division by zero"),
    ("x+1", "names are not allowed: x"), ("__import__('os').system('true')", "function calls are not allowed"),
    ("abs(-3)", "function calls are not allowed"), ("(1).real", "attributes are not allowed: .real"),
    ("2**65", "exponent larger than 64"), ("9**9**9", "exponent larger than 64"),
    ("10**31", "number too large"), ("10**20*10**11", "number too large"), ("1e999", "number too large"),
    ("2**0.5", "the exponent must be an integer"), ("7%3", "operator % is not supported"),
    ("7//2", "operator // is not supported"), ("~1", "operator ~ is not supported"),
    ("1,000", "not Tuple"), ("[1]", "not List"), ("1<2", "not Compare"), ("lambda: 1", "not Lambda"),
    ("True+1", "not a number: True"), ("'a'", "not a number: 'a'"), ("2j", "not a number: 2j"),
    ("", "empty expression"), ("   ", "empty expression"), ("3 12", "not an arithmetic expression: 3 12"),
    ("37*", "not an arithmetic expression"), ("1+" * 101 + "1", "longer than 200 characters"),
])
def test_evaluate_refuses(expression, message):
    with pytest.raises(calc.CalcError, match=re.escape(message)):
        calc.evaluate(expression)


@pytest.mark.parametrize("value, text", [
    (Fraction(444), "444"), (Fraction(-3), "-3"), (Fraction(0), "0"), (Fraction(5, 2), "2.5"),
    (Fraction(-5, 2), "-2.5"), (Fraction(1, 3), "0.3333333333"), (Fraction(2, 3), "0.6666666667"),
    (Fraction(-1, 3), "-0.3333333333"), (Fraction(1, 8), "0.125"), (Fraction(1, 10 ** 12), "0"),
])
def test_format_number(value, text):
    assert calc.format_number(value) == text


def test_calculator_reply():
    assert calc.calculator_reply("37*12") == "<result>444</result>"
    assert calc.calculator_reply("1/0") == "<error>division by zero</error>"


# ---- the environment's steps -------------------------------------------------------------------------------

CHATML = "<|im_start|>user\nWhat is 37*12?<|im_end|>\n<|im_start|>assistant\n"


def _step(env, action, label="444", params=None):
    return asyncio.run(env.step({"observation_text": "", "action_text": action, "label": label,
                                 "sampling_params": params}))


def test_reset_puts_the_hint_at_the_end_of_the_user_message():
    env = calc.AgentInstance()
    obs = asyncio.run(env.reset({"observation": CHATML, "label": "444"}))["observation"]
    assert obs == f"<|im_start|>user\nWhat is 37*12?\n{calc.TOOL_HINT}<|im_end|>\n<|im_start|>assistant\n"
    plain = asyncio.run(env.reset({"observation": "What is 37*12?", "label": "444"}))["observation"]
    assert plain == f"{calc.TOOL_HINT}\n\nWhat is 37*12?"


def test_a_call_gets_its_result_as_feedback_and_the_answer_its_reward():
    env = calc.AgentInstance()
    out = _step(env, "Let me compute <calc>37*12</calc>", params={"temperature": 0.5})
    assert out == {"rewards": 0.0, "scores": 0.0, "environment_feedback": "<result>444</result>", "done": False,
                   "sampling_params": {"temperature": 0.5}, "extra_logs": {"tool_calls": 1.0, "correct": 0.0}}
    out = _step(env, "The answer is 444.")
    assert (out["rewards"], out["done"], out["environment_feedback"]) == (1.0, True, "")
    assert out["extra_logs"] == {"tool_calls": 1.0, "correct": 1.0}


def test_final_answers_are_verified_against_the_label():
    assert _step(calc.AgentInstance(), "9", label="9 apples")["rewards"] == 1.0
    assert _step(calc.AgentInstance(), "There are 9.0 apples", label="9 apples")["rewards"] == 1.0
    wrong = _step(calc.AgentInstance(), "The answer is 440", label="444")
    assert (wrong["rewards"], wrong["done"], wrong["extra_logs"]) == (0.0, True, {"tool_calls": 0.0, "correct": 0.0})
    assert _step(calc.AgentInstance(), "no number at all", label="444")["rewards"] == 0.0
    with pytest.raises(ValueError, match="no label"):
        _step(calc.AgentInstance(), "444", label=None)


def test_several_calls_in_one_turn_each_get_a_reply():
    env = calc.AgentInstance()
    out = _step(env, "<calc>3+4</calc> and <calc>10/4</calc>")
    assert out["environment_feedback"] == "<result>7</result><result>2.5</result>"
    assert out["extra_logs"]["tool_calls"] == 2.0 and not out["done"]


@pytest.mark.parametrize("action, feedback", [
    ("<calc>37*</calc>", "<error>not an arithmetic expression: 37*</error>"),
    ("<calc>os.system('ls')</calc>", "<error>function calls are not allowed</error>"),
    ("<calc>12/0</calc>", "<error>division by zero</error>"),
    ("<calc>37*12", "<error>unclosed <calc>: write <calc>expression</calc></error>"),
])
def test_a_malformed_call_gets_an_error_as_feedback_not_a_failure(action, feedback):
    env = calc.AgentInstance()
    out = _step(env, action)
    assert (out["environment_feedback"], out["rewards"], out["done"]) == (feedback, 0.0, False)
    assert out["extra_logs"]["tool_calls"] == 1.0
    assert _step(env, "444")["rewards"] == 1.0  # the episode goes on to a verified answer


def test_calls_past_the_cap_end_the_episode_with_reward_0():
    env = calc.AgentInstance()
    for k in range(calc.MAX_CALLS):
        out = _step(env, f"<calc>{k}+1</calc>")
        assert not out["done"] and out["environment_feedback"] == f"<result>{k + 1}</result>"
    out = _step(env, "<calc>37*12</calc> The answer is 444")
    assert (out["rewards"], out["done"], out["environment_feedback"]) == (0.0, True, "")
    assert out["extra_logs"] == {"tool_calls": calc.MAX_CALLS + 1.0, "correct": 0.0}
    many = _step(calc.AgentInstance(), "<calc>1</calc>" * (calc.MAX_CALLS + 1))
    assert many["done"] and many["rewards"] == 0.0


# ---- end to end: the executor with a scripted engine -------------------------------------------------------

def _engine_class():
    from hpc_rlhf.generation.engine import FINISH_STOP, Completion, RolloutEngine

    class ScriptedEngine(RolloutEngine):
        """A perfect tool user, or a confident guesser: ``script(context_text)`` is the next action's text,
        sent with the end-of-turn token and log-prob -0.25 per token."""

        def __init__(self, tokenizer, script, end_id: int):
            self.tok, self.script, self.end_id = tokenizer, script, end_id
            self.calls = []

        def generate(self, prompts, params, seeds):
            out = []
            for p in prompts:
                ids = self.tok(self.script(self.tok.decode(p)), add_special_tokens=False)["input_ids"] + [self.end_id]
                assert len(ids) <= params.max_new_tokens
                out.append(Completion(list(p), ids, [-0.25] * len(ids), FINISH_STOP))
            self.calls.append(len(prompts))
            return out

        def load_weights(self, named_tensors):
            raise RuntimeError("the scripted engine has no weights")

        def probe_logprobs(self, prompt_ids, response_ids):
            raise RuntimeError("the scripted engine has no weights")

        def part_checksums(self):
            return None

    return ScriptedEngine


def tool_user(context: str) -> str:
    """Calls the calculator on the question's expression, then answers with the result ("7*9" is answered
    "The answer is 62" without a call: a wrong guess)."""
    question, _, after = context.partition(calc.TOOL_HINT)  # (the hint's example has a call and a result)
    results = re.findall(r"<result>(.*?)</result>", after)
    if results:
        return f"The answer is {results[-1]}"
    expression = re.search(r"What is (\S+)\?", question).group(1)
    return "The answer is 62" if expression == "7*9" else f"<calc>{expression}</calc>"


def _requests(tokenizer, questions):
    from hpc_rlhf.agents import Request
    out = []
    for k, (q, label) in enumerate(questions):
        text = tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                             add_generation_prompt=True)
        out.append(Request(tokenizer(text, add_special_tokens=False)["input_ids"], text, label, seed=k))
    return out


def _executor(tokenizer, style, max_turns=3):
    from hpc_rlhf.agents import make_executor
    from hpc_rlhf.config.rl import AgentConfig
    stop = [tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|im_end|>")]
    agent = AgentConfig(agent_func_path=str(ENV_FILE), max_turns=max_turns, max_context_len=512,
                        feedback_template=style)
    return make_executor(agent, tokenizer, stop), stop


FEEDBACK = {"raw": "<result>444</result>",
            "user_turn": "\n<|im_start|>user\n<result>444</result><|im_end|>\n<|im_start|>assistant\n"}


@pytest.mark.parametrize("style", ["raw", "user_turn"])
def test_executor_runs_the_tool_loop_token_in_token_out(style):
    from hpc_rlhf.generation.engine import SamplingParams
    from hpc_rlhf.models.tokenizer import build_tokenizer
    tok = build_tokenizer()
    end = tok.convert_tokens_to_ids("<|im_end|>")
    executor, stop = _executor(tok, style)
    engine = _engine_class()(tok, tool_user, end)
    requests = _requests(tok, [("What is 37*12?", "444"), ("What is 7*9?", "63")])
    params = SamplingParams(max_new_tokens=24, stop_token_ids=stop)
    trajs = executor.run(engine, requests, params)
    assert engine.calls == [2, 1]  # turn 2 generates only for the live trajectory
    assert trajs[0] == executor.run(_engine_class()(tok, tool_user, end), requests[:1], params)[0]  # alone = batched
    t = trajs[0]
    enc = lambda s: tok(s, add_special_tokens=False)["input_ids"]  # noqa: E731
    action1, action2, fb = enc("<calc>37*12</calc>") + [end], enc("The answer is 444") + [end], enc(FEEDBACK[style])
    assert t.prompt_ids == enc(calc.with_hint(requests[0].prompt_text))  # the hint is in the prompt
    assert t.response_ids == action1 + fb + action2
    assert tok.decode(fb) == FEEDBACK[style]
    assert t.action_mask == [1] * len(action1) + [0] * len(fb) + [1] * len(action2)
    assert t.logprobs == [-0.25] * len(action1) + [0.0] * len(fb) + [-0.25] * len(action2)
    assert t.turn_ends == [len(action1) - 1, len(t.response_ids) - 1]
    assert (t.turns, t.turn_rewards, t.reward, t.score, t.finish_reason, t.error) == (2, [0.0, 1.0], 1.0, 1.0,
                                                                                      "stop", None)
    assert t.extra_logs == {"tool_calls": 1.0, "correct": 1.0}
    guess = trajs[1]  # answered without a call, wrongly: one turn, reward 0
    assert guess.response_ids == enc("The answer is 62") + [end] and guess.action_mask == [1] * 17
    assert (guess.turns, guess.reward, guess.extra_logs) == (1, 0.0, {"tool_calls": 0.0, "correct": 0.0})


def test_max_turns_cuts_a_trajectory_after_its_call():
    from hpc_rlhf.generation.engine import SamplingParams
    from hpc_rlhf.models.tokenizer import build_tokenizer
    tok = build_tokenizer()
    executor, stop = _executor(tok, "raw", max_turns=1)
    engine = _engine_class()(tok, tool_user, tok.convert_tokens_to_ids("<|im_end|>"))
    t = executor.run(engine, _requests(tok, [("What is 37*12?", "444")]), SamplingParams(max_new_tokens=24,
                                                                                       stop_token_ids=stop))[0]
    assert (t.turns, t.turn_rewards, t.reward, t.finish_reason, t.error) == (1, [0.0], 0.0, "length", None)
    assert t.extra_logs == {"tool_calls": 1.0, "correct": 0.0}
    assert t.response_ids == tok("<calc>37*12</calc><|im_end|>", add_special_tokens=False)["input_ids"]
    assert t.action_mask == [1] * 19  # no feedback after the last turn allowed


# ---- end to end: `hpc-rlhf train rl` with the transformers engine ------------------------------------------

QUESTIONS = [("What is 37*12?", "444"), ("What is 7*9?", "63")]


@pytest.fixture(scope="module")
def memorised(tmp_path_factory):
    """A tiny model trained to generate, greedily, the scripted trajectories of QUESTIONS (the tool call and
    the answer from its result for 37*12; a wrong guess without a call for 7*9), and their prompt file."""
    import torch
    from transformers import AutoModelForCausalLM

    from hpc_rlhf.agents import Request
    from hpc_rlhf.config.rl import PromptDataConfig
    from hpc_rlhf.data.prompts import build_prompts
    from hpc_rlhf.data.rows import BadRows
    from hpc_rlhf.generation.engine import SamplingParams
    from hpc_rlhf.models.loading import load_tokenizer
    from hpc_rlhf.models.tiny import build_tiny_model
    from hpc_rlhf.roles.rollout import stop_token_ids

    root = tmp_path_factory.mktemp("calc")
    path = build_tiny_model(root / "model", hidden_size=64, num_layers=2, max_position_embeddings=512, seed=0)
    data = root / "prompts.jsonl"
    rows = [{"input": q, "label": a} for q, a in QUESTIONS]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    tok = load_tokenizer(str(path))
    prompts = build_prompts(rows, "prompts", tok, PromptDataConfig(prompt_data=[str(data)],
                                                                   apply_chat_template=True), BadRows())
    executor, _ = _executor(tok, "user_turn")
    stop = stop_token_ids(str(path), tok)
    engine = _engine_class()(tok, tool_user, tok.convert_tokens_to_ids("<|im_end|>"))
    trajs = executor.run(engine, [Request(p.prompt_ids, p.text, p.label, 0) for p in prompts],
                         SamplingParams(max_new_tokens=24, stop_token_ids=stop))
    assert [t.reward for t in trajs] == [1.0, 0.0]
    seqs = [t.prompt_ids + t.response_ids for t in trajs]
    masks = [[0] * len(t.prompt_ids) + t.action_mask for t in trajs]
    width = max(map(len, seqs))
    ids = torch.tensor([s + [tok.pad_token_id] * (width - len(s)) for s in seqs])
    attn = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in seqs])
    target = torch.tensor([m + [0] * (width - len(m)) for m in masks])[:, 1:].bool()
    labels = ids[:, 1:]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(path)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    # one thread: ~63 small steps take 3 s on a loaded 2-core machine, and 75-90 s with two threads contending
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for _ in range(400):
            logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1][target]
            right = logits.gather(-1, labels[target][:, None])[:, 0]
            margin = right - logits.scatter(-1, labels[target][:, None], float("-inf")).max(-1).values
            if margin.min() > 3.0:  # every action token is the argmax by a wide margin: greedy decoding repeats it
                break
            loss = torch.nn.functional.cross_entropy(logits, labels[target])
            opt.zero_grad()
            loss.backward()
            opt.step()
    finally:
        torch.set_num_threads(threads)
    assert margin.min() > 3.0, f"the tiny model did not memorise the trajectories (margin {margin.min():.2f})"
    model.save_pretrained(path)
    return root, path, data, [t.action_mask.count(1) for t in trajs]


@pytest.mark.slow  # the default suite stays under 12 minutes (moved in issue 16)
def test_train_rl_runs_the_calculator_tool_with_the_transformers_engine(memorised):
    root, path, data, action_lengths = memorised
    cfg = yaml.safe_load((EXAMPLE / "config.yaml").read_text())
    cfg["model"]["pretrain"] = str(path)
    cfg["data"] |= {"prompt_data": [str(data)], "input_key": "input", "label_key": "label"}
    cfg["agent"]["agent_func_path"] = str(ENV_FILE)
    cfg["rollout"] |= {"n_samples_per_prompt": 2, "rollout_batch_size": 2, "temperature": 0.0}
    cfg["train"] |= {"train_batch_size": 4, "micro_train_batch_size": 2, "max_steps": 2,
                     "num_episodes": 2}  # the two prompts twice: a step after an update
    cfg["log"] |= {"progress_bar": "off"}
    metrics = run_rl(cfg, root, "run", timeout=300)
    assert [m["step"] for m in metrics] == [1, 2]
    for m in metrics:  # 37*12: call, result, right answer (2 turns, reward 1); 7*9: a wrong guess (1 turn, 0)
        assert m["reward/mean"] == pytest.approx(0.5)
        assert m["agent/tool_calls"] == pytest.approx(0.5)
        assert m["agent/correct"] == pytest.approx(0.5)
        assert m["rollout/turns"] == pytest.approx(1.5)
        assert m["rollout/truncated"] == 0.0 and m["rollout/env_failures"] == 0.0
        # action tokens only: the feedback and template tokens between the turns are not counted
        assert m["response_length/mean"] == pytest.approx(sum(action_lengths) / 2)


# ---- the example's config ----------------------------------------------------------------------------------

def test_example_config_parses_and_names_the_environment(monkeypatch):
    from hpc_rlhf.agents import load_agent
    from hpc_rlhf.config import load_config
    from hpc_rlhf.config.rl import RLConfig
    monkeypatch.chdir(ROOT)  # its paths are relative to the repository root
    cfg = load_config(RLConfig, EXAMPLE / "config.yaml")
    assert Path(cfg.agent.agent_func_path).resolve() == ENV_FILE
    assert (cfg.agent.feedback_template, cfg.data.label_key, cfg.data.apply_chat_template) == ("user_turn", "answer",
                                                                                              True)
    assert load_agent(cfg.agent.agent_func_path)[1] == "openrlhf"


@pytest.mark.real
def test_example_config_inputs_pass_preflight_with_the_real_assets(monkeypatch, real_model, asdiv):
    from hpc_rlhf.commands import check_inputs
    from hpc_rlhf.config import ConfigError, load_config
    from hpc_rlhf.config.rl import RLConfig
    monkeypatch.chdir(ROOT)
    real = [f"model.pretrain={real_model}", f"data.prompt_data={asdiv / 'train.jsonl'}"]
    check_inputs(load_config(RLConfig, EXAMPLE / "config.yaml", real))  # the model, the data and the environment
    # each input is checked: a missing one is named
    for key, bad in (("model.pretrain", "/nonexistent/model"), ("data.prompt_data", "/nonexistent/train.jsonl"),
                     ("agent.agent_func_path", "/nonexistent/env.py")):
        cfg = load_config(RLConfig, EXAMPLE / "config.yaml", [*real, f"{key}={bad}"])
        with pytest.raises(ConfigError, match=rf"^{key}"):
            check_inputs(cfg)
