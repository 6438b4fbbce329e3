"""Rule-based rewards from a Python file that defines ``reward_func`` (:mod:`.reward_file`: what it defines
and returns).

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

import logging
import math
import threading
import time
import traceback
from pathlib import Path

import torch

from .reward_file import load_reward_function, parse_output
from .types import RewardBatch, RewardError, merge_extras, check_inputs

log = logging.getLogger("hpc_rlhf.rewards")


class _Timeout(Exception):
    pass


class _CallError(Exception):
    """``reward_func`` raised in the worker thread: the exception and its formatted traceback."""

    def __init__(self, error: BaseException, tb: str):
        super().__init__(str(error))
        self.error, self.tb = error, tb


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
