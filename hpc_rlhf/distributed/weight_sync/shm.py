"""What the two shared-memory transports share: where their files go, the leader's offer of a new file to the
members of the ``weights`` bridge, and its answer.  A file is mapped by a member only on the leader's host; the
leader removes its name once every member has answered (mapped or not), so a file is left behind only if the
leader dies in between."""
from __future__ import annotations

import logging
import os
import socket
import uuid
from pathlib import Path
from typing import Callable

from ..collectives import Bridge

log = logging.getLogger(__name__)

SHM_DIR = Path("/dev/shm")


def writable() -> bool:
    """Whether this host can hold the shared-memory transports' files."""
    return SHM_DIR.is_dir() and os.access(SHM_DIR, os.W_OK)


def host() -> str:
    return os.environ.get("SLURMD_NODENAME") or socket.gethostname()


def create(make: Callable[[Path], object], what: str):
    """Leader: ``(make(path), path)`` for a new file under /dev/shm, or None (logged) when there is no room for it."""
    path = SHM_DIR / f"hpc_rlhf-weights-{os.getpid()}-{uuid.uuid4().hex}"
    try:
        return make(path), path
    except (OSError, RuntimeError) as e:
        path.unlink(missing_ok=True)
        log.info("weight sync: no %s under %s: %s", what, SHM_DIR, e)
        return None


def announce(bridge: Bridge, offer: tuple | None) -> list[bool] | None:
    """Leader: broadcast ``offer`` (host, path, ...; None: nothing offered), gather whether each member of the
    bridge took it, and remove the file's name, which every member has answered."""
    bridge.broadcast_object(offer, 0)
    if offer is None:
        return None
    taken = bridge.all_gather_object(True)
    Path(offer[1]).unlink(missing_ok=True)
    return taken


def answer(bridge: Bridge, open_offer: Callable[[tuple], object | None]):
    """A rollout rank, collective with ``announce``: (the offer, what ``open_offer`` made of it when this rank is on
    the leader's host and could open it, else None, and every member's answer); (None, None, None) when nothing
    was offered."""
    offer = bridge.broadcast_object(None, 0)
    if offer is None:
        return None, None, None
    opened = None
    if offer[0] == host():
        try:
            opened = open_offer(offer)
        except (OSError, RuntimeError):
            opened = None
    return offer, opened, bridge.all_gather_object(opened is not None)
