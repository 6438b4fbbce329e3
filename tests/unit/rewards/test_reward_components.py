"""Reward components (a dict of named numbers per sample instead of one number, for advantage_estimator=gdpo):
parse_output, the batching and retries of RewardFunction, the reward server and client, combine, the reward role,
the collector, the samples' table, and the options the config refuses with gdpo."""
import logging
from types import SimpleNamespace

import pytest
import torch

from hpc_rlhf.config import ConfigError, load_config
from hpc_rlhf.config.rl import RLConfig
from hpc_rlhf.rewards.client import RemoteReward, _TryError
from hpc_rlhf.rewards.errors import RewardError
from hpc_rlhf.rewards.function import RewardFunction
from hpc_rlhf.rewards.reward_file import parse_output
from hpc_rlhf.rewards.server import start_server
from hpc_rlhf.rewards.shaping import combine
from hpc_rlhf.rewards.types import RewardBatch
from hpc_rlhf.roles.experience import Experience, reward_component_table
from hpc_rlhf.roles.reward import RewardRole
from hpc_rlhf.trainers.rl_collect import Collector

# label "1": correct; "word": format 0; "x": a non-number component; "renamed": other names
REWARD_FILE = '''
def reward_func(queries, prompts, labels):
    out = []
    for label in labels:
        if label == "x":
            out.append({"correct": 1.0, "format": "yes"})
        elif label == "renamed":
            out.append({"correct": 1.0, "style": 1.0})
        else:
            out.append({"format": 0.0 if label == "word" else 0.5, "correct": float(label == "1")})
    return out
'''


@pytest.fixture
def reward_file(tmp_path):
    p = tmp_path / "parts.py"
    p.write_text(REWARD_FILE)
    return p


def _inputs(labels):
    return [f"q{i}" for i in range(len(labels))], ["p"] * len(labels), list(labels)


# -- parse_output -------------------------------------------------------------------------------------------------
def test_parse_output_reads_a_dict_per_sample():
    r, s, logs, preds, (names, table) = parse_output([{"format": 0.5, "correct": 1}, {"correct": 0, "format": 1}], 2)
    assert names == ("correct", "format") and table.tolist() == [[1.0, 0.5], [0.0, 1.0]]
    assert r.tolist() == [1.5, 1.0] and s is None and logs == {} and preds is None  # the reward: their sum
    r, _, logs, _, (names, table) = parse_output({"rewards": [{"a": 2}, None], "extra_logs": {"b": [1, 2]}}, 2)
    assert names == ("a",) and r[0] == 2 and r[1].isnan() and logs["b"].tolist() == [1.0, 2.0]  # None: no reward
    assert parse_output([1.0, 2.0], 2)[4] is None  # plain numbers: no components


@pytest.mark.parametrize("out, error", [
    ([{"a": 1}, {"b": 1}], r"^f\.py: reward_func returned reward components \['b'\] for sample 6 but \['a'\] for "
                           r"sample 5: every sample needs the same names$"),
    ([{"a": 1}, 2.0], r"^f\.py: reward_func returned 2\.0 for sample 6 where other samples have a dict of named reward "
                      r"components$"),
    ([{"mean": 1}, {"mean": 0}], r"^f\.py: reward_func returned reward components \['mean'\] for sample 5: names must "
                                 r"be non-empty strings without '/', not mean, invalid, invalid_groups, "
                                 r"groups_few_valid$"),
    ({"rewards": [{"a": 1}, {"a": 0}], "extra_logs": {"a": 1.0}},
     r"^f\.py: reward_func returned 'a' both as a reward component and in extra_logs: both are logged as reward/a$"),
])
def test_parse_output_refuses_components_that_cannot_be_logged_or_summed(out, error):
    with pytest.raises(RewardError, match=error):
        parse_output(out, 2, "f.py: reward_func", 5)


def test_parse_output_a_non_number_component_fails_the_call():
    with pytest.raises(ValueError, match=r"^a list whose value 1 has component 'b' = 'no' \(str\); expected numbers$"):
        parse_output([{"b": 1}, {"b": "no"}], 2)
    with pytest.raises(ValueError, match=r"^a dict whose 'rewards' is a list of length 1 for 2 samples; expected one "
                                         r"dict of reward components per sample$"):
        parse_output({"rewards": [{"b": 1}]}, 2)


# -- RewardFunction -----------------------------------------------------------------------------------------------
def test_function_keeps_components_at_their_samples_through_batches_and_retries(reward_file, caplog):
    rf = RewardFunction(reward_file, batch_size=3, timeout_s=None, max_failure_fraction=1.0)
    with caplog.at_level(logging.ERROR, logger="hpc_rlhf.rewards"):
        out = rf.score(*_inputs(["1", "word", "x", "0", "1"]))
    # the batch [0, 3) fails on sample 2 ("yes" is no number): its halves are retried, sample 2 alone is invalid
    assert out.valid.tolist() == [True, True, False, True, True]
    assert out.component_names == ("correct", "format")
    assert out.components[[0, 1, 3, 4]].tolist() == [[1.0, 0.5], [0.0, 0.0], [0.0, 0.5], [1.0, 0.5]]
    assert out.components[2].isnan().all() and out.rewards[[0, 1, 3, 4]].tolist() == [1.5, 0.0, 0.5, 1.5]
    failed = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert failed == [f"{reward_file}: reward_func on sample 2 returned a list whose value 0 has component 'format' "
                      f"= 'yes' (str); expected numbers"]


def test_function_refuses_components_named_differently(reward_file):
    rf = RewardFunction(reward_file, batch_size=2, timeout_s=None)
    # in one call: samples 2 and 3; across calls: sample 2 (second call) against sample 0 (first call)
    with pytest.raises(RewardError, match=rf"^{reward_file}: reward_func returned reward components \['correct', "
                                          rf"'style'\] for sample 3 but \['correct', 'format'\] for sample 2: every "
                                          rf"sample needs the same names$"):
        rf.score(*_inputs(["1", "0", "0", "renamed"]))
    with pytest.raises(RewardError, match=rf"^{reward_file}: reward_func returned reward components \['correct', "
                                          rf"'style'\] for sample 2 but \['correct', 'format'\] for sample 0"):
        rf.score(*_inputs(["1", "0", "renamed", "renamed"]))


# -- server and client --------------------------------------------------------------------------------------------
def test_server_and_client_carry_the_components(reward_file):
    with start_server(reward_file, port=0, batch_size=2) as server:
        client = RemoteReward([server.url], batch_size=2, max_failure_fraction=1.0)
        out = client.score(*_inputs(["1", "x", "word", "0", "1"]))
    assert out.valid.tolist() == [True, False, True, True, True] and out.component_names == ("correct", "format")
    assert out.components[[0, 2, 3, 4]].tolist() == [[1.0, 0.5], [0.0, 0.0], [0.0, 0.5], [1.0, 0.5]]
    assert out.rewards[[0, 2, 3, 4]].tolist() == [1.5, 0.0, 0.5, 1.5] and out.components[1].isnan().all()


def test_client_refuses_answers_with_other_names_or_non_numbers():
    ans = {"rewards": [{"a": 1.0}, {"b": 0.0}], "valid": [True, True]}
    with pytest.raises(RewardError, match=r"^reward server http://h:1 returned reward components \['b'\] for sample "
                                          r"9 but \['a'\] for sample 8: every sample needs the same names$"):
        RemoteReward._check_answer(ans, 2, "reward server http://h:1", 8)
    with pytest.raises(_TryError, match=r"^answer's rewards are a list whose value 0 has component 'a' = None"):
        RemoteReward._check_answer({"rewards": [{"a": None}, {"a": 0.0}], "valid": [True, True]}, 2)
    # an invalid sample's entry is not read
    rewards, valid, *_, (names, table) = RemoteReward._check_answer(
        {"rewards": [{"a": 1.0, "b": 2.0}, {"zzz": "?"}], "valid": [True, False]}, 2)
    assert rewards[0] == 3.0 and valid == [True, False] and names == ("a", "b") and table[1].isnan().all()


# -- combine and the reward role ----------------------------------------------------------------------------------
def test_combine_names_each_part_of_the_reward():
    parts = RewardBatch([1.5, 0.0, 1.0], [True, True, False], components=[[1.0, 0.5], [0.0, 0.0], [1.0, 0.0]],
                        component_names=("correct", "format"))
    model = RewardBatch([0.25, -1.0, 2.0], [True, True, True])
    out = combine([model, parts], [1.0, 2.0], ["model", "func"])
    # the reward: 1 * model + 2 * (correct + format); the components unweighted, NaN where a sample is invalid
    assert out.rewards[:2].tolist() == [3.25, -1.0] and out.valid.tolist() == [True, True, False]
    assert out.component_names == ("model", "correct", "format")
    assert out.components[:2].tolist() == [[0.25, 1.0, 0.5], [-1.0, 0.0, 0.0]] and out.components[2].isnan().all()
    # several plain sources: one component each; one plain source: none (the default path)
    assert combine([model, model], [1.0, 1.0], ["model", "remote"]).component_names == ("model", "remote")
    assert combine([model], [1.0], ["model"]).components is None
    assert combine([model, model], [1.0, 1.0]).components is None  # unnamed sources (no role): none
    with pytest.raises(RewardError, match=r"^reward component 'model' comes from two reward sources \(model, func\): "
                                          r"rename it$"):
        combine([model, RewardBatch([1.0] * 3, [True] * 3, components=[[1.0]] * 3, component_names=("model",))],
                [1.0, 1.0], ["model", "func"])


def _sample(i, label):
    return Experience(prompt_index=i, sample_index=0, prompt_ids=[1], response_ids=[2, 3], engine_logprobs=[0.0, 0.0],
                      finish_reason="stop", prompt_text=f"Problem {i}?", response_text="r", label=label)


def _role(reward_file):
    cfg = load_config(RLConfig, None, ["pretrain=m", "prompt_data=p.jsonl", f"reward_func={reward_file}",
                                       "advantage_estimator=gdpo"])
    return RewardRole(cfg.reward, cfg.agent, cfg.model.param_dtype, cfg.rollout.generate_max_len, "cpu")


def test_reward_role_and_collector_put_the_components_on_the_samples(reward_file):
    role = _role(reward_file)
    samples = [_sample(0, "1"), _sample(1, "word"), _sample(2, "x")]
    rewards, valid, _, _, components = role.score(samples)
    assert rewards[:2] == [1.5, 0.0] and valid == [True, True, False]
    assert components == [{"correct": 1.0, "format": 0.5}, {"correct": 0.0, "format": 0.0}, None]
    gather = lambda x: [x]  # noqa: E731 - one rank
    ctx = SimpleNamespace(plan=SimpleNamespace(ranks_of=lambda name: [0]), role_rank=lambda name: 0,
                          trainers=SimpleNamespace(all_gather_object=gather),
                          control=SimpleNamespace(all_gather_object=gather))
    collector = object.__new__(Collector)
    collector.r, collector.ctx, collector.reward = SimpleNamespace(dynamic_filtering=False), ctx, role
    collector._score(samples)
    assert [s.reward_components for s in samples] == components
    names, table = reward_component_table(samples)
    assert names == ("correct", "format") and table.tolist() == [[1.0, 0.5], [0.0, 0.0], [0.0, 0.0]]


def test_the_samples_table_refuses_components_that_differ_between_samples():
    a, b, c = _sample(0, "1"), _sample(1, "1"), _sample(2, "1")
    a.reward_components, b.reward_components, c.reward_valid = {"x": 1.0}, {"y": 2.0}, False
    with pytest.raises(RewardError, match=r"^the reward sources returned reward components \['y'\] for sample \(1, 0\) "
                                          r"but \['x'\] for sample \(0, 0\): every sample needs the same names$"):
        reward_component_table([a, b, c])
    b.reward_components = None
    with pytest.raises(RewardError, match=r"returned reward components a plain number for sample \(1, 0\)"):
        reward_component_table([a, b])
    assert reward_component_table([b, c]) is None
    assert torch.equal(reward_component_table([a, c])[1], torch.tensor([[1.0], [0.0]]))


# -- the config ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("option", ["normalize_reward=true", "reward_clip_range=[-1,1]", "overlong_buffer_len=2",
                                    "truncated_reward=0.0", "reward_weights=[1.0]"])
def test_gdpo_refuses_what_would_change_only_the_scalar_reward(option):
    base = ["pretrain=m", "prompt_data=p.jsonl", "reward_func=r.py", "advantage_estimator=gdpo"]
    name = f"reward.{option.split('=')[0]}"
    with pytest.raises(ConfigError, match=rf"^{name} is set but algo.advantage_estimator gdpo normalises each reward "
                                          rf"component with the same weight, not the shaped reward: return a penalty "
                                          rf"as a component of the reward function \(docs/rl.md#reward-components\)$"):
        load_config(RLConfig, None, [*base, option])
    load_config(RLConfig, None, [*base[:3], "advantage_estimator=maxrl", option])  # maxrl takes the shaped reward
    with pytest.raises(ConfigError, match=r"^algo.kl.use_kl_loss is false but algo.advantage_estimator gdpo "):
        load_config(RLConfig, None, [*base, "init_kl_coef=0.01", "use_kl_loss=false"])
    assert load_config(RLConfig, None, [*base, "init_kl_coef=0.01"]).algo.advantage_estimator == "gdpo"
