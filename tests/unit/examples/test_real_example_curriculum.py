"""examples/real_asdiv/curriculum.py: the problems the SFT model solves sometimes, matched to their prompt rows."""
import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parents[3] / "examples" / "real_asdiv" / "curriculum.py"
_spec = importlib.util.spec_from_file_location("real_asdiv_curriculum", SCRIPT)
cur = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(cur)

ROWS = [{"prompt": p, "answer": str(i)} for i, p in enumerate(["one", "two", "one", "three", "four"])]


def render(text: str) -> str:
    return f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"


def test_evaluated_prompts_match_the_next_row_that_holds_their_text():
    """All five rows in order; a sorted subset (rows 1, 2, 4: ids 0, 1, 2); the repeated "one" goes to the row after
    the previous match; a prompt that no later row holds is named."""
    assert cur.rows_of({i: render(r["prompt"]) for i, r in enumerate(ROWS)}, ROWS) == {0: 0, 1: 1, 2: 2, 3: 3, 4: 4}
    assert cur.rows_of({0: render("two"), 1: render("one"), 2: render("four")}, ROWS) == {0: 1, 1: 2, 2: 4}
    with pytest.raises(ValueError, match="prompt_id 1 matches no row after row 3"):
        cur.rows_of({0: render("three"), 1: render("two")}, ROWS)


def test_solved_sometimes_keeps_rates_strictly_between_0_and_1():
    assert cur.solved_sometimes({3: 0.5, 0: 0.125, 1: 0.0, 2: 1.0, 4: 0.875}) == [0, 3, 4]
    assert cur.solved_sometimes({}) == []


def _samples(path: Path, rows: dict[int, str], right: dict[int, int], n: int = 4) -> Path:
    path.write_text("".join(json.dumps({"prompt_id": pid, "sample": k, "prompt": render(text), "valid": True,
                                        "correct": k < right[pid]}) + "\n"
                            for pid, text in rows.items() for k in range(n)))
    return path


def test_the_script_writes_the_kept_rows_and_a_summary(tmp_path):
    """A subset of rows 0, 1, 3, 4 with 2, 0, 4 and 1 right of 4: rows 0 and 4 kept, in file order."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    samples = _samples(tmp_path / "s.jsonl", {0: "one", 1: "two", 2: "three", 3: "four"}, {0: 2, 1: 0, 2: 4, 3: 1})
    out = tmp_path / "cur.jsonl"
    proc = subprocess.run([sys.executable, str(SCRIPT), str(prompts), str(samples), str(out),
                           "--summary", str(tmp_path / "summary.json")], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert [json.loads(x) for x in out.read_text().splitlines()] == [ROWS[0], ROWS[4]]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary == {"problems": 5, "rated": 4, "kept": 2, "by_correct": {"0": 1, "1": 1, "2": 1, "3": 0, "4": 1},
                       "mean_pass_rate": (0.5 + 0 + 1 + 0.25) / 4}


@pytest.mark.parametrize("rows,right,message", [
    ({0: "five"}, {0: 1}, "the sample of prompt_id 0 matches no row after row -1"),
    ({0: "one", 1: "two"}, {0: 0, 1: 4}, "no problem of .* is solved sometimes"),
])
def test_the_script_names_what_is_wrong_and_exits_2(tmp_path, rows, right, message):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    samples = _samples(tmp_path / "s.jsonl", rows, right)
    proc = subprocess.run([sys.executable, str(SCRIPT), str(prompts), str(samples), str(tmp_path / "o.jsonl")],
                          capture_output=True, text=True)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1
    assert re.search(message, proc.stderr), proc.stderr
