"""Peer liveness through the shared store, so a dead rank takes the whole job down quickly.

Every rank writes a heartbeat key every ``interval_s``; a daemon thread reads everyone's.  A peer
silent for ``dead_after_s`` (or a store that stops answering: it lives on global rank 0) ends this
process with exit code 1 and a message naming the dead rank, its roles and its host.  The first rank
to find a dead peer writes its finding to the store, and the others repeat it, so every rank names
the same culprit.

Under srun --kill-on-bad-exit the survivors of a dead rank get SIGTERM and, KillWait seconds later
(often 30 s, 5 s on small clusters), SIGKILL.  Once a stop signal has arrived (``urgent()`` true)
a peer silent for three heartbeat intervals already counts as dead, so the job still says who died.
"""
from __future__ import annotations

import datetime
import os
import socket
import sys
import threading
import time

import torch.distributed as dist

_VERDICT = "hb/verdict"


class Watchdog:
    def __init__(self, host: str, port: int, rank: int, world: int, describe, interval_s: float = 1.0,
                 dead_after_s: float = 20.0, urgent=lambda: False):
        self.rank, self.world, self.describe, self.urgent = rank, world, describe, urgent
        self.interval_s, self.dead_after_s = interval_s, dead_after_s
        self._store = dist.TCPStore(host, port, world, False, timeout=datetime.timedelta(seconds=dead_after_s))
        self._stop = threading.Event()
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

    def explain_failure(self) -> None:
        """Called when a collective failed: give the watchdog time to name a dead peer (it then ends the
        process with that message); return if every peer is alive, so the caller re-raises its error."""
        self._thread.join(timeout=self.dead_after_s + 5 * self.interval_s)

    def _beat(self) -> None:
        self._store.set(f"hb/{self.rank}", repr(time.time()))

    def dead_peers(self) -> list[int]:
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
                dead.append(r)
        return dead

    def _host(self, r: int) -> str:
        try:
            return self._store.get(f"hb/host/{r}").decode()
        except Exception:
            return "?"

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self._beat()
                if self._store.check([_VERDICT]):  # a peer already found the dead rank: repeat its finding
                    self._die(self._store.get(_VERDICT).decode(), publish=False)
                    return
                dead = self.dead_peers()
            except Exception as e:  # the store lives on rank 0: it is gone, or unreachable
                if self._stop.is_set():
                    return
                self._die(f"the rendezvous store on global rank 0 ({self.describe(0)}) stopped answering "
                          f"({type(e).__name__}); rank 0 has most likely died")
                return
            if dead and not self._stop.is_set():
                names = "; ".join(f"rank {r} ({self.describe(r)}, host {self._host(r)})" for r in dead)
                self._die(f"no heartbeat from {names}")
                return

    def _die(self, why: str, publish: bool = True) -> None:
        print(f"hpc-rlhf: rank {self.rank} ({self.describe(self.rank)}) stops the job: {why}",
              file=sys.stderr, flush=True)
        if publish:
            try:
                self._store.set(_VERDICT, why)
                if self.rank == 0:  # the store dies with this process: give the others time to read the verdict
                    time.sleep(3 * self.interval_s)
            except Exception:
                pass
        os._exit(1)
