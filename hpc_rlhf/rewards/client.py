"""Client of one or more reward servers (:mod:`.server`): :class:`RemoteReward`.

A :meth:`RemoteReward.score` call splits the samples into batches and sends them concurrently.  Batch ``i``
starts on URL ``(k + i) % len(urls)``, where ``k`` advances with every call, so the load spreads over the
servers even when calls are small.  A failed try (connection error, timeout, HTTP 5xx/408/429, malformed
answer) moves that batch to the next URL after ``backoff_s * 2**(try - 1)`` seconds; other 4xx answers
(bad token, too large, bad request) are not retried since another try would get the same answer.  After
``retries`` retries (``retries + 1`` tries) the batch's samples are invalid; the failure is logged on the
``hpc_rlhf.rewards`` logger with every URL tried and its error, and counted.

Samples the server itself could not score (``valid`` false in its answer) are invalid too, with the
server's error messages.  The servers' ``predictions`` (when they send them) are kept at their samples (None
where a sample is invalid), and so are the reward components of an answer whose rewards are dicts of named
numbers (every batch the same names, else :class:`RewardError`).  More than ``max_failure_fraction`` invalid
samples raise :class:`RewardError`.

``extra`` holds ``reward/remote/requests/<i>`` (HTTP requests sent to ``urls[i]`` by this call, failed ones
included), ``reward/remote/failures`` (invalid samples), ``reward/remote/failed_batches``,
``reward/remote/retries`` and the servers' own extras merged (counts summed, means weighted by valid samples).

Proxies from the environment (``http_proxy`` ...) are ignored: reward servers are cluster-internal.
"""
from __future__ import annotations

import http.client
import json
import logging
import socket
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import torch

from .errors import RewardError
from .types import RewardBatch, merge_extras, check_inputs, component_rows, same_components

log = logging.getLogger("hpc_rlhf.rewards")

_RETRY_STATUS = {408, 429}
_MAX_BACKOFF_S = 30.0


class _TryError(Exception):
    def __init__(self, message: str, retry: bool = True):
        super().__init__(message)
        self.retry = retry


class RemoteReward:
    """Score samples on the reward servers at ``urls`` (``http://host:port``, without ``/score``)."""

    def __init__(self, urls: list[str] | str, token: str | None = None, timeout_s: float = 30.0, retries: int = 3,
                 batch_size: int = 64, backoff_s: float = 0.5, max_failure_fraction: float = 0.5,
                 max_concurrency: int | None = None):
        urls = [urls] if isinstance(urls, str) else list(urls)
        if not urls:
            raise ValueError("RemoteReward needs at least one URL")
        for u in urls:
            if not u.startswith(("http://", "https://")):
                raise ValueError(f"reward server URL {u!r} must start with http:// or https://")
        if batch_size < 1 or retries < 0:
            raise ValueError(f"batch_size must be >= 1 and retries >= 0, got {batch_size}, {retries}")
        if not 0.0 <= max_failure_fraction <= 1.0:
            raise ValueError(f"max_failure_fraction must be in [0, 1], got {max_failure_fraction}")
        self.urls = [u.rstrip("/") for u in urls]
        self.token = token
        self.timeout_s = timeout_s
        self.retries = retries
        self.batch_size = batch_size
        self.backoff_s = backoff_s
        self.max_failure_fraction = max_failure_fraction
        self.max_concurrency = max_concurrency or 8 * len(self.urls)
        self.total_requests = [0] * len(self.urls)  # over the object's lifetime
        self._next_start = 0
        self._lock = threading.Lock()
        self._opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))

    # -- one HTTP request ------------------------------------------------------------------------------

    def _post(self, url: str, payload: bytes) -> dict:
        headers = {"Content-Type": "application/json"}
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        req = urllib.request.Request(url + "/score", data=payload, headers=headers, method="POST")
        try:
            with self._opener.open(req, timeout=self.timeout_s) as resp:
                body = resp.read()
        except urllib.error.HTTPError as e:
            try:
                detail = json.loads(e.read().decode("utf-8", "replace")).get("error", "")
            except Exception:  # noqa: BLE001 - the status says enough
                detail = ""
            retry = e.code >= 500 or e.code in _RETRY_STATUS
            raise _TryError(f"HTTP {e.code} {e.reason}" + (f": {detail}" if detail else ""), retry=retry) from None
        except urllib.error.URLError as e:
            raise _TryError(f"connection failed: {e.reason}") from None
        except (socket.timeout, TimeoutError):
            raise _TryError(f"no answer within {self.timeout_s:g} s") from None
        except (OSError, http.client.HTTPException) as e:
            raise _TryError(f"connection failed: {type(e).__name__}: {e}") from None
        try:
            return json.loads(body.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise _TryError(f"answer is not JSON: {e}") from None

    @staticmethod
    def _check_answer(ans, n: int, source: str = "reward server", first: int = 0):
        if not isinstance(ans, dict) or not isinstance(ans.get("rewards"), list) or not isinstance(ans.get("valid"),
                                                                                                   list):
            raise _TryError("answer lacks the rewards/valid lists")
        if len(ans["rewards"]) != n or len(ans["valid"]) != n:
            raise _TryError(f"answer has {len(ans['rewards'])} rewards / {len(ans['valid'])} valid for {n} samples")
        components = None
        read = [r if v else None for r, v in zip(ans["rewards"], ans["valid"])]  # an invalid sample's is not read
        if any(isinstance(r, dict) for r in read):  # reward components: the reward is their sum
            try:
                components = component_rows(read, source, first)
            except ValueError as e:
                raise _TryError(f"answer's rewards are {e}") from None
            ans = {**ans, "rewards": components[1].sum(1).tolist()}
        rewards, valid = [], []
        for r, v in zip(ans["rewards"], ans["valid"]):
            ok = bool(v) and isinstance(r, (int, float)) and not isinstance(r, bool)
            valid.append(ok)
            rewards.append(float(r) if ok else float("nan"))
        extra = ans.get("extra") if isinstance(ans.get("extra"), dict) else {}
        extra = {k: float(v) for k, v in extra.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        errors = [str(e) for e in ans.get("errors") or []]
        predictions = ans.get("predictions")
        if predictions is not None:
            if not isinstance(predictions, list) or len(predictions) != n or \
                    any(p is not None and not isinstance(p, str) for p in predictions):
                raise _TryError(f"answer's predictions are not a list of {n} strings or nulls")
            predictions = [p if ok else None for p, ok in zip(predictions, valid)]
        return rewards, valid, extra, errors, predictions, components

    # -- one batch -------------------------------------------------------------------------------------

    def _score_batch(self, lo: int, hi: int, start: int, payload: bytes, counts: list[int]):
        tried: list[str] = []
        n_url = len(self.urls)
        for attempt in range(self.retries + 1):
            if attempt:
                time.sleep(min(self.backoff_s * 2 ** (attempt - 1), _MAX_BACKOFF_S))
            i = (start + attempt) % n_url
            with self._lock:
                counts[i] += 1
                self.total_requests[i] += 1
            try:
                rewards, valid, extra, errors, predictions, components = self._check_answer(
                    self._post(self.urls[i], payload), hi - lo, f"reward server {self.urls[i]}", lo)
                return {"rewards": rewards, "valid": valid, "extra": extra, "errors": errors,
                        "predictions": predictions, "components": components, "tries": attempt + 1}
            except _TryError as e:
                tried.append(f"{self.urls[i]}: {e}")
                if not e.retry:
                    break
        msg = (f"reward servers failed samples [{lo}, {hi}) after {len(tried)} tries: " + "; ".join(tried))
        log.error("%s", msg)
        return {"error": msg, "tries": len(tried)}

    # -- public ----------------------------------------------------------------------------------------

    def score(self, queries: list[str], prompts: list[str], labels: list[str] | None = None) -> RewardBatch:
        n = len(queries)
        labels = check_inputs(queries, prompts, labels)
        ranges = [(lo, min(lo + self.batch_size, n)) for lo in range(0, n, self.batch_size)]
        with self._lock:  # the next call starts where this one's round robin ends
            first = self._next_start
            self._next_start = (first + max(len(ranges), 1)) % len(self.urls)
        counts = [0] * len(self.urls)
        jobs = []
        for b, (lo, hi) in enumerate(ranges):
            payload = json.dumps({"queries": list(queries[lo:hi]), "prompts": list(prompts[lo:hi]),
                                  "labels": list(labels[lo:hi])}).encode()
            jobs.append((lo, hi, (first + b) % len(self.urls), payload))
        if len(jobs) == 1:
            results = [self._score_batch(*jobs[0], counts)]
        elif jobs:
            with ThreadPoolExecutor(max_workers=min(len(jobs), self.max_concurrency),
                                    thread_name_prefix="reward-client") as pool:
                results = list(pool.map(lambda j: self._score_batch(*j, counts), jobs))
        else:
            results = []

        rewards = torch.full((n,), float("nan"))
        valid = torch.zeros(n, dtype=torch.bool)
        predictions: list[str | None] = [None] * n
        has_predictions = False
        names: tuple[str, ...] | None = None  # the components' names (() for plain numbers) of the first answer
        components = torch.empty(0)
        errors: list[str] = []
        parts = []
        failed_batches = retries = 0
        for (lo, hi, _, _), res in zip(jobs, results):
            retries += res["tries"] - 1
            if "error" in res:
                failed_batches += 1
                errors.append(res["error"])
                continue
            rewards[lo:hi] = torch.tensor(res["rewards"])
            valid[lo:hi] = torch.tensor(res["valid"], dtype=torch.bool)
            if res["predictions"] is not None:
                predictions[lo:hi] = res["predictions"]
                has_predictions = True
            got = res["components"] or ((), None)
            if names is None:
                names, names_from = got[0], lo
                components = torch.full((n, len(names)), float("nan"))
            same_components(got[0], names, "reward servers", lo, names_from)
            if names:
                components[lo:hi] = got[1].float()
            if res["errors"]:
                errors.extend(res["errors"])
                log.error("reward server marked %d of samples [%d, %d) failed: %s", hi - lo - sum(res["valid"]),
                          lo, hi, res["errors"][0])
            parts.append((res["extra"], float(sum(res["valid"]))))
        n_failed = int((~valid).sum())
        extra = merge_extras(parts)
        extra.update({f"reward/remote/requests/{i}": float(c) for i, c in enumerate(counts)})
        extra.update({"reward/remote/failures": float(n_failed), "reward/remote/failed_batches": float(failed_batches),
                      "reward/remote/retries": float(retries)})
        if n and n_failed > self.max_failure_fraction * n:
            first_err = errors[0] if errors else "the servers marked the samples invalid"
            raise RewardError(f"{n_failed} of {n} remote reward samples failed (more than max_failure_fraction="
                              f"{self.max_failure_fraction:g}); first error: {first_err}")
        return RewardBatch(rewards=rewards, valid=valid, extra=extra, errors=errors,
                           predictions=predictions if has_predictions else None,
                           components=components if names else None, component_names=names or ())

    __call__ = score
