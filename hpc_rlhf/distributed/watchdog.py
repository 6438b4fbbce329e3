"""Peer liveness through the shared store, and one verdict per job naming the rank that brought it down.

Every rank writes a heartbeat key every ``interval_s``; a daemon thread reads everyone's.  A peer silent for
``dead_after_s`` (or a store that stops answering) ends this process with exit code 1 and a message naming
the dead rank, its roles and its host.

The verdict (store key ``hb/verdict``, the first one written stays) says which rank brought the job down
and why.  It is written by whoever learns it first: a watchdog that finds a dead peer, a rank whose own code
raised (``Watchdog.fail``: the rank reports its error at once, it does not wait for anything), or the local
launcher when it sees a rank killed by a signal.  Every other rank's watchdog reads it within ``interval_s``
and ends its process repeating it, so every log, the launcher's included, names the same culprit.

The store lives in the local launcher, or under srun on global rank 0.  A rank hosting it waits before it
exits until its peers have read the verdict (at most three heartbeat intervals).

Under srun --kill-on-bad-exit the survivors of a dead rank get SIGTERM and, KillWait seconds later
(often 30 s, 5 s on small clusters), SIGKILL.  Once a stop signal has arrived (``urgent()`` true, asked
from this thread: it must not wait for the main thread, which may be inside a collective) a peer silent for
three heartbeat intervals already counts as dead, so the job still says who died.
"""
from __future__ import annotations

import datetime
import os
import socket
import sys
import threading
import time

import torch.distributed as dist

from .steprecord import note_exit, note_verdict

_VERDICT = "hb/verdict"  # "CULPRIT_RANK why"
_ENDED = "hb/ended"  # how many ranks have ended on the verdict


def publish_verdict(store: dist.Store, culprit: int, why: str) -> tuple[int, str]:
    """Record that global rank ``culprit`` brought the job down, and why, unless a verdict is already
    there; returns the verdict that stands: (culprit, why)."""
    return _parse(store.compare_set(_VERDICT, "", f"{culprit} {why}"))


def read_verdict(store: dist.Store) -> tuple[int, str] | None:
    return _parse(store.get(_VERDICT)) if store.check([_VERDICT]) else None


def _parse(raw: bytes) -> tuple[int, str]:
    culprit, _, why = raw.decode().partition(" ")
    return int(culprit), why


def from_torch_distributed(error: BaseException) -> bool:
    """Whether ``error`` came out of a collective or the store, where a peer's death is the usual cause.
    gloo raises a plain RuntimeError whose text starts with its source file's path."""
    return isinstance(error, dist.DistError) or (isinstance(error, RuntimeError) and "gloo" in str(error))


class Watchdog:
    def __init__(self, host: str, port: int, rank: int, world: int, describe, interval_s: float = 1.0,
                 dead_after_s: float = 20.0, urgent=lambda: False, store_host: int | None = 0):
        """``store_host``: the global rank hosting the store (rank 0 under srun), None for the local launcher."""
        self.rank, self.world, self.describe, self.urgent = rank, world, describe, urgent
        self.interval_s, self.dead_after_s, self.store_host = interval_s, dead_after_s, store_host
        self._store = dist.TCPStore(host, port, world, False, timeout=datetime.timedelta(seconds=dead_after_s))
        # A connection that never carries a request: it reads end-of-file once the store's host is gone.  Checked
        # before every use of the store, it spares the logs the C++ stack trace that torch prints (whatever the
        # Python code does) when a store call meets a closed connection.
        self._probe = socket.create_connection((host, port), timeout=dead_after_s)
        self._probe.setblocking(False)
        self._stop = threading.Event()
        self.on_die = None  # called with the verdict just before the watchdog ends the process (the attempt record)
        # the SLURM node name (several virtual nodes may share a host), else the host name
        self._store.set(f"hb/host/{rank}", os.environ.get("SLURMD_NODENAME") or socket.gethostname())
        self._thread = threading.Thread(target=self._run, name="hpc_rlhf-watchdog", daemon=True)

    def start(self) -> "Watchdog":
        self._beat()
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=self.interval_s * 5)
        self._probe.close()

    def explain_failure(self) -> None:
        """Called when a collective failed: give the watchdog time to name the peer that caused it (it then
        ends the process with the verdict); return if none is named, so the caller reports its error as
        its own.  Without peers there is nothing to wait for."""
        if self.world > 1:
            self._thread.join(timeout=self.dead_after_s + 5 * self.interval_s)

    def fail(self, error: BaseException) -> None:
        """This rank's own code raised ``error``: publish it as the verdict (the peers stop, naming this
        rank) and return, so that the caller re-raises it at once."""
        self.stop()
        first_line = (str(error).splitlines() or [""])[0]
        why = f"rank {self.rank} ({self.describe(self.rank)}) failed: {type(error).__name__}: {first_line}"
        try:
            if publish_verdict(self._store, self.rank, why) == (self.rank, why):
                note_verdict(self.rank, self._host(self.rank), why)
            self._store.add(_ENDED, 1)
        except Exception:  # the store is gone with its host: the peers' watchdogs find out on their own
            return
        self._linger()

    def _check_store(self) -> None:
        try:
            closed = self._probe.recv(1) == b""
        except BlockingIOError:  # open, nothing to read
            return
        except OSError:
            closed = True
        if closed:
            raise ConnectionError("connection closed")

    def _beat(self) -> None:
        self._store.set(f"hb/{self.rank}", repr(time.time()))

    def dead_peers(self) -> list[int]:
        """The peers silent past the limit, the longest silent first (under srun's SIGTERM, the first to die)."""
        now = time.time()
        limit = min(self.dead_after_s, 3 * self.interval_s) if self.urgent() else self.dead_after_s
        dead = []
        for r in range(self.world):
            if r == self.rank:
                continue
            try:
                last = float(self._store.get(f"hb/{r}").decode()) if self._store.check([f"hb/{r}"]) else None
            except Exception:
                last = None
            if last is not None and now - last > limit:
                dead.append((last, r))
        return [r for _, r in sorted(dead)]

    def _host(self, r: int) -> str:
        try:
            return self._store.get(f"hb/host/{r}").decode()
        except Exception:
            return "?"

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self._check_store()
                self._beat()
                verdict = read_verdict(self._store)
                dead = [] if verdict else self.dead_peers()
            except Exception as e:  # the store's host is gone, or unreachable
                if not self._stop.is_set():
                    h, error = self.store_host, type(e).__name__
                    self._die(f"the local launcher's rendezvous store stopped answering ({error}); the launcher "
                              "has most likely died" if h is None else
                              f"the rendezvous store on global rank {h} ({self.describe(h)}) stopped answering "
                              f"({error}); rank {h} has most likely died", store_alive=False)
                return
            if self._stop.is_set():
                return
            if verdict:
                self._die(verdict[1])
            if dead:
                names = "; ".join(f"rank {r} ({self.describe(r)}, host {self._host(r)})" for r in dead)
                self._die(f"no heartbeat from {names}", culprit=dead[0])

    def _die(self, why: str, culprit: int | None = None, store_alive: bool = True) -> None:
        """End the process (exit code 1) printing the verdict: ``why`` about rank ``culprit`` becomes the
        verdict unless another came first; without a culprit ``why`` is the verdict as read."""
        if store_alive:
            try:
                if culprit is not None:
                    ours = why
                    _, why = publish_verdict(self._store, culprit, why)
                    if why == ours:
                        note_verdict(culprit, self._host(culprit), why)
                self._store.add(_ENDED, 1)
            except Exception:
                store_alive = False
        print(f"hpc-rlhf: rank {self.rank} ({self.describe(self.rank)}) stops the job: {why}",
              file=sys.stderr, flush=True)
        if self.on_die is not None:
            self.on_die(why)
        if store_alive:
            self._linger()
        note_exit(1)
        os._exit(1)

    def _linger(self) -> None:
        """The rank hosting the store: wait until every rank has ended on the verdict (killed ranks never
        do: at most three heartbeat intervals), since the store, and the verdict, die with this process."""
        deadline = time.time() + 3 * self.interval_s
        while self.store_host == self.rank and self._store.add(_ENDED, 0) < self.world and time.time() < deadline:
            time.sleep(0.05)
