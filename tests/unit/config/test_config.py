import dataclasses

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
    examples = Path(__file__).parents[3] / "examples"
    for f in sorted(examples.glob("sft*.yaml")):
        load_config(SFTConfig, f)
    worlds = {f.stem: plan_from_config(load_config(RLConfig, f)).world_size for f in sorted(examples.glob("*.yaml"))
              if not f.stem.startswith("sft")}
    assert worlds == {"grpo": 1, "ppo": 5}


RL_BASE = ["pretrain=m", "prompt_data=p.jsonl", "reward_func=r.py"]
# every option that names a registered unit, with the registry it is checked against
REGISTERED = {"algo.advantage_estimator": "ADVANTAGE_ESTIMATORS", "algo.policy_loss": "POLICY_LOSSES",
              "algo.kl.kl_estimator": "KL_ESTIMATORS", "algo.loss_agg_mode": "LOSS_AGGREGATIONS",
              "algo.is_correction": "IS_CORRECTIONS", "algo.token_mask": "TOKEN_MASKS"}
UNIT_NEEDS = {"opd": ["teacher_pretrain=t"]}  # the options a unit's config check asks for


@pytest.mark.parametrize("key", sorted(REGISTERED))
def test_registered_unit_names_are_checked_at_parse_time(key):
    # a misspelt unit stops the run at parse time (algo.loss_agg_mode=nonsense used to pass the parser
    # and fail with a KeyError at the first backward), and the message lists the registry's names
    from hpc_rlhf.algorithms import registry
    from hpc_rlhf.config.rl import RLConfig
    names = getattr(registry, REGISTERED[key]).names()
    with pytest.raises(ConfigError) as e:
        load_config(RLConfig, None, RL_BASE + [f"{key}=nonsense"])
    assert f"{key}: 'nonsense' is not allowed; choose one of" in str(e.value)
    assert all(repr(n) in str(e.value) for n in names), str(e.value)
    for name in names:  # every registered name is accepted (with what it needs: opd a teacher)
        value = load_config(RLConfig, None, RL_BASE + [f"{key}={name}", *UNIT_NEEDS.get(name, [])])
        for attr in key.split("."):
            value = getattr(value, attr)
        assert value == name


def test_registered_unit_fields_read_their_registry():
    # a unit registered after the config classes were defined is accepted: the names are not copied
    from hpc_rlhf.algorithms.registry import KL_ESTIMATORS
    from hpc_rlhf.config.rl import RLConfig
    with pytest.raises(ConfigError):
        load_config(RLConfig, None, RL_BASE + ["kl_estimator=k9"])
    KL_ESTIMATORS.register("k9")(lambda *a: None)
    try:
        assert load_config(RLConfig, None, RL_BASE + ["kl_estimator=k9"]).algo.kl.kl_estimator == "k9"
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
    assert cfg.algo.advantage.whiten_advantages is False and cfg.algo.advantage.advantage_eps == 1e-5
    assert load_config(RLConfig, None, RL_BASE).algo.advantage.whiten_advantages is None  # the estimator's default
    with pytest.raises(ConfigError, match="^algo.advantage.whiten_advantages is set but algo.advantage_estimator is "
                                          "'group_norm': it applies to advantage_estimator gae, reinforce, "
                                          "reinforce_baseline, rloo$"):
        load_config(RLConfig, None, RL_BASE + ["whiten_advantages=true"])
    with pytest.raises(ConfigError, match="algo.advantage.advantage_eps is set but algo.advantage_estimator is "
                                          "'dr_grpo'"):
        load_config(RLConfig, None, RL_BASE + ["advantage_estimator=dr_grpo", "advantage_eps=1e-3"])
    with pytest.raises(ConfigError, match="algo.advantage.advantage_eps: 0 is out of range; it must be > 0"):
        load_config(RLConfig, None, RL_BASE + ["advantage_eps=0"])


# -- aliases, the old layout, unit options -----------------------------------------------------------------

OLD_LAYOUT = """
model: {pretrain: m}
data: {prompt_data: p.jsonl}
reward: {reward_func: r.py}
rollout: {engine: vllm, vllm_max_model_len: 64, vllm_gpu_memory_utilization: 0.3, vllm_cpu_kv_cache_gib: 2,
          vllm_tensor_parallel_size: 2, vllm_sleep: false, cuda_graphs: false, shared_prefix: false,
          few_row_kernel: false}
algo: {advantage_estimator: gae, policy_loss: ppo, gamma: 0.99, lambd: 0.9, whiten_advantages: false,
       advantage_eps: 1.0e-6, eps_clip: 0.1, eps_clip_high: 0.3, dual_clip: 3.0, value_clip: 0.4, init_kl_coef: 0.01,
       kl_estimator: k3, use_kl_loss: true, kl_target: 0.1, kl_horizon: 500, entropy_loss_coef: 0.01,
       is_correction: icepop, is_low: 0.25, is_high: 4.0}
"""
NEW_LAYOUT = """
model: {pretrain: m}
data: {prompt_data: p.jsonl}
reward: {reward_func: r.py}
rollout:
  engine: vllm
  vllm: {max_model_len: 64, gpu_memory_utilization: 0.3, cpu_kv_cache_gib: 2, tensor_parallel_size: 2, sleep: false}
  lean: {cuda_graphs: false, shared_prefix: false, few_row_kernel: false}
algo:
  advantage_estimator: gae
  policy_loss: ppo
  entropy_loss_coef: 0.01
  is_correction: icepop
  advantage: {gamma: 0.99, whiten_advantages: false, advantage_eps: 1.0e-6}
  gae: {lambd: 0.9}
  critic: {value_clip: 0.4}
  clip: {eps_clip: 0.1, eps_clip_high: 0.3, dual_clip: 3.0}
  kl: {init_kl_coef: 0.01, kl_estimator: k3, use_kl_loss: true, kl_target: 0.1, kl_horizon: 500}
  is_bounds: {is_low: 0.25, is_high: 4.0}
"""


@pytest.mark.parametrize("key", ["lean_decoder=false", "rollout.lean_decoder=true"])
def test_a_removed_option_names_what_replaced_it(key):
    from hpc_rlhf.config.rl import RLConfig
    want = (r"^unknown option '(rollout\.)?lean_decoder' for RLConfig\. rollout\.engine \(or model\.engine\) replaced "
            r"it: `hf` for false, `auto` or `lean` for true\.")
    with pytest.raises(ConfigError, match=want):
        load_config(RLConfig, None, ["pretrain=/x", "prompt_data=p.jsonl", "reward_func=r.py", key])


def test_the_old_layout_and_the_leaf_names_read_as_the_new_layout(tmp_path):
    from hpc_rlhf.config import to_dict
    from hpc_rlhf.config.rl import RLConfig
    (tmp_path / "old.yaml").write_text(OLD_LAYOUT)
    (tmp_path / "new.yaml").write_text(NEW_LAYOUT)
    new = to_dict(load_config(RLConfig, tmp_path / "new.yaml"))
    assert to_dict(load_config(RLConfig, tmp_path / "old.yaml")) == new
    assert new["rollout"]["vllm"]["max_model_len"] == 64 and new["algo"]["clip"]["dual_clip"] == 3.0
    old = yaml.safe_load(OLD_LAYOUT)
    leaves = [f"{k}={v}" for section in ("algo", "rollout") for k, v in old[section].items()]
    assert to_dict(load_config(RLConfig, None, RL_BASE + leaves)) == new
    from hpc_rlhf.config.pipelines import GenerateConfig
    gen = ["pretrain=m", "prompt_data=p.jsonl", "output_path=o.jsonl"]
    assert load_config(GenerateConfig, None, gen + ["model.vllm_max_model_len=32"]).model.vllm.max_model_len == 32


def test_a_key_is_a_section_and_a_name_unique_inside_it():
    from hpc_rlhf.config.rl import RLConfig
    for key in ("algo.clip.eps_clip", "algo.eps_clip", "eps_clip", "--eps_clip"):
        assert load_config(RLConfig, None, RL_BASE + [f"{key}=0.3"]).algo.clip.eps_clip == 0.3
    for key in ("rollout.vllm.gpu_memory_utilization", "rollout.vllm_gpu_memory_utilization",
                "rollout.gpu_memory_utilization", "vllm_gpu_memory_utilization", "gpu_memory_utilization"):
        assert load_config(RLConfig, None, RL_BASE + [f"{key}=0.7"]).rollout.vllm.gpu_memory_utilization == 0.7
    # an option of another engine is an unknown key, and the message suggests the close ones
    with pytest.raises(ConfigError, match=r"unknown option 'rollout.vllm.cuda_graphs'.*rollout.lean.cuda_graphs"):
        load_config(RLConfig, None, RL_BASE + ["rollout.vllm.cuda_graphs=false"])
    with pytest.raises(ConfigError, match=r"unknown option 'vllm_gpu_memory_utilisation'.*"
                                          r"Did you mean vllm_gpu_memory_utilization"):
        load_config(RLConfig, None, RL_BASE + ["vllm_gpu_memory_utilisation=0.7"])
    with pytest.raises(ConfigError, match=r"unknown option 'data.eps_clip'"):
        load_config(RLConfig, None, RL_BASE + ["data.eps_clip=0.3"])


def test_every_alias_reads_as_its_option_in_every_command():
    from hpc_rlhf.commands import COMMANDS, resolve
    from hpc_rlhf.config.base import leaf_paths, resolve_key
    seen = 0
    for command in COMMANDS.values():
        cls = resolve(command.config)
        for path, (_, f, _) in leaf_paths(cls).items():
            for alias in f.metadata.get("aliases", ()):
                section = path.split(".")[0]
                assert resolve_key(cls, alias) == resolve_key(cls, f"{section}.{alias}") == path, (cls, alias)
                seen += 1
    assert seen == 5 + 4 + 5 + 4 + 4  # train rl, generate, eval, iterative-dpo, kd (its rollout section)


@pytest.mark.parametrize("override,message", [
    ("lambd=0.9", "algo.gae.lambd is set but algo.advantage_estimator is 'group_norm': it applies to "
                  "advantage_estimator gae"),
    ("value_clip=0.3", "algo.critic.value_clip is set but algo.advantage_estimator is 'group_norm': it applies to "
                       "advantage_estimator gae"),
    ("gamma=0.99", "algo.advantage.gamma is set but algo.advantage_estimator is 'group_norm': it applies to "
                   "advantage_estimator gae, reinforce, reinforce_baseline, rloo"),
    ("is_low=0.1", "algo.is_bounds.is_low is set but algo.is_correction is 'none': it applies to is_correction "
                   "icepop, seq_mask_tis, tis"),
])
def test_an_option_of_a_unit_not_selected_is_an_error(override, message):
    from hpc_rlhf.config.rl import RLConfig
    with pytest.raises(ConfigError) as e:
        load_config(RLConfig, None, RL_BASE + [override])
    assert str(e.value) == message
    with pytest.raises(ConfigError, match=r"^algo.clip.dual_clip is set but algo.policy_loss is 'cispo': it applies "
                                          r"to policy_loss gspo, ppo$"):
        load_config(RLConfig, None, RL_BASE + ["policy_loss=cispo", "dual_clip=3"])
    # set to its default, an option is not set; the unit that reads it takes it
    load_config(RLConfig, None, RL_BASE + ["gamma=1.0", "lambd=0.95", "value_clip=0.5"])
    cfg = load_config(RLConfig, None, RL_BASE + ["advantage_estimator=gae", "lambd=0.9", "value_clip=0.3"])
    assert (cfg.algo.gae.lambd, cfg.algo.critic.value_clip) == (0.9, 0.3)


def test_declared_units_are_the_registered_ones_and_read_what_they_take():
    import inspect

    import torch

    import hpc_rlhf.algorithms.rl_algorithm  # noqa: F401  (imports every RL unit's module)
    from hpc_rlhf.algorithms import registry
    from hpc_rlhf.algorithms.advantages import CONFIG_FIELDS
    from hpc_rlhf.config.algo import AlgoConfig
    from hpc_rlhf.config.base import leaf_paths
    algo, options = AlgoConfig(), set(leaf_paths(AlgoConfig))
    read = set()
    for name in ("ADVANTAGE_ESTIMATORS", "POLICY_LOSSES", "IS_CORRECTIONS", "TOKEN_MASKS", "KL_ESTIMATORS",
                 "LOSS_AGGREGATIONS"):
        reg = getattr(registry, name)
        assert set(reg.declared) == set(reg._items), f"{name}: declared and registered units differ"
        for unit in reg.names():
            paths = reg.read_paths(unit, algo)
            assert set(paths) <= options, (unit, paths)
            read |= set(paths)
    # every option of a section is read by some unit (kl: by every algorithm)
    assert {p for p in options if "." in p and not p.startswith("kl.")} == read
    for unit in registry.POLICY_LOSSES.names():  # a policy loss takes what it reads as keyword arguments
        params = inspect.signature(registry.POLICY_LOSSES.get(unit)).parameters
        assert set(registry.POLICY_LOSSES.options(unit, algo)) <= {
            n for n, p in params.items() if p.kind is inspect.Parameter.KEYWORD_ONLY}, unit
    # an estimator reads whiten_advantages / advantage_eps when it has the field they set, value_clip when it needs a
    # critic, gamma and lambd when its advantages change with them
    rewards, token_rewards, mask = torch.tensor([1.0, 0.0, 2.0, 0.0]), torch.full((4, 3), -0.1), torch.ones(4, 3)
    values, groups = torch.rand(4, 3, generator=torch.Generator().manual_seed(0)), torch.tensor([0, 0, 1, 1])
    for unit in registry.ADVANTAGE_ESTIMATORS.names():
        cls, paths = registry.ADVANTAGE_ESTIMATORS.get(unit), registry.ADVANTAGE_ESTIMATORS.read_paths(unit, algo)
        fields = {f.name for f in dataclasses.fields(cls)}
        assert {o for o, f in CONFIG_FIELDS.items() if f in fields} == {p.split(".")[1] for p in paths} & set(
            CONFIG_FIELDS), unit
        assert cls.needs_critic == ("critic.value_clip" in paths), unit
        assert cls.needs_teacher == ("opd.teacher_kl_coef" in paths), unit  # a teacher when it reads the opd section
        teacher = {"logprobs": -values, "teacher_logprobs": -values.flip(0)} if cls.needs_teacher else {}
        for option, changed in (("advantage.gamma", {"gamma": 0.5}), ("gae.lambd", {"lambd": 0.5})):
            knobs = {"gamma": 1.0, "lambd": 1.0, **teacher}
            a, b = (cls().compute(rewards, token_rewards, mask, values=values, group_ids=groups, **k)[0]
                    for k in (knobs, knobs | changed))
            assert (not torch.equal(a, b)) == (option in paths), (unit, option)


HEAVY = ["torch", "transformers", "datasets", "deepspeed"]
# what a command's checks ask beyond its required options: a reward source, a teacher, two samples per prompt
CHECKED = {"train rl": ["reward_func=r.py"], "eval": ["reward_func=r.py"], "train kd": ["teacher_pretrain=t"],
           "iterative-dpo": ["n_samples_per_prompt=2"]}
PARSE = """
import importlib, json, sys
from hpc_rlhf.config import ConfigError, load_config
cases, heavy = json.loads(sys.argv[1]), json.loads(sys.argv[2])
for name, spec, required, errors in cases:
    module, cls = spec.split(":")
    config = getattr(importlib.import_module(module), cls)
    load_config(config, None, required)
    for args, needle in errors:
        try:
            load_config(config, *args)
        except ConfigError as e:
            assert needle in str(e), (name, args, str(e))
        else:
            raise AssertionError(f"{name}: {args} parsed")
    loaded = [m for m in heavy if m in sys.modules]
    assert not loaded, f"parsing the config of {name} imported {loaded}"
print(len(cases), "commands")
"""


def test_parsing_every_command_config_imports_no_torch(tmp_path):
    """Every config of the command table is parsed and validated (registry names, unit options, ranges, unknown
    keys, a missing file) in a process that never imports torch, transformers, datasets or deepspeed."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    from hpc_rlhf.commands import COMMANDS, resolve
    from hpc_rlhf.config.base import leaf_paths
    cases = []
    for name, command in COMMANDS.items():
        required = [f"{p}=x" for p, (_, f, _) in leaf_paths(resolve(command.config)).items()
                    if f.default is f.default_factory is dataclasses.MISSING] + CHECKED.get(name, [])
        errors = [([None, required + ["nonsense=1"]], "unknown option 'nonsense'"),
                  ([str(tmp_path / "absent.yaml"), required], "does not exist")]
        if name == "train rl":
            errors += [([None, required + ["gamma=2"]], "algo.advantage.gamma: 2 is out of range"),
                       ([None, required + ["policy_loss=nonsense"]], "algo.policy_loss: 'nonsense' is not allowed"),
                       ([None, required + ["lambd=0.9"]], "algo.gae.lambd is set but")]
        cases.append([name, command.config, required, errors])
    proc = subprocess.run([sys.executable, "-c", PARSE, json.dumps(cases), json.dumps(HEAVY)], capture_output=True,
                          text=True, cwd=Path(__file__).parents[3], timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == [str(len(COMMANDS)), "commands"]


@pytest.mark.parametrize("overrides, message", [
    (["beta=1.5"], "objective.beta: 1.5 is out of range; it must be in [0, 1]"),
    (["lmbda=-0.5"], "objective.lmbda: -0.5 is out of range; it must be in [0, 1]"),
    (["lmbda=0.5", "kd_coef=0"], "objective.lmbda > 0 trains on the student's own responses, whose loss is kd_coef × "
                                 "the divergence (no CE): set objective.kd_coef > 0"),
    (["lmbda=0.5", "pretrain_mode=true"], "objective.lmbda > 0 needs prompts for the student to answer: "
                                          "data.pretrain_mode has none (loss on every token)"),
    (["rollout.engine=hf"], "rollout.engine is set but objective.lmbda is 0: the rollout section applies to the "
                            "steps on the student's own responses (objective.lmbda > 0)"),
])
def test_kd_generalized_jsd_and_on_policy_options(overrides, message):
    from hpc_rlhf.config.preference import KDConfig
    base = ["pretrain=m", "dataset=a", "teacher_pretrain=t"]
    with pytest.raises(ConfigError) as e:
        load_config(KDConfig, None, base + overrides)
    assert str(e.value) == message
    cfg = load_config(KDConfig, None, base + ["beta=0.5", "lmbda=0.25", "rollout.engine=hf", "generate_max_len=8",
                                              "temperature=2"])
    assert (cfg.objective.beta, cfg.objective.lmbda, cfg.objective.temperature) == (0.5, 0.25, 2.0)
    assert (cfg.rollout.engine, cfg.rollout.generate_max_len) == ("hf", 8)
