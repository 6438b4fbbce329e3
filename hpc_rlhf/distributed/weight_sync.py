"""Actor -> rollout weight broadcast: gathered, flattened into buckets, converted on the sender.

Every actor rank walks the same bucket plan (under ZeRO-3 each bucket's parameters are gathered
collectively); the actor leader packs each bucket into one flat tensor of the rollout dtype and
broadcasts it over the ``weights`` bridge (leader = index 0, rollout ranks 1..N), whose ranks
unpack it into views and load them into their engine.  One broadcast per bucket instead of one
per parameter.
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Callable, Iterator

import torch

from .collectives import Bridge


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


def actor_buckets(items: list[SyncItem], zero3: bool, dtype: torch.dtype,
                  bucket_bytes: int) -> Iterator[tuple[list[ParamSpec], torch.Tensor]]:
    """Collective over the actor's world: yields (specs, flat tensor in ``dtype``) per bucket."""
    specs = [it.spec for it in items]
    itemsize = torch.empty((), dtype=dtype).element_size()
    for bucket in plan_buckets(specs, bucket_bytes, itemsize):
        params = list({id(p): p for i in bucket for p in items[i].params}.values())
        with _gathered(params, zero3):
            flat = torch.cat([items[i].value().detach().to(dtype).reshape(-1) for i in bucket])
        yield [specs[i] for i in bucket], flat


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
                 is_leader: bool, local_engine=None) -> Sent:
    """Actor side: walk every bucket (all actor ranks), broadcast from the leader, and load into a
    colocated engine when there is one."""
    count, wait = 0, 0.0
    if local_engine is not None:
        local_engine.begin_weight_update()
    for specs, flat in buckets:
        count += 1
        if is_leader and bridge is not None:
            if count == 1:
                t0 = time.perf_counter()
                bridge.broadcast_object(None, 0)  # rendezvous on gloo before a GPU collective
                wait = time.perf_counter() - t0
            bridge.broadcast_object([(s.name, s.shape) for s in specs], 0)
            bridge.broadcast(flat.to(bridge.device), 0)
        if local_engine is not None:
            local_engine.load_weights(unpack(specs, flat))
    if is_leader and bridge is not None:
        bridge.broadcast_object("done", 0)
    if local_engine is not None:
        local_engine.finish_weight_update()
    return Sent(count, wait)


def receive_weights(bridge: Bridge, engine, dtype: torch.dtype) -> int:
    """Rollout side: receive buckets until the leader says done; load each into ``engine``."""
    assert bridge.broadcast_object(None, 0) is None
    engine.begin_weight_update()
    count = 0
    while True:
        meta = bridge.broadcast_object(None, 0)
        if meta == "done":
            engine.finish_weight_update()
            return count
        specs = [ParamSpec(n, tuple(shape)) for n, shape in meta]
        flat = torch.empty(sum(s.numel for s in specs), dtype=dtype, device=bridge.device)
        bridge.broadcast(flat, 0)
        engine.load_weights(unpack(specs, flat))
        count += 1
