"""Rule-based rewards from a Python file that defines ``reward_func``.

The file defines::

    def reward_func(queries: list[str], prompts: list[str], labels: list[str]):
        ...  # return a list of floats, a tensor [B], or a dict:
        return {"rewards": [...],                   # required, one number per sample
                "scores": [...],                    # optional, one number per sample
                "extra_logs": {"acc": [...], ...}}  # optional, per-sample lists/tensors or scalars

``queries`` are the full texts (prompt + response), ``prompts`` the prompts, ``labels`` the references
from the data set.

:class:`RewardFunction` calls it batch by batch.  A batch that raises, times out or returns something
unusable marks its samples invalid; the error is logged with the file, the sample range and the traceback
on the ``hpc_rlhf.rewards`` logger and counted in ``extra["reward/func/failures"]``.  More than
``max_failure_fraction`` failed samples in one :meth:`RewardFunction.score` call raise :class:`RewardError`.

Timeouts use a worker thread, not a subprocess.  Each batch runs in its own daemon thread and the caller
waits at most ``timeout_s`` for it.  Python cannot kill a thread, so a call that never returns is abandoned:
it keeps running in the background (a daemon thread does not keep the process alive at exit) and training
goes on.  A thread was chosen over a subprocess because reward functions commonly hold large state
(tokenizers, parsers, models) that a subprocess would have to re-import or receive by pickling, and forking
a process that already runs torch threads is unsafe.  The price: a busy-looping hung call still competes for
the GIL, and abandoned threads pile up, so after ``max_abandoned`` of them are still alive further calls
raise :class:`RewardError` instead of leaking more.  Work that must be killable (e.g. running generated
code) belongs in a subprocess that ``reward_func`` starts and times out itself.

``extra`` of the result holds ``reward/func/failures`` (failed samples), ``reward/func/failed_batches``,
``reward/func/timeouts``, ``reward/func/time_s`` and, for each extra log ``name`` the function returned,
``reward/<name>``: its mean over the valid samples.
"""
from __future__ import annotations

import hashlib
import importlib.util
import logging
import math
import numbers
import os
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Callable

import torch

from .types import RewardBatch, RewardError, RewardFileError, merge_extras, check_inputs

log = logging.getLogger("hpc_rlhf.rewards")

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


class _Timeout(Exception):
    pass


class _CallError(Exception):
    """``reward_func`` raised in the worker thread: the exception and its formatted traceback."""

    def __init__(self, error: BaseException, tb: str):
        super().__init__(str(error))
        self.error, self.tb = error, tb


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


class RewardFunction:
    """Score samples with the ``reward_func`` of a file, in batches, with a per-batch timeout.

    ``timeout_s=None`` (or 0) calls the function directly in the caller's thread, without a timeout.
    The object may be used from several threads at once (the reward server does); ``reward_func`` is then
    called concurrently and must be thread-safe.
    """

    def __init__(self, path, batch_size: int = 64, timeout_s: float | None = 60.0,
                 max_failure_fraction: float = 0.5, max_abandoned: int = 4):
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if not 0.0 <= max_failure_fraction <= 1.0:
            raise ValueError(f"max_failure_fraction must be in [0, 1], got {max_failure_fraction}")
        self.path = str(path)
        self.fn = load_reward_function(path)
        self.batch_size = batch_size
        self.timeout_s = timeout_s if timeout_s else None
        self.max_failure_fraction = max_failure_fraction
        self.max_abandoned = max_abandoned
        self._abandoned: list[threading.Thread] = []
        self._lock = threading.Lock()

    # -- one batch -------------------------------------------------------------------------------------

    def _abandoned_alive(self) -> int:
        with self._lock:
            self._abandoned = [t for t in self._abandoned if t.is_alive()]
            return len(self._abandoned)

    def _call(self, queries, prompts, labels):
        if self.timeout_s is None:
            return self.fn(queries, prompts, labels)
        box: dict = {}
        done = threading.Event()

        def target():
            try:
                box["value"] = self.fn(queries, prompts, labels)
            except BaseException as e:  # noqa: BLE001 - reported to the caller below
                box["error"] = e
                box["tb"] = traceback.format_exc()
            finally:
                done.set()

        t = threading.Thread(target=target, daemon=True, name=f"reward_func:{Path(self.path).name}")
        t.start()
        if not done.wait(self.timeout_s):
            with self._lock:
                self._abandoned.append(t)
            raise _Timeout(f"reward_func did not return within {self.timeout_s:g} s (the call was abandoned "
                           "and may still be running in a background thread)")
        if "error" in box:
            raise _CallError(box["error"], box["tb"])
        return box["value"]

    # -- public ----------------------------------------------------------------------------------------

    def score(self, queries: list[str], prompts: list[str], labels: list[str] | None = None) -> RewardBatch:
        n = len(queries)
        labels = check_inputs(queries, prompts, labels)
        rewards = torch.full((n,), float("nan"), dtype=torch.float64)
        scores = torch.full((n,), float("nan"), dtype=torch.float64)
        valid = torch.zeros(n, dtype=torch.bool)
        errors: list[str] = []
        failed_batches = timeouts = 0
        log_parts: list[tuple[dict, float]] = []
        t0 = time.monotonic()
        for lo in range(0, n, self.batch_size):
            hi = min(lo + self.batch_size, n)
            where = f"reward function {self.path}, samples [{lo}, {hi})"
            alive = self._abandoned_alive()
            if alive >= self.max_abandoned:
                raise RewardError(f"{alive} timed-out calls of reward_func in {self.path} are still running; "
                                  "refusing to start more (fix the hang or raise timeout_s)")
            try:
                out = self._call(list(queries[lo:hi]), list(prompts[lo:hi]), list(labels[lo:hi]))
            except _Timeout as e:
                timeouts += 1
                failed_batches += 1
                msg = f"{where}: {e}"
                log.error("%s", msg)
                errors.append(msg)
                continue
            except Exception as e:  # noqa: BLE001 - a failing batch must not stop training
                failed_batches += 1
                err, tb = (e.error, e.tb) if isinstance(e, _CallError) else (e, traceback.format_exc())
                msg = f"{where} raised {type(err).__name__}: {err}"
                log.error("%s\n%s", msg, tb)
                errors.append(msg)
                continue
            try:
                r, s, logs = parse_output(out, hi - lo)
            except ValueError as e:
                failed_batches += 1
                msg = f"{where}: reward_func returned an unusable value: {e}"
                log.error("%s", msg)
                errors.append(msg)
                continue
            ok = torch.isfinite(r)
            if not bool(ok.all()):
                bad = (~ok).nonzero().flatten().tolist()
                msg = (f"{where}: reward_func returned non-finite rewards for {len(bad)} of {hi - lo} samples "
                       f"(batch indices {bad[:10]}{' ...' if len(bad) > 10 else ''}: "
                       f"{[r[i].item() for i in bad[:5]]})")
                log.error("%s", msg)
                errors.append(msg)
            rewards[lo:hi] = torch.where(ok, r, torch.nan)
            scores[lo:hi] = s if s is not None else r
            valid[lo:hi] = ok
            n_ok = int(ok.sum())
            means = {}
            for k, v in logs.items():
                if isinstance(v, torch.Tensor):
                    vals = v[ok & torch.isfinite(v)]
                    if vals.numel():
                        means[f"reward/{k}"] = float(vals.mean())
                elif math.isfinite(v):
                    means[f"reward/{k}"] = v
            log_parts.append((means, float(n_ok)))
        n_failed = int((~valid).sum())
        extra = merge_extras(log_parts)
        extra.update({"reward/func/failures": float(n_failed), "reward/func/failed_batches": float(failed_batches),
                      "reward/func/timeouts": float(timeouts), "reward/func/time_s": time.monotonic() - t0})
        if n and n_failed > self.max_failure_fraction * n:
            raise RewardError(f"{n_failed} of {n} reward samples failed (more than max_failure_fraction="
                              f"{self.max_failure_fraction:g}); first error: {errors[0]}")
        return RewardBatch(rewards=rewards.float(), valid=valid, extra=extra,
                           scores=torch.where(valid, scores, torch.nan).float(), errors=errors)

    __call__ = score
