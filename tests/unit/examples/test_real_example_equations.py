"""examples/real_asdiv/equations.py: the numbers of a problem and the one-step equation giving its answer."""
import importlib.util
import json
from fractions import Fraction
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location(
    "real_asdiv_equations", Path(__file__).parents[3] / "examples" / "real_asdiv" / "equations.py")
eq = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(eq)


def test_numbers_digits_and_words_in_order():
    assert eq.numbers("Seven red apples and 2 green; twenty-one pears, 1,200 g, 3.5 kg, a dozen eggs") == [
        7, 2, 21, 1200, Fraction(7, 2), 12]
    assert eq.numbers("no numbers here") == []


@pytest.mark.parametrize("problem,answer,expected", [
    ("Seven red apples and two green apples are in the basket. How many apples?", "9", "7 + 2 = 9"),
    ("17 plums were in the basket. Now there are 21 plums. How many were added?", "4", "21 - 17 = 4"),
    ("Each box has 6 pens. How many pens are in 4 boxes?", "24", "6 * 4 = 24"),
    ("12 cookies are shared by 3 children. How many does each get?", "4", "12 / 3 = 4"),
    ("Ann has 2, Bob has 3 and Cy has 4 cards. How many in all?", "9", "2 + 3 + 4 = 9"),
    ("Ann has 2 cards and Bob has 3. How many in all?", "7", None),     # no one step gives 7
    ("The ratio of 9 boys to 7 girls?", "9:7", None),                   # not a number
    ("Tom ran 1.5 km and then 2 km. How far?", "3.5", "1.5 + 2 = 3.5"),
])
def test_equation(problem, answer, expected):
    assert eq.equation(problem + "\nAnswer with just the final number.", answer) == expected


def test_main_keeps_only_rows_with_an_equation(tmp_path, capsys):
    src, dst = tmp_path / "train.jsonl", tmp_path / "out.jsonl"
    rows = [{"id": "a", "prompt": "Two and three? How many?", "answer": "5 apples", "response": "5"},
            {"id": "b", "prompt": "Two and three? How many?", "answer": "8 apples", "response": "8"}]
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    eq.main(str(src), str(dst))
    out = [json.loads(line) for line in dst.read_text().splitlines()]
    assert out == [rows[0] | {"response": "2 + 3 = 5"}]
    assert "1 of the 2 rows" in capsys.readouterr().out
