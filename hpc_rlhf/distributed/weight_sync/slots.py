"""The shared-slots transport (a gloo bridge whose ranks share a host; engines that keep their own weights, such as
vLLM): two slots of one file under /dev/shm, mapped by every rank of the bridge.  The leader packs bucket k
straight into slot k % 2 while the rollout ranks load bucket k - 1 from the other; only the buckets' names and
shapes travel over gloo."""
from __future__ import annotations

import logging
from pathlib import Path

import torch

from ..collectives import Bridge
from . import shm
from .broadcast import Broadcast
from .plan import Bucket, ParamSpec, unpack
from .transport import Transport, end_specs, receive_specs, send_specs

log = logging.getLogger(__name__)


class SharedSlots:
    """The two slots' file, mapped.  The leader creates it (``create``); the rollout ranks map the leader's."""

    def __init__(self, path: Path, slot_bytes: int, create: bool):
        self.slot_bytes = -(-slot_bytes // 4096) * 4096  # page-aligned slots: any dtype views them
        if create:
            with open(path, "wb") as f:
                f.truncate(2 * self.slot_bytes)
        self.buffer = torch.from_file(str(path), shared=True, size=2 * self.slot_bytes, dtype=torch.uint8)

    def view(self, k: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
        start = (k % 2) * self.slot_bytes
        return self.buffer[start:start + numel * dtype.itemsize].view(dtype)


def offer_slots(bridge: Bridge, slot_bytes: int, offer: bool) -> Transport | None:
    """Leader, collective with ``accept_slots``: new slots of ``slot_bytes`` offered (when ``offer``): ``Slots`` when
    every member mapped them, ``Broadcast`` when one could not, None when none were offered (not ``offer``, or no
    room for them)."""
    made = (shm.create(lambda path: SharedSlots(path, slot_bytes, create=True),
                       f"shared slots of {slot_bytes} bytes (gloo broadcast)") if offer else None)
    new = made[0] if made is not None else None
    mapped = shm.announce(bridge, None if made is None else (shm.host(), str(made[1]), new.slot_bytes))
    if mapped is None:
        return None
    if all(mapped):
        log.info("weight sync: through two shared-memory slots of %.1f MiB under %s", new.slot_bytes / 2 ** 20,
                 shm.SHM_DIR)
        return Slots(new)
    log.info("weight sync: gloo broadcast (members %s of the weights bridge, 0 the actor leader, could not map "
             "the shared slots: another host?)", [i for i, ok in enumerate(mapped) if not ok])
    return Broadcast()


def accept_slots(bridge: Bridge) -> Transport | None:
    offer, new, mapped = shm.answer(bridge, lambda o: SharedSlots(Path(o[1]), o[2], create=False))
    if offer is None:
        return None
    return Slots(new) if all(mapped) else Broadcast()


class Slots(Transport):
    name = "slots"

    def __init__(self, slots: SharedSlots):
        self.slots = slots

    def renew_sender(self, bridge: Bridge, slot_bytes: int) -> Transport:
        """Larger slots when a bucket would not fit these (a LoRA actor's first sync sends the frozen base too)."""
        return offer_slots(bridge, slot_bytes, self.slots.slot_bytes < slot_bytes) or self

    def renew_receiver(self, bridge: Bridge) -> Transport:
        return accept_slots(bridge) or self

    def pack(self, k: int, specs: list[ParamSpec], parts: list[torch.Tensor],
             dtype: torch.dtype) -> tuple[torch.Tensor, list[torch.Tensor]]:
        flat, offset = self.slots.view(k, sum(t.numel() for t in parts), dtype), 0
        for t in parts:
            flat[offset:offset + t.numel()].copy_(t.reshape(-1))
            offset += t.numel()
        return flat, [t for _, t in unpack(specs, flat)]

    def send(self, bridge: Bridge, bucket: Bucket, k: int) -> None:
        send_specs(bridge, bucket)
        if k:
            bridge.barrier()  # the rollout ranks have loaded bucket k - 1: its slot takes the next one

    def end(self, bridge: Bridge, count: int) -> None:
        end_specs(bridge)
        bridge.barrier()  # the last bucket is loaded: the next sync may write its slot

    def receive(self, bridge: Bridge, engine, dtype: torch.dtype) -> int:
        count = 0
        while (specs := receive_specs(bridge)) is not None:
            if count:
                bridge.barrier()
            engine.load_weights(unpack(specs, self.slots.view(count, sum(s.numel for s in specs), dtype)))
            count += 1
        bridge.barrier()
        return count
