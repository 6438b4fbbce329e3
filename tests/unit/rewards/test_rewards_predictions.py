"""A reward function's `predictions` (the answers it extracted, for maj@k): RewardBatch, parse_output, the
batching and retries of RewardFunction, the reward server and client, combine, the reward role and the
collector, and `reward_func=builtin:math` in the config."""
from types import SimpleNamespace

import pytest

from hpc_rlhf.commands import check_inputs
from hpc_rlhf.config import ConfigError, load_config
from hpc_rlhf.config.rl import RLConfig
from hpc_rlhf.rewards.client import RemoteReward
from hpc_rlhf.rewards.function import RewardFunction
from hpc_rlhf.rewards.server import start_server
from hpc_rlhf.rewards.shaping import combine
from hpc_rlhf.rewards.types import RewardBatch
from hpc_rlhf.rewards.client import _TryError
from hpc_rlhf.rewards.reward_file import parse_output
from hpc_rlhf.roles.experience import Experience
from hpc_rlhf.roles.reward import RewardRole
from hpc_rlhf.trainers.rl_collect import Collector

REWARD_FILE = '''
CALLS = []

def reward_func(queries, prompts, labels):
    CALLS.append(list(labels))
    if "raise" in labels:
        raise RuntimeError("cannot score label raise")
    preds = ["pred-" + l if l != "none" else None for l in labels]
    if "short" in labels:
        preds = preds[:-1]
    if "plain" in labels:
        return [1.0] * len(queries)
    return {"rewards": [float(len(q)) for q in queries], "predictions": preds}
'''


@pytest.fixture
def reward_file(tmp_path):
    p = tmp_path / "pred_reward.py"
    p.write_text(REWARD_FILE)
    return p


def _inputs(labels):
    return [f"q{i}" for i in range(len(labels))], ["p"] * len(labels), list(labels)


# -- RewardBatch and parse_output ------------------------------------------------------------------------

def test_reward_batch_checks_predictions():
    assert RewardBatch([1.0, 2.0], [True, True]).predictions is None
    assert RewardBatch([1.0, 2.0], [True, True], predictions=("9", None)).predictions == ["9", None]
    with pytest.raises(ValueError, match="predictions has 1 entries, rewards 2"):
        RewardBatch([1.0, 2.0], [True, True], predictions=["9"])
    with pytest.raises(ValueError, match=r"predictions\[1\] is a int; expected a string or None"):
        RewardBatch([1.0, 2.0], [True, True], predictions=["9", 9])


def test_parse_output_predictions():
    r, s, logs, preds, _ = parse_output({"rewards": [1, 0, 1], "predictions": ["9", None, "3:4"]}, 3)
    assert r.tolist() == [1.0, 0.0, 1.0] and s is None and logs == {} and preds == ["9", None, "3:4"]
    assert parse_output({"rewards": [1, 0]}, 2)[3] is None
    assert parse_output({"rewards": [1, 0], "predictions": None}, 2)[3] is None
    assert parse_output([1.0, 0.0], 2)[3] is None
    with pytest.raises(ValueError, match=r"^a dict whose 'predictions' is a list of length 2 for 3 samples; "
                                         r"expected one string or None per sample$"):
        parse_output({"rewards": [1, 0, 1], "predictions": ["9", None]}, 3)
    with pytest.raises(ValueError, match=r"^a dict whose 'predictions' value 1 is 9 \(int\); expected a string "
                                         r"or None$"):
        parse_output({"rewards": [1, 0], "predictions": ["9", 9]}, 2)
    with pytest.raises(ValueError, match=r"^a dict whose 'predictions' is a str; expected a list of 2 strings"):
        parse_output({"rewards": [1, 0], "predictions": "99"}, 2)


# -- RewardFunction: batches and retries keep predictions at their samples ------------------------------

def test_function_keeps_predictions_aligned_through_batches_and_retries(reward_file):
    rf = RewardFunction(reward_file, batch_size=4, timeout_s=None, max_failure_fraction=1.0)
    labels = ["a", "b", "raise", "none", "c", "short", "d", "e", "f"]
    out = rf.score(*_inputs(labels))
    # "raise" and "short" fail on their own (the latter returns one prediction too few); the rest keep theirs
    assert out.valid.tolist() == [True, True, False, True, True, False, True, True, True]
    assert out.predictions == ["pred-a", "pred-b", None, None, "pred-c", None, "pred-d", "pred-e", "pred-f"]
    assert out.extra["reward/func/failures"] == 2.0
    calls = rf.fn.__globals__["CALLS"]
    assert calls[0] == ["a", "b", "raise", "none"] and ["raise"] in calls and ["short"] in calls


def test_function_without_predictions_gives_none(reward_file):
    out = RewardFunction(reward_file, batch_size=8, timeout_s=5.0).score(*_inputs(["plain", "x"]))
    assert out.predictions is None and out.rewards.tolist() == [1.0, 1.0]


# -- server and client -----------------------------------------------------------------------------------

def test_server_round_trip_keeps_predictions(reward_file):
    with start_server(reward_file, port=0, batch_size=2) as server, \
            start_server("builtin:math", port=0) as math_server:
        client = RemoteReward([server.url], batch_size=3, max_failure_fraction=1.0)
        labels = ["a", "raise", "none", "b", "c", "d", "e"]
        out = client.score(*_inputs(labels))
        assert out.valid.tolist() == [True, False, True, True, True, True, True]
        assert out.predictions == ["pred-a", None, None, "pred-b", "pred-c", "pred-d", "pred-e"]
        assert client.score(*_inputs(["plain", "x"])).predictions is None
        out = RemoteReward([math_server.url]).score(["Q: #### 9", "Q: 7 apples", "Q: none"], ["Q: "] * 3,
                                                    ["9 apples", "9", "1"])
        assert out.rewards.tolist() == [1.0, 0.0, 0.0] and out.predictions == ["9", "7", None]
        assert out.extra["reward/answer_found"] == pytest.approx(2 / 3)


@pytest.mark.parametrize("predictions", [["9"], "9", [9, None], [["9"], None]])
def test_client_refuses_malformed_predictions(predictions):
    with pytest.raises(_TryError, match="answer's predictions are not a list of 2 strings or nulls"):
        RemoteReward._check_answer({"rewards": [1.0, 0.0], "valid": [True, True], "predictions": predictions}, 2)
    # null entries, and entries of invalid samples dropped
    ok = RemoteReward._check_answer({"rewards": [1.0, None], "valid": [True, False], "predictions": ["9", "8"]}, 2)
    assert ok[4] == ["9", None]


# -- combine, the reward role, the collector -------------------------------------------------------------

def test_combine_takes_each_samples_first_prediction():
    a = RewardBatch([1.0, 1.0, 1.0], [True] * 3)  # a reward model: none
    b = RewardBatch([0.0, 1.0, 0.0], [True] * 3, predictions=[None, "4", None])
    c = RewardBatch([0.0, 0.0, 1.0], [True] * 3, predictions=["x", "y", None])
    assert combine([a, b, c], [1, 1, 1]).predictions == ["x", "4", None]
    assert combine([a, a], [1, 1]).predictions is None


def _sample(i, response, label):
    return Experience(prompt_index=i, sample_index=0, prompt_ids=[1], response_ids=[2, 3], engine_logprobs=[0.0, 0.0],
                      finish_reason="stop", prompt_text=f"Problem {i}?", response_text=response, label=label)


def _role(extra=()):
    cfg = load_config(RLConfig, None, ["pretrain=m", "prompt_data=p.jsonl", "reward_func=builtin:math", *extra])
    return RewardRole(cfg.reward, cfg.agent, cfg.model.param_dtype, cfg.rollout.generate_max_len, "cpu")


def test_reward_role_returns_predictions():
    samples = [_sample(0, "The answer is 12.", "12 eggs"), _sample(1, "no idea", "3"), _sample(2, "#### 4:5", "4:5")]
    rewards, valid, extra, predictions, _ = _role().score(samples)
    assert rewards == [1.0, 0.0, 1.0] and valid == [True] * 3 and predictions == ["12", None, "4:5"]
    assert extra["reward/accuracy"] == pytest.approx(2 / 3)
    assert _role().score([]) == ([], [], {}, [], [])


def test_collector_sets_each_samples_prediction():
    role = _role()
    gather = lambda x: [x]  # noqa: E731 - one rank
    ctx = SimpleNamespace(plan=SimpleNamespace(ranks_of=lambda name: [0]), role_rank=lambda name: 0,
                          trainers=SimpleNamespace(all_gather_object=gather),
                          control=SimpleNamespace(all_gather_object=gather))
    collector = object.__new__(Collector)
    collector.r, collector.ctx, collector.reward = SimpleNamespace(dynamic_filtering=False), ctx, role
    samples = [_sample(1, "#### 7", "7"), _sample(0, "6", "5 cups"), _sample(2, "", "1")]
    collector._score(samples)
    assert [(s.reward, s.reward_valid, s.prediction) for s in samples] == [(1.0, True, "7"), (0.0, True, "6"),
                                                                           (0.0, True, None)]


def test_config_accepts_builtin_math_and_names_unknown_builtins(tmp_path):
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "tokenizer.json").write_text("{}")  # the check looks for the tokenizer's files only
    (tmp_path / "p.jsonl").write_text('{"input": "1+1=", "label": "2"}\n')
    base = [f"pretrain={tmp_path / 'model'}", f"prompt_data={tmp_path / 'p.jsonl'}"]
    check_inputs(load_config(RLConfig, None, [*base, "reward_func=builtin:math"]))
    with pytest.raises(ConfigError, match=r"^reward\.reward_func: unknown built-in reward 'builtin:maths'; "
                                          r"built-ins: builtin:math$"):
        check_inputs(load_config(RLConfig, None, [*base, "reward_func=builtin:maths"]))
    with pytest.raises(ConfigError, match=r"^reward\.reward_func: file .*nope\.py does not exist$"):
        check_inputs(load_config(RLConfig, None, [*base, f"reward_func={tmp_path / 'nope.py'}"]))


def test_experience_prediction_defaults_to_none():
    assert _sample(0, "x", "1").prediction is None
