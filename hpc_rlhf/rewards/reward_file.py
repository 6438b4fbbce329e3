"""The reward function file: what it defines and returns, importing it, and checking what it returned.

The file defines::

    def reward_func(queries: list[str], prompts: list[str], labels: list[str]):
        ...  # return a list of floats, a tensor [B], or a dict:
        return {"rewards": [...],                   # required, one number per sample, or one dict of named
                                                    # numbers per sample (reward components, summed to the reward)
                "scores": [...],                    # optional, one number per sample
                "extra_logs": {"acc": [...], ...},  # optional, per-sample lists/tensors or scalars
                "predictions": ["9", None, ...]}    # optional, one str or None per sample (maj@k votes on them)

``queries`` are the full texts (prompt + response), ``prompts`` the prompts, ``labels`` the references
from the data set.

Built-in reward functions need no file: ``builtin:NAME`` in place of the path (:data:`.builtins.BUILTINS`), e.g.
``builtin:math``, the math-answer verifier of :mod:`.math_verify`.
"""
from __future__ import annotations

import hashlib
import importlib.util
import numbers
import os
import sys
import traceback
from pathlib import Path
from typing import Callable

import torch

from .builtins import BUILTIN_PREFIX, builtin_reward
from .errors import RewardError, RewardFileError
from .types import component_rows

FUNC_NAME = "reward_func"


def load_reward_function(path) -> Callable:
    """Import the file at ``path`` and return its ``reward_func`` (``builtin:NAME``: that built-in function);
    :class:`RewardFileError` on any problem."""
    if str(path).startswith(BUILTIN_PREFIX):
        return builtin_reward(str(path))
    p = Path(os.path.expanduser(str(path)))
    if not p.is_file():
        raise RewardFileError(f"reward function file {p} does not exist" if not p.exists()
                              else f"reward function path {p} is not a file")
    resolved = p.resolve()
    name = "hpc_rlhf_reward_" + hashlib.sha1(str(resolved).encode()).hexdigest()[:12]
    spec = importlib.util.spec_from_file_location(name, resolved)
    if spec is None or spec.loader is None:
        raise RewardFileError(f"cannot import reward function file {p} (is it a .py file?)")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # so pickling / dataclasses inside the file can find their module
    # The file's folder is on sys.path while it is imported, so it can import helper modules next to it.
    folder = str(resolved.parent)
    added = folder not in sys.path
    if added:
        sys.path.insert(0, folder)
    try:
        spec.loader.exec_module(module)
    except SyntaxError as e:
        sys.modules.pop(name, None)
        raise RewardFileError(f"syntax error in reward function file {p}, line {e.lineno}: {e.msg}"
                              + (f": {e.text.strip()}" if e.text and e.text.strip() else "")) from e
    except Exception as e:
        sys.modules.pop(name, None)
        lines = [f.lineno for f in traceback.extract_tb(e.__traceback__) if f.filename == str(resolved)]
        at = f" at line {lines[-1]}" if lines else ""
        raise RewardFileError(f"importing reward function file {p} failed{at}: {type(e).__name__}: "
                              f"{one_line(e)}") from e
    finally:
        if added:
            try:
                sys.path.remove(folder)
            except ValueError:
                pass
    fn = getattr(module, FUNC_NAME, None)
    if fn is None:
        raise RewardFileError(f"reward function file {p} defines no `{FUNC_NAME}(queries, prompts, labels)`")
    if not callable(fn):
        raise RewardFileError(f"`{FUNC_NAME}` in {p} is a {type(fn).__name__}, not a function")
    return fn


def one_line(text, limit: int = 300) -> str:
    """``text`` (e.g. an exception) on one line, whitespace runs collapsed, cut to ``limit`` characters."""
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _as_vector(value, n: int) -> torch.Tensor:
    """``value`` as float64 [n]; otherwise ValueError describing ``value`` (it completes "returned ...")."""
    if isinstance(value, torch.Tensor):
        t = value.detach()
        if t.dtype.is_complex or not (t.dtype.is_floating_point or t.dtype in
                                      (torch.bool, torch.int8, torch.uint8, torch.int16, torch.int32,
                                       torch.int64)):
            raise ValueError(f"a tensor of dtype {t.dtype}; expected numbers")
        if t.ndim == 2 and t.shape[1] == 1:
            t = t[:, 0]
        if t.ndim != 1 or t.numel() != n:
            raise ValueError(f"a tensor of shape {tuple(value.shape)}; expected [{n}], one number per sample")
        return t.to("cpu", torch.float64)
    kind = type(value).__name__
    if isinstance(value, (str, bytes, dict)) or not hasattr(value, "__len__"):
        raise ValueError(f"a {kind}; expected a list of {n} numbers or a tensor")
    if hasattr(value, "tolist") and not isinstance(value, list):  # numpy arrays
        value = value.tolist()
    if len(value) != n:
        raise ValueError(f"a {kind} of length {len(value)} for {n} sample{'s' if n != 1 else ''}; expected one "
                         f"number per sample")
    vals = []
    for i, v in enumerate(value):
        if isinstance(v, torch.Tensor) and v.numel() == 1:
            v = v.item()
        if not isinstance(v, numbers.Real):
            raise ValueError(f"a {kind} whose value {i} is {_short(v)} ({type(v).__name__}); expected numbers")
        vals.append(float(v))
    return torch.tensor(vals, dtype=torch.float64)


def _short(value, limit: int = 40) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _is_scalar(v) -> bool:
    return isinstance(v, numbers.Real) or (isinstance(v, torch.Tensor) and v.numel() == 1 and v.ndim == 0)


def _predictions(value, n: int) -> list[str | None]:
    """``value`` as a list of ``n`` str-or-None; otherwise ValueError completing "returned a dict whose ..."."""
    kind = type(value).__name__
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"a dict whose 'predictions' is a {kind}; expected a list of {n} strings or None")
    if len(value) != n:
        raise ValueError(f"a dict whose 'predictions' is a {kind} of length {len(value)} for {n} "
                         f"sample{'s' if n != 1 else ''}; expected one string or None per sample")
    for i, v in enumerate(value):
        if v is not None and not isinstance(v, str):
            raise ValueError(f"a dict whose 'predictions' value {i} is {_short(v)} ({type(v).__name__}); "
                             f"expected a string or None")
    return list(value)


def _rewards(value, n: int, source: str, first: int):
    """The rewards (float64 [n]) and the components ((names, float64 [n, K]) or None) of a list of numbers, or of
    a list of dicts of named numbers (their sum is the reward)."""
    if not (isinstance(value, (list, tuple)) and any(isinstance(v, dict) for v in value)):
        return _as_vector(value, n), None
    if len(value) != n:
        raise ValueError(f"a {type(value).__name__} of length {len(value)} for {n} sample{'s' if n != 1 else ''}; "
                         f"expected one dict of reward components per sample")
    names, table = component_rows(value, source, first)
    return table.sum(1), (names, table)


def parse_output(out, n: int, source: str = "reward_func", first: int = 0):
    """Check a ``reward_func`` return for ``n`` samples (``first`` the index of the first in the caller's call,
    ``source`` the function's name in an error).

    Returns ``(rewards float64 [n], scores float64 [n] or None, logs {name: float64 [n] or float},
    predictions list of n str-or-None or None when the function returned none, components (names, float64 [n, K])
    or None when it returned plain numbers)``; otherwise ValueError whose message describes what was returned (it
    completes "reward_func returned ..."), or RewardError for components named differently (types.component_rows).
    Non-finite rewards are not an error here (the caller invalidates just those samples).
    """
    if out is None:
        raise ValueError("None; expected a dict with 'rewards', a tensor or a list of numbers")
    if not isinstance(out, dict):
        rewards, components = _rewards(out, n, source, first)
        return rewards, None, {}, None, components

    def entry(key: str, value) -> torch.Tensor:
        try:
            return _as_vector(value, n)
        except ValueError as e:
            raise ValueError(f"a dict whose {key} is {e}") from None

    if "rewards" not in out:
        raise ValueError(f"a dict without a 'rewards' key (keys: {sorted(map(str, out))})")
    try:
        rewards, components = _rewards(out["rewards"], n, source, first)
    except ValueError as e:
        raise ValueError(f"a dict whose 'rewards' is {e}") from None
    scores = entry("'scores'", out["scores"]) if out.get("scores") is not None else None
    extra = out.get("extra_logs") or {}
    if not isinstance(extra, dict):
        raise ValueError(f"a dict whose 'extra_logs' is a {type(extra).__name__}; expected a dict of "
                         f"name -> values")
    logs = {str(k): float(v) if _is_scalar(v) else entry(f"extra_logs[{k!r}]", v) for k, v in extra.items()}
    predictions = _predictions(out["predictions"], n) if out.get("predictions") is not None else None
    clash = sorted(set(components[0] if components else ()) & set(logs))
    if clash:
        raise RewardError(f"{source} returned {clash[0]!r} both as a reward component and in extra_logs: both are "
                          f"logged as reward/{clash[0]}")
    return rewards, scores, logs, predictions, components
