"""Actor -> rollout weight broadcast: gathered, flattened into buckets, converted on the sender.

Every actor rank walks the same bucket plan (under ZeRO-3 each bucket's parameters are gathered
collectively); the actor leader packs each bucket into one flat tensor of the rollout dtype and
broadcasts it over the ``weights`` bridge (leader = index 0, rollout ranks 1..N), whose ranks
unpack it into views and load them into their engine.  One broadcast per bucket instead of one
per parameter.

On a CPU (gloo) bridge whose ranks share a host, the buckets go through shared memory instead
(``SharedSlots``): the leader packs each bucket straight into a slot that every rank has mapped, and only
the bucket's names and shapes travel over gloo.  A rank on another host, or a host without ``/dev/shm``,
keeps the broadcast.
"""
from __future__ import annotations

import contextlib
import logging
import os
import socket
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import torch

from .collectives import Bridge

log = logging.getLogger(__name__)

BUCKET_BYTES = 64 << 20  # the sync's bucket: one broadcast (or one shared slot) each


@dataclass(frozen=True)
class ParamSpec:
    name: str
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


def hf_name(name: str) -> str:
    """The Hugging Face parameter name inside DeepSpeed / compile wrappers."""
    for prefix in ("module.", "_orig_mod."):
        while name.startswith(prefix):
            name = name[len(prefix):]
    return name


def _full_shape(p: torch.nn.Parameter) -> tuple[int, ...]:
    return tuple(getattr(p, "ds_shape", p.shape))


def plan_buckets(specs: list[ParamSpec], bucket_bytes: int, itemsize: int) -> list[list[int]]:
    """Consecutive parameters grouped so each bucket holds at most ``bucket_bytes`` (a larger single
    parameter gets a bucket of its own)."""
    buckets, current, size = [], [], 0
    for i, s in enumerate(specs):
        nbytes = s.numel * itemsize
        if current and size + nbytes > bucket_bytes:
            buckets.append(current)
            current, size = [], 0
        current.append(i)
        size += nbytes
    if current:
        buckets.append(current)
    return buckets


def _gathered(params: list[torch.nn.Parameter], zero3: bool):
    if not zero3:
        return contextlib.nullcontext()
    import deepspeed
    return deepspeed.zero.GatheredParameters(params, modifier_rank=None)


@dataclass(frozen=True)
class SyncItem:
    """One tensor to send: its name and full shape, the parameters it is computed from (gathered
    together under ZeRO-3) and how to compute it from them."""
    spec: ParamSpec
    params: tuple[torch.nn.Parameter, ...]
    value: Callable[[], torch.Tensor]


def full_items(module: torch.nn.Module) -> list[SyncItem]:
    """Every parameter as it is."""
    return [SyncItem(ParamSpec(hf_name(n), _full_shape(p)), (p,), lambda p=p: p) for n, p in module.named_parameters()]


def lora_items(module: torch.nn.Module, include_frozen: bool) -> list[SyncItem]:
    """A peft LoRA model as the rollout engine needs it: the weight of every LoRA-wrapped layer merged
    (W + scale * B @ A, computed, the actor's modules untouched), under its base model name; the frozen
    rest of the base (embeddings, norms, head, biases) only when ``include_frozen`` (the first sync:
    it never changes, so it is never sent again)."""
    from peft.tuners.lora import LoraLayer
    items, covered = [], set()
    for mname, m in module.named_modules():
        if not (isinstance(m, LoraLayer) and hasattr(m, "base_layer")):
            continue
        covered |= {id(p) for p in m.parameters()}
        adapters = list(m.active_adapters)
        base = m.base_layer.weight
        params = (base, *[p for p in m.parameters() if p.requires_grad])

        def merged(m=m, base=base, adapters=adapters):
            w = base.detach()
            for a in adapters:
                w = w + m.get_delta_weight(a).detach().to(w.dtype)
            return w
        items.append(SyncItem(ParamSpec(_base_name(mname) + ".weight", _full_shape(base)), params, merged))
        bias = getattr(m.base_layer, "bias", None)
        if include_frozen and bias is not None:
            items.append(SyncItem(ParamSpec(_base_name(mname) + ".bias", _full_shape(bias)), (bias,),
                                  lambda b=bias: b))
    if include_frozen:
        items += [SyncItem(ParamSpec(_base_name(n), _full_shape(p)), (p,), lambda p=p: p)
                  for n, p in module.named_parameters() if id(p) not in covered]
    return items


def _base_name(name: str) -> str:
    """The base model's parameter name inside a peft (and DeepSpeed) wrapper."""
    name = hf_name(name)
    return name[len("base_model.model."):] if name.startswith("base_model.model.") else name


def actor_buckets(items: list[SyncItem], zero3: bool, dtype: torch.dtype, bucket_bytes: int,
                  channel: Channel | None = None) -> Iterator[tuple[list[ParamSpec], torch.Tensor]]:
    """Collective over the actor's world: yields (specs, flat tensor in ``dtype``) per bucket; bucket k is
    packed into ``channel``'s shared slot k % 2 while the channel has slots (the leader's, read lazily: after
    ``send_weights`` has offered them), else into a new tensor."""
    specs = [it.spec for it in items]
    for k, bucket in enumerate(plan_buckets(specs, bucket_bytes, dtype.itemsize)):
        params = list({id(p): p for i in bucket for p in items[i].params}.values())
        with _gathered(params, zero3):
            parts = [items[i].value().detach().reshape(-1) for i in bucket]
            if channel is not None and channel.slots is not None:
                # copy_ casts and crosses devices in one copy: a CUDA actor's parameters land in the host slot
                flat, offset = channel.slots.view(k, sum(t.numel() for t in parts), dtype), 0
                for t in parts:
                    flat[offset:offset + t.numel()].copy_(t)
                    offset += t.numel()
            else:
                flat = torch.cat([t.to(dtype) for t in parts])
        yield [specs[i] for i in bucket], flat


def largest_bucket_bytes(items: list[SyncItem], dtype: torch.dtype, bucket_bytes: int) -> int:
    """The bytes of the largest bucket ``actor_buckets`` packs (a parameter larger than a bucket is one)."""
    specs = [it.spec for it in items]
    return max((sum(specs[i].numel for i in b) * dtype.itemsize
                for b in plan_buckets(specs, bucket_bytes, dtype.itemsize)), default=0)


SHM_DIR = Path("/dev/shm")


class SharedSlots:
    """Two slots of one file under /dev/shm, mapped by every rank of the weights bridge: the leader packs
    bucket k into slot k % 2 while the rollout ranks load bucket k - 1 from the other.  The leader creates
    the file and removes its name once every rank has answered its offer (mapped or not), so a file is left
    behind only if the leader dies in between."""

    def __init__(self, path: Path, slot_bytes: int, create: bool):
        self.slot_bytes = -(-slot_bytes // 4096) * 4096  # page-aligned slots: any dtype views them
        if create:
            with open(path, "wb") as f:
                f.truncate(2 * self.slot_bytes)
        self.buffer = torch.from_file(str(path), shared=True, size=2 * self.slot_bytes, dtype=torch.uint8)

    def view(self, k: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
        start = (k % 2) * self.slot_bytes
        return self.buffer[start:start + numel * dtype.itemsize].view(dtype)


@dataclass
class Channel:
    """What one rank of the weights bridge keeps between syncs: the shared slots every rank has mapped, and
    whether to offer them again (not after a rank could not map them)."""
    slots: SharedSlots | None = None
    offer: bool = field(default_factory=lambda: SHM_DIR.is_dir() and os.access(SHM_DIR, os.W_OK))


def _host() -> str:
    return os.environ.get("SLURMD_NODENAME") or socket.gethostname()


def _offer_slots(bridge: Bridge, channel: Channel, slot_bytes: int) -> None:
    """Leader, collective with ``_accept_slots``: new slots when none are mapped or they are too small."""
    offer = None
    new = None
    if channel.offer and (channel.slots is None or channel.slots.slot_bytes < slot_bytes):
        path = SHM_DIR / f"hpc_rlhf-weights-{os.getpid()}-{uuid.uuid4().hex}"
        try:
            new = SharedSlots(path, slot_bytes, create=True)
            offer = (_host(), str(path), new.slot_bytes)
        except (OSError, RuntimeError) as e:  # no room under /dev/shm: keep the broadcast
            path.unlink(missing_ok=True)
            channel.offer = False
            log.info("weight sync: gloo broadcast (no shared slots of %d bytes under %s: %s)", slot_bytes, SHM_DIR, e)
    bridge.broadcast_object(offer, 0)
    if offer is None:
        return
    mapped = bridge.all_gather_object(True)
    Path(offer[1]).unlink(missing_ok=True)
    channel.slots, channel.offer = (new, True) if all(mapped) else (None, False)
    if channel.slots is not None:
        log.info("weight sync: through two shared-memory slots of %.1f MiB under %s", new.slot_bytes / 2 ** 20,
                 SHM_DIR)
    else:
        log.info("weight sync: gloo broadcast (members %s of the weights bridge, 0 the actor leader, could not map "
                 "the shared slots: another host?)", [i for i, ok in enumerate(mapped) if not ok])


def _accept_slots(bridge: Bridge, channel: Channel) -> None:
    offer = bridge.broadcast_object(None, 0)
    if offer is None:
        return
    host, path, slot_bytes = offer
    new = None
    if host == _host():
        try:
            new = SharedSlots(Path(path), slot_bytes, create=False)
        except (OSError, RuntimeError):
            new = None
    mapped = bridge.all_gather_object(new is not None)
    channel.slots, channel.offer = (new, True) if all(mapped) else (None, False)


def unpack(specs: list[ParamSpec], flat: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    out, offset = [], 0
    for s in specs:
        out.append((s.name, flat[offset:offset + s.numel].view(s.shape)))
        offset += s.numel
    return out


@dataclass(frozen=True)
class Sent:
    buckets: int
    wait_s: float  # the leader's wait for the rollout ranks to join the first broadcast (they were busy)


def send_weights(bridge: Bridge | None, buckets: Iterator[tuple[list[ParamSpec], torch.Tensor]],
                 is_leader: bool, local_engine=None, channel: Channel | None = None, slot_bytes: int = 0) -> Sent:
    """Actor side: walk every bucket (all actor ranks), send each from the leader, and load it into a
    colocated engine when there is one.  With a ``channel`` on a CPU bridge, the leader offers shared slots of
    ``slot_bytes`` first (when it has none that large); ``buckets`` must then be ``actor_buckets`` of the same
    channel, which packs into the slots."""
    count, wait = 0, 0.0
    sending = is_leader and bridge is not None
    slots = None
    if sending:
        t0 = time.perf_counter()
        bridge.broadcast_object(None, 0)  # rendezvous on gloo before a GPU collective
        wait = time.perf_counter() - t0
        if channel is not None and bridge.device.type == "cpu":
            _offer_slots(bridge, channel, slot_bytes)
            slots = channel.slots
    if local_engine is not None:
        local_engine.begin_weight_update()
    for specs, flat in buckets:
        if sending:
            bridge.broadcast_object([(s.name, s.shape) for s in specs], 0)
            if slots is None:
                bridge.broadcast(flat.to(bridge.device), 0)
            elif count:
                bridge.barrier()  # the rollout ranks have loaded bucket count - 1: its slot takes the next one
        if local_engine is not None:
            local_engine.load_weights(unpack(specs, flat))
        count += 1
    if sending:
        bridge.broadcast_object("done", 0)
        if slots is not None:
            bridge.barrier()  # the last bucket is loaded: the next sync may write its slot
    if local_engine is not None:
        local_engine.finish_weight_update()
    return Sent(count, wait)


def receive_weights(bridge: Bridge, engine, dtype: torch.dtype, channel: Channel | None = None) -> int:
    """Rollout side: receive buckets until the leader says done; load each into ``engine``.  With a
    ``channel``, first answer the leader's offer of shared slots (``send_weights``; CPU bridges only)."""
    assert bridge.broadcast_object(None, 0) is None
    slots = None
    if channel is not None and bridge.device.type == "cpu":
        _accept_slots(bridge, channel)
        slots = channel.slots
    engine.begin_weight_update()
    count = 0
    while True:
        meta = bridge.broadcast_object(None, 0)
        if meta == "done":
            if slots is not None:
                bridge.barrier()
            engine.finish_weight_update()
            return count
        specs = [ParamSpec(n, tuple(shape)) for n, shape in meta]
        numel = sum(s.numel for s in specs)
        if slots is None:
            flat = torch.empty(numel, dtype=dtype, device=bridge.device)
            bridge.broadcast(flat, 0)
        else:
            if count:
                bridge.barrier()
            flat = slots.view(count, numel, dtype)
        engine.load_weights(unpack(specs, flat))
        count += 1
