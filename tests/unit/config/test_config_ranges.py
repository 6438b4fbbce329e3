"""Numbers out of range and missing inputs stop a run at parse time: exit code 2, one line naming the key,
in seconds, printed once (by the launching process or rank 0), before any rank loads anything."""
import dataclasses
import subprocess
import sys
import time
import types
import typing
from pathlib import Path
from typing import Literal, get_args, get_origin

import pytest

from hpc_rlhf import cli, commands
from hpc_rlhf.commands import COMMANDS, resolve
from hpc_rlhf.config import ConfigError, load_config
from hpc_rlhf.config.base import leaf_paths
from hpc_rlhf.config.rl import RLConfig
from hpc_rlhf.launch import local
from hpc_rlhf.launch.submit import submit

ROOT = Path(__file__).resolve().parents[3]
EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))
# what each command needs besides its defaults (paths that do not exist: parsing stops before they are read)
REQUIRED = {
    "generate": ["model.pretrain=./m", "data.prompt_data=./p.jsonl", "output.output_path=./o.jsonl"],
    "score": ["reward.reward_pretrain=./r", "data.input_path=./i.jsonl", "data.output_path=./o.jsonl"],
    "iterative-dpo": ["model.pretrain=./m", "data.prompt_data=./p.jsonl", "reward.reward_pretrain=./r",
                      "sampling.n_samples_per_prompt=2"],
    "train kd": ["model.pretrain=./m", "data.dataset=./d.jsonl", "objective.teacher_pretrain=./t"],
    "eval": ["model.pretrain=./m", "data.eval_prompt_data=./e.jsonl", "reward.reward_func=./r.py", "output_path=./o"],
}


def numeric_type(tp) -> type | None:
    """int or float for a numeric field (also optional, or a list of numbers), None for any other."""
    if get_origin(tp) in (typing.Union, types.UnionType, list):
        kinds = {numeric_type(a) for a in get_args(tp) if a is not type(None)}
        return kinds.pop() if len(kinds) == 1 else None
    return tp if tp in (int, float) else None


def numeric_fields(cls) -> dict[str, tuple[dataclasses.Field, type]]:
    return {path: (f, numeric_type(tp)) for path, (_, f, tp) in leaf_paths(cls).items()
            if numeric_type(tp) is not None and get_origin(tp) is not Literal}


def out_of_range(bounds, kind: type) -> list:
    """A value just below the minimum and one just above the maximum of a declared range."""
    below = bounds.ge - 1 if bounds.ge is not None else bounds.gt
    above = bounds.le + 1 if bounds.le is not None else bounds.lt
    values = [kind(v) for v in (below, above) if v is not None]
    assert values and not any(v in bounds for v in values), (bounds, values)
    return values


def test_every_numeric_option_declares_its_range():
    missing, both = [], []
    for name, command in COMMANDS.items():
        for path, (f, _) in numeric_fields(resolve(command.config)).items():
            ranged, unbounded = "range" in f.metadata, f.metadata.get("unbounded", False)
            if not ranged and not unbounded:
                missing.append(f"{name}: {path}")
            if ranged and unbounded:
                both.append(f"{name}: {path}")
    assert not missing, "numeric options without a range (field(..., ge=/gt=/le=/lt=) or unbounded=True): " + \
        ", ".join(missing)
    assert not both, both


TOKENIZER_FROM = {name: {"reward.reward_pretrain"} if name == "score" else
                  {"model.pretrain", "reward.reward_pretrain"} if name == "iterative-dpo" else {"model.pretrain"}
                  for name in COMMANDS}
TOKENIZER_FROM["train rl"].add("model.teacher_pretrain")  # its tokenizer files are compared with the actor's


def test_every_model_and_file_option_is_checked_before_the_ranks_start():
    for name, command in COMMANDS.items():
        for path, (_, f, _) in leaf_paths(resolve(command.config)).items():
            leaf = path.rsplit(".", 1)[-1]
            if leaf.endswith("pretrain"):  # the tokenizer is read from the trained (generating, scoring) model, and a
                # teacher's compared with it
                assert f.metadata.get("path") == ("tokenizer" if path in TOKENIZER_FROM[name] else "model"), \
                    (name, path)
            if leaf in ("input_path", "dpo_config"):
                assert f.metadata.get("path") == "file", (name, path)
            if leaf == "reward_func":  # a file or builtin:NAME
                assert f.metadata.get("path") == "reward", (name, path)
            if leaf in ("dataset", "eval_dataset", "prompt_data", "eval_prompt_data"):
                assert f.metadata.get("path") == "data", (name, path)


RL_BASE = ["pretrain=m", "prompt_data=p.jsonl", "reward_func=r.py"]


@pytest.mark.parametrize("override, message", [
    ("rollout.temperature=-1", "rollout.temperature: -1 is out of range; it must be >= 0"),
    ("train.micro_train_batch_size=0", "train.micro_train_batch_size: 0 is out of range; it must be >= 1"),
    ("actor_learning_rate=-1e-6", "train.actor_learning_rate: -1e-06 is out of range; it must be > 0"),
    ("top_p=0", "rollout.top_p: 0 is out of range; it must be in (0, 1]"),
    ("save_steps=0", "ckpt.save_steps: 0 is out of range; it must be -1 or >= 1"),
    ("adam_betas=0.9,1", "train.adam_betas[1]: 1 is out of range; it must be in [0, 1)"),
    ("seed=4294967296", "train.seed: 4294967296 is out of range; it must be in [0, 4294967295]"),
    ("algo.gamma=1.0000001", "algo.advantage.gamma: 1.0000001 is out of range; it must be in [0, 1]"),
    ("rollout.temperature=nan", "rollout.temperature: 'nan' is not a finite number"),
])
def test_range_error_names_key_value_and_range(override, message):
    with pytest.raises(ConfigError) as e:
        load_config(RLConfig, None, RL_BASE + [override])
    assert str(e.value) == message


def test_values_on_the_bounds_and_the_unbounded_options_are_accepted():
    cfg = load_config(RLConfig, None, RL_BASE + ["temperature=0", "top_p=1", "save_steps=-1", "eval_steps=1",
                                                 "advantage_estimator=rloo", "gamma=0", "seed=0", "reward_weights=-1,2",
                                                 "truncated_reward=-5", "reward_clip_range=-10,10"])
    assert (cfg.rollout.temperature, cfg.rollout.top_p, cfg.ckpt.save_steps, cfg.reward.reward_weights) == \
        (0.0, 1.0, -1, [-1.0, 2.0])


@pytest.fixture
def no_run(monkeypatch):
    """In-process CLI calls: a config that passes the checks fails the test at once instead of starting ranks
    or training; no hub; not a rank of a launched group."""
    def ran(*args, **kwargs):
        raise AssertionError("the command ran: its config passed the checks")
    monkeypatch.setattr(commands, "run", ran)
    monkeypatch.setattr(local, "launch_local", ran)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    for v in ("RANK", "WORLD_SIZE", "SLURM_JOB_ID", "SLURM_STEP_ID"):
        monkeypatch.delenv(v, raising=False)


def _cases():
    """(id, CLI arguments of a config that parses, its config class) for every example and every command."""
    out = []
    for f in EXAMPLES:
        command = "train sft" if f.stem.startswith("sft") else "train rl"
        out.append((f.name, [*command.split(), "--config", str(f)], resolve(COMMANDS[command].config)))
    for name, command in COMMANDS.items():
        if name not in ("train sft", "train rl"):
            args = REQUIRED.get(name, ["model.pretrain=./m", "data.dataset=./d.jsonl"])
            out.append((name, [*name.split(), *args], resolve(command.config)))
    return out


CASES = _cases()


@pytest.mark.parametrize("args, cls", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_each_numeric_option_out_of_range_exits_2_naming_it(args, cls, no_run, capsys, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)  # the examples' relative paths do not exist here
    load_config(cls, args[args.index("--config") + 1] if "--config" in args else None,
                [a for a in args if "=" in a])  # the base config parses
    failures, count = [], 0
    for path, (f, kind) in numeric_fields(cls).items():
        if "range" not in f.metadata:
            continue
        for value in out_of_range(f.metadata["range"], kind):
            start = time.monotonic()
            rc = cli.main([*args, f"{path}={value}"])
            elapsed = time.monotonic() - start
            err = capsys.readouterr().err.strip().splitlines()
            count += 1
            if rc != 2 or elapsed >= 10 or len(err) != 1 or path not in err[0] or "out of range" not in err[0]:
                failures.append(f"{path}={value}: rc {rc}, {elapsed:.1f} s, stderr {err}")
    assert count > 0 and not failures, "\n".join(failures)


@pytest.fixture
def rl_inputs(tmp_path):
    """An RL config whose inputs exist (a model folder with a tokenizer file is enough for the check) and needs 3
    ranks."""
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "tokenizer.json").write_text("{}")
    (tmp_path / "p.jsonl").write_text('{"input": "1+1=", "label": "2"}\n')
    (tmp_path / "reward.py").write_text("def reward_func(queries, prompts, labels):\n    return [0.0] * len(queries)\n")
    return [f"pretrain={tmp_path / 'model'}", f"prompt_data={tmp_path / 'p.jsonl'}",
            f"reward_func={tmp_path / 'reward.py'}", "rollout_num_ranks=1", "reward_num_ranks=1",
            f"save_path={tmp_path / 'out'}", f"ckpt_path={tmp_path / 'ckpt'}"]


@pytest.mark.parametrize("override, key", [
    ("pretrain=MISSING/model", "model.pretrain"),
    ("pretrain=org/model-offline", "model.pretrain"),
    ("prompt_data=MISSING/p.jsonl", "data.prompt_data"),
    ("prompt_data=org/prompts-offline", "data.prompt_data"),
    ("eval_prompt_data=MISSING/e.jsonl", "data.eval_prompt_data"),
    ("reward_func=MISSING/reward.py", "reward.reward_func"),
    ("reward_pretrain=MISSING/rm", "reward.reward_pretrain"),
    ("critic_pretrain=MISSING/critic", "critic_pretrain"),
    ("ref_pretrain=MISSING/ref", "ref_pretrain"),
])
def test_missing_input_stops_before_the_ranks_start(rl_inputs, no_run, tmp_path, override, key, capsys):
    override = override.replace("MISSING", str(tmp_path / "missing"))
    start = time.monotonic()
    rc = cli.main(["train", "rl", *rl_inputs, override])
    assert time.monotonic() - start < 10
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1, err
    assert err[0].startswith(f"hpc-rlhf: config error: {key}: "), err
    assert ("HF_HUB_OFFLINE is set" in err[0]) if "offline" in override else (str(tmp_path / "missing") in err[0])


def test_models_whose_tokenizer_is_the_trained_models_need_no_tokenizer_files(rl_inputs, tmp_path):
    # reference, critic, reward (RL) and teacher models read the token ids of model.pretrain's tokenizer
    (tmp_path / "bare").mkdir()
    bare = tmp_path / "bare"
    commands.check_inputs(load_config(RLConfig, None, [*rl_inputs, f"reward_pretrain={bare}",
                                                       f"critic_pretrain={bare}", f"ref_pretrain={bare}"]))
    pretrain, data = rl_inputs[0], rl_inputs[1].replace("prompt_data", "dataset")
    for trainer, option in (("train dpo", "ref_pretrain"), ("train kd", "teacher_pretrain")):
        commands.check_inputs(commands.load_config(trainer, None, [pretrain, data, f"{option}={bare}"]))
    with pytest.raises(ConfigError, match=rf"^model\.pretrain: model folder {bare} has no tokenizer"):
        commands.check_inputs(load_config(RLConfig, None, [*rl_inputs, f"pretrain={bare}"]))


def test_the_iterative_dpo_driver_checks_its_inputs(no_run, tmp_path, capsys):
    # the driver is one process that starts its stages: a missing dpo_config stops it before the first stage
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "tokenizer.json").write_text("{}")
    (tmp_path / "p.jsonl").write_text('{"input": "1+1="}\n')
    rc = cli.main(["iterative-dpo", f"pretrain={tmp_path / 'model'}", f"reward_pretrain={tmp_path / 'model'}",
                   f"prompt_data={tmp_path / 'p.jsonl'}", "n_samples_per_prompt=2",
                   f"dpo_config={tmp_path / 'missing.yaml'}"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and err[0].startswith("hpc-rlhf: config error: iterative.dpo_config: "), err


def test_submit_checks_before_queueing(rl_inputs, no_run, tmp_path):
    # `hpc-rlhf submit` and the launchers' submit(): a missing input stops on the login node, not in the queue
    with pytest.raises(ConfigError, match=r"^reward\.reward_func: file .*nope\.py does not exist"):
        submit("rl", None, [*rl_inputs, f"reward_func={tmp_path / 'nope.py'}", f"log_dir={tmp_path / 'logs'}"],
               folder=tmp_path / "submitit")
    assert not (tmp_path / "submitit").exists()


def test_only_the_main_rank_reports(rl_inputs, no_run, tmp_path, capsys, monkeypatch):
    # under srun every rank checks the config; the others exit with the same code without a word
    bad = ["train", "rl", *rl_inputs, f"reward_func={tmp_path / 'nope.py'}"]
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setenv("RANK", "1")
    for args in (bad, [*bad[:-1], "temperature=-1"]):
        with pytest.raises(SystemExit) as e:
            cli.main(args)
        assert e.value.code == 2 and capsys.readouterr().err == ""
    monkeypatch.setenv("RANK", "0")
    assert cli.main(bad) == 2
    assert capsys.readouterr().err == f"hpc-rlhf: config error: reward.reward_func: file {tmp_path / 'nope.py'} " \
                                      "does not exist\n"


@pytest.fixture(scope="module")
def cli_start_s():
    """Seconds `python -m hpc_rlhf.cli --help` takes here and now: starting Python and importing torch, which no
    error can avoid (about 4 s on an idle 2-core machine, twice that when it is busy)."""
    start = time.monotonic()
    subprocess.run([sys.executable, "-m", "hpc_rlhf.cli", "--help"], capture_output=True, check=True, cwd=ROOT)
    return time.monotonic() - start


@pytest.mark.parametrize("override, key", [
    ("rollout.temperature=-1", "rollout.temperature"),
    ("train.micro_train_batch_size=0", "train.micro_train_batch_size"),
    ("train.actor_learning_rate=-1e-6", "train.actor_learning_rate"),
    ("reward.reward_func=MISSING/reward.py", "reward.reward_func"),
    ("model.pretrain=MISSING/model", "model.pretrain"),
], ids=["temperature", "micro-batch", "learning-rate", "reward-func", "pretrain"])
def test_cli_exits_2_with_one_line_before_any_rank_starts(rl_inputs, tmp_path, override, key, cli_start_s):
    # the config needs 3 ranks (actor, rollout, reward): the launching process stops before it starts them
    # (these runs took 36-47 s and printed a traceback per rank, or the same line 3 times, before the checks)
    override = override.replace("MISSING", str(tmp_path / "missing"))
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "hpc_rlhf.cli", "train", "rl", *rl_inputs, override],
                          capture_output=True, text=True, cwd=ROOT, timeout=60)
    elapsed = time.monotonic() - start
    err = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(err) == 1 and err[0].startswith(f"hpc-rlhf: config error: {key}: "), \
        proc.stderr[-3000:]
    assert elapsed < max(10.0, 2 * cli_start_s), (elapsed, cli_start_s)  # 10 s unless the machine is busy


def test_the_option_reference_shows_the_ranges():
    text = commands.option_reference()
    for row in ("| `rollout.temperature` | float, >= 0 | `1.0` |", "| `ckpt.save_steps` | int, -1 or >= 1 | `-1` |",
                "| `train.adam_betas` | list[float], each in [0, 1) |", "| `rollout.top_p` | float, in (0, 1] |",
                "| `reward.truncated_reward` | float \\| null | `null` |"):
        assert row in text, row
