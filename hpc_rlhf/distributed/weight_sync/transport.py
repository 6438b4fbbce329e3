"""The transport interface: how one sync's buckets travel from the actor leader (index 0 of the ``weights``
bridge) to the rollout ranks.  ``channel.send_weights`` and ``channel.receive_weights`` drive whichever transport
the bridge chose (``channel.Channel``) through these methods only."""
from __future__ import annotations

import contextlib

import torch

from ..collectives import Bridge
from .plan import Bucket, ParamSpec


class Transport:
    """One way across the bridge.  A sync, on the leader: ``renew_sender``, then for each bucket ``pack`` (while the
    bucket is gathered) and ``send``, within ``sending()``, then ``end``; on each rollout rank: ``renew_receiver``,
    then ``receive``, which loads every bucket into the engine.  Both sides call the same collectives in order."""

    name = ""

    def renew_sender(self, bridge: Bridge, slot_bytes: int) -> Transport:
        """Leader, at each sync before its buckets, collective with ``renew_receiver``: the transport for this sync
        (this one, unless it must remap its memory for buckets of up to ``slot_bytes`` bytes)."""
        return self

    def renew_receiver(self, bridge: Bridge) -> Transport:
        return self

    def pack(self, k: int, specs: list[ParamSpec], parts: list[torch.Tensor],
             dtype: torch.dtype) -> tuple[torch.Tensor | None, list[torch.Tensor]]:
        """Leader: bucket ``k``'s tensors (``parts``, for ``specs``) in ``dtype`` where ``send`` sends them from: (the
        whole bucket end to end, or None; each spec's tensor).  ``copy_`` casts and crosses devices in one copy:
        a CUDA actor's parameters land in host memory."""
        raise NotImplementedError

    def sending(self) -> contextlib.AbstractContextManager:
        """Leader: the context its buckets are packed and sent in."""
        return contextlib.nullcontext()

    def send(self, bridge: Bridge, bucket: Bucket, k: int) -> None:
        raise NotImplementedError

    def end(self, bridge: Bridge, count: int) -> None:
        """Leader: every one of the sync's ``count`` buckets is sent."""
        raise NotImplementedError

    def receive(self, bridge: Bridge, engine, dtype: torch.dtype) -> int:
        """A rollout rank: load every bucket of the sync into ``engine`` (between its begin and finish of the weight
        update); the count of buckets."""
        raise NotImplementedError


def send_specs(bridge: Bridge, bucket: Bucket) -> None:
    """Leader: the bucket's names and shapes (the buckets' transports send them ahead of each bucket)."""
    bridge.broadcast_object([(s.name, s.shape) for s in bucket.specs], 0)


def end_specs(bridge: Bridge) -> None:
    bridge.broadcast_object("done", 0)


def receive_specs(bridge: Bridge) -> list[ParamSpec] | None:
    """A rollout rank: the next bucket's specs, or None when the leader has sent them all."""
    meta = bridge.broadcast_object(None, 0)
    return None if meta == "done" else [ParamSpec(n, tuple(shape)) for n, shape in meta]
