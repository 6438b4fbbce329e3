"""Training data from scored rows: best-of-n (rejection sampling) SFT data, best/worst DPO pairs,
conditional-SFT data with a score prefix.

Rows are grouped by ``prompt_index`` when they have one (the output of `hpc-rlhf generate`), else by
the prompt text; groups keep the order in which their prompts first appear.  Within a group the
highest reward wins and ties go to the earlier row (lower ``sample_index``).
"""
from __future__ import annotations

import math

DEFAULT_SCORE_TEMPLATE = "<rm_score>: {score:.1f} "


def _check(n: int, row: dict, prompt_key: str, response_key: str, reward_key: str) -> None:
    """ValueError naming row ``n`` (1-based), the column and the flag that names it, for a row the builders cannot
    use: a prompt or response that is missing or not a string, a reward that is not a finite number."""
    for key, flag in ((prompt_key, "--prompt-key"), (response_key, "--response-key")):
        if not isinstance(row.get(key), str):
            raise ValueError(f"row {n}: {key!r} is missing or not a string (the column is set by {flag}; "
                             f"the row has {sorted(row)})")
    reward = row.get(reward_key)
    if isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(reward):
        raise ValueError(f"row {n}: {reward_key!r} is {reward!r}, expected a finite number (the column is set by "
                         "--reward-key)")


def _groups(rows: list[dict], prompt_key: str, response_key: str, reward_key: str) -> list[list[dict]]:
    groups: dict = {}
    for n, r in enumerate(rows, 1):
        _check(n, r, prompt_key, response_key, reward_key)
        key = ("index", r["prompt_index"]) if "prompt_index" in r else ("text", r[prompt_key])
        groups.setdefault(key, []).append(r)
    return list(groups.values())


def _best(group: list[dict], reward_key: str) -> dict:
    return max(enumerate(group), key=lambda ir: (ir[1][reward_key], -ir[0]))[1]


def _worst(group: list[dict], reward_key: str) -> dict:
    return min(enumerate(group), key=lambda ir: (ir[1][reward_key], ir[0]))[1]


def best_of_n(rows: list[dict], threshold: float | None = None, prompt_key: str = "prompt",
              response_key: str = "response", reward_key: str = "reward", input_key: str = "input",
              output_key: str = "output") -> list[dict]:
    """Rejection sampling: the best response of each prompt (only when its reward >= ``threshold``),
    as SFT rows ``{input_key: prompt, output_key: response, "reward": r}`` for `hpc-rlhf train sft`."""
    out = []
    for g in _groups(rows, prompt_key, response_key, reward_key):
        b = _best(g, reward_key)
        if threshold is not None and b[reward_key] < threshold:
            continue
        out.append({input_key: b[prompt_key], output_key: b[response_key], "reward": b[reward_key]})
    return out


def best_worst_pairs(rows: list[dict], min_margin: float = 0.0, prompt_key: str = "prompt",
                     response_key: str = "response", reward_key: str = "reward") -> list[dict]:
    """One ``{prompt, chosen, rejected, chosen_reward, rejected_reward}`` row per prompt whose best reward
    exceeds its worst by more than ``min_margin`` (groups of one, and ties, give no pair)."""
    out = []
    for g in _groups(rows, prompt_key, response_key, reward_key):
        b, w = _best(g, reward_key), _worst(g, reward_key)
        if len(g) < 2 or not b[reward_key] - w[reward_key] > min_margin:
            continue
        out.append({"prompt": b[prompt_key], "chosen": b[response_key], "rejected": w[response_key],
                    "chosen_reward": b[reward_key], "rejected_reward": w[reward_key]})
    return out


def score_prefix(score: float, template: str = DEFAULT_SCORE_TEMPLATE) -> str:
    """The conditional-SFT prefix for ``score`` (the template's ``{score}`` field, format spec allowed)."""
    return template.format(score=score)


def conditional_sft(rows: list[dict], template: str = DEFAULT_SCORE_TEMPLATE, prompt_key: str = "prompt",
                    response_key: str = "response", reward_key: str = "reward", input_key: str = "input",
                    output_key: str = "output") -> list[dict]:
    """Every scored row as SFT data whose input starts with its score: ``score_prefix(r) + prompt``.

    Generate with `prompt_prefix` set to ``score_prefix(desired score)`` to ask the trained model for a
    response of that quality.
    """
    if "{score" not in template:
        raise ValueError(f"template {template!r} has no {{score}} field")
    out = []
    for n, r in enumerate(rows, 1):
        _check(n, r, prompt_key, response_key, reward_key)
        reward = r[reward_key]
        out.append({input_key: score_prefix(reward, template) + r[prompt_key], output_key: r[response_key],
                    "reward": reward})
    return out
