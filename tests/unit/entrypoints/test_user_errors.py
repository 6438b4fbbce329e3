"""Bad user input ends `hpc-rlhf train` with one line on stderr and exit code 2, not a traceback."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import datasets
import pytest
import yaml
from rl_fixtures import make_assets, merged
from sft_fixtures import sft_config

from hpc_rlhf.cli import main

GOOD = json.dumps({"input": "1+1=", "output": "2", "label": "2"})
BROKEN_LINE = '{"input": "2+2=", "output": "4"'


def _data_files(root):
    """(data file, the one line `hpc-rlhf` must print for it)."""
    broken, empty = root / "broken.jsonl", root / "empty.jsonl"
    broken.write_text(f"{GOOD}\n{GOOD}\n{BROKEN_LINE}\n{GOOD}\n")
    empty.write_text("")
    return [(broken, f"hpc-rlhf: {broken} line 3: invalid JSON (Expecting ',' delimiter at column 32): "
                     f"{BROKEN_LINE!r}"),
            (empty, f"hpc-rlhf: {empty}: the file is empty")]


RANK_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture(autouse=True)
def _cache_in_tmp(tmp_path, monkeypatch):
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf_cache"))


@pytest.fixture
def _environ_kept():
    """The in-process run sets the rank variables of a lone rank; later tests must not inherit them."""
    before = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(before)


@pytest.mark.usefixtures("_environ_kept")
def test_sft_data_errors(tmp_path, capsys):
    config = sft_config(tmp_path, steps=1)
    config["launch"]["nproc"] = 1
    # the run writes its attempt record into save_path even when a bad row stops it: keep it out of the cwd
    config["ckpt"] = {"save_path": str(tmp_path / "run"), "ckpt_path": str(tmp_path / "run_ckpt")}
    capsys.readouterr()  # building the tiny model printed a progress bar
    for data, line in _data_files(tmp_path):
        config["data"]["dataset"] = [str(data)]
        path = tmp_path / "sft.yaml"
        path.write_text(yaml.safe_dump(config))
        assert main(["train", "sft", "--config", str(path)]) == 2
        assert capsys.readouterr().err.splitlines() == [line]


@pytest.mark.slow  # the default suite stays under 12 minutes (moved in issue 16)
def test_rl_data_and_reward_errors(tmp_path):
    """One rank (every role on it); the three runs in parallel.  A reward function that returns strings for
    every sample fails more than max_failure_fraction of the samples: RewardError, one line, exit 2."""
    base = merged(make_assets(tmp_path), placement={"colocate_all": True, "dead_rank_timeout_s": 1},
                  train={"max_steps": 1})
    words = tmp_path / "words.py"
    words.write_text("def reward_func(queries, prompts, labels):\n    return ['high'] * len(queries)\n")
    cases = [(merged(base, data={"prompt_data": [str(data)]}), line) for data, line in _data_files(tmp_path)]
    cases.append((merged(base, reward={"reward_func": str(words)}),
                  f"hpc-rlhf: {words}: reward_func failed on 5 of 8 samples, more than max_failure_fraction=0.5 "
                  f"allows; first failure: on samples [0, 8) it returned a list whose value 0 is 'high' (str); "
                  f"expected numbers"))
    procs = []
    env = {k: v for k, v in os.environ.items() if k not in RANK_VARS}
    for i, (config, _) in enumerate(cases):
        path = tmp_path / f"rl{i}.yaml"
        path.write_text(yaml.safe_dump(merged(config, ckpt={"save_path": str(tmp_path / f"rl{i}")})))
        procs.append(subprocess.Popen([sys.executable, "-m", "hpc_rlhf.cli", "train", "rl", "--config", str(path)],
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                      env={**env, "HF_DATASETS_CACHE": str(tmp_path / f"c{i}")}))
    for proc, (_, line) in zip(procs, cases):
        _, err = proc.communicate(timeout=300)
        assert proc.returncode == 2, err[-3000:]
        assert "Traceback" not in err
        assert err.splitlines()[-1] == line
        if "reward_func" not in line:  # the run stops at reading its data: nothing else on stderr
            assert err.splitlines() == [line]


@pytest.mark.usefixtures("_environ_kept")
def test_score_names_the_option_of_a_missing_key_and_the_keys_the_row_has(tmp_path, capsys):
    model = tmp_path / "rm"
    model.mkdir()
    (model / "tokenizer.json").write_text("{}")  # the rows are checked before the model loads
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({"prompt": "1+1=", "response": "2"}) + "\n" +
                    json.dumps({"prompt": "2+2=", "answer": "4"}) + "\n")
    assert main(["score", f"reward_pretrain={model}", f"input_path={rows}", f"output_path={tmp_path / 'o.jsonl'}"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"hpc-rlhf: {rows} row 2: missing key 'response' (data.response_key); the row has keys: prompt, answer"]
