"""The demo's verifiable task: two-digit addition, with demonstrations that often forget the carry.

SFT on these demonstrations learns the majority answer, which is wrong whenever the units digits
carry (45% of pairs) and right otherwise, so held-out accuracy lands near 0.55 for an honest
reason.  An exact-match reward can then teach what the demonstrations got wrong.

The sums are split by unordered pair: a held-out or validation sum a+b has neither a+b nor b+a among the
training prompts, so a model cannot pass the held-out set by remembering the commuted sum.  Settings are chosen
on the validation rows; the held-out rows are for the figures reported.
"""
from __future__ import annotations

import json
import random
from pathlib import Path


def carries(a: int, b: int) -> bool:
    return a % 10 + b % 10 >= 10


def forgetful_sum(a: int, b: int) -> int:
    """a + b computed digit by digit but dropping the carry out of the units column."""
    return (a // 10 + b // 10) * 10 + (a % 10 + b % 10) % 10


def prompt(a: int, b: int) -> str:
    return f"{a}+{b}="


def make_task(seed: int, heldout_pairs: int = 200, validation_pairs: int = 200, forget_prob: float = 0.7,
              lo: int = 10, hi: int = 99):
    """(train, validation, held-out) rows: held-out and validation rows are both orders (a+b and b+a) of
    ``heldout_pairs`` and ``validation_pairs`` unordered pairs {a, b} with a != b, drawn with ``seed``, with true
    answers; every other ordered pair is a training row, with a forgetful demonstration."""
    rng = random.Random(seed)
    unordered = [(a, b) for a in range(lo, hi + 1) for b in range(a + 1, hi + 1)]
    rng.shuffle(unordered)
    held = unordered[:heldout_pairs]
    validation = unordered[heldout_pairs:heldout_pairs + validation_pairs]
    apart = set(held) | set(validation)
    train = [(a, b) for a in range(lo, hi + 1) for b in range(lo, hi + 1) if (min(a, b), max(a, b)) not in apart]
    rng.shuffle(train)
    train_rows = []
    for a, b in train:
        wrong = carries(a, b) and rng.random() < forget_prob
        answer = forgetful_sum(a, b) if wrong else a + b
        train_rows.append({"input": prompt(a, b), "output": str(answer), "label": str(a + b)})
    def true_rows(pairs):
        return [{"input": prompt(x, y), "output": str(a + b), "label": str(a + b)}
                for a, b in pairs for x, y in ((a, b), (b, a))]
    return train_rows, true_rows(validation), true_rows(held)


def write_jsonl(rows: list[dict], path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    return path


def wrong_answer(a: int, b: int, rng: random.Random) -> int:
    """A plausible wrong sum: the forgotten carry when the units carry, else an off-by-ten or off-by-one slip."""
    if carries(a, b):
        return forgetful_sum(a, b)
    return a + b + rng.choice([10, -10, 1, -1])


def preference_rows(rows: list[dict], seed: int) -> list[dict]:
    """Pairs {prompt, chosen, rejected}: chosen is the true sum (the row's label), rejected a wrong one."""
    rng = random.Random(seed)
    out = []
    for r in rows:
        a, b = (int(x) for x in r["input"].rstrip("=").split("+"))
        out.append({"prompt": r["input"], "chosen": r["label"], "rejected": str(wrong_answer(a, b, rng))})
    return out


def kto_rows(pairs: list[dict]) -> list[dict]:
    """Unpaired labelled rows for KTO: each pair gives a desirable (correct) and an undesirable (wrong) row."""
    out = []
    for p in pairs:
        out.append({"prompt": p["prompt"], "completion": p["chosen"], "label": True})
        out.append({"prompt": p["prompt"], "completion": p["rejected"], "label": False})
    return out


def retry_rows(train_rows: list[dict], seed: int, feedback: str, eos: str, forget_prob: float = 0.7) -> list[dict]:
    """Two-try demonstrations from the same demonstrator: for each training row whose demonstrated answer is
    wrong, the transcript up to the second try (``a+b=WRONG<eos>`` + ``feedback`` + ``a+b=``) as the input and
    the demonstrator's second answer as the output; asked again, it forgets the carry with the same
    ``forget_prob`` as the first time (independently), so the second answer mostly repeats the first."""
    rng = random.Random(seed)
    out = []
    for r in train_rows:
        if r["output"] == r["label"]:
            continue
        a, b = (int(x) for x in r["input"].rstrip("=").split("+"))
        second = forgetful_sum(a, b) if rng.random() < forget_prob else a + b
        out.append({"input": r["input"] + r["output"] + eos + feedback + r["input"], "output": str(second),
                    "label": r["label"]})
    return out
