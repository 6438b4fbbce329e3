"""ASDiv rows and their train/held-out split (hpc_rlhf.data.asdiv, written by scripts/real_assets.sh)."""
from __future__ import annotations

import json

import pytest

from hpc_rlhf.data.asdiv import read_asdiv, response_of, split_rows, write_splits
from hpc_rlhf.data.rows import DataError


@pytest.mark.parametrize("answer, response", [
    ("9 apples", "9"), ("14  seats", "14"), ("383", "383"), ("-2.5 degrees", "-2.5"), ("0.75", "0.75"),
    ("57  science books", "57"),
    # not one plain number: kept as they are
    ("3:4", "3:4"), ("5/2", "5/2"), ("-1/3", "-1/3"), ("6th", "6th"), ("3:30 p.m.", "3:30 p.m."),
    ("5 years old; 15 years old", "5 years old; 15 years old"), ("8 ft; 128 sq. ft", "8 ft; 128 sq. ft"),
    ("36 km; 4 km/hour", "36 km; 4 km/hour"), ("The 60th caller.", "The 60th caller."), ("Vendor 2", "Vendor 2"),
    ("Yes", "Yes"), (" 12 cookies ", "12"),
])
def test_response_of(answer, response):
    assert response_of(answer) == response


def _source(tmp_path, n=20):
    path = tmp_path / "test.jsonl"
    with path.open("w") as f:
        for i in range(n):
            f.write(json.dumps({"passage": f"Ann has {i} pens. ", "question": "How many pens does Ann have? ",
                                "answer": f"{i} pens"}) + "\n")
    return path


def test_rows_keep_the_line_number_and_build_the_prompt(tmp_path):
    rows = read_asdiv(_source(tmp_path, 3))
    assert rows[2] == {"id": "asdiv-0003",
                       "prompt": "Ann has 2 pens. How many pens does Ann have?\nAnswer with just the final number.",
                       "answer": "2 pens", "response": "2"}
    assert [r["id"] for r in rows] == ["asdiv-0001", "asdiv-0002", "asdiv-0003"]


def test_split_is_deterministic_disjoint_complete_and_sorted(tmp_path):
    src = _source(tmp_path)
    counts = write_splits(src, tmp_path / "a", heldout=6, seed=0)
    write_splits(src, tmp_path / "b", heldout=6, seed=0)
    write_splits(src, tmp_path / "c", heldout=6, seed=1)
    assert counts == {"train": 14, "heldout": 6}
    for name in ("train.jsonl", "heldout.jsonl"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()

    def ids(folder, name):
        return [json.loads(line)["id"] for line in (tmp_path / folder / name).read_text().splitlines()]
    train, held = ids("a", "train.jsonl"), ids("a", "heldout.jsonl")
    assert train == sorted(train) and held == sorted(held)
    assert not set(train) & set(held)
    assert sorted(train + held) == [f"asdiv-{i:04d}" for i in range(1, 21)]
    assert ids("c", "heldout.jsonl") != held  # another seed draws another held-out set
    # random.Random(0) shuffles positions 0..19 of the 20 rows; the first 6 are held out
    import random
    order = list(range(20))
    random.Random(0).shuffle(order)
    assert held == [f"asdiv-{i + 1:04d}" for i in sorted(order[:6])]


def test_split_sizes_are_checked():
    rows = [{"id": str(i)} for i in range(3)]
    assert [len(part) for part in split_rows(rows, 2)] == [1, 2]
    for bad in (0, 3):
        with pytest.raises(DataError, match=f"held-out size {bad} must be between 1 and 2 \\(3 rows\\)"):
            split_rows(rows, bad)


@pytest.mark.parametrize("line, needle", [
    ('{"passage": "p", "question": "q"}', "missing field 'answer'"),
    ('{"passage": "p", "question": "  ", "answer": "1"}', "field 'question' is empty"),
    ('{"passage": 3, "question": "q", "answer": "1"}', "field 'passage' is int, not a string"),
    ('["p", "q", "1"]', "expected a JSON object, got list"),
    ('{"passage": "p", ', "not JSON"),
    ("", "empty line"),
], ids=["missing", "empty", "not-string", "not-object", "broken-json", "blank-line"])
def test_a_bad_row_is_named(tmp_path, line, needle):
    src = _source(tmp_path, 4)
    lines = src.read_text().splitlines()
    lines.insert(2, line)
    src.write_text("\n".join(lines) + "\n")
    with pytest.raises(DataError) as e:
        write_splits(src, tmp_path / "out", heldout=2)
    assert str(e.value).startswith(f"{src} line 3: {needle}"), str(e.value)
    assert not (tmp_path / "out").exists()


def test_missing_or_empty_source(tmp_path):
    with pytest.raises(DataError, match=f"ASDiv file {tmp_path / 'nope.jsonl'} does not exist"):
        read_asdiv(tmp_path / "nope.jsonl")
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(DataError, match="holds no rows"):
        read_asdiv(tmp_path / "empty.jsonl")
