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


def _error(path) -> str:
    """The message of the DataError loading ``path`` raises; it must be one line."""
    with pytest.raises(DataError) as e:
        load_source(str(path))
    assert "\n" not in str(e.value)
    return str(e.value)


def test_malformed_json_names_the_line(tmp_path, caplog):
    good = json.dumps(ROWS[0])
    path = tmp_path / "broken.jsonl"
    path.write_text(f"{good}\n\n{good}\n" + '{"input": "a", "output": "b"\n' + f"{good}\n")
    assert _error(path) == (f"{path} line 4: invalid JSON (Expecting ',' delimiter at column 29): "
                            """'{"input": "a", "output": "b"'""")
    assert "Failed to load JSON" not in caplog.text  # the datasets library's 0-based report is muted
    path.write_text(f"{good}\n7\n")
    assert _error(path) == f"{path} line 2: a JSON int, not a row object {{...}}: '7'"
    path.write_bytes(good.encode() + b"\n" + b'{"input": "\xff"}\n')
    assert _error(path).startswith(f"{path} line 2: not UTF-8 text (invalid start byte at byte 11")
    # a .json file holding one JSON document: the line inside it
    whole = tmp_path / "whole.json"
    whole.write_text('[\n  {"input": "a"},\n  {"input": }\n]\n')
    assert _error(whole) == f"""{whole} line 3: invalid JSON (Expecting value at column 13): '{{"input": }}'"""
    whole.write_text("[]")
    assert _error(whole) == f"{whole} holds an empty JSON list, no rows"
    # a .json file in JSON-lines form is read the same way as .jsonl
    lines = tmp_path / "lines.json"
    lines.write_text(f"{good}\n{{oops}}\n")
    assert _error(lines).startswith(f"{lines} line 2: invalid JSON (Expecting property name")


@pytest.mark.parametrize("suffix", [".jsonl", ".json", ".csv", ".parquet", ".arrow"])
def test_empty_and_blank_files(tmp_path, suffix):
    path = tmp_path / f"data{suffix}"
    path.write_text("")
    assert _error(path) == f"{path}: the file is empty"
    if suffix in (".jsonl", ".json", ".csv"):
        path.write_text("\n  \n\n")
        assert _error(path) == f"{path}: the file has only blank lines, no rows"


def test_rows_lacking_the_key_are_named(tmp_path):
    from hpc_rlhf.config.rl import PromptDataConfig
    from hpc_rlhf.data.prompts import load_prompts

    class Chars:  # a tokenizer: one id per character
        def __call__(self, text, add_special_tokens=True):
            return {"input_ids": [ord(c) for c in text]}

    path = write_jsonl(tmp_path / "p.jsonl", [{"question": "q1", "answer": "a"}, {"question": "q2"}])
    with pytest.raises(DataError) as e:
        load_prompts(PromptDataConfig(prompt_data=[str(path)], input_key="input"), Chars(), 0)
    # the option that names the key, and the keys the row has (the second row's answer is null in Arrow's table)
    assert str(e.value) == (f"{path}: none of its 2 rows is a usable prompt: missing_key: 2 rows skipped, e.g. "
                            f"{path} row 1: missing key 'input' (data.input_key); the row has keys: question, "
                            f"answer; {path} row 2: missing key 'input' (data.input_key); the row has keys: question")
    path = write_jsonl(tmp_path / "p.jsonl", [{"input": "q1"}])
    with pytest.raises(DataError, match=r"row 1: missing key 'label' \(data.label_key\); the row has keys: input "):
        load_prompts(PromptDataConfig(prompt_data=[str(path)], label_key="label", bad_rows="error"), Chars(), 0)


def test_csv_and_parquet_problems(tmp_path):
    csv_path = tmp_path / "d.csv"
    csv_path.write_text("input,output\n")
    assert _error(csv_path) == f"{csv_path}: the CSV file has a header row but no rows"
    # one more field than the header: pandas would silently take the first column as the row index
    csv_path.write_text("input,output\na,b,c\nd,e,f\n")
    assert _error(csv_path) == f"{csv_path} line 2: 3 fields, but the header has 2"
    csv_path.write_text("input,output\na,b\nc,d\ne,f,g\n")
    assert _error(csv_path) == f"{csv_path} line 4: 3 fields, but the header has 2"
    csv_path.write_text('input,output\na,b\n"c\nd,e\nf,g\n')  # the quote opened on line 3 never closes
    assert _error(csv_path) == f"{csv_path} line 3: unexpected end of data"
    parquet = tmp_path / "d.parquet"
    parquet.write_bytes(b"PAR1 not really parquet")
    assert _error(parquet).startswith(f"{parquet}: cannot read it as parquet: ArrowInvalid: ")
    datasets.Dataset.from_list(ROWS).select([]).to_parquet(str(parquet))
    assert _error(parquet) == f"{parquet} has no rows"


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
