"""The two sides of a sync and the transport they use.  A ``Channel`` is what one rank of the ``weights`` bridge
keeps between syncs: the transport chosen at the bridge's first sync.  On a CPU (gloo) bridge whose ranks share a
host: shared weights when every rollout engine can take them, else shared slots, else (another host, no room under
/dev/shm) the broadcast, which a GPU bridge or a sync without a channel always uses."""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Iterator

import torch

from ..collectives import Bridge
from . import shm
from .broadcast import Broadcast
from .plan import Bucket, ParamSpec, SyncItem, gathered, plan_buckets
from .shared import accept_shared, offer_shared
from .slots import accept_slots, offer_slots
from .transport import Transport


@dataclass
class Channel:
    transport: Transport | None = None  # chosen at the first sync over a CPU bridge
    share: bool = True  # whether to offer shared weights (False: shared slots at best)


def _sender(bridge: Bridge, channel: Channel | None, specs: list[ParamSpec] | None, dtype: torch.dtype,
            slot_bytes: int) -> Transport:
    """Leader, collective with ``_receiver``: this sync's transport (chosen at the first sync, renewed at each)."""
    if channel is None or bridge.device.type != "cpu":
        return Broadcast()
    if channel.transport is None:
        offer = shm.writable()
        channel.transport = (offer_shared(bridge, specs, dtype, offer and channel.share)
                             or offer_slots(bridge, slot_bytes, offer) or Broadcast())
    channel.transport = channel.transport.renew_sender(bridge, slot_bytes)
    return channel.transport


def _receiver(bridge: Bridge, channel: Channel | None, engine) -> Transport:
    if channel is None or bridge.device.type != "cpu":
        return Broadcast()
    if channel.transport is None:
        channel.transport = accept_shared(bridge, engine) or accept_slots(bridge) or Broadcast()
    channel.transport = channel.transport.renew_receiver(bridge)
    return channel.transport


def actor_buckets(items: list[SyncItem], zero3: bool, dtype: torch.dtype, bucket_bytes: int,
                  channel: Channel | None = None, send: bool = True) -> Iterator[Bucket]:
    """Collective over the actor's world: yields each bucket in ``dtype``, packed by the leader's transport
    (``channel``, read lazily: ``send_weights`` chooses it before the first bucket is drawn), else into one flat
    tensor.  A rank that sends nothing (``send=False``: no bridge, or not the leader) gets the tensors as they are,
    cast to ``dtype`` (a colocated engine copies them once), except under ZeRO-3, where a gathered parameter's
    values last only while its bucket is gathered."""
    specs = [it.spec for it in items]
    for k, bucket in enumerate(plan_buckets(specs, bucket_bytes, dtype.itemsize)):
        params = list({id(p): p for i in bucket for p in items[i].params}.values())
        bucket_specs = [specs[i] for i in bucket]
        with gathered(params, zero3):
            parts = [items[i].value().detach() for i in bucket]
            transport = channel.transport if channel is not None else None
            if transport is None and not (send or zero3):
                flat, tensors = None, [t.to(dtype).reshape(s.shape) for t, s in zip(parts, bucket_specs)]
            else:
                flat, tensors = (transport or Broadcast()).pack(k, bucket_specs, parts, dtype)
        yield Bucket(bucket_specs, flat, tensors)


@dataclass(frozen=True)
class Sent:
    buckets: int
    wait_s: float  # the leader's wait for the rollout ranks to join the first broadcast (they were busy)


def send_weights(bridge: Bridge | None, buckets: Iterator[Bucket], is_leader: bool, local_engine=None,
                 channel: Channel | None = None, slot_bytes: int = 0, specs: list[ParamSpec] | None = None,
                 dtype: torch.dtype = torch.float32) -> Sent:
    """Actor side: walk every bucket (all actor ranks), send each from the leader, and load it into a colocated
    engine when there is one.  With a ``channel`` on a CPU bridge, the first sync chooses the transport (shared
    weights laid out from ``specs`` in ``dtype``, or slots of ``slot_bytes``, the largest bucket's bytes); ``buckets``
    must then be ``actor_buckets`` of the same channel, which packs into it."""
    count, wait = 0, 0.0
    transport = None
    if is_leader and bridge is not None:
        t0 = time.perf_counter()
        bridge.broadcast_object(None, 0)  # rendezvous on gloo before a GPU collective
        wait = time.perf_counter() - t0
        transport = _sender(bridge, channel, specs, dtype, slot_bytes)
    if local_engine is not None:
        local_engine.begin_weight_update()
    with transport.sending() if transport is not None else contextlib.nullcontext():
        for b in buckets:
            if transport is not None:
                transport.send(bridge, b, count)
            if local_engine is not None:
                local_engine.load_weights(b.named())
            count += 1
    if transport is not None:
        transport.end(bridge, count)
    if local_engine is not None:
        local_engine.finish_weight_update()
    return Sent(count, wait)


def receive_weights(bridge: Bridge, engine, dtype: torch.dtype, channel: Channel | None = None) -> int:
    """Rollout side: with a ``channel``, first answer the leader's choice of transport (its first sync on a CPU
    bridge); then load every bucket into ``engine``.  Returns the count of buckets."""
    assert bridge.broadcast_object(None, 0) is None
    transport = _receiver(bridge, channel, engine)
    engine.begin_weight_update()
    count = transport.receive(bridge, engine, dtype)
    engine.finish_weight_update()
    return count
