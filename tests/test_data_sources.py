"""Data sources (files, saved folders, hub names) and the bad-row collector."""
from __future__ import annotations

import json

import datasets
import pyarrow as pa
import pytest

from hpc_rlhf.data.rows import BadRows, DataError
from hpc_rlhf.data.sources import load_source

ROWS = [{"input": f"q{i}", "output": f"a{i}"} for i in range(3)]


@pytest.fixture(autouse=True)
def _cache_in_tmp(tmp_path, monkeypatch):
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf_cache"))
    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        monkeypatch.delenv(var, raising=False)


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_jsonl_and_json(tmp_path):
    rows, name = load_source(str(write_jsonl(tmp_path / "train.jsonl", ROWS)))
    assert rows.to_list() == ROWS and name.endswith("train.jsonl")
    (tmp_path / "train.json").write_text(json.dumps(ROWS))
    assert load_source(str(tmp_path / "train.json"))[0].to_list() == ROWS


def test_parquet_csv_arrow(tmp_path):
    ds = datasets.Dataset.from_list(ROWS)
    ds.to_parquet(str(tmp_path / "d.parquet"))
    assert load_source(str(tmp_path / "d.parquet"))[0].to_list() == ROWS

    (tmp_path / "d.csv").write_text("input,output\nhow much?,42\nzero,0.50\n")
    rows, _ = load_source(str(tmp_path / "d.csv"))
    assert rows.to_list() == [{"input": "how much?", "output": "42"}, {"input": "zero", "output": "0.50"}]

    table = pa.Table.from_pylist(ROWS)
    with pa.OSFile(str(tmp_path / "d.arrow"), "wb") as f, pa.ipc.new_stream(f, table.schema) as w:
        w.write_table(table)
    assert load_source(str(tmp_path / "d.arrow"))[0].to_list() == ROWS


def test_save_to_disk_folders_and_splits(tmp_path):
    datasets.Dataset.from_list(ROWS).save_to_disk(str(tmp_path / "one"))
    rows, name = load_source(str(tmp_path / "one"))
    assert rows.to_list() == ROWS and name == str(tmp_path / "one")

    dd = datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS),
                               "test": datasets.Dataset.from_list(ROWS[:1])})
    dd.save_to_disk(str(tmp_path / "dd"))
    assert len(load_source(str(tmp_path / "dd"))[0]) == 3
    rows, name = load_source(str(tmp_path / "dd"), split="test")
    assert len(rows) == 1 and name == f"{tmp_path / 'dd'}@test"
    rows, name = load_source(f"{tmp_path / 'dd'}@test", split="train")  # '@split' overrides the argument
    assert len(rows) == 1
    with pytest.raises(DataError, match=r"has no split 'valid'; its splits are train, test"):
        load_source(f"{tmp_path / 'dd'}@valid")


def test_folder_of_data_files(tmp_path):
    folder = tmp_path / "snapshot"
    folder.mkdir()
    write_jsonl(folder / "train.jsonl", ROWS)
    write_jsonl(folder / "test.jsonl", ROWS[:2])
    rows, name = load_source(f"{folder}@test")
    assert rows.to_list() == ROWS[:2] and name == f"{folder}@test"


def test_path_errors(tmp_path):
    with pytest.raises(DataError, match="file not found"):
        load_source(str(tmp_path / "nope.jsonl"))
    with pytest.raises(DataError, match="file not found"):
        load_source("data/missing.parquet")
    (tmp_path / "notes.txt").write_text("hi")
    with pytest.raises(DataError, match=r"unsupported file type '.txt'; supported are .arrow, .csv, .json, "
                                        r"\.jsonl, \.parquet"):
        load_source(str(tmp_path / "notes.txt"))
    path = write_jsonl(tmp_path / "t.jsonl", ROWS)
    with pytest.raises(DataError, match="a single file has no splits"):
        load_source(f"{path}@test")
    (tmp_path / "broken.jsonl").write_text('{"input": "a"\n')
    with pytest.raises(DataError, match="broken.jsonl: cannot read it as json"):
        load_source(str(tmp_path / "broken.jsonl"))


@pytest.mark.parametrize("var", ["HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"])
def test_hub_name_offline(monkeypatch, var):
    monkeypatch.setenv(var, "1")
    with pytest.raises(DataError) as e:
        load_source("some-org/some-dataset@train")
    assert str(e.value) == ("some-org/some-dataset is not a local file or folder, and HF_HUB_OFFLINE is set, so the "
                            "Hub cannot be reached: copy the dataset to the cluster and pass its path")
    with pytest.raises(DataError, match="HF_HUB_OFFLINE is set"):
        load_source("teknium/OpenHermes-2.5")  # a dot in a hub name is not a file suffix


def test_bad_rows_skip_counts_and_summary():
    bad = BadRows("skip")
    for row in (17, 18, 19, 20):
        bad.add("train.jsonl", row, "missing_key", "missing key 'output'")
    bad.add("more.parquet", 2, "too_long", "90 tokens, more than max_len 64")
    assert bad.counts() == {"missing_key": 4, "too_long": 1}
    assert bad.total == 5
    lines = bad.summary().splitlines()
    assert lines == [
        "missing_key: 4 rows skipped, e.g. train.jsonl row 17: missing key 'output'; train.jsonl row 18: missing "
        "key 'output'; train.jsonl row 19: missing key 'output'",
        "too_long: 1 row skipped, e.g. more.parquet row 2: 90 tokens, more than max_len 64",
    ]
    assert BadRows("skip").summary() == "" and BadRows("skip").total == 0
    with pytest.raises(ValueError, match="unknown bad-row kind"):
        bad.add("x", 1, "ugly", "?")


def test_bad_rows_error_policy():
    bad = BadRows("error")
    with pytest.raises(DataError, match=r"^train.jsonl row 17: missing key 'output'"):
        bad.add("train.jsonl", 17, "missing_key", "missing key 'output'")
    with pytest.raises(ValueError, match="policy"):
        BadRows("ignore")
