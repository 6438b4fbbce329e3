"""Rule-based rewards from a Python file that defines ``reward_func`` (:mod:`.reward_file`: what it defines
and returns).

:class:`RewardFunction` calls it batch by batch.  A call that raises or returns something unusable is retried
on the two halves of its samples, and so on down to single samples; a half whose other half scored must hold
the failure, so it is split without being called.  One sample the function cannot score thus costs only that
sample, not its whole batch, for at most ``2 * log2(batch_size)`` extra calls that score one to two batches'
worth of samples in all; the function must give a sample the same reward whatever batch it is in.  Each sample
that fails on its own is invalid: the error (with the file, the sample and the traceback) is logged on the
``hpc_rlhf.rewards`` logger and counted in ``extra["reward/func/failures"]``.  A call that times out is not
retried: each retry of a sample that hangs would wait ``timeout_s`` again and leave one more abandoned thread,
so the samples of a timed-out call are invalid together.  Once more than ``max_failure_fraction`` of the
samples of one :meth:`RewardFunction.score` call have failed, it stops (the rest is not scored) and raises
:class:`RewardError`, one line naming the file, the function and the first failure.

Timeouts use a worker thread, not a subprocess.  Each call runs in its own daemon thread and the caller
waits at most ``timeout_s`` for it.  Python cannot kill a thread, so a call that never returns is abandoned:
it keeps running in the background (a daemon thread does not keep the process alive at exit) and training
goes on.  A thread was chosen over a subprocess because reward functions commonly hold large state
(tokenizers, parsers, models) that a subprocess would have to re-import or receive by pickling, and forking
a process that already runs torch threads is unsafe.  The price: a busy-looping hung call still competes for
the GIL, and abandoned threads pile up, so after ``max_abandoned`` of them are still alive further calls
raise :class:`RewardError` instead of leaking more.  Work that must be killable (e.g. running generated
code) belongs in a subprocess that ``reward_func`` starts and times out itself.

``extra`` of the result holds ``reward/func/failures`` (failed samples), ``reward/func/failed_batches``
(batches whose first call failed), ``reward/func/retries`` (calls made to find the failing samples),
``reward/func/timeouts``, ``reward/func/time_s`` and, for each extra log ``name`` the function returned,
``reward/<name>``: its mean over the valid samples.  When the function returns ``predictions`` the result
carries them, each at its sample whatever batch or retry scored it (None where the sample failed or a call
returned none); so it carries the reward components when the function returns a dict of named numbers per sample
(every call the same names, else :class:`RewardError`).
"""
from __future__ import annotations

import logging
import math
import threading
import time
import traceback
from pathlib import Path

import torch

from .reward_file import load_reward_function, one_line, parse_output
from .errors import RewardError
from .types import RewardBatch, merge_extras, check_inputs, same_components

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
            raise _Timeout(f"did not return within {self.timeout_s:g} s (the call was abandoned and may still "
                           "be running in a background thread)")
        if "error" in box:
            raise _CallError(box["error"], box["tb"])
        return box["value"]

    # -- public ----------------------------------------------------------------------------------------

    def score(self, queries: list[str], prompts: list[str], labels: list[str] | None = None) -> RewardBatch:
        labels = check_inputs(queries, prompts, labels)
        run = _Run(self, list(queries), list(prompts), list(labels))
        for lo in range(0, run.n, self.batch_size):
            run.settle(lo, min(lo + self.batch_size, run.n), first_try=True)
        extra = merge_extras(run.log_parts)
        extra.update({"reward/func/failures": float(run.failed),
                      "reward/func/failed_batches": float(run.failed_batches),
                      "reward/func/retries": float(run.retries), "reward/func/timeouts": float(run.timeouts),
                      "reward/func/time_s": time.monotonic() - run.t0})
        predictions = None
        if run.has_predictions:
            predictions = [p if ok else None for p, ok in zip(run.predictions, run.valid.tolist())]
        names = run.component_names or ()
        return RewardBatch(rewards=run.rewards.float(), valid=run.valid, extra=extra,
                           scores=torch.where(run.valid, run.scores, torch.nan).float(), errors=run.errors,
                           predictions=predictions, components=run.components.float() if names else None,
                           component_names=names)

    __call__ = score


class _Run:
    """The state of one :meth:`RewardFunction.score` call."""

    def __init__(self, rf: RewardFunction, queries: list[str], prompts: list[str], labels: list):
        self.rf, self.queries, self.prompts, self.labels = rf, queries, prompts, labels
        self.n = n = len(queries)
        self.rewards = torch.full((n,), float("nan"), dtype=torch.float64)
        self.scores = torch.full((n,), float("nan"), dtype=torch.float64)
        self.valid = torch.zeros(n, dtype=torch.bool)
        self.predictions: list[str | None] = [None] * n
        self.has_predictions = False  # some call returned predictions
        # the reward components' names (() for plain numbers) as the first call that scored returned them, from
        # sample names_from; their float64 [n, K] table (NaN until scored)
        self.component_names: tuple[str, ...] | None = None
        self.names_from = 0
        self.components = torch.empty(0)
        self.errors: list[str] = []  # one per failure behind invalid samples
        self.first_error: str | None = None  # the first failure of any call, for the RewardError
        self.failed = self.failed_batches = self.retries = self.timeouts = 0
        self.log_parts: list[tuple[dict, float]] = []
        self.t0 = time.monotonic()

    def settle(self, lo: int, hi: int, first_try: bool = False, failing: bool = False) -> bool:
        """Score samples [lo, hi); when the call fails (not by timeout), settle the two halves the same way.
        ``failing``: a call of these samples is known to fail (the larger range they belong to failed and its
        other half did not), so a range of several is split without calling it.  Returns whether no call failed."""
        if failing and hi - lo > 1:
            return self.split(lo, hi)
        rf = self.rf
        alive = rf._abandoned_alive()
        if alive >= rf.max_abandoned:
            raise RewardError(f"{rf.path}: {alive} timed-out calls of reward_func are still running; refusing to "
                              f"start more (fix the hang or raise the timeout)")
        where = f"sample {lo}" if hi - lo == 1 else f"samples [{lo}, {hi})"
        self.retries += not first_try
        tb = None
        try:
            out = rf._call(self.queries[lo:hi], self.prompts[lo:hi], self.labels[lo:hi])
        except _Timeout as e:
            self.timeouts += 1
            self.failed_batches += first_try
            self.fail(where, str(e), hi - lo)
            return False
        except Exception as e:  # noqa: BLE001 - a failing call must not stop training
            err, tb = (e.error, e.tb) if isinstance(e, _CallError) else (e, traceback.format_exc())
            problem = f"raised {type(err).__name__}: {one_line(err)}"
        else:
            try:
                parsed = parse_output(out, hi - lo, f"{rf.path}: reward_func", lo)
            except ValueError as e:
                problem = f"returned {e}"
            else:
                self.accept(lo, hi, where, *parsed)
                return True
        self.failed_batches += first_try
        if hi - lo == 1:
            self.fail(where, problem, 1, tb)
            return False
        self.first_error = self.first_error or f"on {where} it {problem}"
        log.warning("%s: reward_func on %s %s; retrying on halves of the batch to find the samples it fails on",
                    rf.path, where, problem)
        return self.split(lo, hi)

    def split(self, lo: int, hi: int) -> bool:
        """Settle the halves of [lo, hi), whose call failed: when the first half scores, the second must hold
        the failure."""
        mid = (lo + hi) // 2
        self.settle(mid, hi, failing=self.settle(lo, mid))
        return False

    def fail(self, where: str, problem: str, count: int, tb: str | None = None) -> None:
        """``count`` samples failed: log and count them; RewardError once too many of the call's samples failed."""
        msg = f"{self.rf.path}: reward_func on {where} {problem}"
        if tb:
            log.error("%s\n%s", msg, tb)
        else:
            log.error("%s", msg)
        self.errors.append(msg)
        self.first_error = self.first_error or f"on {where} it {problem}"
        self.failed += count
        rf = self.rf
        if self.failed > rf.max_failure_fraction * self.n:
            raise RewardError(f"{rf.path}: reward_func failed on {self.failed} of {self.n} samples, more than "
                              f"max_failure_fraction={rf.max_failure_fraction:g} allows; first failure: "
                              f"{self.first_error}")

    def accept(self, lo: int, hi: int, where: str, r: torch.Tensor, s: torch.Tensor | None, logs: dict,
               predictions: list[str | None] | None, components: tuple | None) -> None:
        ok = torch.isfinite(r)
        names = components[0] if components is not None else ()
        if self.component_names is None:
            self.component_names, self.names_from = names, lo
            self.components = torch.full((self.n, len(names)), float("nan"), dtype=torch.float64)
        same_components(names, self.component_names, f"{self.rf.path}: reward_func", lo, self.names_from)
        if names:
            self.components[lo:hi] = torch.where(ok[:, None], components[1], torch.nan)
        if predictions is not None:
            self.predictions[lo:hi] = predictions
            self.has_predictions = True
        self.rewards[lo:hi] = torch.where(ok, r, torch.nan)
        self.scores[lo:hi] = s if s is not None else r
        self.valid[lo:hi] = ok
        means = {}
        for k, v in logs.items():
            if isinstance(v, torch.Tensor):
                vals = v[ok & torch.isfinite(v)]
                if vals.numel():
                    means[f"reward/{k}"] = float(vals.mean())
            elif math.isfinite(v):
                means[f"reward/{k}"] = v
        self.log_parts.append((means, float(ok.sum())))
        if not bool(ok.all()):
            bad = (~ok).nonzero().flatten().tolist()
            self.fail(where, f"returned non-finite rewards for {len(bad)} of {hi - lo} samples (samples "
                             f"{[lo + i for i in bad[:10]]}{' ...' if len(bad) > 10 else ''}: "
                             f"{[r[i].item() for i in bad[:5]]})", len(bad))
