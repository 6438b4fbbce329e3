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
    from hpc_rlhf.trainers.rl import plan_from_config
    examples = Path(__file__).parents[1] / "examples"
    for f in sorted(examples.glob("sft*.yaml")):
        load_config(SFTConfig, f)
    worlds = {f.stem: plan_from_config(load_config(RLConfig, f)).world_size for f in sorted(examples.glob("*.yaml"))
              if not f.stem.startswith("sft")}
    assert worlds == {"grpo": 1, "ppo": 5}
