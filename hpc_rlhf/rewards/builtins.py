"""The built-in reward functions (``builtin:NAME`` in place of a reward-function file) and the check of a reward
source before a run (no torch)."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Callable

from . import math_verify
from .errors import RewardFileError

BUILTIN_PREFIX = "builtin:"
# name -> the reward_func of a module shipped with the toolkit
BUILTINS: dict[str, Callable] = {"math": math_verify.reward_func}


def builtin_reward(spec: str) -> Callable:
    """The built-in reward function ``spec`` names (``builtin:NAME``); RewardFileError for an unknown NAME."""
    name = spec[len(BUILTIN_PREFIX):]
    if name not in BUILTINS:
        raise RewardFileError(f"unknown built-in reward {spec!r}; built-ins: "
                              + ", ".join(BUILTIN_PREFIX + n for n in sorted(BUILTINS)))
    return BUILTINS[name]


def check_reward_source(spec: str) -> None:
    """Before a run: ``spec`` names a known built-in or an existing file (RewardFileError otherwise)."""
    if str(spec).startswith(BUILTIN_PREFIX):
        builtin_reward(str(spec))
        return
    p = Path(os.path.expanduser(str(spec)))
    if not p.is_file():
        raise RewardFileError(f"{p} is not a file" if p.exists() else f"file {p} does not exist")
