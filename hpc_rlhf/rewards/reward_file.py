"""The reward function file: what it defines and returns, importing it, and checking what it returned.

The file defines::

    def reward_func(queries: list[str], prompts: list[str], labels: list[str]):
        ...  # return a list of floats, a tensor [B], or a dict:
        return {"rewards": [...],                   # required, one number per sample
                "scores": [...],                    # optional, one number per sample
                "extra_logs": {"acc": [...], ...}}  # optional, per-sample lists/tensors or scalars

``queries`` are the full texts (prompt + response), ``prompts`` the prompts, ``labels`` the references
from the data set.
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

from .types import RewardFileError

FUNC_NAME = "reward_func"


def load_reward_function(path) -> Callable:
    """Import the file at ``path`` and return its ``reward_func``; :class:`RewardFileError` on any problem."""
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
                              + (f"\n    {e.text.rstrip()}" if e.text else "")) from e
    except Exception as e:
        sys.modules.pop(name, None)
        raise RewardFileError(f"importing reward function file {p} failed: {type(e).__name__}: {e}\n"
                              + traceback.format_exc()) from e
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


def _as_vector(value, n: int, what: str) -> torch.Tensor:
    """``value`` as float64 [n]; ValueError naming ``what`` and the problem otherwise."""
    if isinstance(value, torch.Tensor):
        t = value.detach()
        if t.dtype.is_complex or not (t.dtype.is_floating_point or t.dtype in
                                      (torch.bool, torch.int8, torch.uint8, torch.int16, torch.int32,
                                       torch.int64)):
            raise ValueError(f"{what} is a tensor of dtype {t.dtype}; expected numbers")
        if t.ndim == 2 and t.shape[1] == 1:
            t = t[:, 0]
        if t.ndim != 1:
            raise ValueError(f"{what} has shape {tuple(t.shape)}; expected [{n}]")
        t = t.to("cpu", torch.float64)
    elif isinstance(value, (str, bytes, dict)) or not hasattr(value, "__len__"):
        raise ValueError(f"{what} is a {type(value).__name__}; expected a list of {n} numbers or a tensor")
    else:
        if hasattr(value, "tolist") and not isinstance(value, list):  # numpy arrays
            value = value.tolist()
        vals = []
        for i, v in enumerate(value):
            if isinstance(v, torch.Tensor) and v.numel() == 1:
                v = v.item()
            if not isinstance(v, numbers.Real):
                raise ValueError(f"{what}[{i}] is {v!r} ({type(v).__name__}); expected a number")
            vals.append(float(v))
        t = torch.tensor(vals, dtype=torch.float64)
    if t.numel() != n:
        raise ValueError(f"{what} has {t.numel()} entries for a batch of {n} samples")
    return t


def _is_scalar(v) -> bool:
    return isinstance(v, numbers.Real) or (isinstance(v, torch.Tensor) and v.numel() == 1 and v.ndim == 0)


def parse_output(out, n: int):
    """Check a ``reward_func`` return for ``n`` samples.

    Returns ``(rewards float64 [n], scores float64 [n] or None, logs {name: float64 [n] or float})``;
    ValueError saying what is wrong otherwise.  Non-finite rewards are not an error here (the caller
    invalidates just those samples).
    """
    scores = None
    logs: dict = {}
    if isinstance(out, dict):
        if "rewards" not in out:
            raise ValueError(f"returned a dict without a 'rewards' key (keys: {sorted(map(str, out))})")
        rewards = _as_vector(out["rewards"], n, "rewards")
        if out.get("scores") is not None:
            scores = _as_vector(out["scores"], n, "scores")
        extra = out.get("extra_logs") or {}
        if not isinstance(extra, dict):
            raise ValueError(f"extra_logs is a {type(extra).__name__}; expected a dict of name -> values")
        for k, v in extra.items():
            if _is_scalar(v):
                logs[str(k)] = float(v)
            else:
                logs[str(k)] = _as_vector(v, n, f"extra_logs[{k!r}]")
    elif out is None:
        raise ValueError("returned None; expected a dict with 'rewards', a tensor or a list of numbers")
    else:
        rewards = _as_vector(out, n, "rewards")
    return rewards, scores, logs
