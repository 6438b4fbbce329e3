import pytest
import yaml

from hpc_rlhf.commands import option_reference
from hpc_rlhf.config import ConfigError, SFTConfig, load_config
from hpc_rlhf.config import reference

BASE = ["pretrain=m", "dataset=a.jsonl"]


def test_yaml_then_overrides(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text(yaml.safe_dump({"model": {"pretrain": "m"}, "data": {"dataset": ["a.jsonl", "b.jsonl"],
                                 "dataset_probs": [0.3, 0.7]}, "train": {"learning_rate": 1e-4}}))
    cfg = load_config(SFTConfig, f, ["--learning_rate", "2e-5", "zero_stage=3", "--packing_samples",
                                     "data.max_len=64"])
    assert cfg.train.learning_rate == 2e-5
    assert cfg.train.zero_stage == 3
    assert cfg.data.packing_samples is True
    assert cfg.data.max_len == 64
    assert cfg.data.dataset == ["a.jsonl", "b.jsonl"] and cfg.data.dataset_probs == [0.3, 0.7]


@pytest.mark.parametrize("value,expected", [
    ("a.jsonl,b.jsonl", ["a.jsonl", "b.jsonl"]),
    ("[a.jsonl, b.jsonl]", ["a.jsonl", "b.jsonl"]),  # the YAML flow form, as in a config file
    ("['a.jsonl','b.jsonl']", ["a.jsonl", "b.jsonl"]),
    ("[a.jsonl]", ["a.jsonl"]),
])
def test_list_overrides_comma_or_bracketed(value, expected):
    cfg = load_config(SFTConfig, None, ["pretrain=m", f"dataset={value}", "dataset_probs=[1.0]" if len(expected) == 1
                                        else "dataset_probs=[0.25, 0.75]"])
    assert cfg.data.dataset == expected and sum(cfg.data.dataset_probs) == 1.0


def test_flat_yaml_keys_resolve_to_sections(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("pretrain: m\ndataset: a.jsonl\nmicro_train_batch_size: 2\n")
    cfg = load_config(SFTConfig, f)
    assert cfg.train.micro_train_batch_size == 2 and cfg.data.dataset == ["a.jsonl"]


@pytest.mark.parametrize("override,needle", [
    ("learnin_rate=1", "unknown option 'learnin_rate'"),
    ("zero_stage=5", "train.zero_stage: '5' is not allowed; choose one of 0, 1, 2, 3"),
    ("max_len=abc", "data.max_len: 'abc' is not an integer"),
    ("packing_samples=maybe", "is not a boolean"),
    ("dataset_probs=0.5", "dataset_probs has 1 values for 1 datasets") ,
    ("load_in_4bit=true", "set lora_rank > 0"),
    ("input_template=no-placeholder", "exactly one {}"),
    ("bad_rows=ignore", "choose one of 'skip', 'error'"),
])
def test_bad_values_name_key_and_allowed(override, needle):
    if needle.startswith("dataset_probs"):
        load_config(SFTConfig, None, BASE + [override])  # one prob for one dataset is fine
        with pytest.raises(ConfigError, match="dataset_probs has 1 values for 2 datasets"):
            load_config(SFTConfig, None, ["pretrain=m", "dataset=a,b", override])
        return
    with pytest.raises(ConfigError) as e:
        load_config(SFTConfig, None, BASE + [override])
    assert needle in str(e.value)


def test_unknown_key_in_yaml_names_file(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("model: {pretrain: m, lora_rnk: 4}\ndata: {dataset: a}\n")
    with pytest.raises(ConfigError, match=r"c.yaml: unknown option 'model.lora_rnk'.*lora_rank"):
        load_config(SFTConfig, f)


def test_required_and_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="model.pretrain is required"):
        load_config(SFTConfig, None, ["dataset=a"])
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(SFTConfig, tmp_path / "nope.yaml")


def test_option_reference_is_fresh():
    assert reference.DOC_PATH.read_text() == option_reference(), \
        "docs/options.md is stale: run `hpc-rlhf options --write`"


def test_reference_lists_every_openrlhf_name():
    text = option_reference()
    for name in ["pretrain", "dataset", "dataset_probs", "eval_dataset", "input_key", "output_key",
                 "input_template", "apply_chat_template", "max_len", "max_samples", "train_batch_size",
                 "micro_train_batch_size", "learning_rate", "lr_warmup_ratio", "max_epochs", "zero_stage",
                 "adam_offload", "gradient_checkpointing", "packing_samples", "lora_rank", "lora_alpha",
                 "target_modules", "load_in_4bit", "save_path", "save_steps", "ckpt_path", "load_checkpoint",
                 "logging_steps", "eval_steps", "seed", "param_dtype"]:
        assert f".{name}`" in text, name


def test_example_configs_parse():
    from pathlib import Path

    from hpc_rlhf.config.rl import RLConfig
    from hpc_rlhf.trainers.placement import plan_from_config
    examples = Path(__file__).parents[1] / "examples"
    for f in sorted(examples.glob("sft*.yaml")):
        load_config(SFTConfig, f)
    worlds = {f.stem: plan_from_config(load_config(RLConfig, f)).world_size for f in sorted(examples.glob("*.yaml"))
              if not f.stem.startswith("sft")}
    assert worlds == {"grpo": 1, "ppo": 5}


RL_BASE = ["pretrain=m", "prompt_data=p.jsonl", "reward_func=r.py"]
# every option that names a registered unit, with the registry it is checked against
REGISTERED = {"algo.advantage_estimator": "ADVANTAGE_ESTIMATORS", "algo.policy_loss": "POLICY_LOSSES",
              "algo.kl_estimator": "KL_ESTIMATORS", "algo.loss_agg_mode": "LOSS_AGGREGATIONS",
              "algo.is_correction": "IS_CORRECTIONS"}


@pytest.mark.parametrize("key", sorted(REGISTERED))
def test_registered_unit_names_are_checked_at_parse_time(key):
    # a misspelt unit stops the run at parse time (algo.loss_agg_mode=nonsense used to pass the parser
    # and fail with a KeyError at the first backward), and the message lists the registry's names
    import hpc_rlhf.algorithms as algorithms
    from hpc_rlhf.config.rl import RLConfig
    names = getattr(algorithms, REGISTERED[key]).names()
    with pytest.raises(ConfigError) as e:
        load_config(RLConfig, None, RL_BASE + [f"{key}=nonsense"])
    assert f"{key}: 'nonsense' is not allowed; choose one of" in str(e.value)
    assert all(repr(n) in str(e.value) for n in names), str(e.value)
    for name in names:  # every registered name is accepted
        assert getattr(load_config(RLConfig, None, RL_BASE + [f"{key}={name}"]).algo, key[5:]) == name


def test_registered_unit_fields_read_their_registry():
    # a unit registered after the config classes were defined is accepted: the names are not copied
    from hpc_rlhf.algorithms import KL_ESTIMATORS
    from hpc_rlhf.config.rl import RLConfig
    with pytest.raises(ConfigError):
        load_config(RLConfig, None, RL_BASE + ["kl_estimator=k9"])
    KL_ESTIMATORS.register("k9")(lambda *a: None)
    try:
        assert load_config(RLConfig, None, RL_BASE + ["kl_estimator=k9"]).algo.kl_estimator == "k9"
    finally:
        KL_ESTIMATORS._items.pop("k9")
    cfg = load_config(RLConfig, None, RL_BASE + ["is_correction=none", "loss_agg_mode=null"])
    assert cfg.algo.loss_agg_mode is None


def test_every_objective_section_names_a_registered_unit():
    # no option names a preference objective: the command's config class does, through its objective section
    from typing import get_type_hints

    from hpc_rlhf.commands import COMMANDS, resolve
    from hpc_rlhf.trainers.objectives import OFFLINE_OBJECTIVES
    units = {name: hints["objective"].unit for name, command in COMMANDS.items()
             for hints in [get_type_hints(resolve(command.config))] if "objective" in hints}
    assert len(units) == 7 and all(unit in OFFLINE_OBJECTIVES for unit in units.values()), units


def test_advantage_whitening_and_eps_options():
    from hpc_rlhf.config.rl import RLConfig
    cfg = load_config(RLConfig, None, RL_BASE + ["advantage_estimator=gae", "whiten_advantages=false",
                                                 "advantage_eps=1e-5"])
    assert cfg.algo.whiten_advantages is False and cfg.algo.advantage_eps == 1e-5
    assert load_config(RLConfig, None, RL_BASE).algo.whiten_advantages is None  # the estimator's default
    with pytest.raises(ConfigError, match="algo.whiten_advantages does not apply to advantage_estimator "
                                          "'group_norm'"):
        load_config(RLConfig, None, RL_BASE + ["whiten_advantages=true"])
    with pytest.raises(ConfigError, match="algo.advantage_eps: 0 is out of range; it must be > 0"):
        load_config(RLConfig, None, RL_BASE + ["advantage_eps=0"])
