"""Actor -> rollout weight broadcast: gathered, flattened into buckets, converted on the sender.

Every actor rank walks the same bucket plan (under ZeRO-3 each bucket's parameters are gathered
collectively); the actor leader packs each bucket into one flat tensor of the rollout dtype and
broadcasts it over the ``weights`` bridge (leader = index 0, rollout ranks 1..N), whose ranks
unpack it into views and load them into their engine.  One broadcast per bucket instead of one
per parameter.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterator

import torch

from .bridge import Bridge


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


def actor_buckets(module: torch.nn.Module, zero3: bool, dtype: torch.dtype,
                  bucket_bytes: int) -> Iterator[tuple[list[ParamSpec], torch.Tensor]]:
    """Collective over the actor's world: yields (specs, flat tensor in ``dtype``) per bucket."""
    named = [(hf_name(n), p) for n, p in module.named_parameters()]
    specs = [ParamSpec(n, _full_shape(p)) for n, p in named]
    itemsize = torch.empty((), dtype=dtype).element_size()
    for bucket in plan_buckets(specs, bucket_bytes, itemsize):
        params = [named[i][1] for i in bucket]
        with _gathered(params, zero3):
            flat = torch.cat([p.detach().to(dtype).reshape(-1) for p in params])
        yield [specs[i] for i in bucket], flat


def unpack(specs: list[ParamSpec], flat: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    out, offset = [], 0
    for s in specs:
        out.append((s.name, flat[offset:offset + s.numel].view(s.shape)))
        offset += s.numel
    return out


def send_weights(bridge: Bridge | None, buckets: Iterator[tuple[list[ParamSpec], torch.Tensor]],
                 is_leader: bool, local_engine=None) -> int:
    """Actor side: walk every bucket (all actor ranks), broadcast from the leader, and load into a
    colocated engine when there is one.  Returns the number of buckets."""
    count = 0
    if local_engine is not None:
        local_engine.begin_weight_update()
    for specs, flat in buckets:
        count += 1
        if is_leader and bridge is not None:
            if count == 1:
                bridge.broadcast_object(None, 0)  # rendezvous on gloo before a GPU collective
            bridge.broadcast_object([(s.name, s.shape) for s in specs], 0)
            bridge.broadcast(flat.to(bridge.device), 0)
        if local_engine is not None:
            local_engine.load_weights(unpack(specs, flat))
    if is_leader and bridge is not None:
        bridge.broadcast_object("done", 0)
    if local_engine is not None:
        local_engine.finish_weight_update()
    return count


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
