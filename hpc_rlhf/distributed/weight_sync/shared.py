"""The shared-weights transport (a gloo bridge whose ranks share a host, engines that can take shared tensors as
their parameters: ``RolloutEngine.shareable``, the transformers engine): every tensor of a sync lives at a fixed
place in one file under /dev/shm that the leader and every rollout rank have mapped, and the rollout engines take
these views as their parameters.  A sync is the leader's one copy into them, with all the CPUs its process may
use, while the rollout ranks wait."""
from __future__ import annotations

import contextlib
import logging
import os
from pathlib import Path

import torch

from ..collectives import Bridge
from ..openmp import usable_cpus
from . import shm
from .plan import Bucket, ParamSpec
from .transport import Transport

log = logging.getLogger(__name__)

ALIGN = 64  # bytes: where each tensor of the shared weights starts


def shared_layout(specs: list[ParamSpec], dtype: torch.dtype) -> tuple[dict[str, tuple[int, tuple[int, ...]]], int]:
    """Each tensor's place in the shared weights, in order, each starting on an ``ALIGN``-byte boundary: name ->
    (byte offset, shape), and the bytes of the whole."""
    layout, offset = {}, 0
    for s in specs:
        layout[s.name] = (offset, s.shape)
        offset += -(-s.numel * dtype.itemsize // ALIGN) * ALIGN
    return layout, offset


class SharedWeights:
    """The shared weights' file, mapped, laid out by ``shared_layout``.  The leader reserves the file's pages as it
    creates it (a full /dev/shm fails here, not as a bus error at the first write)."""

    def __init__(self, path: Path, layout: dict[str, tuple[int, tuple[int, ...]]], nbytes: int,
                 dtype: torch.dtype, create: bool):
        self.layout, self.dtype = layout, dtype
        if create:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                os.posix_fallocate(fd, 0, max(nbytes, 1))
            finally:
                os.close(fd)
        self.buffer = torch.from_file(str(path), shared=True, size=max(nbytes, 1), dtype=torch.uint8)

    def view(self, name: str) -> torch.Tensor:
        if name not in self.layout:
            raise KeyError(f"weight sync: {name!r} has no place in the shared weights (laid out at the first sync "
                           f"from its tensors)")
        offset, shape = self.layout[name]
        numel = ParamSpec(name, shape).numel
        return self.buffer[offset:offset + numel * self.dtype.itemsize].view(self.dtype).view(shape)

    def named(self) -> list[tuple[str, torch.Tensor]]:
        return [(name, self.view(name)) for name in self.layout]


def offer_shared(bridge: Bridge, specs: list[ParamSpec] | None, dtype: torch.dtype, offer: bool) -> Transport | None:
    """Leader, collective with ``accept_shared``: shared weights laid out from ``specs`` offered (when ``offer`` and
    there are specs): ``Shared`` when every rollout rank took them, else None."""
    new = announced = None
    if offer and specs is not None:
        layout, nbytes = shared_layout(specs, dtype)
        made = shm.create(lambda path: SharedWeights(path, layout, nbytes, dtype, create=True),
                          f"shared weights of {nbytes} bytes (slots or the broadcast)")
        if made is not None:
            new, announced = made[0], (shm.host(), str(made[1]), layout, nbytes, dtype)
    taken = shm.announce(bridge, announced)
    if taken is None:
        return None
    if all(taken):
        log.info("weight sync: the rollout engines' weights live in %.1f MiB of shared memory under %s",
                 new.buffer.numel() / 2 ** 20, shm.SHM_DIR)
        return Shared(new)
    log.info("weight sync: no shared weights (members %s of the weights bridge, 0 the actor leader, could not "
             "take them: another host, or an engine that keeps its own weights)",
             [i for i, ok in enumerate(taken) if not ok])
    return None


def accept_shared(bridge: Bridge, engine) -> Transport | None:
    def take(offer):
        _, path, layout, nbytes, dtype = offer
        new = SharedWeights(Path(path), layout, nbytes, dtype, create=False)
        return new if engine.shareable(new.named()) else None
    offer, new, taken = shm.answer(bridge, take)
    if offer is None or not all(taken):
        return None
    engine.share_weights(new.named())
    return Shared(new)


@contextlib.contextmanager
def all_cpus():
    """torch's threads raised to every CPU this process may use, for the leader's copy into the shared weights
    while the rollout ranks of its host wait for it (an srun task bound to its own CPUs keeps its count)."""
    before, cpus = torch.get_num_threads(), usable_cpus()
    if cpus > before:
        torch.set_num_threads(cpus)
    try:
        yield
    finally:
        if cpus > before:
            torch.set_num_threads(before)


class Shared(Transport):
    name = "shared"

    def __init__(self, weights: SharedWeights):
        self.weights = weights

    def pack(self, k: int, specs: list[ParamSpec], parts: list[torch.Tensor],
             dtype: torch.dtype) -> tuple[None, list[torch.Tensor]]:
        tensors = [self.weights.view(s.name) for s in specs]
        for t, part in zip(tensors, parts):
            t.copy_(part.reshape(t.shape))
        return None, tensors

    def sending(self) -> contextlib.AbstractContextManager:
        return all_cpus()

    def send(self, bridge: Bridge, bucket: Bucket, k: int) -> None:
        pass  # the copy into the shared weights (pack) is the sync

    def end(self, bridge: Bridge, count: int) -> None:
        bridge.broadcast_object(count, 0)  # every tensor is in the rollout engines' own weights

    def receive(self, bridge: Bridge, engine, dtype: torch.dtype) -> int:
        return bridge.broadcast_object(None, 0)
