"""A math-answer verifier: the final answer of a response, normalised, compared to the data set's label.

Shipped as the built-in reward ``reward.reward_func=builtin:math`` (:func:`reward_func`); everything else
here is a pure function of its text arguments.

**Where the answer is.** The first of these that the response holds decides, each at its *last* occurrence:

1. ``#### ANSWER`` (GSM8K style): the rest of that line;
2. ``\\boxed{ANSWER}`` (or ``\\fbox``), braces nested to any depth; LaTeX in it is simplified
   (``\\frac{a}{b}`` -> ``a/b``, ``\\text{..}`` -> its text, ``\\%`` -> ``%``, ``{,}`` and ``\\!``/``\\,`` spacing);
3. ``the answer is ANSWER`` / ``answer: ANSWER`` (any case, "final answer" too): the rest of that line;
4. none of these: the whole response (for a number, its *last* number).

**What the label is.** :func:`parse_label` sorts a label into one of four kinds, and the response is read as
the same kind:

* ``number``: the label holds one number, units and words around it ignored ("9 apples", "18.69 dollars",
  "-1/3").  The prediction is the first number of the answer span (the last number of the response when it
  has no marker).  Numbers: an optional sign (``-`` or the Unicode minus, a sign only when not glued to a
  word or number: "3-5" is 3 and 5), thousands commas in groups of three ("1,000" = 1000; "1,5" is 1 and 5),
  decimals ("9" = "9.0" = "9.00", ".5" = 0.5), fractions "3/4" = 0.75.  Compared exactly (as fractions):
  "0.33" is not 1/3.  A percent sign is a unit like any other: "50%" = 50, never 0.5.  The canonical
  prediction is an integer ("9"), a terminating decimal ("0.75", "-0.125") or "p/q" ("1/3").
* ``ratio``: the label holds ``a:b`` (ratios, clock times, "9:03:36 a.m.").  Compared as the first
  ``a:b[:c...]`` (digits and colons, no spaces: "Step 1: 5" is no ratio) of the answer (the last one in the
  response without a marker) as a string, with "a.m."/"p.m." written "am"/"pm" when one follows it
  ("3:30 p.m." = "3:30 PM", but "3:30" is not "3:30 p.m.").  "18:14" is not "9:7", and a bare number
  ("9", "7") never matches a ratio.
* ``multi``: the label holds several answers separated by ``;`` ("60; 72", "8 km/hour; 3 km/hour").  The
  answer span (or the whole response) is split at ``;`` and each part read as its label part's kind; all
  parts must match, in order.
* ``text``: the label holds no number ("Yes", "Mrs. Hilt", "They are equal").  Compared as normalised text:
  lower case, "the"/"a"/"an" at the start dropped, punctuation other than apostrophes inside words dropped,
  whitespace collapsed.  The answer span (or the whole response) must equal it: "Yes, because 5 > 3" is
  refused for "Yes".

**Refused.** A response with no answer of the label's kind (no number for a number label, no ``a:b`` for a
ratio, fewer parts than a multi label, or empty text) scores 0 with prediction None.  An empty label is an
error (ValueError): a sample without a reference cannot be verified.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from fractions import Fraction

NUMBER = "number"
RATIO = "ratio"
MULTI = "multi"
TEXT = "text"

_MINUS = "\u2212"
# a number: sign (not glued to a word/number before it), thousands groups or plain digits, decimals, or ".5";
# then an optional "/ denominator"
_NUM = (r"(?<![\w.])[-\u2212]?(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?|(?<![\w.])[-\u2212]?\.\d+"
        r"|(?<=[\w.])(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?")
_NUMBER_RE = re.compile(rf"(?P<a>{_NUM})(?:\s*/\s*(?P<b>\d+(?:\.\d+)?)(?![\d/]))?")
_DATE_RE = re.compile(r"\d+(?:/\d+){2,}")
_RATIO_RE = re.compile(r"(?<![\d:])\d+(?::\d+)+(?![\d:])(?:\s*(?P<ampm>[ap])\.?\s?m\b\.?)?", re.IGNORECASE)
_HASH_RE = re.compile(r"####[ \t]*([^\n]*)")
_ANSWER_IS_RE = re.compile(r"\b(?:final\s+)?answer\s*(?:is\b\s*:?|:)[ \t]*([^\n]*)", re.IGNORECASE)
_BOX_RE = re.compile(r"\\(?:boxed|fbox)\s*\{")


@dataclass(frozen=True)
class Label:
    """A parsed label: its ``kind`` and ``value`` (the canonical answer string), ``parts`` for ``multi``."""

    kind: str
    value: str
    parts: tuple["Label", ...] = ()


# -- numbers ---------------------------------------------------------------------------------------------

def _to_fraction(text: str) -> Fraction:
    return Fraction(text.replace(",", "").replace(_MINUS, "-"))


def parse_numbers(text: str) -> list[Fraction]:
    """Every number in ``text``, in order, as an exact fraction (see the module docstring for the forms)."""
    out = []
    # a chain of two or more slashes is a date ("12/25/2020"), not fractions: its numbers stand alone
    text = _DATE_RE.sub(lambda m: m.group(0).replace("/", " "), text)
    for m in _NUMBER_RE.finditer(text):
        value = _to_fraction(m.group("a"))
        if m.group("b") is not None:
            den = _to_fraction(m.group("b"))
            if den == 0:  # "3/0": not a fraction; the numerator alone
                out.append(value)
                continue
            value = value / den
        out.append(value)
    return out


def canonical_number(value: Fraction) -> str:
    """``value`` as an integer, a terminating decimal, or "p/q" when its decimal does not end."""
    if value.denominator == 1:
        return str(value.numerator)
    den, twos, fives = value.denominator, 0, 0
    while den % 2 == 0:
        den, twos = den // 2, twos + 1
    while den % 5 == 0:
        den, fives = den // 5, fives + 1
    if den != 1:
        return f"{value.numerator}/{value.denominator}"
    places = max(twos, fives)
    scaled = abs(value) * 10 ** places
    digits = str(scaled.numerator).rjust(places + 1, "0")
    return ("-" if value < 0 else "") + digits[:-places] + "." + digits[-places:]


def normalise_number(text: str, last: bool = False) -> str | None:
    """The canonical form of the first (``last``: the last) number of ``text``; None when it has none.

    >>> normalise_number("9 apples"), normalise_number("1,000"), normalise_number("3/4")
    ('9', '1000', '0.75')
    """
    nums = parse_numbers(text)
    if not nums:
        return None
    return canonical_number(nums[-1] if last else nums[0])


# -- ratios and text -------------------------------------------------------------------------------------

def _canonical_ratio(m: re.Match) -> str:
    core = m.group(0)[:m.start("ampm") - m.start()].strip() if m.group("ampm") else m.group(0)
    return core + (f" {m.group('ampm').lower()}m" if m.group("ampm") else "")


def normalise_ratio(text: str, last: bool = False) -> str | None:
    """The first (``last``: the last) ``a:b[:c...]`` of ``text`` with its am/pm, normalised; None when none."""
    found = list(_RATIO_RE.finditer(text))
    if not found:
        return None
    return _canonical_ratio(found[-1] if last else found[0])


def normalise_text(text: str) -> str:
    """Lower case, no leading article, only letters/digits/inner apostrophes and single spaces."""
    t = text.lower().replace("\u2019", "'").replace("\u2018", "'")
    t = re.sub(r"\\text\{([^{}]*)\}", r"\1", t)
    t = re.sub(r"[^\w\s']|_", " ", t)
    t = re.sub(r"(?<!\w)'|'(?!\w)", " ", t)
    t = " ".join(t.split())
    return re.sub(r"^(?:the|a|an) ", "", t)


# -- where the answer is ---------------------------------------------------------------------------------

def _braced(text: str, start: int) -> str | None:
    """The contents of the brace group opening at ``text[start - 1] == '{'``; None when it never closes."""
    depth = 1
    for i in range(start, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[start:i]
    return None


def _simplify_latex(text: str) -> str:
    t = text
    for _ in range(8):  # \frac nested in \frac
        new = re.sub(r"\\[dt]?frac\s*\{([^{}]*)\}\s*\{([^{}]*)\}", r"(\1)/(\2)", t)
        new = re.sub(r"\\(?:text|textbf|mathrm|mbox)\s*\{([^{}]*)\}", r"\1", new)
        if new == t:
            break
        t = new
    t = re.sub(r"\((-?[\d.,]+)\)/\(([\d.,]+)\)", r"\1/\2", t)  # (3)/(4) -> 3/4
    t = t.replace("{,}", ",").replace("\\%", "%").replace("\\$", "$")
    t = re.sub(r"\\[,!;: ]", "", t)
    return t.replace("{", "").replace("}", "")


def answer_span(response: str) -> tuple[str, str] | None:
    """``(marker, text)`` of the final answer the response marks ("####", "boxed" or "answer is"), else None."""
    hashes = _HASH_RE.findall(response)
    if hashes:
        return "####", hashes[-1].strip()
    boxes = [m.end() for m in _BOX_RE.finditer(response)]
    for start in reversed(boxes):
        inner = _braced(response, start)
        if inner is not None:
            return "boxed", _simplify_latex(inner).strip()
    said = _ANSWER_IS_RE.findall(response)
    if said:
        return "answer is", said[-1].strip()
    return None


# -- labels and verdicts ---------------------------------------------------------------------------------

def parse_label(label: str) -> Label:
    """The kind and canonical value of a reference answer; ValueError when it is empty."""
    if label is None or not str(label).strip():
        raise ValueError("empty label: a sample without a reference answer cannot be verified")
    label = str(label).strip()
    if ";" in label:
        parts = tuple(parse_label(p) for p in label.split(";") if p.strip())
        if len(parts) > 1:
            return Label(MULTI, "; ".join(p.value for p in parts), parts)
        return parts[0]
    ratio = normalise_ratio(label)
    if ratio is not None:
        return Label(RATIO, ratio)
    number = normalise_number(label)
    if number is not None:
        return Label(NUMBER, number)
    return Label(TEXT, normalise_text(label))


def _read(text: str, kind: str, marked: bool) -> str | None:
    """The canonical answer of ``kind`` in ``text`` (an answer span when ``marked``, else a whole response)."""
    if kind == NUMBER:
        return normalise_number(text, last=not marked)
    if kind == RATIO:
        return normalise_ratio(text, last=not marked)
    return normalise_text(text) or None


def predict(response: str, label: Label) -> str | None:
    """The response's final answer, read as ``label``'s kind and normalised; None when it has none."""
    span = answer_span(response)
    text, marked = (span[1], True) if span else (response, False)
    if label.kind == MULTI:
        pieces = [p for p in text.split(";") if p.strip()]
        if len(pieces) != len(label.parts):
            return None
        read = [_read(p, part.kind, True) for p, part in zip(pieces, label.parts)]
        return None if any(r is None for r in read) else "; ".join(read)
    return _read(text, label.kind, marked)


def verify(response: str, label: str) -> tuple[float, str | None]:
    """``(score, prediction)``: 1.0 when the response's final answer equals ``label`` after normalisation,
    else 0.0; the prediction is the normalised answer (None when the response has none of the label's kind)."""
    parsed = parse_label(label)
    prediction = predict(response, parsed)
    return (1.0 if prediction is not None and prediction == parsed.value else 0.0), prediction


# -- the built-in reward ---------------------------------------------------------------------------------

def reward_func(queries: list[str], prompts: list[str], labels: list[str]) -> dict:
    """``builtin:math``: reward 1/0 per sample, ``extra_logs`` accuracy and answer_found, ``predictions``.

    The response is ``query[len(prompt):]`` (the whole query when it does not start with the prompt).
    A sample with an empty label raises ValueError (the reward function marks just that sample failed).
    """
    rewards, found, predictions = [], [], []
    for i, (query, prompt, label) in enumerate(zip(queries, prompts, labels)):
        if label is None or not str(label).strip():
            raise ValueError(f"math verifier: sample {i} has an empty label; builtin:math needs the reference "
                             f"answer in the data set's label key")
        response = query[len(prompt):] if prompt and query.startswith(prompt) else query
        score, prediction = verify(response, label)
        rewards.append(score)
        found.append(0.0 if prediction is None else 1.0)
        predictions.append(prediction)
    return {"rewards": rewards, "extra_logs": {"accuracy": list(rewards), "answer_found": found},
            "predictions": predictions}
