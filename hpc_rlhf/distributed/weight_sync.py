"""Actor -> rollout weight broadcast: gathered, flattened into buckets, converted on the sender.

Every actor rank walks the same bucket plan (under ZeRO-3 each bucket's parameters are gathered
collectively); the actor leader packs each bucket into one flat tensor of the rollout dtype and
broadcasts it over the ``weights`` bridge (leader = index 0, rollout ranks 1..N), whose ranks
unpack it into views and load them into their engine.  One broadcast per bucket instead of one
per parameter.

On a CPU (gloo) bridge whose ranks share a host, the weights go through shared memory instead.  When
every rollout engine can take its parameters from shared memory (``RolloutEngine.shareable``: the transformers
engine), they live in one file that every rank has mapped (``SharedWeights``): a sync is one copy, the leader
writing the actor's tensors into the engines' own parameters while the rollout ranks wait, with all the CPUs
its process may use.  Otherwise (vLLM) the buckets go through two slots (``SharedSlots``): the leader packs
each bucket straight into a slot, each rollout rank loads it into its engine, and only the bucket's names and
shapes travel over gloo.  A rank on another host, or a host without ``/dev/shm``, keeps the broadcast.
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
from .openmp import usable_cpus

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


@dataclass(frozen=True)
class Bucket:
    """One bucket of a sync: its specs, its tensors end to end in the sync's dtype (``flat``; None when they
    went straight into shared weights) and each spec's tensor (views of ``flat``, or of the shared weights)."""
    specs: list[ParamSpec]
    flat: torch.Tensor | None
    tensors: list[torch.Tensor]

    def named(self) -> list[tuple[str, torch.Tensor]]:
        return [(s.name, t) for s, t in zip(self.specs, self.tensors)]


def actor_buckets(items: list[SyncItem], zero3: bool, dtype: torch.dtype, bucket_bytes: int,
                  channel: Channel | None = None, send: bool = True) -> Iterator[Bucket]:
    """Collective over the actor's world: yields each bucket in ``dtype``.  ``channel`` is the leader's, read
    lazily (after ``send_weights`` has offered shared memory): while it has shared weights each tensor is
    written into its place there, else while it has slots bucket k is packed into slot k % 2, else into a new
    tensor.  A rank that sends nothing (``send=False``: no bridge, or not the leader) gets the tensors as they
    are, cast to ``dtype`` (a colocated engine copies them once), except under ZeRO-3, where a gathered
    parameter's values last only while its bucket is gathered."""
    specs = [it.spec for it in items]
    for k, bucket in enumerate(plan_buckets(specs, bucket_bytes, dtype.itemsize)):
        params = list({id(p): p for i in bucket for p in items[i].params}.values())
        bucket_specs = [specs[i] for i in bucket]
        with _gathered(params, zero3):
            parts = [items[i].value().detach() for i in bucket]
            # copy_ casts and crosses devices in one copy: a CUDA actor's parameters land in host memory
            if channel is not None and channel.shared is not None:
                tensors = [channel.shared.view(s.name) for s in bucket_specs]
                for t, part in zip(tensors, parts):
                    t.copy_(part.reshape(t.shape))
                flat = None
            elif not (send or zero3):
                tensors, flat = [t.to(dtype).reshape(s.shape) for t, s in zip(parts, bucket_specs)], None
            else:
                if channel is not None and channel.slots is not None:
                    flat, offset = channel.slots.view(k, sum(t.numel() for t in parts), dtype), 0
                    for t in parts:
                        flat[offset:offset + t.numel()].copy_(t.reshape(-1))
                        offset += t.numel()
                else:
                    flat = torch.cat([t.reshape(-1).to(dtype) for t in parts])
                tensors = [t for _, t in unpack(bucket_specs, flat)]
        yield Bucket(bucket_specs, flat, tensors)


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
    """Every tensor of a sync at a fixed place (``shared_layout``) in one file under /dev/shm, mapped by the
    leader and by every rollout rank, whose engines take these views as their parameters: the leader's copy
    into them is the whole sync.  The leader reserves the file's pages as it creates it (a full /dev/shm fails
    here, not as a bus error at the first write) and removes its name once every rank has answered."""

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


@dataclass
class Channel:
    """What one rank of the weights bridge keeps between syncs: the shared weights or the shared slots every
    rank has mapped, whether to offer shared memory again (not after a rank could not map it) and whether
    to offer shared weights (not after a rollout engine could not take them; ``share=False`` offers slots only)."""
    shared: SharedWeights | None = None
    slots: SharedSlots | None = None
    offer: bool = field(default_factory=lambda: SHM_DIR.is_dir() and os.access(SHM_DIR, os.W_OK))
    share: bool = True


def _host() -> str:
    return os.environ.get("SLURMD_NODENAME") or socket.gethostname()


def _create(make: Callable[[Path], object], what: str):
    """Leader: ``(make(path), path)`` for a new file under /dev/shm, or None (logged) when there is no room for it."""
    path = SHM_DIR / f"hpc_rlhf-weights-{os.getpid()}-{uuid.uuid4().hex}"
    try:
        return make(path), path
    except (OSError, RuntimeError) as e:
        path.unlink(missing_ok=True)
        log.info("weight sync: no %s under %s: %s", what, SHM_DIR, e)
        return None


def _announce(bridge: Bridge, offer: tuple | None) -> list[bool] | None:
    """Leader: broadcast ``offer`` (host, path, ...; None: nothing offered), gather whether each member of the
    bridge took it, and remove the file's name, which every member has answered."""
    bridge.broadcast_object(offer, 0)
    if offer is None:
        return None
    taken = bridge.all_gather_object(True)
    Path(offer[1]).unlink(missing_ok=True)
    return taken


def _offer_slots(bridge: Bridge, channel: Channel, slot_bytes: int) -> None:
    """Leader, collective with ``_accept_slots``: new slots when none are mapped or they are too small."""
    offer = new = None
    if channel.offer and (channel.slots is None or channel.slots.slot_bytes < slot_bytes):
        made = _create(lambda path: SharedSlots(path, slot_bytes, create=True),
                       f"shared slots of {slot_bytes} bytes (gloo broadcast)")
        channel.offer = made is not None
        if made is not None:
            new, path = made
            offer = (_host(), str(path), new.slot_bytes)
    mapped = _announce(bridge, offer)
    if mapped is None:
        return
    channel.slots, channel.offer = (new, True) if all(mapped) else (None, False)
    if channel.slots is not None:
        log.info("weight sync: through two shared-memory slots of %.1f MiB under %s", new.slot_bytes / 2 ** 20,
                 SHM_DIR)
    else:
        log.info("weight sync: gloo broadcast (members %s of the weights bridge, 0 the actor leader, could not map "
                 "the shared slots: another host?)", [i for i, ok in enumerate(mapped) if not ok])


def _offer_shared(bridge: Bridge, channel: Channel, specs: list[ParamSpec] | None, dtype: torch.dtype) -> None:
    """Leader, collective with ``_accept_shared``: shared weights laid out from this sync's ``specs``, offered
    once (None: nothing offered)."""
    offer = new = None
    if specs is not None and channel.offer and channel.share and channel.shared is None:
        layout, nbytes = shared_layout(specs, dtype)
        made = _create(lambda path: SharedWeights(path, layout, nbytes, dtype, create=True),
                       f"shared weights of {nbytes} bytes (slots or the broadcast)")
        channel.share = made is not None
        if made is not None:
            new, path = made
            offer = (_host(), str(path), layout, nbytes, dtype)
    taken = _announce(bridge, offer)
    if taken is None:
        return
    if all(taken):
        channel.shared = new
        log.info("weight sync: the rollout engines' weights live in %.1f MiB of shared memory under %s",
                 new.buffer.numel() / 2 ** 20, SHM_DIR)
    else:
        channel.share = False
        log.info("weight sync: no shared weights (members %s of the weights bridge, 0 the actor leader, could not "
                 "take them: another host, or an engine that keeps its own weights)",
                 [i for i, ok in enumerate(taken) if not ok])


def _accept_shared(bridge: Bridge, channel: Channel, engine) -> None:
    offer = bridge.broadcast_object(None, 0)
    if offer is None:
        return
    host, path, layout, nbytes, dtype = offer
    new = None
    if host == _host():
        try:
            new = SharedWeights(Path(path), layout, nbytes, dtype, create=False)
        except (OSError, RuntimeError):
            new = None
    taken = bridge.all_gather_object(new is not None and engine.shareable(new.named()))
    if all(taken):
        channel.shared = new
        engine.share_weights(new.named())
    else:
        channel.share = False


@contextlib.contextmanager
def _all_cpus():
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


def send_weights(bridge: Bridge | None, buckets: Iterator[Bucket], is_leader: bool, local_engine=None,
                 channel: Channel | None = None, slot_bytes: int = 0, specs: list[ParamSpec] | None = None,
                 dtype: torch.dtype = torch.float32) -> Sent:
    """Actor side: walk every bucket (all actor ranks), send each from the leader, and load it into a
    colocated engine when there is one.  With a ``channel`` on a CPU bridge, the leader first offers shared
    weights laid out from ``specs`` in ``dtype`` (once, when given), else shared slots of ``slot_bytes`` (when it
    has none that large); ``buckets`` must then be ``actor_buckets`` of the same channel, which writes into them."""
    count, wait = 0, 0.0
    sending = is_leader and bridge is not None
    shared = slots = None
    if sending:
        t0 = time.perf_counter()
        bridge.broadcast_object(None, 0)  # rendezvous on gloo before a GPU collective
        wait = time.perf_counter() - t0
        if channel is not None and bridge.device.type == "cpu":
            _offer_shared(bridge, channel, specs, dtype)
            if channel.shared is None:
                _offer_slots(bridge, channel, slot_bytes)
            shared, slots = channel.shared, channel.slots
    if local_engine is not None:
        local_engine.begin_weight_update()
    with _all_cpus() if shared is not None else contextlib.nullcontext():
        for b in buckets:
            if sending and shared is None:
                bridge.broadcast_object([(s.name, s.shape) for s in b.specs], 0)
                if slots is None:
                    bridge.broadcast(b.flat.to(bridge.device), 0)
                elif count:
                    bridge.barrier()  # the rollout ranks have loaded bucket count - 1: its slot takes the next one
            if local_engine is not None:
                local_engine.load_weights(b.named())
            count += 1
    if sending:
        if shared is not None:
            bridge.broadcast_object(count, 0)  # every tensor is in the rollout engines' own weights
        else:
            bridge.broadcast_object("done", 0)
            if slots is not None:
                bridge.barrier()  # the last bucket is loaded: the next sync may write its slot
    if local_engine is not None:
        local_engine.finish_weight_update()
    return Sent(count, wait)


def receive_weights(bridge: Bridge, engine, dtype: torch.dtype, channel: Channel | None = None) -> int:
    """Rollout side: receive buckets until the leader says done; load each into ``engine``.  With a
    ``channel``, first answer the leader's offers of shared memory (``send_weights``; CPU bridges only); once
    ``engine`` has taken shared weights, wait while the leader writes them.  Returns the count of buckets."""
    assert bridge.broadcast_object(None, 0) is None
    slots = shared = None
    if channel is not None and bridge.device.type == "cpu":
        _accept_shared(bridge, channel, engine)
        if channel.shared is None:
            _accept_slots(bridge, channel)
        shared, slots = channel.shared, channel.slots
    engine.begin_weight_update()
    if shared is not None:
        count = bridge.broadcast_object(None, 0)
        engine.finish_weight_update()
        return count
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
